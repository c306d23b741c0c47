"""Structured output in the engine: grammars compiled off the step, one matcher per request, the mask.

`Grammars` compiles each request's `StructuredOutput` (through `m3lm.grammar`) against the
tokenizer on a small thread pool (xgrammar lets go of the GIL while it compiles) and keeps the
results in an LRU bounded by their bytes, keyed by the spec, so a schema is compiled once for all
the requests and choices that use it. A request whose grammar is compiling waits in the scheduler;
the step never waits for a compile.

`Constraint` is one request's state: where its reasoning is (`ThinkingControl`, decided on token
ids) and its grammar matcher, which lives with the request: a preempted request keeps it, since
its recompute samples nothing it has not already accepted. Each step `Masks.fill` fills one
bitmask row per request that needs one (the grammar's next tokens, every grammar's row at once on
xgrammar's threads; while reasoning under a grammar, anything but a stop token; with the thinking
budget spent, only the closer) on the host while the step's forward runs on the GPU (the forward
does not need them, only sampling does), and sends them in one copy from pinned memory;
`StepMasks.apply` then masks the logits on their device; other rows are untouched. After
sampling `Constraint.accept` advances the state; a request ends when its matcher terminates.

The vocabulary is the tokenizer's, padded to the model's (ids past the tokenizer are never
allowed). Special tokens have no text in it, except the stop tokens and the markers a grammar
binds (M3's tool-call tokens): a grammar cannot emit a think marker or a turn marker as text.
Logprobs are those of the masked logits (after the mask, before penalties and temperature), as
vLLM reports them.
"""

from __future__ import annotations

import collections
import enum
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar

import torch

from m3lm.core import StructuredOutput, ThinkingControl

log = logging.getLogger("m3lm.engine")


