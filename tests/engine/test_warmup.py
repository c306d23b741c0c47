"""The warm-up: finite buckets for every launch choice, a plan that reaches each, throwaway steps
that give their pages back, and (on a GPU) no compiling after it."""

import inspect
import itertools
import random

import pytest
import torch

import m3lm
from m3lm.config import EngineConfig
from m3lm.engine.engine import LLMEngine
from m3lm.engine.warmup import (
    StepShape,
    WarmupReport,
    _run_shape,
    block_buckets,
    representatives,
    token_key,
    warm_up,
    warmup_plan,
)
from m3lm.kernels.compiles import CompileCount, compiled_variants, variants_by_kernel
from m3lm.kernels.host import pad

triton = pytest.importorskip("triton")

from m3lm.kernels import (  # noqa: E402
    fp8_triton,
    fused,
    moe_fp8_triton,
    moe_triton,
    msa_prefill_triton,
    msa_tiles,
    router_triton,
)
from m3lm.kernels.msa_tiles import chunking  # noqa: E402

# (max_num_batched_tokens, max_num_seqs, max_model_len, page size, topk blocks, experts per token)
LIMITS = [
    (2048, 64, 8192, 128, 16, 8),  # the defaults at the release's dimensions
    (512, 16, 4096, 4, 3, 2),  # the tiny test model
    (8192, 256, 1 << 20, 128, 16, 8),
    (100, 5, 300, 16, 4, 6),  # experts per token not a power of two
]


def test_pad_is_a_finite_monotone_bucket_cover():
    seen = [pad(n) for n in range(1, 1 << 14)]
    assert all(p >= n and p >= 16 and p & (p - 1) == 0 for n, p in enumerate(seen, 1))
    assert all(a <= b for a, b in itertools.pairwise(seen))
    assert all(p < 2 * n or p == 16 for n, p in enumerate(seen, 1))
    assert set(seen) == {1 << i for i in range(4, 15)}


def test_tile_chunks_come_from_the_length_bucket():
    prev = (0, 0)
    for n in range(1, 1 << 14):
        ch, steps = chunking(n)
        assert ch * steps == pad(n) >= n and ch <= 256
        assert (ch, steps) == chunking(pad(n))  # a function of the bucket only
        assert (ch, steps) >= prev
        prev = (ch, steps)
    assert len({chunking(n) for n in range(1, 1 << 14)}) == 11


@pytest.mark.parametrize("experts, block_m", [(6, 16), (128, 16), (256, 128)])
def test_align_extents_come_from_the_pair_bucket(experts, block_m):
    for m in range(1, moe_triton.ALIGN_KERNEL_MAX_PAIRS + 1):
        ext = moe_triton.align_extents(m, experts, block_m)
        slots = moe_triton._slots(m, experts, block_m)
        assert ext["MP"] >= m and ext["EMP"] >= slots and ext["NBP"] >= slots // block_m
        assert ext == moe_triton.align_extents(pad(m), experts, block_m)
    extents = {tuple(moe_triton.align_extents(m, experts, block_m).values()) for m in range(1, 257)}
    assert len(extents) == 5  # MP = 16 .. 256


def launch_choices(t: int, top_k: int) -> tuple:
    """Every choice the kernels' wrappers make from a step of t tokens (bf16, the release's
    projection shapes), as the launches compute them."""
    m = t * top_k
    (up_m, _), (down_m, _) = moe_triton.tiles(m, torch.bfloat16)
    align = (
        moe_triton.align_extents(m, 256, max(up_m, down_m))
        if m <= moe_triton.ALIGN_KERNEL_MAX_PAIRS
        else None
    )
    fp8 = None
    if t < fp8_triton.DEQUANT_MIN_T:
        fp8 = []
        for o, kdim, act in (
            (6144, 3072, False),
            (128, 3072, False),
            (1536, 3072, True),
            (3072, 6144, False),
        ):
            cfg = fp8_triton.matmul_config(t, o, kdim, 132, act)
            bt = (
                None if cfg.kernel == "tile" else 16 if cfg.kernel == "gemv_tc" else triton.next_power_of_2(t)
            )
            fp8.append((cfg, bt))
    return (
        moe_triton.tiles(m, torch.bfloat16),
        moe_fp8_triton.tiles(m, torch.bfloat16),
        moe_fp8_triton.pair_path(m),
        align,
        fp8,
        t <= router_triton.ROUTER_GEMV_MAX_T,
    )


@pytest.mark.parametrize("limits", LIMITS)
def test_plan_covers_every_token_count_bucket(limits):
    tokens, seqs, max_len, _, _, top_k = limits
    plan = warmup_plan(*limits)
    prefill = {s.new for s in plan if s.kind == "prefill"}
    decode = {s.batch for s in plan if s.kind == "decode"}
    for limit, reps in ((min(tokens, max_len - 1), prefill), (seqs, decode)):
        by_key = {token_key(n, top_k): n for n in reps}
        for t in range(1, limit + 1):
            rep = by_key[token_key(t, top_k)]  # some planned step has t's key
            assert launch_choices(t, top_k) == launch_choices(rep, top_k), (t, rep)
    assert all(s.positions <= max_len for s in plan)
    assert len(plan) < 100  # a few dozen steps, not one per length


