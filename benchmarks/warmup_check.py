"""Does anything compile while serving? The release-dimension slice (random weights) in a fresh
process: the warm-up's time and variants, then bursts of mixed-length requests, each with the
kernel variants it added and its slowest step against the median.

    python benchmarks/warmup_check.py --layers 4 --bursts 3 --requests 96
    python benchmarks/warmup_check.py --no-warmup   # the same bursts on a cold engine

Variants count compiled or loaded from Triton's disk cache (`m3lm.kernels.compiles`); run it twice
to see a restart's warm-up (the second loads from ~/.triton/cache).
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time

import torch

from m3lm.bench import build_slice
from m3lm.config import EngineConfig
from m3lm.core import SamplingParams
from m3lm.engine.engine import LLMEngine
from m3lm.engine.warmup import warm_up
from m3lm.kernels.compiles import CompileCount, compiled_variants
from m3lm.models.minimax_m3 import keep_mxfp8_


def burst(
    engine: LLMEngine, rng: random.Random, n: int, lo: int, hi: int
) -> tuple[list[float], CompileCount]:
    """n requests (prompts lo..hi tokens, outputs 16..128), arriving in waves of varied size."""
    times = []
    vocab = engine.model.args.vocab_size
    with CompileCount() as count:
        left = n
        while left or engine.has_unfinished():
            wave = min(left, rng.choice((1, 2, 5, 8, 16, 24)))
            for _ in range(wave):
                ids = [rng.randrange(vocab) for _ in range(rng.randint(lo, hi))]
                engine.add_request(ids, SamplingParams(max_tokens=rng.randint(16, 128), ignore_eos=True))
            left -= wave
            for _ in range(rng.randint(1, 8)):
                if not engine.has_unfinished():
                    break
                t = time.perf_counter()
                engine.step()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
    return times, count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--fp8", action="store_true", help="MXFP8 weights (as the release ships)")
    p.add_argument("--bursts", type=int, default=3)
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=3000)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--no-warmup", action="store_true")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model = build_slice(args.layers)
    if args.fp8:
        keep_mxfp8_(model, quantize=True)
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=args.max_num_seqs))
    print(f"max_model_len {engine.max_model_len}, variants at start {compiled_variants()}")
    if not args.no_warmup:
        r = warm_up(engine)
        print(f"warm-up: {r.seconds:.1f} s, {r.steps} steps, {r.variants} variants, {r.graphs} graphs")
    rng = random.Random(0)
    for i in range(args.bursts):
        t = time.perf_counter()
        times, count = burst(engine, rng, args.requests, args.min_prompt, args.max_prompt)
        med = statistics.median(times)
        print(
            f"burst {i}: {time.perf_counter() - t:.1f} s, {len(times)} steps, new variants {count.new}, "
            f"slowest step {max(times) * 1e3:.1f} ms = {max(times) / med:.1f}x the median {med * 1e3:.1f} ms"
        )
        if count.new:
            print("  new variants by kernel:", count.kernels)


if __name__ == "__main__":
    main()
