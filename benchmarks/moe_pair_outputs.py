"""The MoE's per-pair outputs as bf16 products, unweighted, against fp32 weighted ones (GPU).

    PYTHONPATH=. python3 benchmarks/moe_pair_outputs.py [--rounds 5] [--layers 4] [--length 8192]

The engine's down GEMM leaves each token-expert pair's product rounded to bf16, as the
reference's product is (`moe_experts_ref`: `(h @ w2[e].T).float() * weight`), and the combine
weights and sums the pairs in fp32. The form before it multiplied each pair by its weight in the
down GEMM's epilogue and stored it in fp32: 805 MB a layer at 8k tokens written and read again by
the combine, against 403 MB now. Both forms are timed in one process, alternating by round: the
MoE layer on layer 1's input of one 8k step (back to back, ms and J a call) and the 8k step back
to back as `m3lm bench` times it (the median over a second after the warm-up). The step's last
logits of the two forms are compared.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.step_energy import capture, per_call
from m3lm.bench.gpu_meter import GpuMeter
from m3lm.bench.slice import build_slice
from m3lm.bench.timing import PREFILL_SECONDS, measure
from m3lm.kernels import moe_triton as mt
from m3lm.kernels.fused import moe_combine
from m3lm.kernels.moe import route, router_logits
from m3lm.models.minimax_m3 import MoE

ENGINE = MoE.unsummed


def engine_summed(self: MoE, x: torch.Tensor) -> torch.Tensor:
    """The engine's pairs summed on their own, as `fp32_weighted` sums its pairs (since version
    18 the engine sums them in the next residual add and norm: `moe_fold.py`)."""
    return ENGINE(self, x).sum()


def fp32_weighted(self: MoE, x: torch.Tensor) -> torch.Tensor:
    """The bf16 GPU path as it was: pairs weighted in the down GEMM's epilogue, stored in fp32."""
    logits = router_logits(x, self.gate.weight, self._router_split(x))
    weights, ids = route(logits, self.e_score_correction_bias, self.top_k)
    ex = self.experts
    t, a = ids.shape
    (up_m, up_cfg), (down_m, down_cfg) = mt.tiles(t * a, x.dtype)
    aligned = mt.align(ids, ex.w1.shape[0], max(up_m, down_m))
    h = mt.gate_up(x.contiguous(), ex.w1, ex.w3, t * a, a, aligned, self.alpha, self.limit, up_m, up_cfg)
    scale = weights.flatten().float().contiguous()
    down = mt.grouped_gemm(
        h, ex.w2, t * a, a, aligned, pair_rows=True, scale=scale, out_dtype=torch.float32,
        block_m=down_m, config=down_cfg,
    )  # fmt: skip
    return moe_combine(down.view(t, a, -1), self.shared_experts(x), self.scaling)


FORMS = {"bf16 unweighted (engine)": engine_summed, "fp32 weighted (before)": fp32_weighted}


def ab_args(doc: str) -> argparse.Namespace:
    """--layers, --length and --rounds of an A/B script."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=5)
    return p.parse_args()


def last_logits(forms: dict, step) -> dict[str, torch.Tensor]:
    """The step's last logits under each form of `MoE.unsummed` (the same tokens for all)."""
    out = {}
    for name, form in forms.items():
        MoE.unsummed = form
        out[name] = step()
    MoE.unsummed = ENGINE
    return out


def alternate(forms: dict, step, rounds: int, extra=lambda: "") -> None:
    """Rounds in which each form of `MoE.unsummed` runs in turn: what `extra` reports, then the
    8k step back to back as `m3lm bench` times it (the median over a second after the warm-up);
    then each form's median over the rounds."""
    steps = {name: [] for name in forms}
    for r in range(rounds):
        for name, form in forms.items():
            MoE.unsummed = form
            more = extra()
            ms, gpu = measure(step, 3, gpu=True, seconds=PREFILL_SECONDS)
            steps[name].append(ms)
            print(f"round {r} {name}: {more}8k step back to back {ms:.2f} ms ({gpu})", flush=True)
    MoE.unsummed = ENGINE
    for name, v in steps.items():
        print(
            f"{name}: step median {statistics.median(v):.2f} ms over {len(v)} rounds ({min(v):.2f}-{max(v):.2f})"
        )


def main() -> None:
    args = ab_args(__doc__)
    model = build_slice(args.layers)
    meter = GpuMeter.open()
    step, seen = capture(model, args.length)
    moe, x = model.model.layers[1].block_sparse_moe, seen["moe"]
    a, b = (v.float() for v in last_logits(FORMS, step).values())
    print(f"last logits, relative difference between the forms: {float((a - b).norm() / b.norm()):.2e}")

    def moe_layer() -> str:
        with torch.inference_mode():
            ms, j, w = per_call(meter, lambda: moe(x), 1.0)
        return f"MoE layer {ms:.3f} ms {j:.3f} J {w:.0f} W | "

    alternate(FORMS, step, args.rounds, moe_layer)


if __name__ == "__main__":
    main()