class Grammars:
    """Compiles `StructuredOutput`s against one vocabulary, off the caller's thread, with a cache.

    `tokenizer` gives the m3lm `Tokenizer` (called once, on a compile thread, when first needed).
    """

    def __init__(
        self,
        tokenizer: Callable[[], Any],
        vocab_size: int,
        stop_ids: Iterable[int],
        max_bytes: int = 512 << 20,
        max_entries: int = 1024,
        workers: int = 2,
    ) -> None:
        self._tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_ids = sorted(i for i in set(stop_ids) if 0 <= i < vocab_size)
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="m3lm-grammar")
        self._lock = threading.Lock()  # the cache
        self._build_lock = threading.Lock()  # the vocabulary and compilers, built on a compile thread
        self._cache: collections.OrderedDict[StructuredOutput, Future] = collections.OrderedDict()
        self._vocab: tuple[list[bytes], frozenset[int], bool] | None = None
        self._compilers: dict[frozenset[int], Any] = {}
        self.compiles = 0  # grammars compiled (cache misses), for tests and logs

    def submit(self, spec: StructuredOutput) -> Future:
        """The compiled grammar of `spec`, as a future (already done when cached)."""
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[spec] = future
            self._evict()
            return future

    def _evict(self) -> None:
        """Drop the least recently used entries past the bounds (their requests keep theirs)."""
        done = [f for f in self._cache.values() if f.done() and f.exception() is None]
        size = sum(f.result().memory_size_bytes for f in done)
        while len(self._cache) > 1 and (size > self.max_bytes or len(self._cache) > self.max_entries):
            _, old = self._cache.popitem(last=False)
            if old.done() and old.exception() is None:
                size -= old.result().memory_size_bytes

    def refuse(self, spec: StructuredOutput, error: str) -> str:
        """Remember `spec` as refused with `error` (its compile, if running, is left to end);
        returns the error."""
        future: Future = Future()
        future.set_exception(ValueError(error))
        with self._lock:
            self._cache[spec] = future
            self._cache.move_to_end(spec)
            self._evict()
        return error

    def release(self, spec: StructuredOutput, future: Future) -> None:
        """No request waits for `spec`'s compile any more: cancel it if it has not started."""
        if future.cancel():
            with self._lock:
                if self._cache.get(spec) is future:
                    del self._cache[spec]

    def _compile(self, spec: StructuredOutput):
        from m3lm.grammar import grammar

        markers = frozenset(tid for _, tid in spec.markers)
        compiled = self._compiler(markers).compile_grammar(grammar(spec))
        with self._lock:
            self.compiles += 1
            self._evict()
        return compiled

    def _compiler(self, markers: frozenset[int]):
        """A compiler whose vocabulary gives text to the stop tokens, `markers` and no other special token."""
        import xgrammar as xgr

        with self._build_lock:
            if markers in self._compilers:
                return self._compilers[markers]
            if self._vocab is None:
                tok = self._tokenizer()
                if tok is None:
                    raise ValueError("structured output needs the checkpoint's tokenizer")
                if not self.stop_ids:
                    raise ValueError("structured output needs a stop token (the checkpoint names none)")
                base = xgr.TokenizerInfo.from_huggingface(
                    tok.hf, vocab_size=self.vocab_size, stop_token_ids=self.stop_ids
                )
                self._vocab = (base.decoded_vocab, frozenset(tok.all_special_ids), base.add_prefix_space)
            decoded, specials, prefix_space = self._vocab
            keep = markers | set(self.stop_ids)
            vocab = [b"" if i in specials and i not in keep else b for i, b in enumerate(decoded)]
            info = xgr.TokenizerInfo(
                vocab, xgr.VocabType.RAW, vocab_size=self.vocab_size, stop_token_ids=self.stop_ids,
                add_prefix_space=prefix_space,
            )  # fmt: skip
            threads = max(1, min(8, (os.cpu_count() or 2) // 2))
            compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
            self._compilers[markers] = compiler
            return compiler

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class _State(enum.Enum):
    START = "start"  # adaptive: the first token decides between reasoning and the answer
    REASONING = "reasoning"
    ANSWER = "answer"


class Constraint:
    """One request's output rules: its reasoning state and its grammar matcher (see the module)."""

    def __init__(self, grammar: Future | None, thinking: ThinkingControl | None) -> None:
        self._grammar = grammar
        self.since = time.monotonic()  # for the compile budget
        self.matcher = None
        self.thinking = thinking
        mode = thinking.mode if thinking is not None else "disabled"
        self.state = {"enabled": _State.REASONING, "adaptive": _State.START}.get(mode, _State.ANSWER)
        self.reasoned = 0  # reasoning tokens so far

    @property
    def compiling(self) -> bool:
        return self._grammar is not None and self.matcher is None and not self._grammar.done()

    @property
    def ready(self) -> bool:
        """Whether the request may run: no grammar, or its matcher is built."""
        return self._grammar is None or self.matcher is not None

    def start(self) -> str | None:
        """Build the matcher once the grammar is compiled; the error text if it could not be."""
        import xgrammar as xgr

        try:
            compiled = self._grammar.result()
            matcher = xgr.GrammarMatcher(compiled)
        except Exception as e:
            from m3lm.grammar import library_message

            message = library_message(e)  # a refusal `Grammars.refuse` kept says so already
            return message if message.startswith("structured output:") else f"structured output: {message}"
        first = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
        matcher.fill_next_token_bitmask(first, 0)
        if not first.any():  # nothing can be generated: not even its end
            return "structured output: the grammar admits no token (nothing can match it)"
        self.matcher = matcher
        return None

    @property
    def terminated(self) -> bool:
        return self.matcher is not None and self.matcher.is_terminated()

    def _budget_spent(self) -> bool:
        budget = self.thinking.budget if self.thinking is not None else None
        return budget is not None and self.reasoned >= budget

    def masks(self) -> bool:
        """Whether the next token is constrained at all."""
        if self.state is _State.REASONING:
            return self.matcher is not None or self._budget_spent()
        return self.matcher is not None

    @property
    def grammar_row(self) -> bool:
        """Whether the row starts as the grammar's next tokens (else the reasoning's rule)."""
        return self.state is not _State.REASONING

    def fill(self, bitmask: torch.Tensor, row: int, grammar_filled: bool = False) -> None:
        """Write the allowed next tokens into `bitmask[row]` (int32 words, bit i of word i // 32);
        `grammar_filled`: the grammar's tokens are there already (`grammar_row`)."""
        t = self.thinking
        if self.state is _State.REASONING:
            if self._budget_spent():
                bitmask[row] = 0
                _set(bitmask, row, t.end_id, True)
            else:
                bitmask[row] = -1
                for i in self.matcher.stop_token_ids:  # under a grammar the answer must come
                    _set(bitmask, row, i, False)
            return
        if not grammar_filled:
            self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.state is _State.START:
            _set(bitmask, row, t.start_id, True)
            _set(bitmask, row, t.end_id, True)

    def accept(self, token: int) -> bool:
        """Advance by the sampled token; False if the grammar refuses it."""
        t = self.thinking
        if self.state is _State.REASONING:
            if token == t.end_id:
                self.state = _State.ANSWER
            else:
                self.reasoned += 1
            return True
        if self.state is _State.START:
            if token == t.start_id:
                self.state = _State.REASONING
                return True
            self.state = _State.ANSWER
            if token == t.end_id:
                return True
        return self.matcher is None or self.matcher.accept_token(token)


def _set(bitmask: torch.Tensor, row: int, token: int, allowed: bool) -> None:
    word, bit = divmod(token, 32)
    value = int(bitmask[row, word]) & 0xFFFFFFFF
    value = value | (1 << bit) if allowed else value & ~(1 << bit)
    bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value


class StepMasks:
    """One step's bitmask [B, ceil(V' / 32)] int32 on the logits' device, a row each (a row that
    nothing constrains allows every token), and which rows are constrained."""

    _SHIFTS: ClassVar[dict[torch.device, torch.Tensor]] = {}

    def __init__(self, bitmask: torch.Tensor, rows: list[int]):
        self.bitmask, self.rows = bitmask, rows

    @torch.inference_mode()
    def apply(self, logits: torch.Tensor) -> None:
        """Set to -inf, in place, what each row of logits [B, V] forbids (V <= V'): bit t % 32 of
        word t // 32 says whether token t is allowed. Every row at once, with no index list (a
        few tensor ops, where a kernel launched with indices cost more than the step's mask)."""
        dev, (B, V) = logits.device, logits.shape
        shifts = self._SHIFTS.get(dev)
        if shifts is None:
            shifts = self._SHIFTS[dev] = torch.arange(32, dtype=torch.int32, device=dev)
        allowed = (self.bitmask[:B, :, None] >> shifts) & 1  # [B, W, 32]
        logits.masked_fill_(allowed.view(B, -1)[:, :V] == 0, float("-inf"))


class Masks:
    """Fills a step's bitmask rows on the host into a reused buffer (pinned on a GPU, so the copy
    does not wait for the forward), the grammars' rows at once on xgrammar's batch matcher: on
    one thread for a small step (handing rows to threads costs more than filling them there),
    on up to `threads` for one with more than `slots_per_thread` token slots to fill."""

    SLOTS_PER_THREAD = 1 << 20  # rows x vocabulary a fill thread is worth

    def __init__(
        self, vocab_size: int, device: torch.device, threads: int | None = None, slots_per_thread: int = 0
    ):
        self.vocab_size, self.device = vocab_size, device
        self.threads = threads or max(1, min(8, (os.cpu_count() or 2) // 2))
        self.slots_per_thread = slots_per_thread or self.SLOTS_PER_THREAD
        self._host: torch.Tensor | None = None
        self._batch: dict[int, Any] = {}  # threads -> xgrammar's BatchGrammarMatcher

    def _buffer(self, rows: int) -> torch.Tensor:
        import xgrammar as xgr

        if self._host is None or self._host.shape[0] < rows:
            n = max(rows, 2 * self._host.shape[0] if self._host is not None else 16)
            host = xgr.allocate_token_bitmask(n, self.vocab_size)  # [n, ceil(V / 32)] int32
            self._host = host.pin_memory() if self.device.type == "cuda" else host
        return self._host[:rows]

    def fill(self, constraints: Sequence[Constraint | None]) -> StepMasks | None:
        """The bitmask rows of the constrained ones of B rows (None when none is), on the device.
        The host buffer is reused: a step reads its copy back (sampling) before the next fills."""
        rows = [i for i, c in enumerate(constraints) if c is not None and c.masks()]
        if not rows:
            return None
        import xgrammar as xgr

        bitmask = self._buffer(len(constraints))
        grammar = [i for i in rows if constraints[i].grammar_row]
        if len(grammar) > 1:
            threads = min(self.threads, 1 + len(grammar) * self.vocab_size // self.slots_per_thread)
            if threads not in self._batch:
                self._batch[threads] = xgr.BatchGrammarMatcher(threads)
            self._batch[threads].batch_fill_next_token_bitmask(
                [constraints[i].matcher for i in grammar], bitmask, grammar
            )
        for i in rows:
            constraints[i].fill(bitmask, i, grammar_filled=len(grammar) > 1 and constraints[i].grammar_row)
        if len(rows) < len(constraints):  # the others allow everything
            free = torch.ones(len(constraints), dtype=torch.bool)
            free[rows] = False
            bitmask[free] = -1
        return StepMasks(bitmask.to(self.device, non_blocking=True), rows)


def mask_logits(constraints: Sequence[Constraint | None], logits: torch.Tensor) -> None:
    """Set to -inf, in place, each constrained row's logits [B, V] that its rules forbid (the
    plain reference of `Masks`: one row at a time, a fresh buffer)."""
    rows = [i for i, c in enumerate(constraints) if c is not None and c.masks()]
    if not rows:
        return
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(constraints), logits.shape[-1])  # [B, ceil(V / 32)] int32
    for i in rows:
        constraints[i].fill(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)
