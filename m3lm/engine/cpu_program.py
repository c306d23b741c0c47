"""A CPU decode step compiled ahead of time into a program kept on disk, built once per model shape.

The program is `MiniMaxM3.forward_batch` over a `DecodeBatch`, exported whole and compiled to C++
(torch.export + AOTInductor): fused loops around the products, no interpreter and no dispatcher
between the ops, loaded in milliseconds by later processes. The weights are not in it: each
process hands its model's own parameters to the program (user-managed constants), so one program
serves every checkpoint of a shape, and a change to the weights is seen. The pages of the KV
cache are inputs it writes in place.

A program is named by what it was built from (`ProgramSpec.key`): the model's arguments and
dtype, the cache's layout, the batch it takes (a batch of one on one thread, or any larger
batch), torch's version, the CPU's vector width and the source of the code it compiled. Building
one takes about a minute and runs in its own process (`python -m m3lm.engine.cpu_program`), so a
process that needs it decodes op by op meanwhile; the program lands atomically, under a lock
that keeps two processes from building the same one, and a build that fails leaves a note that
stops later processes from trying again with the same torch and source.
"""

from __future__ import annotations

import copy
import dataclasses
import fcntl
import functools
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from m3lm.cache.kv_cache import KVCache
from m3lm.config import ModelArgs
from m3lm.layers import rotary
from m3lm.layers.batch import DecodeBatch
from m3lm.models.minimax_m3 import MiniMaxM3

PACKAGE = Path(__file__).resolve().parents[1]
# The sources a program is compiled from: a change to any of them names a new program.
SOURCES = ("models", "layers", "kernels", "core.py", "cache/kv_cache.py", "engine/cpu_program.py")
MAX_DIM = 1 << 30  # the upper bound of the exported dynamic sizes (pages, table width, batch)


def cache_root() -> Path:
    """Where programs are kept: $M3LM_CACHE_DIR, else $XDG_CACHE_HOME/m3lm, else ~/.cache/m3lm."""
    if root := os.environ.get("M3LM_CACHE_DIR"):
        return Path(root) / "cpu-steps"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "m3lm" / "cpu-steps"


@functools.cache
def _source_digest() -> str:
    """Of the sources as this process found them first (a program is of the code that runs)."""
    h = hashlib.sha256()
    for name in SOURCES:
        root = PACKAGE / name
        for f in sorted(root.rglob("*.py")) if root.is_dir() else [root]:
            h.update(f.relative_to(PACKAGE).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class ProgramSpec:
    """What a program is built from. `bucket` 1: a batch of one, its loops on one thread; 2: any
    batch of two or more, on `threads` threads. `min_width`: the narrowest block table it takes
    (`CompiledDecode` pads every table to it)."""

    args: dict
    dtype: str  # the weights' and the KV cache's, e.g. "float32"
    index_fp8: bool
    bucket: int
    threads: int
    min_width: int

    @classmethod
    def of(cls, model: MiniMaxM3, cache: KVCache, bucket: int, threads: int, min_width: int) -> ProgramSpec:
        dtype = str(cache.k[0].dtype).removeprefix("torch.")
        args = json.loads(json.dumps(dataclasses.asdict(model.args)))
        return cls(args, dtype, bool(cache.ik_scale), bucket, 1 if bucket == 1 else threads, min_width)

    def key(self) -> str:
        ident = {
            **dataclasses.asdict(self),
            "torch": torch.__version__,
            "cpu": torch.backends.cpu.get_cpu_capability(),
            "source": _source_digest(),
        }
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]

    def path(self, root: Path | None = None) -> Path:
        return (root or cache_root()) / f"{self.key()}.pt2"

    def model_args(self) -> ModelArgs:
        fields = {f.name: f.type for f in dataclasses.fields(ModelArgs)}
        return ModelArgs(
            **{k: tuple(v) if isinstance(v, list) else v for k, v in self.args.items() if k in fields}
        )


def failure_note(path: Path) -> Path:
    return path.with_suffix(".failed")


def lock_file(path: Path) -> Path:
    return path.with_suffix(".lock")


