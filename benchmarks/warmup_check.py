"""Does anything compile while serving? The release-dimension slice (random weights) in a fresh
process: the warm-up's time and kernel variants, then a mixed-length workload (prompts 32-4000
tokens, outputs 16-512, arriving in waves of varied size), with the variants it added and each
kind of step's slowest against its median. A step's kind: decode-only at a batch bucket, or a
step with prompt tokens at a token-count bucket (both powers of two).

    python benchmarks/warmup_check.py --layers 4 --requests 200
    python benchmarks/warmup_check.py --no-warmup   # the same workload on a cold engine

Variants count compiled or loaded from Triton's disk cache (`m3lm.kernels.compiles`); run it twice
with the same TRITON_CACHE_DIR to see a restart's warm-up (the second loads from the disk cache).
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from m3lm.bench.report import machine, write_section
from m3lm.bench.slice import build_slice
from m3lm.config import EngineConfig
from m3lm.core import SamplingParams
from m3lm.engine.engine import LLMEngine
from m3lm.engine.warmup import warm_up
from m3lm.kernels.compiles import CompileCount, compiled_variants
from m3lm.models.minimax_m3 import keep_mxfp8_


def bucket(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def composition(plan) -> str:
    """A step's sequences: its decodes, then each prompt chunk as tokens@start."""
    decodes = sum(n == 1 and s.num_cached == s.num_tokens - 1 for s, n in plan)
    chunks = [f"{n}@{s.num_cached}" for s, n in plan if not (n == 1 and s.num_cached == s.num_tokens - 1)]
    return f"{decodes} decodes + {len(chunks)} chunks ({', '.join(chunks)})"


def workload(
    engine: LLMEngine, a: argparse.Namespace
) -> tuple[dict[str, list[float]], CompileCount, list[tuple[float, str, str]]]:
    """`a.requests` requests in waves; per step kind, the steps' seconds; the slowest steps."""
    rng = random.Random(a.seed)
    vocab = engine.model.args.vocab_size
    times: dict[str, list[float]] = defaultdict(list)
    every: list[tuple[float, str, str]] = []  # (seconds, kind, composition)
    plan_of = engine.scheduler.schedule
    seen = {}

    def schedule():
        plan = plan_of()
        tokens = sum(n for _, n in plan)
        seen["kind"] = f"decode b{bucket(len(plan))}" if tokens == len(plan) else f"prefill t{bucket(tokens)}"
        seen["what"] = composition(plan)
        return plan

    engine.scheduler.schedule = schedule
    with CompileCount() as count:
        left = a.requests
        while left or engine.has_unfinished():
            wave = min(left, rng.choice((1, 2, 5, 8, 16, 24)))
            for _ in range(wave):
                ids = [rng.randrange(vocab) for _ in range(rng.randint(a.min_prompt, a.max_prompt))]
                out = rng.randint(a.min_output, a.max_output)
                engine.add_request(ids, SamplingParams(max_tokens=out, ignore_eos=True))
            left -= wave
            for _ in range(rng.randint(1, 16)):
                if not engine.has_unfinished():
                    break
                t = time.perf_counter()
                engine.step()
                torch.cuda.synchronize()
                times[seen["kind"]].append(dt := time.perf_counter() - t)
                every.append((dt, seen["kind"], seen["what"]))
    engine.scheduler.schedule = plan_of
    return times, count, sorted(every, reverse=True)[:8]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--fp8", action="store_true", help="MXFP8 weights (as the release ships)")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=4000)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--out", type=Path, help="write a dated Markdown section to this file (its latest run)")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    t0 = time.perf_counter()
    model = build_slice(a.layers)
    if a.fp8:
        keep_mxfp8_(model, quantize=True).prepare_()
    config = EngineConfig(max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len)
    engine = LLMEngine(model, None, config)
    built = time.perf_counter() - t0
    lines = [f"engine built in {built:.1f} s (weights, pool, profiling); variants then {compiled_variants()}"]
    if not a.no_warmup:
        r = warm_up(engine)
        lines.append(f"warm-up: {r.seconds:.1f} s, {r.steps} steps, {r.variants} variants, {r.graphs} graphs")
    t = time.perf_counter()
    times, count, slowest = workload(engine, a)
    steps = sum(len(v) for v in times.values())
    lines.append(
        f"workload: {a.requests} requests in {time.perf_counter() - t:.1f} s, {steps} steps, "
        f"**{count.new} new kernel variants** {dict(count.kernels) if count.new else ''}"
    )
    rows = [
        "| step kind | steps | median (ms) | slowest (ms) | slowest / median |",
        "|---|---:|---:|---:|---:|",
    ]
    worst = 0.0
    for kind in sorted(times, key=lambda k: (k.split()[0], int(k.split()[1][1:]))):
        xs = times[kind]
        med = statistics.median(xs)
        worst = max(worst, max(xs) / med) if len(xs) >= 5 else worst
        rows.append(f"| {kind} | {len(xs)} | {med * 1e3:.2f} | {max(xs) * 1e3:.2f} | {max(xs) / med:.2f} |")
    lines.append(f"worst slowest/median over kinds with at least 5 steps: {worst:.2f}")
    rows += ["", "| slowest steps (ms) | kind | sequences |", "|---:|---|---|"]
    rows += [f"| {dt * 1e3:.2f} | {kind} | {what} |" for dt, kind, what in slowest]
    body = "\n".join(lines) + "\n\n" + "\n".join(rows)
    print(body)
    if a.out:
        details = [
            f"Device: {machine()}; torch {torch.__version__}; {a.layers}-layer release slice, "
            f"{'MXFP8' if a.fp8 else 'bf16'}, random weights; max_num_seqs {a.max_num_seqs}, "
            f"max_model_len {a.max_model_len}"
        ]
        write_section(a.out, "Compiling while serving", "python " + " ".join(sys.argv), details, body)


if __name__ == "__main__":
    main()
