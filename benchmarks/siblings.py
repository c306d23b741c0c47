"""The n choices of one prompt: computed once (the first choice) or n times (CPU, the embedded model).

    PYTHONPATH=. python3 benchmarks/siblings.py [--prompt 1500] [--n 4] [--rounds 3] [--out FILE]

An engine (`LLMEngine`, the embedded story model on the CPU, 2048-token prefill chunks) gets `--n`
requests with one random prompt of `--prompt` tokens at once, each asking for 16 greedy tokens,
as the server does for a request with n choices. With the scheduler as it is, the first choice
computes the prompt and the others wait for its pages (`BlockManager.awaits`); "no wait" runs the
same engine with `awaits` answering no, as before, so every choice computes the prompt. Reported:
the time from the requests' arrival to each choice's first token and to the last choice's end,
and the prompt positions the runner computed. Every round uses a new prompt and fresh engines.
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

import m3lm
from m3lm.config import EngineConfig
from m3lm.core import SamplingParams
from m3lm.engine.engine import LLMEngine


def run(model, ids: list[int], n: int, wait: bool) -> dict:
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=n, max_num_batched_tokens=2048))
    if not wait:
        engine.blocks.awaits = lambda seq_id, tokens: False
    computed = 0
    real_run = engine.runner.run

    def counting(plan, tables):
        nonlocal computed
        computed += sum(k for seq, k in plan if seq.num_cached < len(seq.prompt_ids))
        return real_run(plan, tables)

    engine.runner.run = counting
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    seqs = [engine.add_request(ids, params) for _ in range(n)]
    first: dict[str, float] = {}
    while engine.has_unfinished():
        for out in engine.step():
            first.setdefault(out.request_id, time.perf_counter() - t0)
    end = time.perf_counter() - t0
    return {
        "ttft": [first[s.request_id] * 1e3 for s in seqs],
        "end": end * 1e3,
        "computed": computed,
        "outputs": [s.output_ids for s in seqs],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", type=int, default=1500)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model, _ = m3lm.load(m3lm.DEFAULT_MODEL, device="cpu")
    vocab = model.args.vocab_size
    rows, ends = [], {True: [], False: []}
    for r in range(args.rounds):
        ids = torch.randint(0, vocab, (args.prompt,), generator=torch.Generator().manual_seed(r)).tolist()
        res = {wait: run(model, ids, args.n, wait) for wait in (True, False)}
        assert res[True]["outputs"] == res[False]["outputs"], "the choices' tokens differ"
        for wait, x in res.items():
            ends[wait].append(x["end"])
            ttft = ", ".join(f"{t:.0f}" for t in x["ttft"])
            rows.append(
                f"| {r} | {'wait' if wait else 'no wait'} | {ttft} | {x['end']:.0f} | {x['computed']} |"
            )
            print(rows[-1], flush=True)
    summary = (
        f"Medians of the last choice's end: wait {statistics.median(ends[True]):.0f} ms, "
        f"no wait {statistics.median(ends[False]):.0f} ms."
    )
    print(summary)
    text = "\n".join(
        [
            f"## {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
            "",
            f"Command: `PYTHONPATH=. python3 benchmarks/siblings.py --prompt {args.prompt} --n {args.n} "
            f"--rounds {args.rounds}`",
            "",
            f"Device: CPU ({torch.get_num_threads()} threads), torch {torch.__version__}; the embedded story model",
            "",
            "| round | scheduler | ms to each choice's first token | ms to the last choice's end | "
            "prompt positions computed |",
            "|---|---|---|---|---|",
            *rows,
            "",
            summary + " The choices' tokens were the same either way in every round.",
        ]
    )
    if args.out:
        path = Path(args.out)
        path.write_text((path.read_text() + "\n\n" if path.exists() else "") + text + "\n")


if __name__ == "__main__":
    main()
