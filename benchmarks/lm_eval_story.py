"""lm-eval's `local-completions` model against `m3lm serve`: a loglikelihood multiple-choice
task over a local jsonl (benchmarks/lm_eval/story_choice.*), end to end over HTTP, with the
same task scored directly on the model (sum of the continuation's log-softmax from one plain
forward) as the reference the server's answer must match.

    python3 benchmarks/lm_eval_story.py --lm-eval PATH/TO/lm_eval --out benchmarks/results/lm_eval_story.md

lm-eval is not a dependency of m3lm: install it in an environment of its own and pass its
`lm_eval` command. The server runs the embedded model in fp32 on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from serve_bench import Server

import m3lm
from m3lm.bench.report import machine, write_section

TASK_DIR = Path(__file__).resolve().parent / "lm_eval"
KEY = "sk-lm-eval"  # the server is keyed, as a deployment is


def reference(items: list[dict]) -> tuple[float, list[list[float]]]:
    """Accuracy and each choice's continuation logprob, scored on the model directly as lm-eval
    scores a request: context tokens, then the tokens of " " + choice."""
    model, tok = m3lm.load(m3lm.DEFAULT_MODEL, device="cpu", dtype="float32")
    right, scores = 0, []
    for item in items:
        ctx = tok.encode(item["context"])
        row = []
        for choice in item["choices"]:
            cont = tok.encode(" " + choice)
            ids = ctx + cont
            with torch.inference_mode():
                lp = torch.log_softmax(model(torch.tensor([ids]))[0].float(), dim=-1)
            row.append(sum(lp[len(ctx) - 1 + i, t].item() for i, t in enumerate(cont)))
        scores.append(row)
        right += max(range(len(row)), key=row.__getitem__) == item["label"]
    return right / len(items), scores


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lm-eval", required=True, help="the lm_eval command of an environment that has it")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    items = [json.loads(line) for line in (TASK_DIR / "story_choice.jsonl").read_text().splitlines()]
    server = Server(
        str(Path(m3lm.DEFAULT_MODEL)), KEY, ["--dtype", "float32", "--served-model-name", "story"]
    )
    try:
        server.wait_healthy(time.monotonic() + 300)
        with tempfile.TemporaryDirectory() as tmp:
            argv = [
                a.lm_eval, "--model", "local-completions", "--model_args",
                # the key twice: OPENAI_API_KEY for completions, auth_token for /tokenize
                f"model=story,base_url={server.url}/v1/completions,tokenized_requests=True,auth_token={KEY}",
                "--tasks", "story_choice", "--include_path", str(TASK_DIR), "--batch_size", "1",
                "--output_path", tmp, "--log_samples",
            ]  # fmt: skip
            env = {**os.environ, "OPENAI_API_KEY": KEY, "HF_DATASETS_OFFLINE": "1"}
            t = time.perf_counter()
            run = subprocess.run(argv, cwd=TASK_DIR, env=env, capture_output=True, text=True)
            took = time.perf_counter() - t
            if run.returncode:
                sys.exit(f"lm_eval failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
            results = json.loads(next(Path(tmp).rglob("results_*.json")).read_text())
            samples = [json.loads(x) for x in next(Path(tmp).rglob("samples_story_choice_*.jsonl")).open()]
    finally:
        server.stop()
    acc = results["results"]["story_choice"]["acc,none"]
    ref_acc, ref_scores = reference(items)
    served = {s["doc_id"]: [r[0] for r in s["filtered_resps"]] for s in samples}
    gap = max(
        abs(float(x) - y) for i, row in enumerate(ref_scores) for x, y in zip(served[i], row, strict=True)
    )
    body = "\n".join(
        [
            "| | accuracy | items |",
            "|---|---:|---:|",
            f"| lm-eval `local-completions` over HTTP | {acc:.4f} | {len(items)} |",
            f"| the model scored directly (reference) | {ref_acc:.4f} | {len(items)} |",
            "",
            f"Largest difference between a choice's logprob over HTTP and the reference: {gap:.2e} "
            f"({sum(len(r) for r in ref_scores)} choices); lm-eval ran in {took:.1f} s.",
        ]
    )
    print(body)
    if a.out:
        py = Path(a.lm_eval).parent / "python"  # the lm_eval environment's own interpreter
        ask = "import importlib.metadata as m; print(m.version('lm_eval'))"
        lm_version = subprocess.run([py, "-c", ask], capture_output=True, text=True).stdout.strip()
        cmd = "python3 benchmarks/lm_eval_story.py --lm-eval PATH/TO/lm_eval " + (f"--out {a.out}")
        details = [
            f"Server: `python -m m3lm serve --dtype float32 --api-key KEY` on the embedded model; task "
            f"`benchmarks/lm_eval/story_choice.yaml` (loglikelihood, 4 choices); lm-eval {lm_version or '?'}",
            f"Device: {machine()}",
        ]
        write_section(a.out, "lm-eval over HTTP: a loglikelihood task", cmd, details, body)
    if gap > 1e-3 or acc != ref_acc:
        sys.exit("the served scores differ from the model's own")


if __name__ == "__main__":
    main()
