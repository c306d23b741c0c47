"""The Python API against the CLI on a CPU that other processes keep busy.

Starts `--busy` processes that spin (`while 1: pass`), then alternates, `--repeats` times:
`m3lm generate` on the embedded model (greedy, 64 tokens, EOS ignored; its generation tok/s);
the README's first Python snippet, verbatim, in a fresh interpreter (its
`result.generation_tps`); and the README's `LLM` snippet, verbatim, followed by one timed
`llm.generate` of the same 64 greedy tokens. Reported: each one's median tok/s and its ratio to
the CLI's (target: at least 1 / 1.5 of it).

    python3 benchmarks/cpu/api_under_load.py --busy 2 --out benchmarks/results/api_under_load.md
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from m3lm.bench.report import machine, write_section

REPO = Path(__file__).resolve().parents[2]
TOKENS = 64


def snippets() -> tuple[str, str]:
    """The README's first Python block and its `LLM` block."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    return blocks[0], next(b for b in blocks if "LLM(" in b)


def run(code: str) -> float:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    return float(re.search(r"^TPS ([\d.]+)$", out.stdout, re.M).group(1))


def cli() -> float:
    argv = [
        sys.executable,
        "-m",
        "m3lm",
        "generate",
        "--prompt",
        "Once upon a time",
        "--max-tokens",
        str(TOKENS),
    ]
    argv += ["--temperature", "0", "--ignore-eos", "--device", "cpu"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    return float(re.search(r"generation: \d+ tokens, ([\d.]+) tok/s", out.stderr).group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--busy", type=int, default=2, help="processes that spin while it measures")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    first, llm = snippets()
    ways = {
        "`m3lm generate`": cli,
        "README snippet 1 (`m3lm.generate`)": lambda: run(first + "\nprint('TPS', result.generation_tps)\n"),
        "README `LLM` snippet, then one request": lambda: run(
            llm
            + "\nimport time\nt = time.perf_counter()\n"
            + f"o = llm.generate(['Once upon a time'], SamplingParams(max_tokens={TOKENS}, temperature=0, ignore_eos=True))\n"
            + "print('TPS', len(o[0].outputs[0].token_ids) / (time.perf_counter() - t))\n"
        ),
    }
    busy = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(a.busy)]
    try:
        time.sleep(1)
        got = {name: [] for name in ways}
        for _ in range(a.repeats):  # interleaved, so that a change in the machine's load hits all
            for name, way in ways.items():
                got[name].append(way())
                print(f"{name}: {got[name][-1]:.1f} tok/s", flush=True)
    finally:
        for p in busy:
            p.kill()
    base = statistics.median(got["`m3lm generate`"])
    rows = ["| way | tok/s (median) | runs | x the CLI |", "|---|---:|---|---:|"]
    for name, v in got.items():
        med = statistics.median(v)
        rows.append(f"| {name} | {med:.1f} | {', '.join(f'{x:.1f}' for x in v)} | {med / base:.2f} |")
    text = "\n".join(rows)
    print(text)
    if a.out:
        setup = (
            f"{a.busy} spinning processes beside it; the embedded model, greedy, {TOKENS} tokens "
            f"after 'Once upon a time' (the README's snippets as they are: `generation_tps` of their "
            f"64-token story; the `LLM` one then times a {TOKENS}-token request), {a.repeats} runs "
            "each, alternated, each in a fresh process."
        )
        write_section(
            a.out, "The Python API under load", " ".join(sys.argv), [setup, f"Device: {machine()}"], text
        )


if __name__ == "__main__":
    main()
