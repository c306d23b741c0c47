"""Sampler tests: hand-computed values for each pure function, then the `Sampler` end to end."""

import math

import pytest
import torch

from m3lm import sampler as sampler_mod
from m3lm.core import SamplingParams
from m3lm.sampler import (
    Sampler,
    apply_penalties,
    apply_temperature,
    logprobs,
    make_generator,
    min_p_mask,
    sample_rows,
    top_k_mask,
    top_p_mask,
)

INF = float("inf")
# Token i has probability PROBS[i]: the order is shuffled so that sorting is exercised.
PROBS = [0.15, 0.4, 0.05, 0.3, 0.1]
LOGITS = torch.tensor([math.log(q) for q in PROBS])  # softmax(LOGITS) == PROBS


def kept(masked: torch.Tensor) -> list[set[int]]:
    return [{i for i, v in enumerate(row) if v != -INF} for row in masked.tolist()]


def test_penalties_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]]).repeat(3, 1)
    prompt_mask = torch.zeros(3, 5, dtype=torch.bool)
    prompt_mask[:, [0, 1]] = True  # prompt tokens {0, 1}
    counts = torch.zeros(3, 5, dtype=torch.int32)
    counts[:, 1], counts[:, 3] = 1, 2  # output [1, 3, 3]
    out = apply_penalties(
        logits,
        prompt_mask,
        counts,
        repetition=torch.tensor([2.0, 1.0, 1.0]),
        presence=torch.tensor([0.5, 0.0, 0.0]),
        frequency=torch.tensor([0.25, 0.0, 1.0]),
    )
    expected = [
        # 2/2; -1*2 - 0.5 - 0.25; unseen; 3/2 - 0.5 - 2*0.25; unseen
        [1.0, -2.75, 0.5, 0.5, -2.0],
        [2.0, -1.0, 0.5, 3.0, -2.0],  # everything off
        # frequency only, output counts only: -1 - 1, 3 - 2
        [2.0, -2.0, 0.5, 1.0, -2.0],
    ]
    assert out.tolist() == expected
    assert logits[0].tolist() == [2.0, -1.0, 0.5, 3.0, -2.0]  # input untouched


def test_repetition_penalty_below_one_raises_seen_tokens():
    out = apply_penalties(
        torch.tensor([[2.0, -2.0, 2.0]]),
        torch.tensor([[True, False, False]]),
        torch.tensor([[0, 1, 0]]),
        torch.tensor([0.5]),
        torch.tensor([0.0]),
        torch.tensor([0.0]),
    )
    assert out.tolist() == [[4.0, -1.0, 2.0]]


def test_temperature_by_hand_and_greedy_rows_unchanged():
    logits = torch.tensor([[2.0, -4.0, 1.0]]).repeat(3, 1)
    out = apply_temperature(logits, torch.tensor([0.5, 0.0, 2.0]))
    assert out.tolist() == [[4.0, -8.0, 2.0], [2.0, -4.0, 1.0], [1.0, -2.0, 0.5]]


def test_top_k_by_hand():
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0, 1.0]]).repeat(5, 1)
    out = top_k_mask(logits, torch.tensor([2, 0, -1, 10, 1]))
    assert kept(out) == [{1, 3}, set(range(5)), set(range(5)), set(range(5)), {1}]
    assert out[0, 1].item() == 3.0 and out[0, 3].item() == 2.0  # survivors keep their values


def test_top_k_keeps_ties_at_the_kth_value():
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0, 2.0]]).repeat(2, 1)
    assert kept(top_k_mask(logits, torch.tensor([2, 1]))) == [{1, 2, 4}, {1, 2, 4}]


def test_top_p_by_hand():
    # Sorted: t1 .4, t3 .3, t0 .15, t4 .1, t2 .05; mass before each: 0, .4, .7, .85, .95.
    ps = torch.tensor([0.01, 0.3, 0.5, 0.75, 0.9, 1.0])
    out = top_p_mask(LOGITS.repeat(6, 1), ps)
    assert kept(out) == [{1}, {1}, {1, 3}, {1, 3, 0}, {1, 3, 0, 4}, set(range(5))]


def test_top_p_keeps_ties_and_ignores_masked_tokens():
    tied = torch.tensor([[math.log(q) for q in (0.4, 0.2, 0.2, 0.2)]])
    assert kept(top_p_mask(tied, torch.tensor([0.5]))) == [{0, 1, 2, 3}]
    # After top_k the nucleus is taken over the renormalised survivors: .4/.7 < .6 needs both.
    after_top_k = top_k_mask(LOGITS[None], torch.tensor([2]))
    assert kept(top_p_mask(after_top_k, torch.tensor([0.6]))) == [{1, 3}]
    assert kept(top_p_mask(after_top_k, torch.tensor([0.5]))) == [{1}]


