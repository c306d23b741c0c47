"""Block manager and scheduler: scripted scenarios and invariants, no model involved."""

import random

import pytest

from m3lm.cache.block_manager import BlockManager
from m3lm.core import SamplingParams
from m3lm.engine.scheduler import Scheduler
from m3lm.engine.sequence import SeqStatus, Sequence


def make_seq(i: int, prompt: int, max_tokens: int, tokens: list[int] | None = None) -> Sequence:
    """Sequence i with a prompt of its own (no page in common with another's), or of `tokens`."""
    ids = tokens if tokens is not None else [i + 1] * prompt
    return Sequence(i, f"r{i}", ids, SamplingParams(max_tokens=max_tokens), max_tokens)


def simulate_step(sched: Scheduler, plan) -> list[Sequence]:
    """What the engine does after a forward: advance the cache, sample for ready sequences."""
    done = []
    for seq, n in plan:
        seq.num_cached += n
        assert seq.num_cached <= seq.num_tokens
        sched.blocks.seal(seq.seq_id, seq.num_cached, seq.tokens)
        if seq.num_cached == seq.num_tokens:
            seq.output_ids.append(7)
            if len(seq.output_ids) >= seq.output_limit:
                sched.finish(seq, "length")
                done.append(seq)
    return done


def test_block_manager_all_or_nothing():
    bm = BlockManager(num_pages=4, page_size=4)
    assert bm.ensure(1, 9) and bm.table(1) == [0, 1, 2]
    assert not bm.ensure(2, 8)  # needs 2 pages, 1 free: nothing allocated
    assert bm.table(2) == [] and bm.num_free == 1
    assert bm.ensure(1, 12) and bm.num_free == 1  # already has room
    bm.free(1)
    assert bm.num_free == 4
    bm.check()


def test_chunked_prefill_respects_budget_and_decodes_keep_running():
    bm = BlockManager(num_pages=64, page_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=16)
    short = make_seq(0, 3, 10)
    sched.add(short)
    simulate_step(sched, sched.schedule())  # short is now decoding
    long = make_seq(1, 50, 2)
    sched.add(long)
    chunks = []
    while not long.output_ids:
        plan = sched.schedule()
        sizes = {s.request_id: n for s, n in plan}
        assert sum(sizes.values()) <= 16
        assert sizes.get("r0") == 1  # the running decode is never stalled by the long prefill
        chunks.append(sizes["r1"])
        simulate_step(sched, plan)
    assert chunks == [15, 15, 15, 5]


def test_max_num_seqs_limits_running():
    bm = BlockManager(num_pages=100, page_size=4)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(5):
        sched.add(make_seq(i, 4, 3))
    plan = sched.schedule()
    assert [s.request_id for s, _ in plan] == ["r0", "r1"]
    assert len(sched.running) == 2 and len(sched.waiting) == 3


def test_preemption_takes_the_newest_and_recomputes():
    bm = BlockManager(num_pages=6, page_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = make_seq(0, 8, 100), make_seq(1, 8, 100)  # 2 pages each for the prompt
    sched.add(a)
    sched.add(b)
    simulate_step(sched, sched.schedule())
    for _ in range(8):  # both decode until the 6 pages cannot hold both
        simulate_step(sched, sched.schedule())
    assert b.status is SeqStatus.WAITING and b.num_preemptions >= 1 and b.num_cached == 0
    assert a.status is SeqStatus.RUNNING
    assert sched.waiting[0] is b  # back at the front of the queue
    assert len(b.output_ids) > 0  # generated tokens are kept and recomputed later
    bm.check()


def test_finish_frees_pages_at_once_and_abort_while_waiting():
    bm = BlockManager(num_pages=10, page_size=4)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=64)
    a, b = make_seq(0, 9, 5), make_seq(1, 4, 5)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    assert bm.num_free == 7
    sched.finish(a, "abort")
    assert bm.num_free == 10 and a.finish_reason == "abort" and not sched.running
    sched.finish(b, "abort")
    assert not sched.waiting and not sched.has_work()


