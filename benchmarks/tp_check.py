"""Parity checks of a tensor-parallel group, run by `tp_bench.py --check` and `--golden`.

`check`: every rank builds its shard of a small real-dimension (or `--tiny`) slice with the
`full` fill (each parameter drawn at full shape from a seed per name, then sliced with the shard
plan), and runs a prefill past MSA's dense range plus one decode step over a paged cache; then
rank 0 alone builds the whole slice from the same seeds and runs the same inputs. The whole slice
must fit one device (2 layers of release dimensions: 10.2B parameters, 20 GB in bf16).

`golden`: every rank loads its shard of a golden fixture (fp32) and rank 0 compares the gathered
logits with the fixture's CPU reference (`expected.safetensors`).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from m3lm.bench.tp_slice import build_shard, slice_args
from m3lm.cache.kv_cache import KVCache, PagedKV
from m3lm.distributed.parallel import SINGLE, ParallelConfig
from m3lm.layers.batch import ForwardBatch
from m3lm.loader import load_model
from m3lm.models.minimax_m3 import MiniMaxM3, keep_mxfp8_


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).abs().max() / ref.abs().max())


def barrier(pc: ParallelConfig, dev: torch.device) -> None:
    if pc.world > 1:
        dist.barrier(device_ids=[dev.index]) if dev.type == "cuda" else dist.barrier()


def from_rank0(ok: bool, pc: ParallelConfig, dev: torch.device) -> bool:
    """Rank 0's verdict on every rank, so all ranks stop (or go on) together."""
    if pc.world == 1:
        return ok
    flag = torch.tensor([int(ok)], device=dev)
    dist.broadcast(flag, 0)
    return bool(flag.item())


def check_inputs(model: MiniMaxM3) -> torch.Tensor:
    """(top-k + 2) blocks of prompt plus one decode token [T + 1], the same on every rank."""
    a = model.args
    t = (a.index_topk_blocks + 2) * a.index_block_size  # MSA selects for the last two blocks
    return torch.randint(0, a.vocab_size, (t + 1,), generator=torch.Generator().manual_seed(7))


def prefill_then_decode(model: MiniMaxM3, ids: torch.Tensor) -> torch.Tensor:
    """Logits [R + 1, V] (fp32, CPU): a prefill of ids[:-1] at R spread rows, then one decode step."""
    a, dev = model.args, model.lm_head.weight.device
    t = ids.numel() - 1
    pages = math.ceil((t + 1) / a.index_block_size)
    kv_heads = model.model.layers[0].self_attn.n_kv
    cache = KVCache(a, pages, dev, model.lm_head.weight.dtype, kv_heads=kv_heads)
    table, tokens = [list(range(pages))], ids.to(dev)
    rows = torch.arange(t - 1, -1, -max(1, t // 16), device=dev).flip(0)  # [R], the last row included
    pre = ForwardBatch(torch.arange(t, device=dev), [t], kv=PagedKV(cache, table, [0], [t]))
    prefill = model.forward_batch(tokens[:t], pre, rows)  # [R, V]
    dec = ForwardBatch(torch.tensor([t], device=dev), [1], kv=PagedKV(cache, table, [t], [1]))
    step = model.forward_batch(tokens[t:], dec)  # [1, V]
    return torch.cat([prefill, step]).float().cpu()


def _built(args, pc: ParallelConfig, dev, dtype, seed: int, quant: str) -> MiniMaxM3:
    model = build_shard(args, pc, dev, dtype, seed, "full")
    return keep_mxfp8_(model, quantize=True).prepare_() if quant == "mxfp8" else model


def check(
    layers: int, tiny: bool, pc: ParallelConfig, dev: torch.device, dtype: torch.dtype, seed: int, quant: str
) -> tuple[bool, str]:
    """Sharded logits against rank 0's single-device run of the same weights -> (passed, line).

    With `quant` mxfp8 both sides quantise their weights; they agree where every shard holds whole
    32-blocks (release dimensions at TP 4 and 8; the tiny slice at TP 2)."""
    args = slice_args(layers, tiny)
    model = _built(args, pc, dev, dtype, seed, quant)
    ids = check_inputs(model)
    sharded = prefill_then_decode(model, ids)
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    barrier(pc, dev)  # every shard is freed before rank 0 builds the whole slice
    ok, line = True, ""
    if pc.rank == 0:
        full = _built(args, SINGLE, dev, dtype, seed, quant)
        ref = prefill_then_decode(full, ids)
        del full
        err = rel_err(sharded, ref)
        agree = float((sharded.argmax(-1) == ref.argmax(-1)).float().mean())
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        ok = err < tol and math.isfinite(err)
        line = (
            f"check {'passed' if ok else 'FAILED'}: {layers}-layer slice, TP {pc.world}"
            f"{' + EP' if pc.ep else ''}, {str(dtype).removeprefix('torch.')}"
            f"{' with MXFP8 weights' if quant == 'mxfp8' else ''}, {ids.numel() - 1}-token "
            f"prefill ({sharded.shape[0] - 1} rows) + 1 decode step: max |sharded - single| / max |single| "
            f"= {err:.2e} (tolerance {tol:g}), greedy argmax agreement {agree:.3f}"
        )
    ok = from_rank0(ok, pc, dev)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return ok, line


def golden(dirs: list[str], pc: ParallelConfig, dev: torch.device) -> tuple[bool, list[str]]:
    """Each fixture's prefill and greedy-step logits against its CPU reference (fp32)."""
    ok, lines = True, []
    tol = 1e-4 if dev.type == "cpu" else 1e-3  # GPU kernels sum in another order
    for d in map(Path, dirs):
        model = load_model(d, dev, torch.float32, parallel=pc)
        expected = load_file(d / "expected.safetensors")
        cases = sorted(
            k[: -len(".logits")] for k in expected if k.startswith("prefill_") and k.endswith(".logits")
        )
        errs = []
        for case in cases:
            logits = model(expected[f"{case}.input_ids"].to(dev))[0].float().cpu()
            errs.append(rel_err(logits, expected[f"{case}.logits"]))
        prompt, out = expected["greedy.input_ids"], expected["greedy.output_ids"]
        ids = torch.cat([prompt[0], out[:-1]])[None].to(dev)
        steps = model(ids)[0, prompt.shape[1] - 1 :].float().cpu()
        errs.append(rel_err(steps, expected["greedy.step_logits"]))
        same = torch.equal(steps.argmax(-1), out)
        passed = max(errs) < tol and same
        ok &= passed
        lines.append(
            f"golden {d.name}: {'passed' if passed else 'FAILED'}, TP {pc.world}{' + EP' if pc.ep else ''}, "
            f"{len(cases)} prefill cases + greedy steps, max relative error {max(errs):.2e} "
            f"(tolerance {tol:g}), greedy tokens {'equal' if same else 'DIFFER'}"
        )
        del model
    return from_rank0(ok, pc, dev), lines
