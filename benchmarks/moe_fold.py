"""The MoE's sum over its pairs folded into the next residual add and norm, against a pass of its own (GPU).

    PYTHONPATH=. python3 benchmarks/moe_fold.py [--rounds 5] [--layers 4] [--length 8192]

Since version 18 a MoE layer on the GPU hands on its per-pair products unsummed (`MoEOutput`),
and the next layer's residual add and input norm weight, sum and add them in their own pass
(`fused.moe_add_rms_norm`). Before, `fused.moe_combine` wrote the MoE's output [T, C] (100 MB at
8k tokens) and `add_rms_norm` read it again. Both forms run the same tokens in one process,
alternating by round: the 8k step back to back as `m3lm bench` times it (the median over a
second after the warm-up), and one step after the GPU idled. Their logits must be equal, bit for
bit.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from m3lm.bench import PREFILL_SECONDS, _measure, build_slice, prefill_step, rested_ms
from m3lm.models.minimax_m3 import MoE

ENGINE = MoE.unsummed
FORMS = {"folded (engine)": ENGINE, "summed on its own": lambda self, x: ENGINE(self, x).sum()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    model = build_slice(args.layers)
    step = prefill_step(model, args.length)
    logits = {}
    for name, form in FORMS.items():
        MoE.unsummed = form
        logits[name] = step()
    print(f"last logits equal bit for bit: {torch.equal(*logits.values())}", flush=True)
    steps = {name: [] for name in FORMS}
    for r in range(args.rounds):
        for name, form in FORMS.items():
            MoE.unsummed = form
            ms, gpu = _measure(step, 3, gpu=True, seconds=PREFILL_SECONDS)
            steps[name].append(ms)
            print(
                f"round {r} {name}: back to back {ms:.2f} ms ({gpu}), rested {rested_ms(step):.2f} ms",
                flush=True,
            )
    MoE.unsummed = ENGINE
    for name, v in steps.items():
        print(
            f"{name}: median {statistics.median(v):.2f} ms over {len(v)} rounds ({min(v):.2f}-{max(v):.2f})"
        )


if __name__ == "__main__":
    main()
