"""MXFP8 weights kept in 8 bits (CPU reference path), the loader's 8-bit path, the FP8 index-key cache."""

import copy

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import m3lm
from m3lm.cache.kv_cache import KVCache, PagedKV
from m3lm.errors import CheckpointError
from m3lm.layers.linear import MXFP8Linear, weight_bytes
from m3lm.loader import resolve_quant
from tests.support.checkpoints import (
    Spec,
    hf_model,
    mxfp8_release,
    quantize_hf,
    release_config,
    write_checkpoint,
)
from tests.support.paths import FIXTURES

MXFP8_FIXTURE = FIXTURES / "minimax-m3-tiny-mxfp8"
needs_fixture = pytest.mark.skipif(not MXFP8_FIXTURE.is_dir(), reason=f"no fixtures at {FIXTURES}")


def test_mxfp8_linear_on_cpu_is_the_dequantised_matmul():
    lin = MXFP8Linear(64, 3)
    values = torch.tensor([1.0, -0.5, 2.0, 448.0, 0.015625, -3.5, 0.0, 6.0])
    with torch.no_grad():
        lin.weight.copy_(values.repeat(3, 8).to(torch.float8_e4m3fn))  # exact e4m3 values
        lin.weight_scale.copy_(torch.tensor([[127, 130], [120, 127], [140, 100]], dtype=torch.uint8))
    x = torch.randn(5, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    w = torch.empty(3, 64, dtype=torch.float64)
    for o in range(3):
        for i in range(64):
            w[o, i] = float(values[i % 8]) * 2.0 ** (int(lin.weight_scale[o, i // 32]) - 127)
    # fp32 accumulation of 64 products of up to 448 * 2^13: bound the error by their magnitudes.
    bound = 1e-5 * (x.abs() @ w.abs().T) + 1e-6
    assert ((lin(x.float()).double() - x @ w.T).abs() <= bound).all()
    assert lin.weight.dtype == torch.float8_e4m3fn and lin.weight_scale.shape == (3, 2)


def test_resolve_quant():
    args = m3lm.ModelArgs.from_file(m3lm.DEFAULT_MODEL / "config.json")
    assert resolve_quant("auto", args, torch.device("cuda")) is None  # not an MXFP8 checkpoint
    assert resolve_quant("mxfp8", args, torch.device("cpu")) == "mxfp8"
    assert resolve_quant("none", args, torch.device("cuda")) is None
    with pytest.raises(ValueError, match="quant"):
        resolve_quant("int4", args, torch.device("cpu"))


@needs_fixture
def test_mxfp8_fixture_kept_in_8_bits_on_cpu():
    model, _ = m3lm.load(MXFP8_FIXTURE, device="cpu", dtype=torch.float32, quant="mxfp8")
    exp = load_file(MXFP8_FIXTURE / "expected.safetensors")
    with torch.inference_mode():
        logits = model(exp["prefill_64.input_ids"])[0]
    ref = exp["prefill_64.logits"]
    assert float((logits - ref).abs().max() / ref.abs().max()) < 1e-4
    layer = model.model.layers[1]
    assert layer.self_attn.index_k_proj.weight.dtype == torch.float8_e4m3fn
    assert layer.block_sparse_moe.experts.w2.dtype == torch.float8_e4m3fn
    assert layer.block_sparse_moe.gate.weight.dtype == torch.float32  # the router stays fp32
    assert model.lm_head.weight.dtype == torch.float32
    fp8 = 0  # every float8 byte of the checkpoint is resident, and nothing else is float8
    for f in MXFP8_FIXTURE.glob("*.safetensors"):
        with safe_open(f, framework="pt") as st:
            for k in st.keys():  # noqa: SIM118
                sl = st.get_slice(k)
                if sl.get_dtype() == "F8_E4M3" and k.startswith("language_model.model.layers."):
                    fp8 += sl.get_shape()[0] * sl.get_shape()[1]
    sizes = weight_bytes(model)
    assert sizes["float8_e4m3fn"] == fp8 and sizes["uint8"] == fp8 // 32


@needs_fixture
def test_quantising_at_load_reproduces_the_release_export():
    """A float checkpoint loaded with quant="mxfp8" uses the release's scheme: same bits as the export."""
    ours, _ = m3lm.load(FIXTURES / "minimax-m3-tiny", device="cpu", dtype=torch.float32, quant="mxfp8")
    export, _ = m3lm.load(MXFP8_FIXTURE, device="cpu", dtype=torch.float32, quant="mxfp8")
    a, b = ours.state_dict(), export.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k


@pytest.mark.parametrize("bad", ["value", "scale"])
def test_kept_8_bit_path_refuses_nan_encodings(tmp_path, bad):
    s = Spec(hidden=64, inter=32, shared_inter=32, dense_inter=64, head_dim=32, rotary_dim=16, index_dim=32)
    values, scales, _ = quantize_hf(hf_model(s, seed=3).state_dict())
    tensors = mxfp8_release(values, scales, s)
    name = "language_model.model.layers.1.block_sparse_moe.experts.2.w3.weight"
    if bad == "value":
        q = tensors[name].view(torch.uint8).clone()
        q[3, 5] = 0xFF  # e4m3fn NaN
        tensors[name] = q.view(torch.float8_e4m3fn)
    else:
        tensors[name + "_scale_inv"] = tensors[name + "_scale_inv"].clone()
        tensors[name + "_scale_inv"][0, 1] = 255  # E8M0 NaN
    config = release_config(s)
    config["quantization_config"] = {"quant_method": "mxfp8", "weight_block_size": [1, 32]}
    write_checkpoint(tmp_path, tensors, config)
    for quant in ("mxfp8", "none"):
        with pytest.raises(CheckpointError, match="NaN"):
            m3lm.load(tmp_path, device="cpu", quant=quant)


def test_fp8_index_cache_stores_e4m3_with_a_scale_per_token():
    args = m3lm.ModelArgs.from_file(m3lm.DEFAULT_MODEL / "config.json")
    cache = KVCache(args, 4, "cpu", torch.float32, index_fp8=True)
    layer = next(iter(cache.ik))
    assert cache.ik[layer].dtype == torch.float8_e4m3fn and cache.ik_scale[layer].shape == (4, 16)
    ik = torch.randn(20, args.index_head_dim) * torch.logspace(-2, 2, 20)[:, None]  # scales vary by token
    kv = PagedKV(cache, [[2, 0]], [0], [20])
    back = kv.update_index(layer, 0, ik)  # [20, Di] dequantised
    rel = (back - ik).abs().amax(-1) / ik.abs().amax(-1)
    assert float(rel.max()) <= 2**-4 and float(rel.max()) > 0  # e4m3: 3 mantissa bits, per-token scale
    assert torch.equal(cache.ik_scale[layer][2], ik[:16].abs().amax(-1) / 448)
    full = KVCache.bytes_per_page(args, torch.bfloat16)
    small = KVCache.bytes_per_page(args, torch.bfloat16, index_fp8=True)
    sparse = sum(args.sparse_layers)
    assert full - small == 16 * sparse * (args.index_head_dim * 2 - args.index_head_dim - 4)


def test_quantising_a_built_model_matches_its_dequantised_copy():
    """`keep_mxfp8_(quantize=True)` (the bench's mxfp8 slice) computes with dequant(quantize(W))."""
    from m3lm.kernels.fp8 import dequant_mxfp8, quantize_mxfp8
    from m3lm.models.minimax_m3 import MiniMaxM3, keep_mxfp8_, random_init_

    args = m3lm.ModelArgs.from_file(m3lm.DEFAULT_MODEL / "config.json")
    model = random_init_(MiniMaxM3(args), seed=1)
    ref = MiniMaxM3(args)
    with torch.no_grad():
        for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
            quantised = name.endswith(("proj.weight", "w1", "w2", "w3")) and "lm_head" not in name
            r.copy_(dequant_mxfp8(*quantize_mxfp8(p)) if quantised else p)
    before = weight_bytes(model)
    keep_mxfp8_(model, quantize=True)
    after = weight_bytes(model)
    assert before["float32"] - after["float32"] == 4 * after["float8_e4m3fn"] == 128 * after["uint8"]
    ids = torch.randint(0, args.vocab_size, (1, 150), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.allclose(model(ids), ref(ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "affine4"])
def test_quantising_a_built_model_to_4_bits_matches_its_dequantised_copy(fmt):
    """`quantize_q4_` (the bench's 4-bit slices) holds each export's modules in 4 bits (MXFP8
    around the MXFP4 experts) and computes with their dequantised values."""
    from m3lm.kernels.fp8 import dequant_mxfp8
    from m3lm.kernels.q4 import Q4Weight, dequant_q4
    from m3lm.layers.linear import MXFP8Linear, Q4Linear, q4_extra
    from m3lm.layers.quantized import quantize_q4_
    from m3lm.models.minimax_m3 import MiniMaxM3, random_init_

    args = m3lm.ModelArgs.from_file(m3lm.DEFAULT_MODEL / "config.json")
    model = random_init_(MiniMaxM3(args), seed=1)
    ref = copy.deepcopy(model)
    quantize_q4_(model, fmt, group=32)
    kept = 0
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, Q4Linear):
                ref.get_submodule(name).weight.copy_(dequant_q4(m.q4()))
            elif isinstance(m, MXFP8Linear):
                ref.get_submodule(name).weight.copy_(dequant_mxfp8(m.weight, m.weight_scale))
            elif hasattr(m, "q4"):  # routed experts
                for w in ("w1", "w3", "w2"):
                    q = Q4Weight(getattr(m, w), getattr(m, w + "_scale"), q4_extra(m, w), *m.q4)
                    getattr(ref.get_submodule(name), w).copy_(dequant_q4(q))
            else:
                continue
            kept += 1
    assert kept > 2 * args.num_hidden_layers
    assert any(isinstance(m, MXFP8Linear) for m in model.modules()) == (fmt == "mxfp4")
    ids = torch.randint(0, args.vocab_size, (1, 150), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got, want = model(ids), ref(ids)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
