"""The embedded model on the CPU: m3lm against transformers, and this build against a baseline tree.

Both engines run the embedded story model in fp32 in this process, on the same token ids, greedy,
EOS ignored (no stop, no mask), prefix caching off. The cases:

- `decode1`: one 256-token prompt, 128 tokens; decode tok/s from the first generated token to
  the last (127 steps).
- `prefill`: one 1024-token prompt to its first token; prompt tok/s.
- `decode16`: 16 prompts of 256 tokens, 128 tokens each; decode tok/s over the 127 steps after
  every sequence has its first token.

Each case runs at each `--threads` count (`all` = the cores this process may use): one untimed
warm-up of each engine, then `--rounds` rounds, the engines' order alternating from round to
round, so that drift in the load of a shared machine falls on both alike. The table gives each
engine's median, the ratio of the medians, the median of the rounds' own ratios and the ratio of
the best rounds; every run's tokens are checked identical between the engines.

transformers runs `MiniMaxM3VLForCausalLM` (its default attention and experts implementations)
with the checkpoint's weights, renamed and stacked here; `generate` with a streamer that stamps
each step. m3lm runs `LLMEngine.step` on token ids with its compiled CPU decode step
(`EngineConfig.cpu_compile`: the default, programs kept on disk), built or loaded before the timed runs (the
seconds it took are reported); prefill runs op by op either way.

`--baseline DIR` adds `decode1` and `prefill` at one thread for this build against the m3lm
source tree DIR (e.g. `git worktree add --detach /tmp/base <commit>`): each round a fresh process
of each tree (order alternating) measures `--baseline-reps` runs after a warm-up and reports their
median; `--baseline-only` runs that comparison alone.

    python3 benchmarks/cpu/cpu_engines.py --rounds 5 --baseline /tmp/m3lm-base \\
        --out benchmarks/results/cpu_engines.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # what `m3lm` sets; before torch loads OpenMP

import torch

REPO = Path(__file__).resolve().parents[2]
PROMPT_LEN, NEW_TOKENS, PREFILL_LEN, BATCH = 256, 128, 1024, 16
CASES = {  # name: (prompts, prompt length, new tokens)
    "decode1": (1, PROMPT_LEN, NEW_TOKENS),
    "prefill": (1, PREFILL_LEN, 1),
    "decode16": (BATCH, PROMPT_LEN, NEW_TOKENS),
}


def story_dir() -> Path:
    from m3lm.assets import DEFAULT_MODEL

    return Path(DEFAULT_MODEL)


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of `length` ids drawn below the first special token (ids of story text)."""
    cfg = json.loads((story_dir() / "generation_config.json").read_text())
    low = min(cfg["bos_token_id"], cfg["eos_token_id"])
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, low, (n, length), generator=gen).tolist()


# --- m3lm ----------------------------------------------------------------------------------------


