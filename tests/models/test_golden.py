"""Golden parity: every checkpoint under ../shared/fixtures reproduces the reference logits."""

import pytest
import torch
from safetensors.torch import load_file

import m3lm
from tests.support.paths import golden_params


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("fixture", golden_params())
def test_prefill_logits_match(fixture):
    model, _ = m3lm.load(fixture, device="cpu", dtype=torch.float32)
    expected = load_file(fixture / "expected.safetensors")
    names = sorted(k.split(".")[0] for k in expected if k.startswith("prefill_") and k.endswith(".logits"))
    assert names, "fixture has no prefill cases"
    for name in names:
        with torch.inference_mode():
            logits = model(expected[f"{name}.input_ids"])[0]
        assert rel_err(logits, expected[f"{name}.logits"]) < 1e-4, name


@pytest.mark.parametrize("fixture", golden_params())
def test_greedy_prefix_logits_match(fixture):
    """A full forward over prompt + greedy output gives each step's logits (no cache needed)."""
    model, _ = m3lm.load(fixture, device="cpu", dtype=torch.float32)
    expected = load_file(fixture / "expected.safetensors")
    prompt, out = expected["greedy.input_ids"], expected["greedy.output_ids"]
    ids = torch.cat([prompt[0], out[:-1]])[None]
    with torch.inference_mode():
        logits = model(ids)[0, prompt.shape[1] - 1 :]
    assert rel_err(logits, expected["greedy.step_logits"]) < 1e-4
    assert torch.equal(logits.argmax(-1), out)


@pytest.mark.parametrize("fixture", golden_params())
def test_router_stays_fp32(fixture):
    model, _ = m3lm.load(fixture, device="cpu", dtype="bfloat16")
    moe = [layer.block_sparse_moe for layer in model.model.layers if hasattr(layer, "block_sparse_moe")]
    assert moe
    for block in moe:
        assert block.gate.weight.dtype == torch.float32
        assert block.e_score_correction_bias.dtype == torch.float32
        assert block.experts.w1.dtype == torch.bfloat16
