"""GPU paths against the CPU reference (run on a machine with an NVIDIA GPU; skipped elsewhere).

The logic these kernels implement is covered on the CPU by the reference tests (test_layers,
test_generate); here the Triton kernels, the decode path and CUDA graphs must agree with it.
"""

import pytest
import torch
from checkpoints import Spec, hf_model, release_config, to_release, write_checkpoint
from conftest import golden_params
from safetensors.torch import load_file

import m3lm
from m3lm.cache.kv_cache import KVCache, PagedKV
from m3lm.config import EngineConfig
from m3lm.core import DecodeBatch, ForwardBatch
from m3lm.engine.engine import LLMEngine
from m3lm.kernels.moe import moe_experts_ref, route
from m3lm.kernels.msa import index_block_scores_ref, msa_attention_ref, select_blocks_ref
from m3lm.layers.rotary import rope_cos_sin

pytestmark = pytest.mark.cuda
DEV = "cuda"
# Engines here take a small pool, not the GPU's memory, so that xdist workers can share the GPU.
POOL = 16384


def rel(out, ref) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def paged_case(b, h, k, d, di, s, lens, dtype, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    maxp = max(-(-n // s) for n in lens)
    pool = sum(-(-n // s) for n in lens) + 1
    perm = torch.randperm(pool, generator=gen)
    tables = torch.zeros(b, maxp, dtype=torch.int32)
    c = 0
    for i, n in enumerate(lens):
        m = -(-n // s)
        tables[i, :m] = perm[c : c + m].int()
        c += m
    mk = lambda *shape: torch.randn(*shape, generator=gen).to(DEV, dtype)  # noqa: E731
    return (
        mk(pool, s, k, d),
        mk(pool, s, k, d),
        mk(pool, s, di),
        mk(b, h, d),
        mk(b, k, di),
        tables.to(DEV),
        torch.tensor(lens, dtype=torch.int32, device=DEV),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("h", "k", "d", "di", "s", "lens", "topk"),
    [
        (8, 2, 16, 16, 4, [5, 33, 70], 3),
        (64, 4, 128, 128, 128, [100, 2048, 2049, 9000], 16),
        (16, 2, 64, 64, 16, [1, 300], 8),
    ],
)
def test_msa_decode_kernels_match_reference(dtype, h, k, d, di, s, lens, topk):
    from m3lm.kernels import msa_triton as mt

    kp, vp, ikp, q, iq, tables, lt = paged_case(len(lens), h, k, d, di, s, lens, dtype)
    scores = mt.index_block_scores(iq, ikp, tables, lt)
    sel = mt.select_blocks(scores, lt, s, topk, 1, 0)
    dense = mt.paged_attention(q, kp, vp, tables, lt, d**-0.5)
    sparse = mt.paged_attention(q, kp, vp, tables, lt, d**-0.5, sel)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for i, n in enumerate(lens):
        pages = tables[i, : -(-n // s)].long()
        kk, vv, ik = kp[pages].flatten(0, 1)[:n], vp[pages].flatten(0, 1)[:n], ikp[pages].flatten(0, 1)[:n]
        pos = torch.tensor([n - 1], device=DEV)
        ref_scores = index_block_scores_ref(iq[i : i + 1], ik, pos, s)[:, 0]
        assert rel(scores[i, :, : ref_scores.shape[-1]], ref_scores) < tol
        ref_sel = select_blocks_ref(ref_scores[:, None], pos, s, topk, 1, 0)[:, 0]
        if dtype == torch.float32:
            for g in range(k):
                assert sorted(x for x in sel[i, g].tolist() if x >= 0) == [
                    x for x in ref_sel[g].tolist() if x >= 0
                ]
        assert rel(dense[i], msa_attention_ref(q[i : i + 1], kk, vv, pos, d**-0.5)[0]) < tol
        ref_sparse = msa_attention_ref(q[i : i + 1], kk, vv, pos, d**-0.5, sel[i][:, None].long(), s)[0]
        assert rel(sparse[i], ref_sparse) < tol


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
    ref = mlp(x)  # CPU: separate products (dequantised for MXFP8), in fp32
    gpu = mlp.to(DEV)
    if quant == "bf16":
        gpu = gpu.bfloat16()
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
    ref = attn.project(x, cos, sin)  # CPU: separate products
    gpu = attn.to(DEV)
    if quant == "bf16":
        gpu = gpu.bfloat16()
    out = gpu.project(x.to(DEV, torch.bfloat16), cos.to(DEV), sin.to(DEV))
    assert gpu.k_proj.weight.untyped_storage().data_ptr() == gpu.q_proj.weight.untyped_storage().data_ptr()
    for o, r in zip(out, ref, strict=True):
        assert o.shape == r.shape
        assert rel(o.cpu(), r) < 2e-2


@pytest.mark.parametrize("index", [True, False])
def test_decode_heads_match_the_unfused_path(index):
    """One launch for the heads of a decode step against per-head norm_rope and indexed cache writes."""
    from m3lm.kernels import fused

    gen = torch.Generator(device="cpu").manual_seed(int(index))
    b, h, k, d, di, pages, page = 5, 64, 4, 128, 128, 12, 128
    widths = [h * d, k * d, k * d] + ([k * di, di] if index else [])
    y = (torch.randn(b, sum(widths), generator=gen) * 3).to(DEV, torch.bfloat16)
    outs = y.split(widths, dim=-1)
    norms = [torch.randn(n, generator=gen).to(DEV, torch.bfloat16) for n in (d, d, di, di)[: len(widths) - 1]]
    cos, sin = (t.to(DEV) for t in rope_cos_sin(torch.tensor([4095, 0, 77, 128, 9000]), 64, 5e6))
    pg = torch.tensor([3, 0, 11, 7, 1], device=DEV)
    sl = torch.tensor([127, 0, 77, 0, 40], device=DEV)
    caches = [torch.zeros(pages, page, *s, device=DEV, dtype=torch.bfloat16) for s in ((k, d), (k, d), (di,))]
    q, iq = fused.decode_heads(
        y,
        (h, k, d, di),
        tuple(norms),
        1e-6,
        cos,
        sin,
        caches[0],
        caches[1],
        caches[2] if index else None,
        pg,
        sl,
    )
    want_q = fused.norm_rope(outs[0].view(b, h, d), norms[0], 1e-6, cos, sin)
    want_k = fused.norm_rope(outs[1].view(b, k, d), norms[1], 1e-6, cos, sin)
    assert rel(q, want_q) < 5e-3 and rel(caches[0][pg, sl], want_k) < 5e-3
    assert torch.equal(caches[1][pg, sl], outs[2].view(b, k, d))
    assert int((caches[0] != 0).any(-1).any(-1).sum()) == b  # nothing else written
    if index:
        assert rel(iq, fused.norm_rope(outs[3].view(b, k, di), norms[2], 1e-6, cos, sin)) < 5e-3
        want_ik = fused.norm_rope(outs[4].view(b, 1, di), norms[3], 1e-6, cos, sin)[:, 0]
        assert rel(caches[2][pg, sl], want_ik) < 5e-3
    else:
        assert iq is None and not caches[2].any()


def test_router_logits_from_bf16_slices_match_fp32():
    from m3lm.kernels.moe import router_logits, split_bf16

    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(300, 512, generator=gen).bfloat16().to(DEV)
    w = (torch.randn(128, 512, generator=gen) * 0.02).to(DEV)
    want = x.double() @ w.double().T
    fp32 = torch.nn.functional.linear(x.float(), w)
    split = router_logits(x, w, split_bf16(w))
    for t in (1, 8):  # a decode step's tokens: one Triton launch (`router_gemv`)
        few = router_logits(x[:t], w)
        assert (
            float((few.double() - want[:t]).abs().max())
            <= 4 * float((fp32[:t].double() - want[:t]).abs().max()) + 1e-6
        )
    assert split.dtype == torch.float32 and split.shape == (300, 128)
    # fp32 accumulation either way: the split is as close to the exact product as the fp32 GEMM
    err = float((split.double() - want).abs().max())
    assert err <= 4 * float((fp32.double() - want).abs().max()) + 1e-6, err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("t", "e", "a", "c", "i"), [(1, 8, 2, 64, 32), (37, 16, 4, 256, 96), (2000, 32, 4, 512, 256)]
)
def test_fused_moe_matches_reference(dtype, t, e, a, c, i):
    from m3lm.kernels.moe_triton import moe_experts

    gen = torch.Generator(device="cpu").manual_seed(t)
    x = torch.randn(t, c, generator=gen).to(DEV, dtype)
    w1, w3 = (torch.randn(e, i, c, generator=gen).mul(0.05).to(DEV, dtype) for _ in range(2))
    w2 = torch.randn(e, c, i, generator=gen).mul(0.05).to(DEV, dtype)
    weights, ids = route(torch.randn(t, e, generator=gen).to(DEV), torch.zeros(e, device=DEV), a)
    out = moe_experts(x, weights, ids, w1, w3, w2, 1.702, 7.0)
    ref = moe_experts_ref(x.float(), weights, ids, w1.float(), w3.float(), w2.float(), 1.702, 7.0)
    assert rel(out, ref) < (1e-4 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("t", [1, 37, 2000])
def test_moe_pairs_are_unweighted_products_in_the_activations_dtype(t):
    """`moe_pairs` leaves each pair's down product rounded to bf16, unweighted, as the reference's
    product; the combine weights and sums them in fp32."""
    from m3lm.kernels.fused import moe_combine
    from m3lm.kernels.moe_triton import moe_pairs
    from m3lm.layers.mlp import swiglu_oai_ref

    e, a, c, i = 32, 4, 512, 256
    gen = torch.Generator(device="cpu").manual_seed(t)
    x = torch.randn(t, c, generator=gen).to(DEV, torch.bfloat16)
    w1, w3 = (torch.randn(e, i, c, generator=gen).mul(0.05).to(DEV, torch.bfloat16) for _ in range(2))
    w2 = torch.randn(e, c, i, generator=gen).mul(0.05).to(DEV, torch.bfloat16)
    weights, ids = route(torch.randn(t, e, generator=gen).to(DEV), torch.zeros(e, device=DEV), a)
    pairs = moe_pairs(x, ids, w1, w3, w2, 1.702, 7.0)
    assert pairs.shape == (t, a, c) and pairs.dtype == torch.bfloat16
    ref = torch.empty(t * a, c, device=DEV)
    flat = ids.flatten()
    for k in flat.unique().tolist():
        sel = (flat == k).nonzero().flatten()
        xe = x[sel // a].float()
        ref[sel] = swiglu_oai_ref(xe @ w1[k].float().T, xe @ w3[k].float().T, 1.702, 7.0) @ w2[k].float().T
    ref = ref.view(t, a, c)
    assert rel(pairs, ref) < 2e-2
    shared = torch.randn(t, c, generator=gen).to(DEV, torch.bfloat16)
    want = (ref * weights[..., None]).sum(1) * 2.0 + shared.float()
    assert rel(moe_combine(pairs, shared, 2.0, weights=weights), want) < 2e-2


@pytest.mark.parametrize("tail", [16, 32, 64])
def test_merged_moe_tails_equal_their_own_tiles(tail):
    """Short last blocks taken by their expert's previous block (`moe_triton._tail`), at the
    prefill tiles: bitwise the same pairs as with each block in its own tile, and the reference.
    One expert per token, so each expert's count picks the case: tails of 10, 16, 17, 25, 33, 60
    pairs after whole blocks, a half-height last block, a long one, lone short experts."""
    from m3lm.kernels import moe_triton as mt

    gen = torch.Generator(device="cpu").manual_seed(tail)
    counts = [256 + 10, 384 + 25, 128 + 40, 20, 128, 128 + 70, 256 + 16, 128 + 17, 0, 33, 128 + 60, 600]
    e, c, i = len(counts), 512, 256
    ids = torch.cat([torch.full((n,), k) for k, n in enumerate(counts)])
    ids = ids[torch.randperm(ids.numel(), generator=gen)][:, None].to(DEV)
    t, m = ids.shape[0], ids.numel()
    x = torch.randn(t, c, generator=gen).to(DEV, torch.bfloat16)
    w1, w3 = (torch.randn(e, i, c, generator=gen).mul(0.05).to(DEV, torch.bfloat16) for _ in range(2))
    w2 = torch.randn(e, c, i, generator=gen).mul(0.05).to(DEV, torch.bfloat16)
    weights = torch.rand(t, 1, generator=gen).to(DEV)
    (up_m, up_cfg), (down_m, down_cfg) = mt.tiles(m, torch.bfloat16)
    assert up_m == down_m == 128
    aligned = mt.align(ids, e, 128)
    outs = []
    for merged in (0, tail):
        h = mt.gate_up(x, w1, w3, m, 1, aligned, 1.702, 7.0, up_m, up_cfg, halves=True, tail=merged)
        outs.append(
            mt.grouped_gemm(
                h,
                w2,
                m,
                1,
                aligned,
                True,
                weights.flatten(),
                torch.float32,
                down_m,
                down_cfg,
                True,
                tail=merged,
            )
        )
    assert torch.equal(outs[0], outs[1])
    ref = moe_experts_ref(x.float(), weights, ids, w1.float(), w3.float(), w2.float(), 1.702, 7.0)
    assert rel(outs[1], ref) < 2e-2


def test_moe_combine_of_unweighted_pairs_in_expert_order():
    from m3lm.kernels.fused import moe_combine

    gen = torch.Generator(device="cpu").manual_seed(9)
    t, a, c = 300, 4, 6144
    y = torch.randn(t * a, c, generator=gen).to(DEV, torch.bfloat16)
    rows = torch.randperm(t * a, generator=gen).view(t, a).to(DEV)
    weights = torch.rand(t, a, generator=gen).to(DEV)
    shared = torch.randn(t, c, generator=gen).to(DEV, torch.bfloat16)
    ref = (y[rows].float() * weights[..., None]).sum(1) * 2.0 + shared.float()
    assert rel(moe_combine(y, shared, 2.0, rows, weights), ref) < 1e-2


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    s = Spec()
    path = tmp_path_factory.mktemp("cuda")
    return write_checkpoint(path, to_release(hf_model(s, seed=5).state_dict(), s), release_config(s))


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


def test_engine_graph_batches_match_cpu(tiny_path):
    cpu, _ = m3lm.load(tiny_path, device="cpu", dtype="float32")
    gpu, _ = m3lm.load(tiny_path, device=DEV, dtype="float32")
    prompts = [
        torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in (3, 17, 40, 9, 25)
    ]
    params = m3lm.SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)

    def run(model):
        engine = LLMEngine(model, None, EngineConfig(max_num_seqs=8, max_model_len=128, kv_cache_tokens=POOL))
        seqs = [engine.add_request(p, params) for p in prompts]
        while engine.has_unfinished():
            engine.step()
        return [s.output_ids for s in seqs], engine

    want, _ = run(cpu)
    got, engine = run(gpu)
    assert got == want
    assert (
        engine.runner.graphs is not None and engine.runner.graphs._graphs
    )  # decode steps went through graphs


def test_engine_mixed_steps_match_cpu(tiny_path, monkeypatch):
    """Prompts arriving while others decode: the decodes of those mixed steps attend as one batch
    (`decode_rows`), and every request gets the CPU's tokens."""
    from m3lm.engine import runner

    cpu, _ = m3lm.load(tiny_path, device="cpu", dtype="float32")
    gpu, _ = m3lm.load(tiny_path, device=DEV, dtype="float32")
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (21, 5, 33, 1, 14, 40)]
    params = m3lm.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    batched = []
    real = runner.decode_rows

    def spy(step, *args):
        dec = real(step, *args)
        batched.append((0 if dec is None else dec.positions.shape[0], len(step.q_lens)))
        return dec

    monkeypatch.setattr(runner, "decode_rows", spy)

    def run(model):
        engine = LLMEngine(model, None, EngineConfig(max_num_seqs=8, max_model_len=128, kv_cache_tokens=POOL))
        seqs = []
        for p in prompts:  # a new prompt every other step
            seqs.append(engine.add_request(p, params))
            engine.step()
            engine.step()
        while engine.has_unfinished():
            engine.step()
        return [s.output_ids for s in seqs]

    assert run(gpu) == run(cpu)
    assert sum(0 < b < n for b, n in batched) >= 4  # decodes batched beside a prefill


def test_engine_prefix_cache_on_gpu_matches_cpu(tiny_path):
    """Prompts that start on cached pages (shared, not consecutive) give the CPU's tokens."""
    cpu, _ = m3lm.load(tiny_path, device="cpu", dtype="float32")
    gpu, _ = m3lm.load(tiny_path, device=DEV, dtype="float32")
    gen = torch.Generator().manual_seed(11)
    shared = torch.randint(0, 96, (45,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, 96, (n,), generator=gen).tolist() for n in (6, 2, 20)] + [
        shared[:30]
    ]
    params = m3lm.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ref = LLMEngine(
        cpu, None, EngineConfig(max_num_seqs=8, max_model_len=128, kv_cache_tokens=POOL, prefix_caching=False)
    )
    want = [ref.add_request(p, params).output_ids for p in prompts]
    while ref.has_unfinished():
        ref.step()
    engine = LLMEngine(gpu, None, EngineConfig(max_num_seqs=8, max_model_len=128, kv_cache_tokens=POOL))
    got, cached = [], []
    for p in prompts:  # one after another: each starts on the pages the earlier ones left
        seq = engine.add_request(p, params)
        while engine.has_unfinished():
            engine.step()
        got.append(seq.output_ids)
        cached.append(seq.num_prefix_cached)
    assert got == want
    assert cached[0] == 0 and min(cached[1:]) > 0
    engine.blocks.check()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_elementwise_kernels_match_reference(dtype):
    from m3lm.kernels import fused
    from m3lm.layers.mlp import swiglu_oai_ref
    from m3lm.layers.norm import rms_norm_ref
    from m3lm.layers.rotary import apply_rope_ref, rope_cos_sin

    gen = torch.Generator(device="cpu").manual_seed(0)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for shape in [(3, 64), (5, 4, 128), (2, 6144)]:
        x = torch.randn(*shape, generator=gen).to(DEV, dtype)
        w = torch.randn(shape[-1], generator=gen).to(DEV, dtype)
        assert rel(fused.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6)) < tol
    for t, n, d, r in [(7, 8, 128, 64), (1, 64, 128, 64), (9, 2, 16, 8), (4, 3, 96, 32)]:
        x = torch.randn(t, n, d, generator=gen).to(DEV, dtype)
        cos, sin = rope_cos_sin(torch.randint(0, 10**6, (t,)).to(DEV), r, 5e6)
        assert rel(fused.apply_rope(x, cos, sin), apply_rope_ref(x, cos, sin)) < tol
    g, u = (torch.randn(37, 3072, generator=gen).mul(5).to(DEV, dtype) for _ in range(2))
    assert rel(fused.swiglu_oai(g, u, 1.702, 7.0), swiglu_oai_ref(g, u, 1.702, 7.0)) < tol
    h, d = (torch.randn(33, 6144, generator=gen).to(DEV, dtype) for _ in range(2))
    w = torch.randn(6144, generator=gen).to(DEV, dtype)
    s, y = fused.add_rms_norm(h, d, w, 1e-6)
    assert torch.equal(s, h + d)
    assert rel(y, rms_norm_ref(h + d, w, 1e-6)) < tol
    ids = torch.randint(0, 33, (70,), generator=gen).to(DEV)
    e, y = fused.embed_rms_norm(ids, h, w, 1e-6)  # the embedding and the first norm in one pass
    assert torch.equal(e, h[ids]) and torch.equal(y, fused.rms_norm(h[ids], w, 1e-6))
    for t, n, d, r in [(7, 64, 128, 64), (300, 4, 128, 64), (5, 1, 128, 64), (4, 3, 96, 32)]:
        wide = torch.randn(t, (n + 2) * d, generator=gen).to(DEV, dtype)
        x = wide[:, d : (n + 1) * d].view(t, n, d)  # a strided slice, as of a fused projection
        w = torch.randn(d, generator=gen).to(DEV, dtype)
        cos, sin = rope_cos_sin(torch.randint(0, 10**6, (t,)).to(DEV), r, 5e6)
        ref = apply_rope_ref(rms_norm_ref(x, w, 1e-6), cos, sin)
        assert rel(fused.norm_rope(x, w, 1e-6, cos, sin), ref) < tol
    pairs = torch.randn(300, 4, 6144, generator=gen).to(DEV)
    shared = torch.randn(300, 6144, generator=gen).to(DEV, dtype)
    ref = (pairs.sum(1) * 2.0 + shared.float()).to(dtype)
    assert rel(fused.moe_combine(pairs, shared, 2.0), ref) < tol
    h, w = shared.flip(0), torch.randn(6144, generator=gen).to(DEV, dtype)
    weights = torch.rand(300, 4, generator=gen).to(DEV)
    # The MoE output is rounded to the shared expert's dtype, which may be wider than h's.
    for p, sh, wt in [
        (pairs, shared, None),
        (pairs.to(dtype), shared, weights),
        (pairs, shared.float(), None),
    ]:
        s, y = fused.moe_add_rms_norm(h, p, sh, 2.0, w, 1e-6, weights=wt)  # bit for bit
        want = fused.add_rms_norm(h, fused.moe_combine(p, sh, 2.0, weights=wt), w, 1e-6)
        assert torch.equal(s, want[0]) and torch.equal(y, want[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("h", "k", "d", "s", "topk", "tk", "t"),
    [(8, 2, 16, 16, 3, 200, 200), (64, 4, 128, 128, 16, 5000, 5000), (64, 4, 128, 128, 16, 4600, 700)],
)
def test_prefill_kernel_matches_reference(dtype, h, k, d, s, topk, tk, t):
    from m3lm.kernels.msa_prefill_triton import msa_prefill_attention

    gen = torch.Generator(device="cpu").manual_seed(tk + t)
    q = torch.randn(t, h, d, generator=gen).to(DEV, dtype)
    kk, vv = (torch.randn(tk, k, d, generator=gen).to(DEV, dtype) for _ in range(2))
    pos = torch.arange(tk - t, tk, device=DEV)  # a chunk at the end of the sequence
    scores = torch.randn(k, t, -(-tk // s), generator=gen).to(DEV)
    sel = select_blocks_ref(scores, pos, s, topk, 1, 0)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for block_ids in (sel, None):
        out = msa_prefill_attention(q, kk, vv, pos, d**-0.5, block_ids, s, tma=False)
        ref = msa_attention_ref(q.float(), kk.float(), vv.float(), pos, d**-0.5, block_ids, s)
        assert rel(out, ref) < tol
        if dtype != torch.float32:  # K and V by tensor-memory copies: the same products, bit for bit
            assert torch.equal(msa_prefill_attention(q, kk, vv, pos, d**-0.5, block_ids, s, tma=True), out)
        # Consecutive queries in a tile instead of grouped ones: each row's arithmetic is the same.
        plain = msa_prefill_attention(q, kk, vv, pos, d**-0.5, block_ids, s, tma=False, grouped=False)
        assert torch.equal(plain, out)
        # A compare and select per score on every step instead of masks by row: the same bits.
        assert torch.equal(
            msa_prefill_attention(q, kk, vv, pos, d**-0.5, block_ids, s, tma=False, row_masks=False), out
        )


def test_whole_sequence_attention_builds_no_plan_per_length():
    """A whole prompt's attention takes a kernel with the length as a runtime argument: cuDNN's
    builds a host-side plan for every new length, inside the serving step."""
    from torch.profiler import ProfilerActivity, profile

    from m3lm.kernels.msa import msa_attention_sdpa

    ops = set()
    for t in (535, 426):
        gen = torch.Generator(device="cpu").manual_seed(t)
        q = torch.randn(t, 64, 128, generator=gen).to(DEV, torch.bfloat16)
        kk, vv = (torch.randn(t, 4, 128, generator=gen).to(DEV, torch.bfloat16) for _ in range(2))
        pos = torch.arange(t, device=DEV)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = msa_attention_sdpa(q, kk, vv, pos, 128**-0.5)
        ops |= {e.key for e in prof.key_averages()}
        assert rel(out, msa_attention_ref(q.float(), kk.float(), vv.float(), pos, 128**-0.5)) < 2e-2
    assert any("flash" in op for op in ops), sorted(ops)
    assert not any("cudnn" in op for op in ops), sorted(ops)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_index_scores_and_selection_match_reference(dtype):
    from m3lm.kernels.msa import select_blocks_ref
    from m3lm.kernels.msa_prefill_triton import index_block_scores, msa_select

    gen = torch.Generator(device="cpu").manual_seed(3)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    for t, tk, k, first in [(3000, 3000, 4, 0), (700, 5000, 4, 4300), (300, 300, 3, 0)]:
        iq = torch.randn(t, k, 128, generator=gen).to(DEV, dtype)
        ik = torch.randn(tk, 128, generator=gen).to(DEV, dtype)
        pos = torch.arange(first, first + t, device=DEV)
        got = index_block_scores(iq, ik, first, 128)
        want = index_block_scores_ref(iq.float(), ik.float(), pos, 128)
        assert torch.equal(got.isinf(), want.isinf())
        assert rel(got.nan_to_num(neginf=0.0), want.nan_to_num(neginf=0.0)) < tol
        # Other program shapes (rows as queries x heads, warps, stages, key blocks: one, a few,
        # all of them; the largest rows hold 16-bit tiles only): the same values bit for bit.
        configs = [(64, 4, 2, 16), (16, 4, 2, 3), (128, 4, 2, 1), (128, 4, 2, 1 << 20)]
        for config in configs + ([(256, 8, 3, 16)] if dtype != torch.float32 else []):
            assert torch.equal(index_block_scores(iq, ik, first, 128, config), got)
        # The selection from those scores, as the reference selects from them (None: every query
        # sees at most 16 blocks, so attention is exactly dense).
        sel = msa_select(iq, ik, pos, 128, 16, 1, 0, first)
        if sel is None:
            assert first + t <= 16 * 128
        else:
            assert torch.equal(sel.long(), select_blocks_ref(got, pos, 128, 16, 1, 0))


def test_query_groups_and_tile_unions_match_reference():
    from m3lm.kernels.msa_tiles import group_queries, group_queries_ref, tile_blocks, tile_blocks_ref

    gen = torch.Generator(device="cpu").manual_seed(5)
    for t, n, k in [(300, 60, 16), (1000, 40, 16), (260, 700, 16)]:
        ids = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(4 * t)]).view(4, t, k)
        order = group_queries(ids.to(DEV), 4)
        assert torch.equal(order.cpu()[:, :t], group_queries_ref(ids, 4)[:, :t])
        got = tile_blocks(ids.to(DEV), 4, n, order)
        for a, b in zip(got, tile_blocks_ref(ids, 4, order.cpu()), strict=True):
            assert torch.equal(a.cpu(), b.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("t", "o", "k"), [(1, 512, 6144), (1, 6144, 3072), (64, 3072, 6144), (300, 200, 512), (1500, 200, 544)]
)
def test_fp8_matmul_matches_dequantised_reference(dtype, t, o, k):
    from m3lm.kernels.fp8 import dequant_mxfp8, quantize_mxfp8
    from m3lm.kernels.fp8_triton import mxfp8_matmul

    gen = torch.Generator(device="cpu").manual_seed(t + o)
    q, s = (u.to(DEV) for u in quantize_mxfp8(torch.randn(o, k, generator=gen) * 0.02))
    x = torch.randn(t, k, generator=gen).to(DEV, dtype)
    ref = x.float() @ dequant_mxfp8(q, s).T
    assert rel(mxfp8_matmul(x, q, s), ref) < (1e-4 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_dequantize_is_exact(dtype):
    """The prefill path's one-launch dequantisation equals the reference, value for value."""
    from m3lm.kernels.fp8 import dequant_mxfp8, quantize_mxfp8
    from m3lm.kernels.fp8_triton import dequantize

    gen = torch.Generator(device="cpu").manual_seed(5)
    q, s = quantize_mxfp8(torch.randn(200, 544, generator=gen) * 0.02)
    s[:, 1::3] += 2
    q, s = q.to(DEV), s.to(DEV)
    assert torch.equal(dequantize(q, s, dtype), dequant_mxfp8(q, s, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("t", "e", "a", "c", "i"), [(1, 8, 2, 64, 32), (64, 32, 4, 512, 256), (2000, 16, 4, 256, 96)]
)
def test_fp8_fused_moe_matches_reference(dtype, t, e, a, c, i):
    from m3lm.kernels.fp8 import dequant_mxfp8, quantize_mxfp8
    from m3lm.kernels.moe_fp8_triton import moe_experts_fp8

    gen = torch.Generator(device="cpu").manual_seed(t)
    x = torch.randn(t, c, generator=gen).to(DEV, dtype)
    ws = [
        [u.to(DEV) for u in quantize_mxfp8(torch.randn(*sh, generator=gen) * 0.05)]
        for sh in ((e, i, c), (e, i, c), (e, c, i))
    ]
    weights, ids = route(torch.randn(t, e, generator=gen).to(DEV), torch.zeros(e, device=DEV), a)
    out = moe_experts_fp8(x, weights, ids, *ws[0], *ws[1], *ws[2], 1.702, 7.0)
    ref = moe_experts_ref(x.float(), weights, ids, *(dequant_mxfp8(*w) for w in ws), 1.702, 7.0)
    assert rel(out, ref) < (1e-4 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 2, 4, 16])
@pytest.mark.parametrize(
    "config", [None, ("gemv", 16, 512, 4, 3), ("gemv", 4, 1024, 8, 2), ("gemv_tc", 32, 256, 4, 3)]
)
@pytest.mark.parametrize(("o", "k"), [(512, 6144), (3072, 6144), (6144, 3072), (200, 544)])
def test_fp8_gemv_matches_dequantised_reference(dtype, t, config, o, k):
    """The few-rows kernel: O not a multiple of the tile, In (544) not a multiple of BK."""
    from m3lm.kernels.fp8 import dequant_mxfp8, quantize_mxfp8
    from m3lm.kernels.fp8_triton import Config, mxfp8_matmul

    gen = torch.Generator(device="cpu").manual_seed(t + o + k)
    q, s = quantize_mxfp8(torch.randn(o, k, generator=gen) * 0.02)
    s[:, 1::3] += 2  # neighbouring 32-blocks of a row at different exponents
    q, s = q.to(DEV), s.to(DEV)
    x = torch.randn(t, k, generator=gen).to(DEV, dtype)
    ref = x.float() @ dequant_mxfp8(q, s).T
    out = mxfp8_matmul(x, q, s, Config(*config) if config else None)
    assert rel(out, ref) < (1e-4 if dtype == torch.float32 else 1e-2)
    assert torch.equal(out, mxfp8_matmul(x, q, s, Config(*config) if config else None))  # deterministic


@pytest.mark.parametrize("t", [1, 4, 16, 64])
@pytest.mark.parametrize("o", [3072, 200])
def test_fp8_packed_gate_up_swiglu_matches_reference(t, o):
    from m3lm.kernels.fp8 import dequant_mxfp8, quantize_mxfp8
    from m3lm.kernels.fp8_triton import mxfp8_matmul, pack_gate_up
    from m3lm.layers.mlp import swiglu_oai_ref

    gen = torch.Generator(device="cpu").manual_seed(t + o)
    (q1, s1), (q3, s3) = (
        [u.to(DEV) for u in quantize_mxfp8(torch.randn(o, 6144, generator=gen) * 0.05)] for _ in range(2)
    )
    x = torch.randn(t, 6144, generator=gen).to(DEV, torch.bfloat16)
    gate, up = (x.float() @ dequant_mxfp8(q, s).T for q, s in ((q1, s1), (q3, s3)))
    assert float((gate > 7).float().mean()) > 0  # the clamp is exercised
    out = mxfp8_matmul(x, *pack_gate_up(q1, s1, q3, s3), act="swiglu", alpha=1.702, limit=7.0)
    assert out.shape == (t, o)
    assert rel(out, swiglu_oai_ref(gate, up, 1.702, 7.0)) < 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 64])
@pytest.mark.parametrize("swap", [False, True])
def test_fp8_moe_pairs_match_reference(dtype, t, swap):
    """Per-pair outputs of the fused fp8 gate/up + down, under both operand orders."""
    from m3lm.kernels.fp8 import dequant_mxfp8, quantize_mxfp8
    from m3lm.kernels.moe_fp8_triton import moe_pairs_fp8
    from m3lm.layers.mlp import swiglu_oai_ref

    e, a, c, i = 32, 4, 512, 256
    gen = torch.Generator(device="cpu").manual_seed(t)
    x = torch.randn(t, c, generator=gen).to(DEV, dtype)
    ws = [
        [u.to(DEV) for u in quantize_mxfp8(torch.randn(*sh, generator=gen) * 0.05)]
        for sh in ((e, i, c), (e, i, c), (e, c, i))
    ]
    weights, ids = route(torch.randn(t, e, generator=gen).to(DEV), torch.zeros(e, device=DEV), a)
    tile = (64, 64 if dtype == torch.float32 else 256, 4, 2, swap)
    out = moe_pairs_fp8(x, weights, ids, *ws[0], *ws[1], *ws[2], 1.702, 7.0, ((16, tile), (16, tile)))
    w1, w3, w2 = (dequant_mxfp8(*w) for w in ws)
    gate, up = (torch.einsum("tc,taic->tai", x.float(), w[ids]) for w in (w1, w3))
    ref = weights[..., None] * torch.einsum("tai,taci->tac", swiglu_oai_ref(gate, up, 1.702, 7.0), w2[ids])
    assert out.shape == (t, a, c)
    assert rel(out, ref) < (1e-4 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("t", [1, 2])
def test_fp8_moe_pairs_with_shared_expert_match_reference(t):
    """A decode step's pairs one program each, the shared expert in the same launches."""
    from m3lm.kernels.fp8 import dequant_mxfp8, quantize_mxfp8
    from m3lm.kernels.moe_fp8_triton import moe_pairs_fp8, pair_path
    from m3lm.layers.mlp import swiglu_oai_ref

    e, a, c, i = 32, 4, 512, 256
    assert pair_path(t * a)
    gen = torch.Generator(device="cpu").manual_seed(t)
    x = torch.randn(t, c, generator=gen).to(DEV, torch.bfloat16)
    shapes = ((e, i, c), (e, i, c), (e, c, i), (i, c), (i, c), (c, i))
    ws = [[u.to(DEV) for u in quantize_mxfp8(torch.randn(*sh, generator=gen) * 0.05)] for sh in shapes]
    weights, ids = route(torch.randn(t, e, generator=gen).to(DEV), torch.zeros(e, device=DEV), a)
    pairs, shared = moe_pairs_fp8(
        x, weights, ids, *ws[0], *ws[1], *ws[2], 1.702, 7.0, shared=(*ws[3], *ws[4], *ws[5])
    )
    w1, w3, w2, g, u, d = (dequant_mxfp8(*w) for w in ws)
    gate, up = (torch.einsum("tc,taic->tai", x.float(), w[ids]) for w in (w1, w3))
    ref = weights[..., None] * torch.einsum("tai,taci->tac", swiglu_oai_ref(gate, up, 1.702, 7.0), w2[ids])
    assert pairs.shape == (t, a, c) and shared.shape == (t, c)
    assert rel(pairs, ref) < 2e-2
    assert rel(shared, swiglu_oai_ref(x.float() @ g.T, x.float() @ u.T, 1.702, 7.0) @ d.T) < 2e-2


def test_fp8_index_scores_match_reference():
    from m3lm.kernels import msa_triton as mt
    from m3lm.kernels.fp8 import dequant_rows_fp8, quantize_rows_fp8

    _, _, ikp, _, iq, tables, lt = paged_case(
        4, 64, 4, 128, 128, 128, [100, 2048, 2049, 9000], torch.bfloat16
    )
    ikq, iks = quantize_rows_fp8(ikp)
    got = mt.index_block_scores(iq, ikq, tables, lt, iks)
    ref = mt.index_block_scores(iq.float(), dequant_rows_fp8(ikq, iks), tables, lt)
    assert torch.equal(got.isinf(), ref.isinf())
    assert rel(got.nan_to_num(0, 0, 0), ref.nan_to_num(0, 0, 0)) < 1e-2


@pytest.mark.parametrize("fixture", [f for f in golden_params() if f.values[0] is None or "mxfp8" in f.id])
def test_mxfp8_golden_kept_8bit_on_gpu(fixture):
    exp = load_file(fixture / "expected.safetensors")
    model, _ = m3lm.load(fixture, device=DEV, dtype="bfloat16")  # an MXFP8 checkpoint stays 8-bit on a GPU
    assert model.model.layers[1].block_sparse_moe.experts.w1.dtype == torch.float8_e4m3fn
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float8_e4m3fn
    with torch.inference_mode():
        short = model(exp["prefill_5.input_ids"].to(DEV))[0].float().cpu()
    assert float((short - exp["prefill_5.logits"]).abs().max() / exp["prefill_5.logits"].abs().max()) < 3e-2


@pytest.mark.parametrize("index_fp8", [False, True])
def test_engine_graphs_with_mxfp8_weights_match_cpu(tiny_path, index_fp8):
    """Weights quantised at load (same bits on both devices), decode through CUDA graphs."""
    cpu, _ = m3lm.load(tiny_path, device="cpu", dtype="float32", quant="mxfp8")
    gpu, _ = m3lm.load(tiny_path, device=DEV, dtype="float32", quant="mxfp8")
    assert gpu.model.layers[1].self_attn.index_q_proj.weight.dtype == torch.float8_e4m3fn
    prompts = [
        torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 40, 25)
    ]
    params = m3lm.SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)

    def run(model):
        config = EngineConfig(
            max_num_seqs=4, max_model_len=128, kv_cache_tokens=POOL, index_cache_fp8=index_fp8
        )
        engine = LLMEngine(model, None, config)
        seqs = [engine.add_request(p, params) for p in prompts]
        while engine.has_unfinished():
            engine.step()
        return [s.output_ids for s in seqs], engine

    want, _ = run(cpu)
    got, engine = run(gpu)
    assert got == want
    assert engine.runner.graphs is not None and engine.runner.graphs._graphs