def building(path: Path) -> bool:
    """Whether a process holds the build lock of the program at `path` now."""
    try:
        with open(lock_file(path), "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
            return False
    except OSError:
        return False


# --- the program -----------------------------------------------------------------------------------


class _RowLinear(TorchFunctionMode):
    """A linear layer on one row as products and a sum: compiled, one loop streams the weight
    where a library call on a single row reaches a fraction of the memory's speed."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is nn.functional.linear and args[0].numel() == args[0].shape[-1]:
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            y = (x.reshape(1, -1) * w).sum(-1).view(*x.shape[:-1], w.shape[0])  # [..., O]
            return y if bias is None else y + bias
        return func(*args, **kwargs)


class DecodeStep(nn.Module):
    """(tokens [B], positions [B], tables [B, W] int32, pages: k of each layer, v of each layer,
    index keys of each sparse layer) -> fp32 logits [B, V]; writes the new keys into the pages."""

    def __init__(self, model: MiniMaxM3, cache: KVCache):
        super().__init__()
        self.model, self.cache = model, cache
        self.layers, self.sparse = len(cache.k), sorted(cache.ik)

    def forward(self, tokens, positions, tables, pages: tuple[torch.Tensor, ...]) -> torch.Tensor:
        n = self.layers
        view = copy.copy(self.cache)  # the cache's layout over the pages given
        view.k, view.v = list(pages[:n]), list(pages[n : 2 * n])
        view.ik = dict(zip(self.sparse, pages[2 * n :], strict=True))
        dec = DecodeBatch.build(positions, tables, view, view.page_size)
        if tokens.shape[0] == 1:
            with _RowLinear():
                return self.model.forward_batch(tokens, dec)
        return self.model.forward_batch(tokens, dec)


def pages_of(cache: KVCache) -> list[torch.Tensor]:
    """The cache's pages in the order `DecodeStep` takes them."""
    return [*cache.k, *cache.v, *(cache.ik[i] for i in sorted(cache.ik))]


def build(spec: ProgramSpec, path: Path) -> None:
    """Export and compile the program of `spec` to `path` (written whole or not at all)."""
    from torch._inductor import aoti_compile_and_package
    from torch.export import Dim, export

    torch.manual_seed(0)  # the weights' values are not in the program: any will do
    model = MiniMaxM3(spec.model_args(), dtype=getattr(torch, spec.dtype)).eval()
    cache = KVCache(model.args, 3, "cpu", getattr(torch, spec.dtype), spec.index_fp8)
    b = spec.bucket
    tokens, positions = torch.zeros(b, dtype=torch.long), torch.zeros(b, dtype=torch.long)
    tables = torch.zeros(b, spec.min_width, dtype=torch.int32)
    pages = tuple(pages_of(cache))
    batch = Dim("batch", min=2, max=MAX_DIM) if b > 1 else None
    width = Dim("width", min=spec.min_width, max=MAX_DIM)
    num_pages = Dim("pages", min=2, max=MAX_DIM)
    row = {0: batch} if batch else None
    shapes = (row, row, {0: batch, 1: width} if batch else {1: width}, tuple({0: num_pages} for _ in pages))
    torch.set_num_threads(spec.threads)
    # The rotary table is kept between calls: one made while tracing is a stand-in tensor that a
    # later export (the next program in this process) must not find.
    rotary._INV_FREQ.clear()
    try:
        program = export(DecodeStep(model, cache), (tokens, positions, tables, pages), dynamic_shapes=shapes)
    finally:
        rotary._INV_FREQ.clear()
    options = {
        "aot_inductor.package_constants_in_so": False,  # the weights are the process's own
        "always_keep_tensor_constants": True,  # else a small weight (8 experts' biases) is inlined as values
        "cpp.threads": spec.threads,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f"{path.stem}.{os.getpid()}.part.pt2")  # the packager takes only .pt2 names
    try:
        aoti_compile_and_package(program, package_path=str(part), inductor_configs=options)
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)


def main(argv: list[str]) -> int:
    """`python -m m3lm.engine.cpu_program KEY.json...`: build each program not built yet, in turn,
    at a low priority; a failure leaves its note (`failure_note`) and stops."""
    os.nice(10)
    for name in argv:
        spec = ProgramSpec(**json.loads(Path(name).read_text()))
        path = Path(name).with_suffix(".pt2")  # beside its spec, under the name the engine looks for
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(lock_file(path), "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # another process builds it
            if path.exists() or failure_note(path).exists():
                continue
            start = time.perf_counter()
            try:
                build(spec, path)
            except Exception as e:  # any failure: its reason is kept for the processes that wait
                first = (str(e).strip().splitlines() or [""])[0]
                failure_note(path).write_text(f"{type(e).__name__}: {first}\n")
                print(f"m3lm: building {path.name} failed: {type(e).__name__}: {first}", file=sys.stderr)
                return 1
            print(f"m3lm: built {path.name} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
