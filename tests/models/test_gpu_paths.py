"""The model's GPU paths (packed projections, the decode path, the folded MoE sum, the golden
fixtures on the GPU) against the CPU reference; GPU only, each with its CPU twin among the
reference and golden tests."""

import pytest
import torch
from safetensors.torch import load_file

import m3lm
from m3lm.cache.kv_cache import KVCache, PagedKV
from m3lm.layers.batch import DecodeBatch, ForwardBatch
from tests.support.checkpoints import Spec, release_config
from tests.support.paths import golden_params

pytestmark = pytest.mark.cuda
DEV = "cuda"


def rel(out, ref) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


@pytest.mark.parametrize("quant", ["bf16", "mxfp8"])
@pytest.mark.parametrize("t", [1, 13, 1100])
def test_packed_mlp_matches_reference(quant, t):
    from m3lm.layers.linear import to_mxfp8_
    from m3lm.layers.mlp import MLP

    torch.manual_seed(t)
    mlp = MLP(256, 96, 1.702, 7.0).requires_grad_(False)
    for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        torch.nn.init.normal_(lin.weight, std=0.2)
    if quant == "mxfp8":
        to_mxfp8_(mlp, ("gate_proj", "up_proj", "down_proj"), quantize=True)
    x = torch.randn(t, 256) * 2
    ref = mlp(x)  # CPU, unprepared: separate products (dequantised for MXFP8), in fp32
    gpu = mlp.to(DEV)
    if quant == "bf16":
        gpu = gpu.bfloat16()
    gpu.prepare_()  # gate and up packed on the GPU, after the last move
    out = gpu(x.to(DEV, torch.bfloat16))
    assert (
        gpu.gate_proj.weight.untyped_storage().data_ptr() == gpu.up_proj.weight.untyped_storage().data_ptr()
    )
    assert rel(out.cpu(), ref) < 2e-2


@pytest.mark.parametrize("quant", ["bf16", "mxfp8"])
@pytest.mark.parametrize("t", [1, 13, 1100])
def test_packed_attention_projections_match_reference(quant, t):
    """q, k, v and the index query/key from one product over the packed weights (GPU) against the
    five separate products of the CPU path."""
    from m3lm.config import ModelArgs
    from m3lm.layers.linear import to_mxfp8_
    from m3lm.layers.rotary import rope_cos_sin
    from m3lm.models.minimax_m3 import Attention

    torch.manual_seed(t)
    args = ModelArgs.from_dict(
        release_config(Spec(hidden=256, heads=8, kv_heads=2, head_dim=64, index_dim=32))
    )
    attn = Attention(args, 1, torch.float32).requires_grad_(False)
    assert attn.sparse
    names = ("q_proj", "k_proj", "v_proj", "index_q_proj", "index_k_proj")
    for name in names:
        torch.nn.init.normal_(getattr(attn, name).weight, std=0.1)
    if quant == "mxfp8":
        to_mxfp8_(attn, names, quantize=True)
    x = torch.randn(t, 256)
    cos, sin = rope_cos_sin(torch.arange(t) + 5, args.rotary_dim, args.rope_theta)
    ref = attn.project(x, cos, sin)  # CPU, unprepared: separate products
    gpu = attn.to(DEV)
    if quant == "bf16":
        gpu = gpu.bfloat16()
    gpu.prepare_()  # the projections packed on the GPU, after the last move
    out = gpu.project(x.to(DEV, torch.bfloat16), cos.to(DEV), sin.to(DEV))
    assert gpu.k_proj.weight.untyped_storage().data_ptr() == gpu.q_proj.weight.untyped_storage().data_ptr()
    for o, r in zip(out, ref, strict=True):
        assert o.shape == r.shape
        assert rel(o.cpu(), r) < 2e-2


LENS = [30, 7, 50]


