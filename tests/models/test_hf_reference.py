"""The transformers reference timers on a tiny fp32 slice on the CPU."""

import pytest
import torch

from tests.support.checkpoints import Spec, hf_text_config

pytest.importorskip("transformers")

from m3lm.bench.hf_reference import (
    _experts_implementations,
    build_hf_slice,
    time_hf_decode,
    time_hf_prefill,
)


@pytest.fixture(scope="module")
def model():
    return build_hf_slice(hf_text_config(Spec()), "cpu", dtype=torch.float32, seed=1)


def test_slice_settings_and_random_weights(model):
    assert model.config._attn_implementation == "sdpa"
    if "grouped_mm" in _experts_implementations():
        assert model.config._experts_implementation == "grouped_mm"
    assert not model.training
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())
    assert all(p.abs().sum() > 0 for p in model.parameters())
    for layer in model.model.layers:
        bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
        assert bias is None or bias.abs().sum() > 0


def test_prefill_timer(model):
    r = time_hf_prefill(model, batch=2, length=24, iters=3)
    assert r["median_ms"] > 0 and r["min_ms"] > 0 and r["tokens_per_s"] > 0
    assert (r["batch"], r["length"], r["iters"], r["attention"]) == (2, 24, 3, "sdpa")


@pytest.mark.parametrize("step_experts", [None, "batched_mm"])
def test_decode_timer_uses_the_cache(model, step_experts):
    own = model.config._experts_implementation
    r = time_hf_decode(model, 2, 21, iters=4, warmup=2, step_experts=step_experts, keep_logits=True)
    assert r["experts"] == (step_experts or own) and model.config._experts_implementation == own
    assert r["median_ms"] > 0 and r["prefill_ms"] > 0 and r["tokens_per_s"] > 0
    assert r["context"] == 21 and r["context_ids"].shape == (2, 21) and r["step_ids"].shape == (2, 1)
    # The last timed step, after 5 crops, equals a cache-free forward over context + step token.
    ids = torch.cat([r["context_ids"], r["step_ids"]], dim=1)
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits[:, -1].float()
    torch.testing.assert_close(r["step_logits"], full, rtol=0, atol=1e-4)
    assert full.abs().max() > 1e-3  # not trivially equal
