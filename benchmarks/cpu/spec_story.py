"""Speculative decoding on the embedded story model with its EAGLE-3 drafter (CPU, batch 1).

    PYTHONPATH=. python3 benchmarks/cpu/spec_story.py [--prompts 16] [--max-tokens 128] [--k 3]

Prompts are the openings (BOS and the first `--words` words) of held-back stories: the
validation split of `training/prepare_data.py`, which neither the model nor the drafter trained
on. Each prompt is generated greedily to `--max-tokens` (or its EOS) twice in one process, plain
and with `m3lm.DEFAULT_DRAFTER` at `--k` draft tokens, alternating, on one torch thread (what
m3lm picks for a model this small); the outputs must be identical. Output tok/s is generated
tokens over the time from the first token to the last, summed over the prompts; the mean
acceptance length is the tokens a verification step emitted on average.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import m3lm
from m3lm.bench.report import machine, write_section
from m3lm.generation import session_engine, stream_generate
from training.prepare_data import BOS, default_data_dir, load_stories


def held_back(n: int, words: int, data_dir: Path, val_every: int = 40) -> list[str]:
    stories, _ = load_stories(data_dir, cased_only=False, limit=None)
    val = list(dict.fromkeys(stories))[val_every - 1 :: val_every]
    return [BOS + " ".join(s.split()[:words]) for s in val[:n]]


def run(model, tok, engine, prompt: str, max_tokens: int) -> tuple[list[int], float, object]:
    """(token ids, seconds from the first token to the last, the last chunk) of one request."""
    ids, first, last = [], None, None
    for chunk in stream_generate(model, tok, prompt, engine=engine, max_tokens=max_tokens, temperature=0.0):
        first = first or time.perf_counter()
        ids.extend(chunk.token_ids)
        last = chunk
    return ids, time.perf_counter() - first, last


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--words", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--data-dir", type=Path, default=default_data_dir())
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/spec_story.md"))
    a = p.parse_args()
    torch.set_num_threads(1)
    model, tok = m3lm.load(m3lm.DEFAULT_MODEL, device="cpu")
    spec = {"method": "eagle3", "model": str(m3lm.DEFAULT_DRAFTER), "num_speculative_tokens": a.k}
    plain_engine = session_engine(model, tok, 1024)
    spec_engine = session_engine(model, tok, 1024, speculative_config=spec)
    prompts = held_back(a.prompts, a.words, a.data_dir)
    run(model, tok, plain_engine, prompts[0], 8)  # warm both paths
    run(model, tok, spec_engine, prompts[0], 8)
    st = spec_engine.speculator.stats
    drafts0, accepted0, per_pos0 = st.num_drafts, st.num_accepted_tokens, list(st.accepted_per_pos)
    totals = {"plain": [0, 0.0], "spec": [0, 0.0]}
    for prompt in prompts:
        plain_ids, plain_s, _ = run(model, tok, plain_engine, prompt, a.max_tokens)
        spec_ids, spec_s, _ = run(model, tok, spec_engine, prompt, a.max_tokens)
        assert spec_ids == plain_ids, f"outputs differ for {prompt!r}"
        totals["plain"][0] += len(plain_ids) - 1
        totals["plain"][1] += plain_s
        totals["spec"][0] += len(spec_ids) - 1
        totals["spec"][1] += spec_s
    tps = {k: n / s for k, (n, s) in totals.items()}
    accept = 1 + (st.num_accepted_tokens - accepted0) / (st.num_drafts - drafts0)
    per_pos = ", ".join(
        f"{(n - n0) / (st.num_drafts - drafts0):.3f}"
        for n, n0 in zip(st.accepted_per_pos, per_pos0, strict=True)
    )
    body = "\n".join(
        [
            "| | output tok/s | tokens |",
            "|---|---|---|",
            f"| plain | {tps['plain']:.1f} | {totals['plain'][0]} |",
            f"| EAGLE-3, k = {a.k} | {tps['spec']:.1f} | {totals['spec'][0]} |",
            "",
            f"Speed-up: **{tps['spec'] / tps['plain']:.2f}x**; mean acceptance length **{accept:.2f}** "
            f"(acceptance rate by draft position: {per_pos}); "
            "outputs identical token for token.",
        ]
    )
    print(body)
    command = "PYTHONPATH=. python3 benchmarks/cpu/spec_story.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if k not in ("out", "data_dir")
    )
    write_section(
        a.out,
        "Speculative decoding: the story model with its EAGLE-3 drafter",
        command,
        [f"Device: {machine()}, one torch thread", f"Prompts: {len(prompts)} held-back story openings"],
        body,
    )


if __name__ == "__main__":
    main()
