"""Decode steps on the CPU as compiled programs kept on disk (`engine.cpu_program`), the CPU's
counterpart of `cuda_graphs.DecodeGraphs`, with the same calls.

Op by op, a decode step of a small model costs the interpreter and the dispatcher more than the
arithmetic; one compiled program for the whole step costs neither. Two programs serve every
batch: one for a batch of one (on one thread: waking a second costs more than its loops take)
and one for every larger batch, each over any table width and any number of pages.

`mode` "auto": the programs this model shape already has on disk load at once; those it lacks
are built by a process of their own while the steps run op by op, and each is taken up at the
first step after it lands. "wait": the warm-up waits for the missing ones (`compile_s` counts
the seconds). Where a build fails (no C++ compiler, say), the steps stay op by op with one
warning, and later processes, finding the failure's note, do not try again.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from m3lm.cache.kv_cache import KVCache
from m3lm.engine.cpu_program import ProgramSpec, building, failure_note, pages_of
from m3lm.layers.batch import DecodeBatch
from m3lm.models.minimax_m3 import MiniMaxM3

log = logging.getLogger("m3lm.engine")

POLL_S = 0.25  # how often a warm-up that waits looks for its programs
_builders: list[subprocess.Popen] = []  # builds started by this process (they may outlive it)


class CompiledDecode:
    """`run(tokens, positions, tables)` -> (fp32 logits [B, V] of one new token per row, None: it
    captures no drafter states, `layers` is empty), as `DecodeGraphs.run`.

    Block tables are padded with the spare page to at least `min_width` pages (past a selection's
    top-k blocks on a sparse model), the narrowest table a program takes."""

    def __init__(
        self,
        model: MiniMaxM3,
        cache: KVCache,
        max_batch: int,
        spare_page: int,
        max_pages: int,
        mode: str = "auto",
    ):
        self.model, self.cache, self.spare, self.max_batch, self.mode = (
            model,
            cache,
            spare_page,
            max_batch,
            mode,
        )
        self.layers: tuple[int, ...] = ()
        sparse = any(model.args.sparse_layers)
        self.min_width = max(2, model.args.index_topk_blocks + 1 if sparse else 2)
        self.buckets = [1, 2] if max_batch > 1 else [1]  # a program each: 1, and every B >= 2
        threads = torch.get_num_threads()
        self.specs = {b: ProgramSpec.of(model, cache, b, threads, self.min_width) for b in self.buckets}
        self.pages = pages_of(cache)
        self.programs: dict[int, object] = {}  # bucket -> loaded program
        self.pending: set[int] = set()  # buckets whose programs are being built
        self.builder: int | None = None  # pid of the build this engine started
        self.failed: str | None = None  # why a program is missing for good: those steps run op by op
        self.compile_s = 0.0  # seconds this engine waited for programs to build or load
        self._started = False

    def bucket(self, n: int) -> int:
        return 1 if n == 1 else 2

    def path(self, b: int) -> Path:
        return self.specs[b].path()

    # --- programs ---------------------------------------------------------------------------------

    def start(self) -> list[int]:
        """Load the programs on disk; start building the others (once). Returns those loaded."""
        loaded = []
        if not self._started:
            self._started = True
            missing = []
            for b in self.buckets:
                if self._load(b):
                    loaded.append(b)
                elif self.failed is None:
                    missing.append(b)
            if missing:
                self._build(missing)
        return loaded

    def capture_all(self, each: Callable[[int], None] | None = None) -> list[int]:
        """The warm-up: `start`, and with mode "wait" wait for every program being built, calling
        each(b) after program b is ready; returns the programs loaded now."""
        loaded = self.start()
        if self.mode == "wait" and self.pending:
            begin = time.perf_counter()
            while self.pending:
                loaded += self.poll()
                if self.pending:
                    time.sleep(POLL_S)
            self.compile_s += time.perf_counter() - begin
        for b in loaded if each is not None else ():
            each(b)
        return loaded

    def poll(self) -> list[int]:
        """Take up the programs that have landed since; returns them."""
        landed = []
        for b in sorted(self.pending):
            path = self.path(b)
            if path.exists():
                self.pending.discard(b)
                if self._load(b):
                    landed.append(b)
                    log.info("compiled CPU decode step for %s ready: decoding with it", _batch(b))
            elif failure_note(path).exists():
                self._fail(failure_note(path).read_text().strip())
            elif not building(path) and (self.builder is None or _exited(self.builder)):
                self._fail("its build stopped before it finished")
        return landed

    def _build(self, buckets: list[int]) -> None:
        self.pending.update(buckets)
        others = [b for b in buckets if building(self.path(b))]  # under way in another process
        buckets = [b for b in buckets if b not in others]
        if others:
            log.info(
                "the compiled CPU decode step for %s is being built by another process", _batch(others[0])
            )
        if not buckets:
            return
        root = self.path(buckets[0]).parent
        try:
            root.mkdir(parents=True, exist_ok=True)
            specs = []
            for b in buckets:
                spec = self.path(b).with_suffix(".json")
                spec.write_text(json.dumps(self.specs[b].__dict__))
                specs.append(str(spec))
            with open(self.path(buckets[0]).with_suffix(".log"), "ab") as out:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "m3lm.engine.cpu_program", *specs],
                    stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
                )  # fmt: skip
        except OSError as e:
            self._fail(f"cannot start its build: {e}")
            return
        _builders.append(proc)
        self.builder = proc.pid
        # A warning, so that a command line shows it: the first run of a model shape is slower.
        log.warning(
            "m3lm: compiling the CPU decode step for this model shape (about a minute, once; pid %d, "
            "kept in %s); %s",
            proc.pid,
            root,
            "waiting for it" if self.mode == "wait" else "decoding op by op until it is ready",
        )

    def _load(self, b: int) -> bool:
        path = self.path(b)
        if failure_note(path).exists():
            self._fail(failure_note(path).read_text().strip())
            return False
        if not path.exists():
            return False
        begin = time.perf_counter()
        try:
            program = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
            params = {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())}
            names = {name.removeprefix("model."): name for name in program.get_constant_fqns()}
            if names.keys() != params.keys():  # a weight folded into the program, or another model's
                raise ValueError(
                    f"its weights are not this model's: {sorted(names.keys() ^ params.keys())[:3]}"
                )
            constants = {name: params[key] for key, name in names.items()}
            program.load_constants(constants, False, True, True)  # the model's own tensors, not copies
        except Exception as e:  # a damaged or foreign file: dropped, to be built again next time
            log.warning("compiled CPU decode step %s unusable (%s: %s): removed", path, type(e).__name__, e)
            path.unlink(missing_ok=True)
            return False
        self.programs[b] = program
        self.compile_s += time.perf_counter() - begin
        return True

    def _fail(self, why: str) -> None:
        self.pending.clear()
        if self.failed is None:
            self.failed = why
            log.warning("compiled CPU decode step unavailable, decoding eagerly (%s)", why)

    # --- steps ------------------------------------------------------------------------------------

    def _inputs(self, tokens: list[int], positions: list[int], tables: list[list[int]]) -> tuple:
        width = max(self.min_width, *map(len, tables))
        host = np.full((len(tokens), width), self.spare, dtype=np.int32)
        for i, table in enumerate(tables):
            host[i, : len(table)] = table
        return torch.tensor(tokens), torch.tensor(positions), torch.from_numpy(host)

    def _step(self, tokens: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        dec = DecodeBatch.build(positions, tables, self.cache, self.cache.page_size)
        return self.model.forward_batch(tokens, dec)  # [B, V]

    @torch.inference_mode()
    def run(
        self, tokens: list[int], positions: list[int], tables: list[list[int]]
    ) -> tuple[torch.Tensor, None]:
        if self.mode == "wait":
            self.capture_all()
        else:
            self.start()
        if self.pending:
            self.poll()
        args = self._inputs(tokens, positions, tables)
        program = self.programs.get(self.bucket(len(tokens)))
        if program is None:
            return self._step(*args), None
        return program.run([*args, *self.pages])[0], None


def _batch(b: int) -> str:
    return "a batch of one" if b == 1 else "batches of two or more"


def _exited(pid: int) -> bool:
    for proc in _builders:
        if proc.pid == pid:
            return proc.poll() is not None
    return True