def test_min_p_by_hand():
    # Top probability .4: thresholds .12, .2, 0 and .4.
    out = min_p_mask(LOGITS.repeat(4, 1), torch.tensor([0.3, 0.5, 0.0, 1.0]))
    assert kept(out) == [{1, 3, 0}, {1, 3}, set(range(5)), {1}]


def test_greedy_rows_take_lowest_id_among_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
    ids = sample_rows(logits, [None, make_generator(0, "cpu")], torch.tensor([True, True]))
    assert ids.tolist() == [1, 0]


def test_seeded_rows_reproducible_and_independent_of_batch():
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(1))

    def draws(batch_rows: list[int], gens: list, steps: int = 8) -> list[list[int]]:
        return [sample_rows(logits[batch_rows], gens).tolist() for _ in range(steps)]

    alone = draws([2], [make_generator(7, "cpu")])
    again = draws([2], [make_generator(7, "cpu")])
    crowded = draws([0, 2, 3, 1], [make_generator(3, "cpu"), make_generator(7, "cpu"), None, None])
    assert alone == again
    assert [step[0] for step in alone] == [step[1] for step in crowded]
    assert len({step[0] for step in alone}) > 1  # the generator advances between steps


def test_seed_and_top_k_are_signed_64_bit_integers():
    lo, hi = SamplingParams.INT64_RANGE
    for seed in (lo, -1, 0, hi):  # every accepted seed makes a generator
        assert make_generator(SamplingParams(seed=seed).seed, "cpu") is not None
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(0))
    wide = [SamplingParams(top_k=hi), SamplingParams(top_k=lo)]  # every accepted top_k samples
    assert Sampler()(logits, wide, [[1], [2]], [[], []], [None, None]).token_ids.shape == (2,)
    for name in ("seed", "top_k"):
        for value in (lo - 1, hi + 1, 2**64):
            with pytest.raises(ValueError, match=name):
                SamplingParams(**{name: value})


def test_sampling_follows_softmax():
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, -INF, -3.0])
    n = 40_000
    ids = sample_rows(logits.expand(n, -1), [make_generator(123, "cpu")] * n)
    freq = torch.bincount(ids, minlength=6).double() / n
    expected = torch.softmax(logits.double(), dim=0)
    assert freq[4] == 0  # a masked token is never drawn
    assert torch.allclose(freq, expected, atol=0.01), (freq, expected)


def test_unseeded_rows_use_global_rng():
    logits = torch.zeros(1, 1000)
    torch.manual_seed(5)
    a = sample_rows(logits, [None])
    torch.manual_seed(5)
    b = sample_rows(logits, [None])
    assert a.tolist() == b.tolist()


def test_logprobs_are_log_softmax_of_raw_logits():
    raw = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    chosen = torch.tensor([4, 0, 49])
    chosen_lp, top_ids, top_lp = logprobs(raw, chosen, 4)
    ref = torch.log_softmax(raw, dim=-1)
    assert chosen_lp.dtype == torch.float32 and top_lp.shape == (3, 4)
    assert torch.allclose(chosen_lp, ref[torch.arange(3), chosen])
    for b in range(3):
        assert set(top_ids[b].tolist()) == set(sorted(range(50), key=lambda i: -raw[b, i].item())[:4])
        assert torch.allclose(top_lp[b], ref[b, top_ids[b]])
        assert top_lp[b].tolist() == sorted(top_lp[b].tolist(), reverse=True)
    assert logprobs(raw, chosen, 0)[1].shape == (3, 0)


def test_make_generator():
    assert make_generator(None, "cpu") is None
    a, b = make_generator(11, "cpu"), make_generator(11, "cpu")
    assert torch.equal(torch.rand(8, generator=a), torch.rand(8, generator=b))


def test_sampler_mixed_rows():
    logits = torch.tensor(
        [
            [3.0, 2.0, 0.0, -1.0, -1.0],  # greedy; repetition turns 3 into 1.5 < 2
            [0.0, 4.0, 3.0, -1.0, 3.5],  # sampled from the top 2
            [1.0, 1.2, 0.0, 0.0, 0.0],  # top_k 1 is greedy; presence turns 1.2 into 0.7
            [2.0, 2.0, -5.0, -5.0, -5.0],  # frequency 2 on token 0; min_p then drops it (e^-2 < .5)
        ]
    )
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=2),
        SamplingParams(temperature=0.5, top_k=2, seed=0),
        SamplingParams(top_k=1, presence_penalty=0.5, logprobs=0),
        SamplingParams(frequency_penalty=1.0, min_p=0.5),
    ]
    gens = [make_generator(p.seed, "cpu") for p in params]
    out = Sampler()(logits, params, [[0], [], [], []], [[], [], [1], [0, 0]], gens)
    assert out.token_ids[[0, 2, 3]].tolist() == [1, 0, 1]
    assert out.token_ids[1].item() in {1, 4}
    ref = torch.log_softmax(logits, dim=-1)  # raw logits, not the penalised ones
    assert torch.allclose(out.logprobs, ref[torch.arange(4), out.token_ids])
    assert out.top_ids.shape == (4, 2)
    assert out.top_ids[0].tolist() == [0, 1]
    assert torch.allclose(out.top_logprobs[0], ref[0, :2])


