"""The block manager's page events and their wire form, on scripted scenarios with the names
computed here; the settings' checks."""

import hashlib
import itertools
import random
from array import array

import msgspec
import pytest

from m3lm.cache.block_manager import BlockManager
from m3lm.cache.events import CacheCleared, PagesRemoved, PagesStored, record
from m3lm.engine.kv_events import KVEventBatch, binds, to_wire
from m3lm.errors import ConfigError
from m3lm.kv_events_config import KVEventsConfig


def name(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def compute(bm: BlockManager, seq_id: int, tokens: list[int], salt: str | None = None) -> None:
    bm.match(seq_id, tokens, salt)
    assert bm.ensure(seq_id, len(tokens))
    bm.seal(seq_id, len(tokens), lambda s, e: tokens[s:e])


def test_pages_named_forgotten_and_cleared_are_recorded_in_order():
    bm = BlockManager(num_pages=4, page_size=2, events=True)
    a = [1, 2, 3, 4, 5]  # two full pages and one partial
    compute(bm, 0, a)
    n1 = name(b"", [1, 2])
    n2 = name(n1, [3, 4])
    assert bm.take_events() == [PagesStored([n1, n2], None, [1, 2, 3, 4])]
    assert bm.take_events() == []
    compute(bm, 1, [1, 2, 3, 4, 9])  # both pages found: nothing new is named
    assert bm.take_events() == []
    bm.free(0)
    bm.free(1)
    compute(bm, 2, [7, 7, 7, 7, 7, 7, 7])  # 4 pages: the free ones, then the idle ones, tail first
    n3 = name(b"", [7, 7])
    n4 = name(n3, [7, 7])
    n5 = name(n4, [7, 7])
    assert bm.take_events() == [PagesRemoved([n2, n1]), PagesStored([n3, n4, n5], None, [7] * 6)]
    bm.free(2, keep=False)  # a failed sequence's names are forgotten, tail first
    assert bm.take_events() == [PagesRemoved([n5, n4, n3])]
    compute(bm, 3, a)
    bm.reset()
    assert bm.cached() == frozenset() and bm.take_events()[-1] == CacheCleared()
    bm.check()
    bm.free(3)
    assert bm.num_idle == 0 and bm.num_free == 4  # its pages lost their names: free, not cached
    bm.check()


def test_a_salted_chain_hangs_from_the_salt_s_root():
    bm = BlockManager(num_pages=4, page_size=2, events=True)
    compute(bm, 0, [1, 2, 3], salt="tenant")
    root = hashlib.sha256(b"cache_salt\0tenant").digest()
    assert bm.take_events() == [PagesStored([name(root, [1, 2])], root, [1, 2])]


def test_record_merges_only_what_continues_the_last_event():
    log = []
    record(log, PagesStored([b"a"], None, [1]))
    record(log, PagesStored([b"b"], b"a", [2]))  # the same chain's next page
    record(log, PagesStored([b"x"], b"q", [3]))  # another chain
    record(log, PagesRemoved([b"a"]))
    record(log, PagesRemoved([b"x"]))
    record(log, CacheCleared())
    record(log, PagesRemoved([b"b"]))
    assert log == [
        PagesStored([b"a", b"b"], None, [1, 2]),
        PagesStored([b"x"], b"q", [3]),
        PagesRemoved([b"a", b"x"]),
        CacheCleared(),
        PagesRemoved([b"b"]),
    ]


def test_the_wire_form_is_an_array_batch_of_tagged_maps():
    n1, n2 = bytes(range(32)), bytes(range(1, 33))
    events = to_wire([PagesStored([n2], n1, [5, 6]), PagesRemoved([n1]), CacheCleared()], 2)
    batch = msgspec.msgpack.decode(msgspec.msgpack.encode(KVEventBatch(1.5, events, 0)))
    low = lambda b: int.from_bytes(b[24:], "big")  # noqa: E731
    assert batch == [
        1.5,
        [
            {
                "type": "BlockStored",
                "block_hashes": [low(n2)],
                "parent_block_hash": low(n1),
                "token_ids": [5, 6],
                "block_size": 2,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "group_idx": 0,
                "kv_cache_spec_kind": "full_attention",
            },
            {"type": "BlockRemoved", "block_hashes": [low(n1)], "medium": "GPU", "group_idx": 0},
            {"type": "AllBlocksCleared"},
        ],
        0,
    ]


def test_settings_as_vllm_spells_them():
    on = KVEventsConfig.parse('{"enable_kv_cache_events": true, "topic": "kv"}')
    assert on.enabled and on.publisher == "zmq" and on.endpoint == "tcp://*:5557"
    assert not KVEventsConfig.parse({}).enabled
    assert not KVEventsConfig.parse({"enable_kv_cache_events": True, "publisher": "null"}).enabled
    assert binds("tcp://*:5557") and binds("ipc:///tmp/x") and not binds("tcp://10.0.0.1:5557")
    for bad, says in [
        ('{"enable_kv_cache_events": 1}', "true or false"),
        ('{"publisher": "kafka"}', "publisher"),
        ('{"buffer_steps": 0}', "buffer_steps"),
        ('{"hwm": 0}', "hwm"),
        ('{"endpoint": 5557}', "endpoint"),
        ('{"topics": "kv"}', "unknown key 'topics'"),
        ("[1]", "JSON object"),
        ("{", "not JSON"),
    ]:
        with pytest.raises(ConfigError, match=says):
            KVEventsConfig.parse(bad)


def test_an_address_the_publisher_cannot_take_is_a_config_error(tmp_path):
    from m3lm.engine.kv_events import KVEventPublisher

    config = KVEventsConfig(
        True, endpoint=f"ipc://{tmp_path}/ok", replay_endpoint=f"ipc://{tmp_path}/no/such/dir"
    )
    with pytest.raises(ConfigError, match="kv_events_config: .*no/such/dir"):
        KVEventPublisher(config, 4)
    publisher = KVEventPublisher(KVEventsConfig(True, endpoint=f"ipc://{tmp_path}/ok"), 4)
    publisher.publish([])  # nothing to send: no batch, no number
    assert publisher.batches == 0
    publisher.close()
    publisher.close()


@pytest.mark.parametrize("seed", range(12))
def test_the_events_replayed_are_the_cache_after_every_operation(seed):
    """Random sequences over a small alphabet (so prefixes are shared), grown, freed, failed,
    evicted and reset: the events, applied in order, name exactly the cached pages, each name
    the SHA-256 chain of its own tokens."""
    rng = random.Random(seed)
    bm = BlockManager(num_pages=12, page_size=2, events=True)
    view: dict[bytes, bytes | None] = {}
    live: dict[int, tuple[list[int], bytes]] = {}  # seq -> (tokens, the root of its chain)
    ids = itertools.count()
    for _ in range(400):
        roll = rng.random()
        if roll < 0.4 and len(live) < 5:
            seq, tokens, salt = next(ids), [rng.choice((1, 2, 3)) for _ in range(rng.randint(1, 9))], None
            if rng.random() < 0.2:
                salt = "tenant"
            bm.match(seq, tokens, salt)
            if bm.ensure(seq, len(tokens)):
                bm.seal(seq, len(tokens), lambda s, e, t=tokens: t[s:e])
                live[seq] = (tokens, hashlib.sha256(b"cache_salt\0tenant").digest() if salt else b"")
            else:
                bm.free(seq)
        elif roll < 0.7 and live:
            seq = rng.choice(list(live))
            tokens, _ = live[seq]
            tokens += [rng.choice((1, 2, 3)) for _ in range(rng.randint(1, 4))]
            if bm.ensure(seq, len(tokens)):
                bm.seal(seq, len(tokens), lambda s, e, t=tokens: t[s:e])
            else:
                bm.free(seq)
                del live[seq]
        elif roll < 0.95 and live:
            seq = rng.choice(list(live))
            bm.free(seq, keep=rng.random() < 0.8)
            del live[seq]
        else:
            bm.reset()
        for event in bm.take_events():
            if isinstance(event, PagesStored):
                parent = event.parent
                for i, n in enumerate(event.names):
                    assert n not in view
                    tokens = event.token_ids[i * 2 : (i + 1) * 2]
                    assert n == name(parent or b"", tokens)
                    view[n], parent = parent, n
            elif isinstance(event, PagesRemoved):
                for n in event.names:
                    del view[n]
            else:
                view.clear()
        assert view.keys() == bm.cached()
        bm.check()
