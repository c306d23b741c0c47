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

import torch

from benchmarks.moe_pair_outputs import ab_args, alternate, last_logits
from m3lm.bench.slice import build_slice, prefill_step
from m3lm.bench.timing import rested_ms
from m3lm.models.minimax_m3 import MoE

ENGINE = MoE.unsummed
FORMS = {"folded (engine)": ENGINE, "summed on its own": lambda self, x: ENGINE(self, x).sum()}


def main() -> None:
    args = ab_args(__doc__)
    model = build_slice(args.layers)
    step = prefill_step(model, args.length)
    print(f"last logits equal bit for bit: {torch.equal(*last_logits(FORMS, step).values())}", flush=True)
    alternate(FORMS, step, args.rounds, lambda: f"rested {rested_ms(step):.2f} ms | ")


if __name__ == "__main__":
    main()