def prefill_then_decode(model, logits_rows=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Three prompts (LENS) but their last tokens prefilled into a fresh paged cache, then one
    decode step of those last tokens -> (the prefill's logits, at `logits_rows`; the step's)."""
    prompts = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in LENS]
    cache = KVCache(model.args, 64, DEV, model.lm_head.weight.dtype)
    tables = [list(range(i * 16, i * 16 + 16)) for i in range(3)]
    with torch.inference_mode():
        toks = torch.tensor([t for p in prompts for t in p[:-1]], device=DEV)
        pos = torch.cat([torch.arange(n - 1) for n in LENS]).to(DEV)
        q_lens = [n - 1 for n in LENS]
        batch = ForwardBatch(pos, q_lens, kv=PagedKV(cache, tables, [0] * 3, q_lens))
        prefill = model.forward_batch(toks, batch, logits_rows)
        dec = DecodeBatch.build(
            torch.tensor([n - 1 for n in LENS], device=DEV),
            torch.tensor(tables, dtype=torch.int32, device=DEV),
            cache,
            model.args.index_block_size,
        )
        return prefill, model.forward_batch(torch.tensor([p[-1] for p in prompts], device=DEV), dec)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_path_matches_full_forward(tiny_path, dtype):
    model, _ = m3lm.load(tiny_path, device=DEV, dtype=dtype)
    cpu, _ = m3lm.load(tiny_path, device="cpu", dtype="float32")
    _, out = prefill_then_decode(model)
    prompts = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in LENS]
    with torch.inference_mode():
        ref = torch.stack([cpu(torch.tensor([p]))[0, -1] for p in prompts])
    # fp32 is the parity check; in bf16 a tiny random model with 4-token blocks flips near-tied
    # block selections, so only gross errors are caught there.
    assert rel(out.cpu(), ref) < (1e-4 if dtype == "float32" else 0.1)


@pytest.mark.parametrize("quant", ["auto", "mxfp8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moe_sum_folded_into_the_next_norm_changes_no_bit(tiny_path, monkeypatch, quant, dtype):
    """The MoE's pairs summed in the next residual add and norm (`MoEOutput`) give the logits of
    the MoE output summed on its own (`moe_combine`, then `add_rms_norm`), in a prefill with and
    without logits rows and in a decode step."""
    from m3lm.kernels.moe import MoEOutput
    from m3lm.models.minimax_m3 import MoE

    model, _ = m3lm.load(tiny_path, device=DEV, dtype=dtype, quant=quant)
    rows = torch.tensor([5, 28, 34, 83], device=DEV)  # of the 84 prefilled tokens
    calls = []
    unsummed = MoE.forward

    def counted(self, x):
        out = unsummed(self, x)
        calls.append(isinstance(out, MoEOutput))
        return out

    monkeypatch.setattr(MoE, "forward", counted)
    folded = [*prefill_then_decode(model), prefill_then_decode(model, rows)[0]]
    assert calls and all(calls)  # every MoE layer's output went on unsummed
    monkeypatch.setattr(MoE, "forward", lambda self, x: unsummed(self, x).sum())
    summed = [*prefill_then_decode(model), prefill_then_decode(model, rows)[0]]
    for a, b in zip(folded, summed, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fixture", golden_params())
def test_golden_on_gpu(fixture):
    exp = load_file(fixture / "expected.safetensors")
    model, _ = m3lm.load(fixture, device=DEV, dtype="float32")
    with torch.inference_mode():
        logits = model(exp["prefill_64.input_ids"].to(DEV))[0].cpu()
    assert (
        float((logits - exp["prefill_64.logits"]).abs().max() / exp["prefill_64.logits"].abs().max()) < 1e-3
    )
    want = exp["greedy.output_ids"].tolist()
    res = m3lm.generate(
        model,
        None,
        exp["greedy.input_ids"][0].tolist(),
        max_tokens=len(want),
        temperature=0.0,
        ignore_eos=True,
    )
    assert res.token_ids == want  # prefill, then graph-captured decode steps
    bf, _ = m3lm.load(fixture, device=DEV, dtype="bfloat16")
    with torch.inference_mode():
        short = bf(exp["prefill_5.input_ids"].to(DEV))[0].float().cpu()
    assert float((short - exp["prefill_5.logits"]).abs().max() / exp["prefill_5.logits"].abs().max()) < 3e-2


@pytest.mark.parametrize("fixture", [f for f in golden_params() if f.values[0] is None or "mxfp8" in f.id])
def test_mxfp8_golden_kept_8bit_on_gpu(fixture):
    exp = load_file(fixture / "expected.safetensors")
    model, _ = m3lm.load(fixture, device=DEV, dtype="bfloat16")  # an MXFP8 checkpoint stays 8-bit on a GPU
    assert model.model.layers[1].block_sparse_moe.experts.w1.dtype == torch.float8_e4m3fn
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float8_e4m3fn
    with torch.inference_mode():
        short = model(exp["prefill_5.input_ids"].to(DEV))[0].float().cpu()
    assert float((short - exp["prefill_5.logits"]).abs().max() / exp["prefill_5.logits"].abs().max()) < 3e-2
