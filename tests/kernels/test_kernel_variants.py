"""Within a bucket, every launch is the same Triton variant.

The kernels' wrappers run on CPU tensors with the launch itself replaced by a recorder that
computes the key Triton compiles by (`JITFunction.run`: each constexpr's value, each other
argument's specialisation unless `do_not_specialize`, the launch options), so no GPU is needed.
Sizes that share a warm-up key (`warmup.token_key` for a step's tokens, `pad(N)` for a sequence's
key blocks) must launch the same set of variants: one warm-up step per key then compiles all.
"""

import inspect
from collections import defaultdict

import pytest
import torch

triton = pytest.importorskip("triton")

from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from m3lm.engine.warmup import token_key  # noqa: E402
from m3lm.kernels import fp8_triton, fused, moe_fp8_triton, moe_triton, router_triton  # noqa: E402
from m3lm.kernels.fp8 import MX_BLOCK  # noqa: E402
from m3lm.kernels.host import pad  # noqa: E402
from m3lm.kernels.msa_prefill_triton import msa_prefill_attention, msa_select  # noqa: E402

BF16 = torch.bfloat16


def variant(fn: JITFunction, args, kwargs) -> tuple:
    """The compile key of one launch, as Triton's binder computes it."""
    params = inspect.signature(fn.fn).parameters
    bound = inspect.signature(fn.fn).bind_partial(*args, **{k: v for k, v in kwargs.items() if k in params})
    spec = []
    for p in fn.params:
        v = bound.arguments.get(p.name, p.default)
        if p.is_constexpr:
            spec.append(repr(v))
        else:
            spec.append(native_specialize_impl(BaseBackend, v, False, not p.do_not_specialize, True))
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in params))
    return fn.fn.__name__, tuple(spec), options


@pytest.fixture
def launches(monkeypatch):
    """Record launches (as compile keys) instead of running them."""
    seen: list[tuple] = []

    def run(self, *args, grid, warmup, **kwargs):
        seen.append(variant(self, args, kwargs))

    monkeypatch.setattr(JITFunction, "run", run)
    monkeypatch.setattr(moe_triton, "interpreted", lambda: True)  # `align`'s kernel on CPU tensors
    return seen


def groups(launches, sizes, key, launch) -> dict:
    """key -> the set of variants each size of that key launched; asserts one set per key."""
    by_key: dict = defaultdict(set)
    for n in sizes:
        launches.clear()
        launch(n)
        by_key[key(n)].add(frozenset(launches))
    bad = {k: len(v) for k, v in by_key.items() if len(v) > 1}
    assert not bad, bad
    return by_key


# tiny dimensions: H q-heads, K kv-heads, D, Di, S, k blocks, E experts, A per token, C, WI expert width
H, K, D, DI, S, TOPK, E, A, C, WI = 4, 2, 16, 16, 4, 3, 6, 2, 64, 32
TOKENS = [*range(1, 40), 63, 64, 65, 100, 127, 128, 129, 200, 255, 256, 257, 300, 511, 512, 513, 1000, 1023]
TOKENS += [1024, 1025, 1500, 2047, 2048]


