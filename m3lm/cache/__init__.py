from m3lm.cache.block_manager import BlockManager
from m3lm.cache.kv_cache import KVCache, PagedKV

__all__ = ["BlockManager", "KVCache", "PagedKV"]