class M3lm:
    """m3lm's engine with the CPU's compiled decode step where the tree has it: one engine per
    batch shape and thread count, its programs built (or loaded from disk) before the timed runs."""

    name = "m3lm"

    def __init__(self):
        import m3lm

        self.model, _ = m3lm.load(story_dir(), device="cpu", dtype=torch.float32, skip_tokenizer_init=True)
        self.engines: dict[tuple, object] = {}
        self.compile_s: dict[tuple, float] = {}

    def engine(self, n: int, length: int, new: int):
        from m3lm.config import EngineConfig
        from m3lm.engine.engine import LLMEngine

        key = (n, length, new, torch.get_num_threads())
        if key not in self.engines:
            compiles = "cpu_compile" in EngineConfig.__dataclass_fields__  # a baseline tree may lack it
            config = EngineConfig(
                max_num_seqs=n,
                max_model_len=length + new,
                max_num_batched_tokens=max(2048, n * length),  # every prompt in one step
                kv_cache_tokens=n * (length + new) + 64 * n,
                prefix_caching=False,
                **({"cpu_compile": True} if compiles else {}),
            )
            engine = self.engines[key] = LLMEngine(self.model, None, config, {})
            if engine.runner.graphs is not None:
                start = time.perf_counter()
                engine.runner.graphs.capture_all()
                self.compile_s[key] = time.perf_counter() - start
        return self.engines[key]

    def run(self, ids: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
        """Seconds of the measured span (see `span`) and each prompt's generated ids."""
        from m3lm.core import SamplingParams

        engine = self.engine(len(ids), len(ids[0]), new)
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        seqs = [engine.add_request(p, params) for p in ids]
        stamps = []
        while engine.has_unfinished():
            engine.step()
            stamps.append(time.perf_counter())
        return span(start, stamps, new), [s.output_ids for s in seqs]


def span(start: float, stamps: list[float], new: int) -> float:
    """From `start` to the first token (a prefill), else from the first token to the last."""
    if new == 1:
        return stamps[0] - start
    if len(stamps) != new:
        raise RuntimeError(f"{len(stamps)} steps for {new} tokens: the prompts did not prefill in one step")
    return stamps[-1] - stamps[0]


# --- transformers --------------------------------------------------------------------------------


def hf_state_dict(path: Path, num_experts: int) -> dict[str, torch.Tensor]:
    """The release checkpoint's tensors under transformers' names: fp32, experts stacked
    ([E, 2I, C] gate then up, [E, C, I] down), gate and up of the other MLPs fused."""
    from safetensors.torch import load_file

    out = {}
    for k, t in load_file(path / "model.safetensors").items():
        k = k.replace("language_model.model.", "model.").replace("language_model.lm_head.", "lm_head.")
        k = k.replace("self_attn.index_", "self_attn.indexer.")
        k = k.replace("block_sparse_moe.e_score_correction_bias", "mlp.gate.e_score_correction_bias")
        out[k.replace("block_sparse_moe.", "mlp.")] = t.float()
    layers = {int(k.split(".")[2]) for k in out if k.startswith("model.layers.")}
    for layer in sorted(layers):
        p = f"model.layers.{layer}.mlp."
        owner = p
        if f"{p}experts.0.w1.weight" in out:
            w = {
                n: [out.pop(f"{p}experts.{e}.{n}.weight") for e in range(num_experts)]
                for n in ("w1", "w2", "w3")
            }
            out[p + "experts.gate_up_proj"] = torch.stack(
                [torch.cat(gu) for gu in zip(w["w1"], w["w3"], strict=True)]
            )
            out[p + "experts.down_proj"] = torch.stack(w["w2"])
            owner = p + "shared_experts."
        gate, up = out.pop(owner + "gate_proj.weight"), out.pop(owner + "up_proj.weight")
        out[owner + "gate_up_proj.weight"] = torch.cat([gate, up])
    return out


class Transformers:
    name = "transformers"

    def __init__(self):
        from transformers import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig

        text = json.loads((story_dir() / "config.json").read_text())["text_config"]
        text = {k: v for k, v in text.items() if k not in ("model_type", "architectures")}
        config = MiniMaxM3VLTextConfig(**text, bos_token_id=None, eos_token_id=None, pad_token_id=None)
        self.model = MiniMaxM3VLForCausalLM(config).eval()
        self.model.load_state_dict(hf_state_dict(story_dir(), text["num_local_experts"]), strict=True)

    def settings(self) -> dict:
        c = self.model.config
        return {
            "attention": getattr(c, "_attn_implementation", None),
            "experts": getattr(c, "_experts_implementation", None),
        }

    def run(self, ids: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
        from transformers import GenerationConfig
        from transformers.generation.streamers import BaseStreamer

        stamps = []

        class Stamps(BaseStreamer):
            def put(self, value):
                stamps.append(time.perf_counter())

            def end(self):
                pass

        x = torch.tensor(ids)
        gen = GenerationConfig(
            do_sample=False, max_new_tokens=new, min_new_tokens=new, eos_token_id=None, pad_token_id=0
        )
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=x, attention_mask=torch.ones_like(x), generation_config=gen, streamer=Stamps()
            )
        return span(start, stamps[1:], new), out[:, x.shape[1] :].tolist()  # stamps[0]: the prompt


# --- runs ----------------------------------------------------------------------------------------


def threads_of(spec: str) -> int:
    return len(os.sched_getaffinity(0)) if spec == "all" else int(spec)


def rate(case: str, seconds: float) -> float:
    """Tokens per second: prompt tokens for a prefill, decoded tokens (after the first) else."""
    n, length, new = CASES[case]
    return n * length / seconds if new == 1 else n * (new - 1) / seconds


def compare(engines: list, case: str, rounds: int) -> dict:
    """Warm-up, then `rounds` alternating rounds; tok/s per round of each engine and whether
    every run's tokens matched."""
    n, length, new = CASES[case]
    ids = prompts(n, length)
    for e in engines:
        e.run(ids, new)
    rates = {e.name: [] for e in engines}
    same = True
    for r in range(rounds):
        outs = []
        for e in engines if r % 2 == 0 else engines[::-1]:
            seconds, tokens = e.run(ids, new)
            rates[e.name].append(rate(case, seconds))
            outs.append(tokens)
        same = same and all(o == outs[0] for o in outs)
    return {"rates": rates, "identical": same}


def ratio_row(label: str, a: list[float], b: list[float]) -> str:
    """a / b: medians, the median of the rounds' own ratios, the best rounds."""
    med = statistics.median
    return (
        f"| {label} | {med(a):.1f} | {med(b):.1f} | {med(a) / med(b):.2f}x "
        f"| {med([x / y for x, y in zip(a, b, strict=True)]):.2f}x | {max(a) / max(b):.2f}x "
        f"| {' '.join(f'{x:.0f}' for x in a)} | {' '.join(f'{x:.0f}' for x in b)} |"
    )


TABLE = (
    "| {what} | {a} tok/s | {b} tok/s | ratio of medians | median of round ratios | best rounds "
    "| {a} each round | {b} each round |\n|---|---|---|---|---|---|---|---|"
)


def worker(case: str, threads: int, reps: int) -> None:
    """This tree's (the PYTHONPATH's) m3lm alone: warm-up, `reps` runs; the JSON on stdout."""
    torch.set_num_threads(threads)
    n, length, new = CASES[case]
    ids = prompts(n, length)
    engine = M3lm()
    engine.run(ids, new)
    runs = [engine.run(ids, new) for _ in range(reps)]
    rates = [rate(case, s) for s, _ in runs]
    print(json.dumps({"rate": statistics.median(rates), "rates": rates, "tokens": runs[0][1]}))


def against_baseline(tree: Path, case: str, rounds: int, reps: int) -> dict:
    """`case` at one thread, a fresh process of each tree per round, order alternating."""
    script = Path(__file__).resolve()
    trees = {"this build": REPO, "baseline": tree.resolve()}
    rates = {k: [] for k in trees}
    tokens = {}
    for r in range(rounds):
        for name in list(trees) if r % 2 == 0 else list(trees)[::-1]:
            env = {**os.environ, "PYTHONPATH": str(trees[name])}
            argv = [sys.executable, str(script), "--worker", case, "--reps", str(reps)]
            res = subprocess.run(argv, env=env, cwd=trees[name], capture_output=True, text=True)
            if res.returncode:
                raise RuntimeError(f"{name} worker failed:\n{res.stderr[-3000:]}")
            got = json.loads(res.stdout.strip().splitlines()[-1])
            rates[name].append(got["rate"])
            tokens.setdefault(name, got["tokens"])
    return {"rates": rates, "identical": tokens["this build"] == tokens["baseline"]}


def baseline_section(a) -> str:
    """decode1 and prefill at one thread, this build against `a.baseline`, as a results section."""
    rows = []
    for case in ("decode1", "prefill"):
        res = against_baseline(a.baseline, case, a.rounds, a.baseline_reps)
        row = ratio_row(f"{case}, 1 thread", res["rates"]["this build"], res["rates"]["baseline"])
        print(row, "identical" if res["identical"] else "TOKENS DIFFER", flush=True)
        rows.append(row + ("" if res["identical"] else " **tokens differ**"))
    return (
        f"### This build ({commit(REPO)}) against the baseline tree ({commit(a.baseline)})\n\n"
        + TABLE.format(what="case", a="this build", b="baseline")
        + "\n" + "\n".join(rows)
        + f"\n\nEach figure: the median of {a.baseline_reps} runs in a fresh process. {load_line()} after these."
    )  # fmt: skip


def commit(tree: Path) -> str:
    r = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()  # fmt: skip
    return r.stdout.strip() + (" + uncommitted changes" if dirty else "")


def load_line() -> str:
    return "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--threads", nargs="+", default=["1", "all"], help="thread counts, or 'all'")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--baseline", type=Path, help="an m3lm source tree to compare decode1 and prefill with")
    ap.add_argument("--baseline-reps", type=int, default=3)
    ap.add_argument("--baseline-only", action="store_true", help="with --baseline: no transformers")
    ap.add_argument("--out", type=Path, help="write a dated section to this file (its latest run)")
    ap.add_argument("--worker", choices=list(CASES), help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker, 1, a.reps)

    from importlib.metadata import version

    from m3lm.bench.report import machine, write_section

    if a.baseline_only:
        body = "\n\n".join([f"Loads at start: {load_line()}", baseline_section(a)])
        print(body)
        if a.out:
            command = "python3 benchmarks/cpu/cpu_engines.py " + shlex.join(sys.argv[1:])
            details = [f"Device: {machine()}; Python {platform.python_version()}, torch {torch.__version__}"]
            write_section(
                a.out,
                "The embedded model on the CPU: this build against a baseline tree",
                command,
                details,
                body,
            )
        return
    t0 = time.perf_counter()
    mine = M3lm()
    load_m3lm = time.perf_counter() - t0
    t0 = time.perf_counter()
    hf = Transformers()
    load_hf = time.perf_counter() - t0
    sections = [f"Loads at start: {load_line()}"]
    for spec in a.threads:
        n = threads_of(spec)
        torch.set_num_threads(n)
        sections.append(
            f"### {n} thread{'s' if n > 1 else ''}\n\n"
            + TABLE.format(what="case", a="m3lm", b="transformers")
        )
        for case in a.cases:
            res = compare([mine, hf], case, a.rounds)
            row = ratio_row(case, res["rates"]["m3lm"], res["rates"]["transformers"])
            sections[-1] += "\n" + row + ("" if res["identical"] else " **tokens differ**")
            print(row, "identical" if res["identical"] else "TOKENS DIFFER", load_line(), flush=True)
        sections[-1] += f"\n\n{load_line()} after these."
    if a.baseline:
        sections.append(baseline_section(a))
    hf_set = hf.settings()
    details = [
        f"Device: {machine()}; Python {platform.python_version()}, torch {torch.__version__}, "
        f"transformers {version('transformers')}; OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}",
        f"m3lm at {commit(REPO)}; transformers' attention {hf_set['attention']}, experts {hf_set['experts']}",
        f"Load time in this process: m3lm {load_m3lm:.2f} s, transformers (build + state dict) {load_hf:.2f} s",
        "m3lm's compiled decode steps built or loaded before the timed runs in "
        + ", ".join(
            f"{s:.0f} s ({k[0]} x {k[1]}, {k[3]} thread{'s' * (k[3] > 1)})" for k, s in mine.compile_s.items()
        ),
        f"{a.rounds} rounds per case, engines alternating; decode tok/s count the tokens after each "
        "sequence's first, prefill tok/s the prompt tokens to the first token. Greedy tokens identical "
        "in every run unless marked.",
    ]
    body = "\n\n".join(sections)
    print(body)
    if a.out:
        command = "python3 benchmarks/cpu/cpu_engines.py " + shlex.join(sys.argv[1:])
        write_section(
            a.out, "The embedded model on the CPU: m3lm against transformers", command, details, body
        )


if __name__ == "__main__":
    main()
