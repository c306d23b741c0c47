"""Speculation's fast paths against their plain references: drafting every sequence at once over
the paged pool (`EagleDrafter.draft_rows`) against drafting each alone (`EagleDrafter.draft`),
the greedy accept rule against the general one, and a verification step's rows in one decode
batch against the packed forward, with the states a drafter reads."""

import copy

import pytest
import torch

from m3lm.cache.kv_cache import KVCache
from m3lm.core import SamplingParams
from m3lm.distributed.steps import Step
from m3lm.engine.drafter import DraftRows, EagleDrafter
from m3lm.engine.runner import forward_step
from m3lm.engine.sequence import Sequence
from m3lm.models.eagle3 import Eagle3, EagleArgs, published_config
from m3lm.speculative.rejection import verify, verify_greedy

K = 3
PAGE = 4


def head(vocab: int = 50, seed: int = 0, dtype=torch.float32) -> Eagle3:
    """A random drafter with its own embedding and lm_head: 4 query heads over 2 KV heads."""
    c = published_config(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=48, vocab_size=vocab, layer_ids=[0, 1, 2],
    )  # fmt: skip
    h = Eagle3(EagleArgs.from_dict(c, 2), dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in h.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    h.bind(None)
    return h.eval()


def case(seed: int, device: str = "cpu", dtype=torch.float32):
    """A drafter whose pool holds noise, and four sequences after a step of decodes: each took
    in `valid` of its `n` rows (1 + drafts) at positions from `start`, on shuffled pages; page 0
    belongs to nobody."""
    h = head(seed=seed, dtype=dtype).to(device)
    g = torch.Generator().manual_seed(seed)
    num_pages = 40
    drafter = EagleDrafter(h, num_pages, PAGE, torch.device(device))
    drafter.k.copy_(torch.randn(drafter.k.shape, generator=g))
    drafter.v.copy_(torch.randn(drafter.v.shape, generator=g))
    pages = (torch.randperm(num_pages - 2, generator=g) + 1).tolist()
    rows, seqs, first = [], [], 0
    for b, (start, n, valid) in enumerate([(9, 4, 2), (3, 4, 4), (14, 1, 1), (6, 3, 1)]):
        end = start + valid  # num_cached after the step
        table = pages[b * 8 : b * 8 + -(-(end + 1) // PAGE)]
        ids = torch.randint(0, 50, (end + 1,), generator=g).tolist()
        seq = Sequence(b, str(b), ids, SamplingParams(), output_limit=100, num_cached=end)
        rows.append(DraftRows(table, start, seq.tokens(start + 1, end + 1), first, n))
        seqs.append(seq)
        first += n
    hidden = torch.randn(first, 3 * 32, generator=g).to(device, dtype)
    return drafter, rows, seqs, hidden


@torch.inference_mode()
def test_drafting_every_sequence_at_once_is_drafting_each_alone():
    """Same drafts, and the same keys at every position taken in; padding rows and drafted
    positions write nothing outside the sequences' pages but the spare page."""
    drafter, rows, seqs, hidden = case(1)
    alone = copy.deepcopy(drafter)
    untouched = drafter.k[0].clone()
    got = drafter.draft_rows(rows, hidden, K)
    want = [
        alone.draft(seq, r.table, hidden[r.first : r.first + len(r.tokens)], r.start, K)
        for seq, r in zip(seqs, rows, strict=True)
    ]
    assert got == want
    assert len({tuple(d) for d in got}) > 1  # drafts that tell sequences apart
    for r in rows:
        for pos in range(r.start, r.start + len(r.tokens)):
            page, slot = r.table[pos // PAGE], pos % PAGE
            torch.testing.assert_close(drafter.k[page, slot], alone.k[page, slot])
            torch.testing.assert_close(drafter.v[page, slot], alone.v[page, slot])
    assert torch.equal(drafter.k[0], untouched)


@torch.inference_mode()
def test_a_later_take_in_overwrites_the_drafted_positions():
    """After drafting, the next step's take-in at those positions gives what drafting the
    sequence afresh from a pool that never held the drafted keys gives."""
    drafter, rows, seqs, hidden = case(2)
    fresh = copy.deepcopy(drafter)
    drafter.draft_rows(rows, hidden, K)  # writes drafted keys past each sequence's end
    for seq, r in zip(seqs, rows, strict=True):  # takes in the same positions, drafts nothing
        fresh.draft(seq, r.table, hidden[r.first : r.first + len(r.tokens)], r.start, 0)
    g = torch.Generator().manual_seed(7)
    used = {p for r in rows for p in r.table}
    free = [p for p in range(1, 39) if p not in used]
    later = []
    for b, (r, seq) in enumerate(zip(rows, seqs, strict=True)):
        start = seq.num_cached  # the next step starts at the bonus token, and accepts one draft
        ids = seq.prompt_ids + torch.randint(0, 50, (2,), generator=g).tolist()
        taken = ids[start + 1 : start + 3]
        later.append(DraftRows([*r.table, free[b]], start, taken, 2 * b, 1 + K))
    h2 = torch.randn(2 * len(later) + K - 1, 96, generator=g)
    got = drafter.draft_rows(later, h2, K)
    assert got == fresh.draft_rows(later, h2, K)


@torch.inference_mode()
def test_a_prompt_taken_in_alone_then_drafted_among_rows_is_drafted_as_alone():
    """After a step that prefilled a prompt's chunk beside decodes (the engine's way): the chunk
    taken in alone, drafting nothing, then its last position again as one row among the
    decoded sequences' rows: the drafts and keys of drafting the prompt alone."""
    drafter, rows, _, hidden = case(3)
    g = torch.Generator().manual_seed(4)
    start, end = 5, 17  # the chunk's positions, start .. end - 1
    ids = torch.randint(0, 50, (end + 1,), generator=g).tolist()
    prompt = Sequence(9, "9", ids, SamplingParams(), output_limit=100, num_cached=end)
    used = {p for r in rows for p in r.table}
    table = [p for p in range(1, 39) if p not in used][: -(-(end + 1) // PAGE)]  # no one else's pages
    chunk = torch.randn(end - start, hidden.shape[1], generator=g)
    alone = copy.deepcopy(drafter)
    want = alone.draft(prompt, table, chunk, start, K)
    drafter.draft(prompt, table, chunk, start, 0)
    both = torch.cat([hidden, chunk])
    last = DraftRows(table, end - 1, prompt.tokens(end, end + 1), len(hidden) + end - start - 1, 1)
    assert drafter.draft_rows([*rows, last], both, K)[-1] == want
    for pos in range(start, end):
        page, slot = table[pos // PAGE], pos % PAGE
        torch.testing.assert_close(drafter.k[page, slot], alone.k[page, slot])


def test_greedy_acceptance_is_the_general_rule_on_greedy_rows():
    g = torch.Generator().manual_seed(3)
    B, V = 64, 6
    logits = torch.randint(-2, 3, (B, K + 1, V), generator=g).float()  # many ties
    top = logits.argmax(-1)
    drafts = torch.where(
        torch.rand(B, K, generator=g) < 0.7, top[:, :K], torch.randint(0, V, (B, K), generator=g)
    )
    num = torch.randint(0, K + 1, (B,), generator=g)
    ones = torch.ones(B, dtype=torch.bool)
    want_acc, want_next = verify(logits, drafts, num, ones, torch.rand(B, K), torch.ones(B, V))
    accepted, emitted = verify_greedy(logits, drafts, num)
    assert torch.equal(accepted, want_acc) and 0 < accepted.float().mean() < K
    assert torch.equal(emitted.gather(1, accepted[:, None])[:, 0], want_next)
    for b in range(B):  # before row `accepted`: the accepted drafts themselves
        assert emitted[b, : accepted[b]].tolist() == drafts[b, : accepted[b]].tolist()


@torch.inference_mode()
def test_verification_rows_are_the_packed_forward_with_the_drafters_states(tiny):
    """A sequence's last token and drafts as rows of one position (the engine's verify step)
    give the logits and the captured states of the same positions as one packed chunk."""
    a = tiny.args
    g = torch.Generator().manual_seed(4)
    tables = [[5, 1, 8, 3, 9, 0], [2, 7, 4, 6, 10, 11]]
    starts, n = [13, 17], K + 1
    tokens = torch.randint(0, a.vocab_size, (2 * n,), generator=g).tolist()

    def run(step):
        cache = KVCache(a, 13, "cpu", torch.float32)
        for t in (*cache.k, *cache.v, *cache.ik.values()):
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(5)))
        capture = dict.fromkeys((1, 3))
        logits = forward_step(tiny, cache, step, None, capture=capture)
        return logits, torch.cat([capture[1], capture[3]], -1)

    rows = Step(tokens, [1] * 2 * n, [s + i for s in starts for i in range(n)], list(range(2 * n)),
                [t for t in tables for _ in range(n)])  # fmt: skip
    packed = Step(tokens, [n, n], starts, list(range(2 * n)), tables)
    got, got_h = run(rows)
    want, want_h = run(packed)
    assert got.std() > 0.1
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_h, want_h, rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
@torch.inference_mode()
def test_drafting_graphs_on_the_gpu_draft_as_the_cpu_does():
    """The captured drafting (`DraftGraphs`) replays the eager batched drafting on the GPU, which
    drafts as the CPU does (fp32), also for fewer sequences than its bucket."""
    from m3lm.engine.drafter import DraftGraphs

    cpu, rows, _, hidden = case(3)
    want = cpu.draft_rows(rows, hidden, K)
    for n in (4, 3):
        gpu, rows, _, hidden = case(3, "cuda")
        gpu.graphs = DraftGraphs(gpu, 4, 8, K)
        assert gpu.draft_rows(rows[:n], hidden, K) == want[:n]
        assert gpu.graphs._graphs  # a replay, not the eager path
