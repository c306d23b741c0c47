"""Where the time goes: kernel table of one prefill and one eager decode step of the bench slice.

    python3 benchmarks/profile/profile_slice.py --layers 4 --prefill 8192 --decode 1x4096

Prints, per phase, the CUDA kernels by total device time and the number of launches, so a
change can be predicted before it is made (see NOTES.md). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import math

import torch
from torch.profiler import ProfilerActivity, profile

from m3lm.bench.slice import build_slice, fill_cache, prefill_step
from m3lm.cache.kv_cache import KVCache
from m3lm.layers.batch import DecodeBatch


def table(prof, rows: int) -> None:
    events = [e for e in prof.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in events)
    launches = sum(e.count for e in events)
    print(f"kernels: {launches} launches, {total / 1e3:.2f} ms of device time")
    for e in events[:rows]:
        share = e.device_time_total / total
        print(f"{e.device_time_total / 1e3:9.3f} ms {share:6.1%} x{e.count:<5d} {e.key[:110]}")


def prefill(model, length: int, rows: int) -> None:
    step = prefill_step(model, length)
    with torch.inference_mode():
        step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
    print(f"== prefill T={length}")
    table(prof, rows)


def decode(model, batch: int, ctx: int, rows: int) -> None:
    s = model.args.index_block_size
    pages = math.ceil(ctx / s)
    cache = KVCache(model.args, batch * pages + 1, "cuda", torch.bfloat16)
    fill_cache(cache, torch.Generator(device="cuda").manual_seed(1))
    tables = torch.arange(batch * pages, device="cuda", dtype=torch.int32).view(batch, pages)
    positions = torch.full((batch,), ctx - 1, device="cuda")
    tokens = torch.randint(0, model.args.vocab_size, (batch,), device="cuda")
    with torch.inference_mode():
        dec = DecodeBatch.build(positions, tables, cache, s)
        model.forward_batch(tokens, dec)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model.forward_batch(tokens, dec)
            torch.cuda.synchronize()
    print(f"== eager decode B={batch} ctx={ctx}")
    table(prof, rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prefill", type=int, nargs="*", default=[8192])
    p.add_argument("--decode", nargs="*", default=["1x4096"])
    p.add_argument("--rows", type=int, default=25)
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    model = build_slice(a.layers)
    for t in a.prefill:
        prefill(model, t, a.rows)
    for spec in a.decode:
        b, c = (int(x) for x in spec.split("x"))
        decode(model, b, c, a.rows)


if __name__ == "__main__":
    main()