@pytest.mark.parametrize("limits", LIMITS)
def test_plan_covers_every_sequence_length_bucket(limits):
    _, _, max_len, page, topk, _ = limits
    plan = warmup_plan(*limits)
    longs = [s for s in plan if s.kind == "long"]
    assert all(s.cached + s.new - 1 >= topk * page for s in longs)  # on MSA's sparse path
    buckets = {pad(-(-s.positions // page)) for s in longs}
    for n in range(topk + 1, -(-max_len // page) + 1):  # every sequence long enough to select
        assert pad(n) in buckets
        assert chunking(n) == chunking(pad(n))
    assert sorted(block_buckets(max_len, page, topk)) == [s.positions for s in longs]
    assert any(s.kind == "extend" for s in plan)


def test_representatives_keep_the_first_of_each_key():
    assert representatives(10, lambda n: n // 4) == [1, 4, 8]
    assert representatives(5, lambda n: 0) == [1]


KERNEL_MODULES = [fp8_triton, fused, moe_fp8_triton, moe_triton, msa_prefill_triton, msa_tiles, router_triton]


def test_runtime_arguments_name_real_parameters():
    """A misspelt do_not_specialize name is silently ignored by Triton; each must be a parameter."""
    marked = 0
    for module in KERNEL_MODULES:
        for value in vars(module).values():
            names = getattr(value, "do_not_specialize", None)
            if not names or getattr(value, "module", None) != module.__name__:
                continue
            params = inspect.signature(value.fn).parameters
            for name in names:
                assert name in params, (value.fn.__name__, name)
                assert "constexpr" not in str(params[name].annotation)
                marked += 1
    assert marked >= 30


def test_no_compiled_variants_on_the_cpu():
    assert compiled_variants() == 0
    assert variants_by_kernel() == {}
    with CompileCount() as c:
        pad(3)
    assert c.new == 0 and c.kernels == {}


def test_variants_are_read_from_each_kernels_device_caches():
    from m3lm.kernels import compiles

    fn = fused._rms_norm_kernel
    assert isinstance(fn.device_caches, dict) and not fn.device_caches  # nothing launched on the CPU
    fake = type("Fake", (), {"device_caches": {0: ({"a": 1, "b": 2}, {}, None, None, None), 1: ({"c": 3},)}})
    assert compiles._variants(fake()) == 3
    names = {name for name, _ in compiles._jit_functions()}
    assert "m3lm.kernels.fused._rms_norm_kernel" in names
    assert "m3lm.kernels.moe_fp8_triton.weight_tile" not in names  # imported, counted where defined


def test_warm_up_is_a_no_op_on_the_cpu(tiny_path):
    model, _ = m3lm.load(tiny_path, device="cpu", dtype="float32")
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=4, max_model_len=64))
    assert warm_up(engine, progress=False) == WarmupReport()
    assert EngineConfig().warmup


def test_throwaway_steps_give_their_pages_back(tiny_path):
    model, _ = m3lm.load(tiny_path, device="cpu", dtype="float32")
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64))
    free = engine.blocks.num_free
    shapes = [StepShape("prefill", 1, 5), StepShape("extend", 1, 2, 4), StepShape("long", 1, 2, 30)]
    shapes.append(StepShape("decode", 3, 1, 1))
    for i, shape in enumerate(shapes):
        assert _run_shape(engine, shape, -1 - 10 * i)
        assert engine.blocks.num_free == free and engine.blocks.num_idle == 0  # nothing named, nothing kept
        engine.blocks.check()
    assert not _run_shape(engine, StepShape("decode", free + 1, 1, 1), -100)  # no room: skipped
    assert engine.blocks.num_free == free
    # the engine still serves, and nothing of the warm-up is a cached prefix
    seq = engine.add_request(list(range(5, 30)), m3lm.SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert len(seq.output_ids) == 3 and seq.num_prefix_cached == 0


@pytest.mark.cuda
@pytest.mark.whole_gpu
def test_no_compiling_after_the_warm_up(tiny_path):
    """After `warm_up`, bursts of mixed-length requests (prompts 32..3000, batches of varied size)
    compile no new kernel variant."""
    model, _ = m3lm.load(tiny_path, device="cuda", dtype="bfloat16")
    config = EngineConfig(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=4096)
    engine = LLMEngine(model, None, config)
    report = warm_up(engine, progress=False)
    assert report.steps > 0 and report.skipped == 0
    assert report.graphs == len(engine.runner.graphs.buckets)
    rng = random.Random(0)
    with CompileCount() as c:
        for wave in (1, 3, 16, 7, 12):
            for _ in range(wave):
                n = rng.randint(32, 3000)
                params = m3lm.SamplingParams(max_tokens=rng.randint(1, 24), ignore_eos=True)
                engine.add_request([rng.randrange(96) for _ in range(n)], params)
            for _ in range(rng.randint(1, 6)):  # let the next wave land mid-decode
                engine.step()
        while engine.has_unfinished():
            engine.step()
    assert c.new == 0, c.kernels
