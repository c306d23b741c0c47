"""How many KV pages the engine allocates: pure arithmetic on memory figures, CPU-testable.

On a GPU the pool takes what `gpu_memory_utilization` leaves of the whole device once the
weights, the peak activation of the largest step and a reserve for the decode graphs are
counted (vLLM's meaning). `kv_cache_tokens` or `kv_cache_memory` set it directly. On the CPU
the default is `CPU_DEFAULT_BYTES`, capped at `max_num_seqs` sequences of `max_model_len`.
"""

from __future__ import annotations

from dataclasses import dataclass

from m3lm.errors import ConfigError

CPU_DEFAULT_BYTES = 1 << 30
GRAPH_RESERVE_BYTES = 256 << 20  # the decode graphs' intermediates, besides their logits


def graph_reserve(max_batch: int, vocab: int) -> int:
    """Bytes kept back for the captured decode graphs: each bucket (1, 2, 4, ..., max_batch,
    summing to under 2 x max_batch rows) keeps its fp32 logits [B, V], plus a fixed allowance."""
    return GRAPH_RESERVE_BYTES + 2 * max_batch * vocab * 4


@dataclass(frozen=True)
class PoolPlan:
    tokens: int  # positions the block manager hands out (pages x page size)
    pages: int
    bytes: int
    max_model_len: int
    source: str  # what set the size: kv_cache_tokens, kv_cache_memory, gpu_memory_utilization, cpu default
    budget_bytes: int | None = None  # what the GPU's memory figures left for the pool

    @property
    def max_concurrency(self) -> float:
        """Sequences of max_model_len tokens the pool holds at once."""
        return self.tokens / self.max_model_len


def plan_pool(
    *,
    bytes_per_page: int,
    page_size: int,
    max_positions: int,
    max_num_seqs: int,
    max_model_len: int | None = None,
    total_bytes: int | None = None,
    utilization: float = 0.9,
    weight_bytes: int = 0,
    peak_activation_bytes: int = 0,
    reserve_bytes: int = 0,
    explicit_tokens: int | None = None,
    explicit_bytes: int | None = None,
    cpu_default_bytes: int = CPU_DEFAULT_BYTES,
) -> PoolPlan:
    """Size the KV pool. `total_bytes` (the GPU's whole memory; None on the CPU) with `weight_bytes`
    (already allocated), `peak_activation_bytes` and `reserve_bytes` give the budget
    total x utilization - weights - activation - reserve. `max_model_len` None: the model's
    `max_positions`, shrunk to what the pool holds. Raises ConfigError naming the flag to change."""
    assert bytes_per_page > 0 and page_size > 0
    limit = min(max_model_len or max_positions, max_positions)
    budget = None
    if explicit_tokens is not None:
        source, pages = "kv_cache_tokens", -(-explicit_tokens // page_size)
    elif explicit_bytes is not None:
        source, pages = "kv_cache_memory", explicit_bytes // bytes_per_page
        if pages < 1:
            raise ConfigError(
                f"kv_cache_memory = {explicit_bytes:,} bytes holds no page ({bytes_per_page:,} bytes); "
                "raise --kv-cache-memory"
            )
    elif total_bytes is not None:
        source = "gpu_memory_utilization"
        used = weight_bytes + peak_activation_bytes + reserve_bytes
        budget = int(total_bytes * utilization) - used
        if budget < bytes_per_page:
            raise ConfigError(
                f"no memory left for the KV cache: {utilization} x {_gib(total_bytes)} of GPU memory "
                f"minus weights {_gib(weight_bytes)}, peak activation {_gib(peak_activation_bytes)} and "
                f"graph reserve {_gib(reserve_bytes)} is {_gib(budget)}; raise --gpu-memory-utilization, "
                "lower --max-num-batched-tokens or set --kv-cache-memory"
            )
        pages = budget // bytes_per_page
    else:
        source = "cpu default"
        by_bytes = max(1, cpu_default_bytes // bytes_per_page) * page_size
        pages = -(-min(max_num_seqs * limit, by_bytes) // page_size)
    tokens = explicit_tokens if explicit_tokens is not None else pages * page_size
    if max_model_len is None:
        limit = min(limit, tokens)
    if tokens < limit:
        flag = {
            "kv_cache_tokens": "raise --kv-cache-tokens",
            "kv_cache_memory": "raise --kv-cache-memory",
            "gpu_memory_utilization": "raise --gpu-memory-utilization",
        }.get(source, "set --kv-cache-memory")
        raise ConfigError(
            f"the KV cache holds {tokens:,} tokens, fewer than max_model_len = {limit:,}; "
            f"lower --max-model-len or {flag}"
        )
    return PoolPlan(tokens, pages, pages * bytes_per_page, limit, source, budget)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"
