"""`m3lm bench --verify/--drafter` on the CPU with a tiny slice: the verification forward it
times is exactly k + 1 decode steps, the drafter case's drafter has the published layout, the
60-layer projection's arithmetic, and the flags."""

import argparse
import re

import pytest
import torch

from m3lm.bench import speculation
from m3lm.bench.report import projection_ms
from m3lm.bench.timing import wall_ms
from m3lm.cli import main
from m3lm.config import parse_config, release_config
from m3lm.distributed.steps import Step
from m3lm.engine.runner import forward_step
from m3lm.models.minimax_m3 import MiniMaxM3

K = 3


@pytest.fixture(scope="module")
def tiny() -> MiniMaxM3:
    """A 3-layer slice (dense + full attention, then two MoE + MSA layers) whose MSA selects 3
    of its blocks of 4 positions, with random weights large enough for the logits to differ."""
    cfg = release_config(
        vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, rotary_dim=8, rope_theta=10000.0, max_position_embeddings=4096, dense_layers=1,
        dense_intermediate_size=64, intermediate_size=32, shared_intermediate_size=32,
        num_local_experts=6, num_experts_per_tok=2, index_head_dim=16, block_size=4, topk_blocks=3,
        local_blocks=1,
    )["text_config"]  # fmt: skip
    model = MiniMaxM3(parse_config(cfg), torch.float32).eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(
                1.0 + 0.3 * torch.randn(p.shape, generator=gen)
                if p.dim() == 1
                else 0.08 * torch.randn(p.shape, generator=gen)
            )
    return model


@torch.inference_mode()
def test_the_verify_forward_is_k_plus_1_decode_steps_on_the_same_cache(tiny):
    """Each sequence's k + 1 positions in one verification forward give the logits that k + 1
    decode steps give, one position at a time, over the same cache contents (its own MSA
    selection at every position: 40 positions are 10 blocks, of which a query attends 3)."""
    batch, ctx = 3, 40
    cache, step = speculation.verify_inputs(tiny, batch, ctx, K)
    n = batch * (K + 1)
    assert step.q_lens == [1] * n and step.starts == [ctx - 1 + i for _ in range(batch) for i in range(K + 1)]
    assert len(step.tokens) == len(step.rows) == n
    assert step.tables == [t for t in step.tables[:: K + 1] for _ in range(K + 1)]  # a table a sequence
    assert sorted(p for t in step.tables[:: K + 1] for p in t) == list(
        range(cache.num_pages - 1)
    )  # shuffled, disjoint
    verified = forward_step(tiny, cache, step, None).view(batch, K + 1, -1)

    fresh, same = speculation.verify_inputs(tiny, batch, ctx, K)  # the same noise in a new cache
    assert same == step
    for i in range(K + 1):
        tokens = [step.tokens[b * (K + 1) + i] for b in range(batch)]
        one = Step(tokens, [1] * batch, [ctx - 1 + i] * batch, list(range(batch)), step.tables[:: K + 1])
        decoded = forward_step(tiny, fresh, one, None)
        assert decoded.std() > 0.1  # logits that tell tokens apart
        torch.testing.assert_close(verified[:, i], decoded, rtol=1e-4, atol=1e-4)
        assert torch.equal(verified[:, i].argmax(-1), decoded.argmax(-1))
    for layer in range(3):  # the keys the verification wrote are the decode steps' keys
        torch.testing.assert_close(cache.k[layer], fresh.k[layer], rtol=1e-5, atol=1e-5)


def test_the_drafter_has_the_published_layout_and_its_case_runs(tiny):
    cfg = speculation.drafter_config(tiny.args, 2)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert (cfg["hidden_size"], cfg["head_dim"], cfg["num_key_value_heads"]) == (64, 16, 2)
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 30, 57]
    head = speculation.build_drafter(tiny, 2)
    assert head.embed_tokens is not None and head.lm_head is not None  # its own, not the target's
    assert head.fc.weight.shape == (64, 3 * 64) and head.lm_head.weight.shape == (96, 64)
    assert head.midlayer.self_attn.k_proj.weight.shape == (2 * 16, 2 * 64)
    assert all(torch.isfinite(p).all() and p.std() > 0 for p in head.parameters() if p.numel() > 1)
    fc, layer, lm_head = speculation.drafter_sizes(head)
    assert fc + layer + lm_head + head.embed_tokens.weight.numel() == sum(
        p.numel() for p in head.parameters()
    )
    row = speculation.bench_draft(tiny, head, 2, 40, K, 1, wall_ms)
    assert row.case == "draft B=2 k=3 ctx=40 (2 KV heads)" and row.tokens == 2 * K
    assert row.ms > 0 and set(row.parts) == {"fc", "step"}