def test_sampler_sampled_row_distribution():
    logits = torch.tensor([[0.0, 4.0, 3.0, -1.0, 3.5]])
    params = [SamplingParams(temperature=0.5, top_k=2)]
    gen = make_generator(42, "cpu")
    n = 4000
    ids = [Sampler()(logits, params, [[]], [[]], [gen]).token_ids.item() for _ in range(n)]
    # Top 2 are tokens 1 (4.0) and 4 (3.5); at temperature .5 their odds are e^1 : 1.
    p1 = math.e / (math.e + 1)
    assert set(ids) == {1, 4}
    assert abs(ids.count(1) / n - p1) < 0.03
    out = Sampler()(logits, params, [[]], [[]], [None])
    assert out.logprobs is None and out.top_ids is None and out.top_logprobs is None  # none asked


def test_sampler_seeded_rows_independent_of_batch():
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(3))
    p = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.3, seed=9)

    def run(rows: list[int], params: list[SamplingParams], steps: int = 10) -> list[int]:
        gens = [make_generator(q.seed, "cpu") for q in params]
        outputs: list[list[int]] = [[] for _ in rows]
        mine = rows.index(0)
        for _ in range(steps):
            ids = Sampler()(logits[rows], params, [[1, 2]] * len(rows), outputs, gens).token_ids.tolist()
            for o, t in zip(outputs, ids, strict=True):
                o.append(t)
        return outputs[mine]

    alone = run([0], [p])
    crowded = run([1, 0, 2], [SamplingParams(temperature=0.0), p, SamplingParams(min_p=0.2, seed=1)])
    assert alone == crowded
    assert len(set(alone)) > 1


def test_sampler_skips_unneeded_work(monkeypatch: pytest.MonkeyPatch):
    def boom(*args, **kwargs):
        raise AssertionError("should have been skipped")

    for name in ("apply_penalties", "apply_temperature", "top_k_mask", "top_p_mask", "min_p_mask"):
        monkeypatch.setattr(sampler_mod, name, boom)
    logits = torch.tensor([[0.0, 1.0, 5.0], [2.0, 0.0, 1.0]])
    # Greedy rows' filters are not applied; a default row needs none of the steps either.
    params = [SamplingParams(temperature=0.0, top_p=0.5, min_p=0.3), SamplingParams()]
    out = Sampler()(logits, params, [[0], [1]], [[2], [0]], [None, make_generator(0, "cpu")])
    assert out.token_ids[0].item() == 2
    monkeypatch.setattr(sampler_mod, "sample_rows", boom)
    out = Sampler()(logits, [SamplingParams(temperature=0.0)] * 2, [[], []], [[], []], [None, None])
    assert out.token_ids.tolist() == [2, 0]


def test_logit_bias_adds_each_rows_pairs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 10, generator=g)
    biases = [[(2, 5.0), (7, -1.5), (2, 0.5)], [], [(9, -100.0)]]
    expected = logits.clone()
    for b, pairs in enumerate(biases):
        for t, v in pairs:
            expected[b, t] += v
    assert torch.equal(sampler_mod.apply_logit_bias(logits, biases), expected)
    assert sampler_mod.apply_logit_bias(logits, [[], [], []]) is logits


def test_logit_bias_steers_sampling_and_is_validated():
    logits = torch.zeros(2, 8)
    params = [SamplingParams(temperature=1.0, logit_bias=((5, 100.0),)), SamplingParams(temperature=0)]
    out = sampler_mod.Sampler()(logits, params, [[1], [1]], [[], []], [None, None])
    assert out.token_ids[0].item() == 5 and out.token_ids[1].item() == 0
    for bad in (
        ((1, 101.0),),
        ((-1, 1.0),),
        tuple((i, 1.0) for i in range(SamplingParams.MAX_LOGIT_BIAS + 1)),
    ):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)


def test_a_repetition_penalty_float32_cannot_hold_is_refused():
    """5e-324 is a positive double but 0 in float32, where it would divide the logits by zero
    (NaN rows, and a grammar's masked tokens drawn); the smallest accepted one keeps -inf."""
    from m3lm.core import FLOAT32_TINY

    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=5e-324)
    logits = torch.tensor([[2.0, float("-inf"), -1.0, 0.0]])
    rep = torch.tensor([SamplingParams(repetition_penalty=FLOAT32_TINY).repetition_penalty])
    seen = torch.ones(1, 4, dtype=torch.bool)
    out = apply_penalties(
        logits, seen, torch.zeros(1, 4, dtype=torch.long), rep, torch.zeros(1), torch.zeros(1)
    )
    assert not out.isnan().any() and out[0, 1] == float("-inf")
