"""Time to first token with and without the prefix cache, on the real-dimension slice (GPU).

    python3 benchmarks/prefix_cache.py [--layers 4] [--prefix 8192] [--suffix 64 512] [--rounds 3]

An engine (`LLMEngine`, bf16, the bench's random slice) serves one request at a time. Each round
sends a fresh random `--prefix` of tokens (asking for one token), then the same prefix followed
by `--suffix` new tokens, once with prefix caching and once without (two engines on the same
weights). The time from `add_request` to the request's end is its time to first token: the
prompt's prefill, the lm_head and the sampling, host work included. Each request starts after
0.2 s with the GPU idle, so that none runs at a clock the previous one's energy lowered (the
H200 caps its power; back to back, a step's time follows the energy of the steps before it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from m3lm.bench.slice import build_slice
from m3lm.config import EngineConfig
from m3lm.core import SamplingParams
from m3lm.engine.engine import LLMEngine


def ttft_ms(engine: LLMEngine, ids: list[int]) -> tuple[float, int]:
    """(ms from add_request to the first token, prompt positions found cached) of one request."""
    torch.cuda.synchronize()
    time.sleep(0.2)
    t0 = time.perf_counter()
    seq = engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3, seq.num_prefix_cached


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prefix", type=int, default=8192)
    p.add_argument("--suffix", type=int, nargs="+", default=[64, 512])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    model = build_slice(args.layers)
    longest = args.prefix + max(args.suffix) + 1

    def engine(prefix_caching: bool) -> LLMEngine:
        config = EngineConfig(
            max_num_seqs=1,
            max_model_len=longest,
            max_num_batched_tokens=longest,
            prefix_caching=prefix_caching,
        )
        return LLMEngine(model, None, config)

    engines = {on: engine(on) for on in (True, False)}
    gen = torch.Generator().manual_seed(0)
    vocab = model.args.vocab_size
    rows: dict[str, list[float]] = {}
    for r in range(args.rounds + 1):  # round 0 warms up (kernels compiled, graphs captured)
        prefix = torch.randint(0, vocab, (args.prefix,), generator=gen).tolist()
        for on, engine in engines.items():
            name = "prefix cache" if on else "no prefix cache"
            ms, _ = ttft_ms(engine, prefix)
            if r:
                rows.setdefault(f"{args.prefix} new tokens, {name}", []).append(ms)
            for n in args.suffix:
                ms, cached = ttft_ms(engine, prefix + torch.randint(0, vocab, (n,), generator=gen).tolist())
                if r:
                    rows.setdefault(f"{args.prefix} + {n} tokens ({cached} cached), {name}", []).append(ms)
    print("| prompt | time to first token, ms (median of rounds) | rounds |\n|---|---|---|")
    for name, ms in rows.items():
        print(f"| {name} | {statistics.median(ms):.1f} | {' / '.join(f'{m:.1f}' for m in ms)} |", flush=True)


if __name__ == "__main__":
    main()