def test_speedup_arithmetic():
    # 2.8 tokens per (4 ms of drafting + a 17 ms verify step) against one per 15.62 ms decode step
    spec, plain, ratio = speculation.speedup(1, 2.8, 15.62, 17.0, 4.0)
    assert spec == pytest.approx(2800 / 21) and plain == pytest.approx(1000 / 15.62)
    assert ratio == pytest.approx(2.8 * 15.62 / 21)
    spec, plain, ratio = speculation.speedup(16, 3.0, 176.16, 200.0, 30.0)
    assert (spec, plain) == (pytest.approx(48000 / 230), pytest.approx(16000 / 176.16))
    assert ratio == pytest.approx(3 * 176.16 / 230)
    assert projection_ms({"head": 0.609, "dense": 0.211, "sparse": 0.251}) == pytest.approx(15.549)


def test_the_cases_give_rows_and_projection_lines(tiny, capsys):
    args = argparse.Namespace(verify=[(1, 24), (2, 20)], num_spec_tokens=K, iters=1, drafter=[4, 2])
    args.acceptance = [2.8, 3.0]
    draft_rows, draft_notes, drafts = speculation.draft_cases(tiny, args, wall_ms)
    assert [r.case for r in draft_rows] == [
        "draft B=1 k=3 ctx=24 (4 KV heads)",
        "draft B=2 k=3 ctx=20 (4 KV heads)",
        "draft B=1 k=3 ctx=24 (2 KV heads)",
        "draft B=2 k=3 ctx=20 (2 KV heads)",
    ]
    assert set(drafts) == {(kv, b, c) for kv in (4, 2) for b, c in args.verify}
    assert len(draft_notes) == 4 and "fc over the 3 captured states" in draft_notes[0]
    decode = {
        (1, 24): {"head": 1.0, "dense": 0.5, "sparse": 0.25},
        (2, 20): {"head": 2.0, "dense": 1.0, "sparse": 0.5},
    }
    rows, notes = speculation.verify_cases(tiny, args, decode, drafts, " [bf16]", wall_ms)
    assert [r.case for r in rows] == ["verify B=1 x 4 ctx=24 [bf16]", "verify B=2 x 4 ctx=20 [bf16]"]
    assert [r.tokens for r in rows] == [4, 8] and all(
        set(r.parts) == {"head", "dense", "sparse"} for r in rows
    )
    # per case: the parts line, the experts read, then the projection without drafting time and
    # with each drafter
    assert len(notes) == 2 * 5
    row, parts_line, experts, upper, with_drafter = rows[1], notes[5], notes[6], notes[7], notes[9]
    read = 6 * (1 - (1 - 2 / 6) ** 8)  # 6 experts, 2 a token, 8 rows
    assert experts.startswith(
        f"verify B=2 x 4 ctx=20 [bf16]: a MoE layer reads {read:.1f} routed experts for the 8 rows"
    )
    assert parts_line.startswith("verify B=2 x 4 ctx=20 [bf16]: step") and "60-layer projection" in parts_line
    assert upper.startswith("B=2 ctx=20 k=3 [bf16], speculation with no drafting time (an upper bound)")
    assert with_drafter.startswith("B=2 ctx=20 k=3 [bf16], speculation with the 2-KV-head drafter")
    verify_ms = row.parts["head"] + 3 * row.parts["dense"] + 57 * row.parts["sparse"]
    decode_ms = 2.0 + 3 * 1.0 + 57 * 0.5
    draft_ms = drafts[(2, 2, 20)]
    for acc in (2.8, 3.0):
        want = 2 * acc / (draft_ms + verify_ms) * 1e3
        got = re.search(
            rf"L = {acc:g}: 2 x {acc:g} tokens / \(\S+ \+ \S+\) ms = ([\d,]+) tok/s, ([\d.]+)x", with_drafter
        )
        assert float(got[1].replace(",", "")) == pytest.approx(want, rel=0.01, abs=1)
        assert float(got[2]) == pytest.approx(want / (2 / decode_ms * 1e3), abs=0.006)
    assert f"plain decode step {decode_ms:.2f} ms" in upper and f"verify step {verify_ms:.2f} ms" in upper
    assert "drafting 0.00 ms" in upper and "measured" in upper and "projected" in upper
    printed = capsys.readouterr().out.splitlines()  # the rows as they come
    assert [line.split(" | ")[0] for line in printed if line.startswith("verify B=") and " | " in line] == [
        r.case for r in rows
    ]


@pytest.mark.parametrize(
    "flags, why",
    [
        (["--acceptance", "4.5"], "--acceptance 4.5: a mean acceptance length is between 1 and k + 1 = 4"),
        (["--drafter"], "--drafter times drafting for the --verify cases: give --verify too"),
        (["--verify", "1x4096", "--drafter", "5"], "--drafter 5: KV head counts must divide 64"),
        (["--verify", "16-2048"], "--verify 16-2048: expected BATCHxCONTEXT,..."),
    ],
)
def test_bad_flags_are_one_line_errors_before_the_gpu_check(flags, why, capsys):
    assert main(["bench", *flags]) != 0
    err = capsys.readouterr().err
    assert why in err and "Traceback" not in err