def mxfp8(o: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(o, i, dtype=torch.float8_e4m3fn), torch.zeros(o, i // MX_BLOCK, dtype=torch.uint8)


def token_step(t: int) -> None:
    """What a step of t tokens launches outside attention (bf16, then MXFP8 weights)."""
    x = torch.zeros(t, C, dtype=BF16)
    w = torch.zeros(C, dtype=BF16)
    cos, sin = torch.zeros(t, 4), torch.zeros(t, 4)
    packed = torch.zeros(t, H * D + 2 * K * D, dtype=BF16)
    fused.norm_rope(packed[:, : H * D].view(t, H, D), w[:D], 1e-6, cos, sin)
    fused.norm_rope(packed[:, H * D : H * D + K * D].view(t, K, D), w[:D], 1e-6, cos, sin)
    fused.rms_norm(x, w, 1e-6)
    fused.add_rms_norm(x, x, w, 1e-6)
    fused.embed_rms_norm(torch.zeros(t, dtype=torch.long), torch.zeros(96, C, dtype=BF16), w, 1e-6)
    fused.swiglu_packed(torch.zeros(t, 2 * WI, dtype=BF16), 1.702, 7.0)
    fused.swiglu_oai(torch.zeros(t, WI, dtype=BF16), torch.zeros(t, WI, dtype=BF16), 1.702, 7.0)
    weights, ids = router_triton.route(torch.zeros(t, E), torch.zeros(E), A)
    ids = torch.arange(t * A).remainder(E).view(t, A)
    if t <= router_triton.ROUTER_GEMV_MAX_T:
        router_triton.router_gemv(x, torch.zeros(E, C, dtype=BF16))
    w13, w2 = torch.zeros(E, WI, C, dtype=BF16), torch.zeros(E, C, WI, dtype=BF16)
    pairs = moe_triton.moe_pairs(x, ids, w13, w13, w2, 1.702, 7.0)
    fused.moe_add_rms_norm(x, pairs, x, 2.0, w, 1e-6, weights=weights)
    fused.moe_combine(pairs, x, 2.0, weights=weights)
    q13, s13 = (
        torch.zeros(E, WI, C, dtype=torch.float8_e4m3fn),
        torch.zeros(E, WI, C // MX_BLOCK, dtype=torch.uint8),
    )
    q2, s2 = (
        torch.zeros(E, C, WI, dtype=torch.float8_e4m3fn),
        torch.zeros(E, C, WI // MX_BLOCK, dtype=torch.uint8),
    )
    moe_fp8_triton.moe_pairs_fp8(x, weights, ids, q13, s13, q13, s13, q2, s2, 1.702, 7.0)
    for o, act in ((H * D + 2 * K * D, None), (2 * WI, "swiglu"), (C, None)):
        fp8_triton.mxfp8_matmul(
            x if o != C else torch.zeros(t, H * D, dtype=BF16), *mxfp8(o, C if o != C else H * D), act=act
        )


def test_token_count_buckets_launch_one_variant_set(launches):
    by_key = groups(launches, TOKENS, lambda t: token_key(t, A), token_step)
    assert len(by_key) == len({token_key(t, A) for t in TOKENS})


def attend(first: int, t: int) -> None:
    """What one sequence's queries at first..first+t-1 launch on a sparse layer (`Attention._sparse`)."""
    tk = first + t
    q, iq = torch.zeros(t, H, D, dtype=BF16), torch.zeros(t, K, DI, dtype=BF16)
    k, v, ik = (
        torch.zeros(tk, K, D, dtype=BF16),
        torch.zeros(tk, K, D, dtype=BF16),
        torch.zeros(tk, DI, dtype=BF16),
    )
    pos = torch.arange(first, tk)
    block_ids = msa_select(iq, ik, pos, S, TOPK, 1, 0, first)
    if block_ids is not None or tk != t:  # else the whole sequence goes to the vendor's flash kernel
        msa_prefill_attention(q, k, v, pos, 0.25, block_ids, S, first)


CASES = [
    (f, t)
    for f in (0, 1, 3, 4, 5, 11, 12, 13, 40, 61, 64, 100, 250, 600, 1500)
    for t in (1, 2, 3, 7, 16, 17, 70)
]


def length_key(case: tuple[int, int]) -> tuple:
    first, t = case
    tk = first + t
    if first + t - 1 >= TOPK * S:
        return "sparse", pad(-(-tk // S))
    return ("dense after cached keys",) if first else ("flash",)


def test_sequence_length_buckets_launch_one_variant_set(launches):
    by_key = groups(launches, CASES, length_key, lambda c: attend(*c))
    assert {k[0] for k in by_key} == {"sparse", "dense after cached keys", "flash"}
    assert len([k for k in by_key if k[0] == "sparse"]) >= 5  # N from 4 blocks to 526: 16 .. 1024
