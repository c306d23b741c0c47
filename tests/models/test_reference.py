"""Parity with transformers' implementation on random checkpoints of many shapes and layouts."""

from dataclasses import replace

import pytest
import torch

import m3lm
from tests.support.checkpoints import (
    Spec,
    bare_text_config,
    hf_logits,
    hf_model,
    hf_vl_config,
    mxfp8_release,
    quantize_hf,
    release_config,
    to_hf_layout,
    to_release,
    write_checkpoint,
)

pytest.importorskip("transformers")

SPECS = {
    "base": Spec(),
    "wide-heads": Spec(heads=8, kv_heads=4, head_dim=32, rotary_dim=16, index_dim=32),
    "full-rope": Spec(head_dim=16, rotary_dim=16, index_dim=16),
    "many-experts": Spec(experts=16, top_k=4, inter=16, shared_inter=48),
    "two-local": Spec(local=2, topk_blocks=4, block=3),
    "big-blocks": Spec(block=8, topk_blocks=2),
    "all-moe": Spec(moe=(True, True), sparse=(True, True)),
    "dense-sparse": Spec(
        moe=(False, False, True, False), sparse=(False, True, True, True), block=2, topk_blocks=5
    ),
    "no-sparse": Spec(sparse=(False, False, False)),
}


def ids_for(s: Spec, length: int = 57, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, s.vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def assert_close(out: torch.Tensor, ref: torch.Tensor):
    err = float((out - ref).abs().max() / ref.abs().max())
    assert err < 1e-4, err


def dense_logits(ref, ids):
    """The reference with every sparse layer forced dense (to prove sparsity is engaged)."""
    cfg = ref.config
    saved = list(cfg.layer_types)
    cfg.layer_types = ["full_attention"] * len(saved)
    for layer in ref.model.layers:
        layer.self_attn.indexer_saved, layer.self_attn.indexer = layer.self_attn.indexer, None
    try:
        return hf_logits(ref, ids)
    finally:
        cfg.layer_types = saved
        for layer in ref.model.layers:
            layer.self_attn.indexer = layer.self_attn.indexer_saved


@pytest.mark.parametrize("name", list(SPECS))
def test_release_layout_matches_transformers(name, tmp_path):
    s = SPECS[name]
    ref = hf_model(s, seed=list(SPECS).index(name))
    ids = ids_for(s)
    path = write_checkpoint(tmp_path, to_release(ref.state_dict(), s), release_config(s), shards=2)
    model, _ = m3lm.load(path, device="cpu", dtype=torch.float32)
    with torch.inference_mode():
        out = model(ids)[0]
    expected = hf_logits(ref, ids)[0]
    assert_close(out, expected)
    if any(s.sparse):  # the case is only meaningful if MSA changes the answer
        assert (dense_logits(ref, ids)[0] - expected).abs().max() > 1e-3


@pytest.mark.parametrize("layout", ["hf", "hf-packed", "bare-text"])
def test_other_layouts_match_transformers(layout, tmp_path):
    s = Spec(heads=8, kv_heads=2, experts=5, top_k=3, topk_blocks=2, block=5)
    ref = hf_model(s, seed=7)
    ids = ids_for(s, 41)
    sd = ref.state_dict()
    if layout == "bare-text":
        tensors = {
            k.removeprefix("language_model."): v
            for k, v in to_release(sd, s).items()
            if k.startswith("language_model.")
        }
        write_checkpoint(tmp_path, tensors, bare_text_config(s))
    else:
        write_checkpoint(tmp_path, to_hf_layout(sd, s, pack_shared=layout == "hf-packed"), hf_vl_config(s))
    model, _ = m3lm.load(tmp_path, device="cpu", dtype="float32")
    with torch.inference_mode():
        assert_close(model(ids)[0], hf_logits(ref, ids)[0])


def test_mxfp8_export_matches_dequantised_reference(tmp_path):
    s = Spec(hidden=64, inter=32, shared_inter=32, dense_inter=64, head_dim=32, rotary_dim=16, index_dim=32)
    ref = hf_model(s, seed=3)
    values, scales, dequant = quantize_hf(ref.state_dict())
    ref.load_state_dict(dequant)
    config = release_config(s)
    config["quantization_config"] = {"quant_method": "mxfp8", "weight_block_size": [1, 32]}
    write_checkpoint(tmp_path, mxfp8_release(values, scales, s), config, shards=3)
    model, _ = m3lm.load(tmp_path, device="cpu", dtype=torch.float32)
    assert model.model.layers[1].block_sparse_moe.gate.weight.dtype == torch.float32
    ids = ids_for(s, 33)
    with torch.inference_mode():
        assert_close(model(ids)[0], hf_logits(ref, ids)[0])


def test_batch_rows_are_independent(tmp_path):
    s = SPECS["base"]
    ref = hf_model(s, seed=11)
    write_checkpoint(tmp_path, to_release(ref.state_dict(), s), release_config(s))
    model, _ = m3lm.load(tmp_path, device="cpu", dtype=torch.float32)
    ids = torch.cat([ids_for(s, 30, seed=1), ids_for(s, 30, seed=2)])
    with torch.inference_mode():
        both = model(ids)
        assert torch.allclose(both[1], model(ids[1:])[0], atol=1e-5)
    assert_close(both[1], hf_logits(ref, ids[1:])[0])


def test_spec_variants_change_the_output():
    """Sanity of the helpers: a different local-block count gives different reference logits."""
    a, b = Spec(), replace(Spec(), local=2)
    ids = ids_for(a)
    assert (hf_logits(hf_model(a), ids) - hf_logits(hf_model(b), ids)).abs().max() > 1e-4