@pytest.mark.parametrize("seed", range(8))
def test_random_load_invariants(seed):
    rng = random.Random(seed)
    pages, page = rng.randint(12, 40), rng.choice([2, 4, 8])
    budget = rng.randint(8, 64)
    bm = BlockManager(pages, page)
    sched = Scheduler(bm, max_num_seqs=rng.randint(1, 6), max_num_batched_tokens=budget)
    capacity = pages * page
    seqs = []
    for i in range(rng.randint(5, 20)):
        prompt = rng.randint(1, capacity // 2)
        seqs.append(make_seq(i, prompt, rng.randint(1, capacity - prompt)))
    pending = list(seqs)
    for _ in range(20000):
        if pending and rng.random() < 0.3:
            sched.add(pending.pop(0))
        if rng.random() < 0.02 and sched.running:
            sched.finish(rng.choice(sched.running), "abort")
        plan = sched.schedule()
        assert sum(n for _, n in plan) <= budget
        assert len(sched.running) <= sched.max_num_seqs
        assert len({s.seq_id for s, _ in plan}) == len(plan)
        for s, n in plan:
            assert len(bm.table(s.seq_id)) * page >= s.num_cached + n
        simulate_step(sched, plan)
        bm.check()
        if not pending and not sched.has_work():
            break
    else:
        pytest.fail("requests starved")
    assert all(s.finished for s in seqs)
    assert bm.num_free == pages


def compute(bm: BlockManager, seq_id: int, tokens: list[int]) -> int:
    """What the engine does for a sequence of `tokens`: start on its cached prefix, take pages for
    the rest, name the full ones once computed; returns the positions found cached."""
    found = bm.match(seq_id, tokens)
    assert bm.ensure(seq_id, len(tokens))
    bm.seal(seq_id, len(tokens), lambda s, e: tokens[s:e])
    return found


def test_prefix_pages_are_shared_named_and_kept_until_needed():
    bm = BlockManager(num_pages=8, page_size=4)
    a = list(range(1, 11))  # 10 tokens: 2 full pages and a partial one
    assert compute(bm, 0, a) == 0
    b = [*a[:8], 99, 98]  # the same two full pages, then its own tokens
    assert bm.match(1, b) == 8 and bm.table(1) == bm.table(0)[:2]
    assert bm.ensure(1, 10) and bm.table(1)[2] != bm.table(0)[2]
    bm.check()
    bm.free(0)  # a's partial page is free again; its full pages are still b's
    assert bm.num_free == 8 - 3 and bm.num_idle == 0
    bm.free(1)
    assert bm.num_free == 8 and bm.num_idle == 2  # b's own last page had no name
    bm.check()
    c = [*a[:4], 5, 6, 7, 9, 1]  # the first page only
    assert bm.match(2, c) == 4 and bm.num_idle == 1
    bm.free(2)
    assert bm.ensure(3, 7 * 4)  # takes the 6 free pages, then the older idle page: the tail first
    assert bm.num_idle == 1 and bm.match(4, a) == 4
    bm.free(4)
    assert bm.ensure(5, 4) and bm.num_idle == 0 and bm.match(6, a) == 0
    bm.check()


def test_room_is_taken_from_a_cached_prefix_tail_first():
    bm = BlockManager(num_pages=3, page_size=2)
    a = [1, 2, 3, 4, 5]
    compute(bm, 0, a)
    bm.free(0)
    assert bm.num_free == 3 and bm.num_idle == 2
    assert bm.ensure(1, 4) and bm.num_idle == 1  # the free page and one cached page
    assert bm.match(2, a) == 2  # the one taken was the tail: the head is still found
    bm.check()


def test_a_prompt_found_whole_recomputes_its_last_page():
    bm = BlockManager(num_pages=8, page_size=4)
    a = list(range(8))
    compute(bm, 0, [*a, 50])
    assert bm.match(1, a) == 4  # the last token's logits are needed: its page is not shared
    assert bm.match(2, [*a, 50]) == 8
    assert bm.match(3, a[:5]) == 4 and bm.match(4, a[:4]) == 0
    bm.check()


def test_failed_sequences_pages_are_not_kept_and_prefix_caching_can_be_off():
    bm = BlockManager(num_pages=4, page_size=2)
    a = [3, 4, 5, 6, 7]
    compute(bm, 0, a)
    bm.free(0, keep=False)
    assert bm.num_idle == 0 and bm.match(1, a) == 0
    off = BlockManager(num_pages=4, page_size=2, prefix_caching=False)
    assert compute(off, 0, a) == 0
    off.free(0)
    assert off.num_idle == 0 and off.match(1, a) == 0
    bm.check()
    off.check()


@pytest.mark.parametrize("seed", range(6))
def test_random_load_with_prefix_caching_reads_only_its_own_tokens(seed):
    """A shadow of every page's contents: a sequence only ever writes pages it alone holds, and
    every cached position it starts on holds its own token."""
    rng = random.Random(seed)
    pages, page = rng.randint(12, 40), rng.choice([2, 4])
    budget = rng.randint(4, 32)
    bm = BlockManager(pages, page)
    sched = Scheduler(bm, max_num_seqs=rng.randint(1, 5), max_num_batched_tokens=budget)
    capacity = pages * page
    stems = [[rng.randint(1, 3) for _ in range(capacity // 2)] for _ in range(3)]
    seqs = []
    for i in range(rng.randint(8, 24)):
        prompt = rng.choice(stems)[: rng.randint(1, capacity // 2)]
        if rng.random() < 0.5:
            prompt = prompt + [rng.randint(1, 3) for _ in range(rng.randint(0, page * 2))]
        prompt = prompt[: capacity // 2]
        max_tokens = rng.randint(1, capacity - len(prompt))
        seqs.append(Sequence(i, f"r{i}", prompt, SamplingParams(max_tokens=max_tokens), max_tokens))
    contents: dict[int, dict[int, int]] = {}  # page -> slot -> token written there
    live = {}
    pending = list(seqs)
    hits = 0
    for _ in range(20000):
        if pending and rng.random() < 0.3:
            s = pending.pop(0)
            sched.add(s)
            live[s.seq_id] = s
        if rng.random() < 0.02 and sched.running:
            sched.finish(rng.choice(sched.running), rng.choice(["abort", "error"]))
        plan = sched.schedule()
        for s, n in plan:
            table = bm.table(s.seq_id)
            for p in range(s.num_cached):  # what it starts from is its own
                assert contents[table[p // page]][p % page] == s.tokens(p, p + 1)[0]
            for p in range(s.num_cached, s.num_cached + n):  # it writes only pages it alone holds
                holders = [
                    o for o in live.values() if not o.finished and table[p // page] in bm.table(o.seq_id)
                ]
                assert holders == [s]
                contents.setdefault(table[p // page], {})[p % page] = s.tokens(p, p + 1)[0]
        for s, n in plan:
            s.num_cached += n
            bm.seal(s.seq_id, s.num_cached, s.tokens)
            if s.num_cached == s.num_tokens:
                s.output_ids.append(rng.randint(1, 3))
                if len(s.output_ids) >= s.output_limit:
                    sched.finish(s, "length")
        hits = max(hits, sched.prefix_cached_tokens)
        bm.check()
        if not pending and not sched.has_work():
            break
    else:
        pytest.fail("requests starved")
    assert all(s.finished for s in seqs) and bm.num_free == pages
    assert hits > 0  # the shared stems were found in the cache


def test_pages_taken_together_are_in_ascending_order():
    bm = BlockManager(num_pages=6, page_size=2)
    a = list(range(12))
    compute(bm, 0, a)
    bm.free(0)  # six named pages, cached tail first
    assert bm.ensure(1, 12) and bm.table(1) == list(range(6))  # reclaimed as one ascending run
    bm.check()


def test_a_prompt_waits_for_the_pages_a_running_prefill_computes():
    """Two requests with one prompt (n choices) arrive together: the second stays queued while
    the first computes the shared pages, then starts on them; a request behind it with a prompt
    of its own is not held up."""
    for budget, steps_waited in ((20, 1), (6, 2)):
        bm = BlockManager(num_pages=20, page_size=4)
        sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=budget)
        shared = list(range(1, 15))  # 3 whole pages and 2 positions
        a, b, c = make_seq(0, 0, 3, shared), make_seq(1, 0, 3, shared), make_seq(2, 5, 3)
        for s in (a, b, c):
            sched.add(s)
        for _ in range(steps_waited):
            plan = sched.schedule()
            assert b not in [s for s, _ in plan] and b.status is SeqStatus.WAITING
            assert not bm.table(b.seq_id)
            simulate_step(sched, plan)
            bm.check()
        if budget == 20:  # room in the first step for the request behind it
            assert c.status is SeqStatus.RUNNING
        plan = dict(sched.schedule())
        assert b in plan and b.num_prefix_cached == 12 and plan[b] == 2  # the 3 pages a computed
        assert bm.table(b.seq_id)[:3] == bm.table(a.seq_id)[:3]
        simulate_step(sched, plan.items())
        bm.check()


def test_a_waiting_prompt_goes_on_when_the_prefill_it_waits_for_ends():
    bm = BlockManager(num_pages=20, page_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=6)
    shared = list(range(1, 15))
    a, b = make_seq(0, 0, 3, shared), make_seq(1, 0, 3, shared)
    sched.add(a)
    sched.add(b)
    simulate_step(sched, sched.schedule())  # a computes 6 positions: one whole page, sealed
    sched.finish(a, "abort")
    plan = dict(sched.schedule())
    assert b in plan and b.num_prefix_cached == 4  # the page a sealed, then b computes the rest
    bm.check()


def test_a_cache_salt_separates_page_chains():
    bm = BlockManager(num_pages=16, page_size=4)
    tokens = list(range(13))
    for seq, salt in [(1, "a"), (2, None)]:
        assert bm.match(seq, tokens, salt) == 0
        assert bm.ensure(seq, len(tokens))
        bm.seal(seq, len(tokens), lambda s, e: tokens[s:e])
        bm.free(seq)
    assert bm.match(3, tokens, "a") == 12 and bm.match(4, tokens, None) == 12
    assert bm.match(5, tokens, "b") == 0
