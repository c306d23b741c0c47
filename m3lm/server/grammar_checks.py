"""Structured output's checks in the server, as a bounded resource every client shares.

Building a request's grammar (`grammar.check`) is where a schema the library cannot use fails (a
400 that names why), and its cost grows with the schema (`grammar.check_repetitions` refuses the
constructs whose cost explodes before any is built). So checks:
- run on threads of their own (`workers`), never on the pool that tokenizes or on the event loop;
- take turns by API key: at most `per_key` of one key's checks at a time, the rest waiting, at
  most `max_waiting` of them (a 429 beyond), so one key's burst cannot hold every thread (nor,
  with one check at a time, more than a core); a request whose client left while it waited
  starts none;
- have a time budget each (`budget_s`, waiting included): a check that runs past it is a 400 and
  its spec is remembered as refused; one that could not start within it is a 429 when its key's
  own checks held it back, else a 503;
- run once per spec: outcomes, refusals too, are remembered (the last `remember` of them), and a
  request whose spec is being checked waits on that check.
"""

from __future__ import annotations

import asyncio
import collections
from concurrent.futures import ThreadPoolExecutor

from m3lm.core import StructuredOutput


class ChecksBusy(Exception):
    """A check that cannot be taken now: `status` 429 (the key's share is in use) or 503."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class GrammarChecks:
    def __init__(
        self,
        workers: int = 4,
        budget_s: float = 5.0,
        per_key: int = 1,
        max_waiting: int = 256,
        remember: int = 4096,
    ):
        self.budget_s, self.per_key, self.max_waiting, self.remember = (
            budget_s,
            per_key,
            max_waiting,
            remember,
        )
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="m3lm-grammar-check")
        self._outcomes: collections.OrderedDict[StructuredOutput, str | None] = collections.OrderedDict()
        self._running: dict[StructuredOutput, asyncio.Future] = {}
        self._started: set[StructuredOutput] = set()  # added to by the check's thread
        self._turns: dict[str | None, asyncio.Semaphore] = {}
        self._waiting: collections.Counter[str | None] = collections.Counter()

    async def check(self, spec: StructuredOutput, key: str | None, gone=None) -> None:
        """Return when `spec` can be used; ValueError (a 400) naming why not; ChecksBusy.
        `gone`: an async callable saying whether the request's client has left; a request whose
        client left while it waited for its turn starts no check (ChecksBusy 499)."""
        if spec in self._outcomes:
            self._outcomes.move_to_end(spec)
            return _raise(self._outcomes[spec])
        if self._waiting[key] >= self.max_waiting:
            raise ChecksBusy(429, f"{self.max_waiting} structured-output checks of this API key are waiting")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.budget_s
        self._waiting[key] += 1
        turn = self._turns.setdefault(key, asyncio.Semaphore(self.per_key))
        try:
            try:
                await asyncio.wait_for(turn.acquire(), self.budget_s)
            except TimeoutError:
                raise ChecksBusy(429, "this API key's structured-output checks are busy; retry") from None
            try:
                if gone is not None and spec not in self._running and await gone():
                    raise ChecksBusy(499, "the client left before its check started")
                error = await self._run(spec, deadline - loop.time())
            finally:
                turn.release()
        finally:
            self._waiting[key] -= 1
            if not self._waiting[key]:
                del self._waiting[key], self._turns[key]
        _raise(error)

    async def _run(self, spec: StructuredOutput, budget: float) -> str | None:
        if spec in self._outcomes:  # checked while this request waited for its turn
            return self._outcomes[spec]
        future = self._running.get(spec)
        if future is None:
            future = asyncio.wrap_future(self._pool.submit(self._outcome, spec))
            self._running[spec] = future
            future.add_done_callback(lambda f, spec=spec: self._done(spec, f))
        try:
            return await asyncio.wait_for(asyncio.shield(future), max(budget, 0.0))
        except TimeoutError:
            if spec not in self._started:
                raise ChecksBusy(503, "the server's structured-output checks are busy; retry") from None
            error = (
                f"the {_what(spec)} took longer than {self.budget_s:g} s to check (this server's "
                "budget): simplify it"
            )
            self._keep(spec, error)
            return error

    def _outcome(self, spec: StructuredOutput) -> str | None:
        from m3lm.grammar import check

        self._started.add(spec)
        try:
            check(spec)
        except ValueError as e:
            return str(e)
        return None

    def _done(self, spec: StructuredOutput, future: asyncio.Future) -> None:
        self._running.pop(spec, None)
        self._started.discard(spec)
        if spec not in self._outcomes and not future.cancelled():  # a refusal by time stays
            self._keep(spec, future.result())

    def _keep(self, spec: StructuredOutput, error: str | None) -> None:
        self._outcomes[spec] = error
        while len(self._outcomes) > self.remember:
            self._outcomes.popitem(last=False)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _raise(error: str | None) -> None:
    if error is not None:
        raise ValueError(error)


def _what(spec: StructuredOutput) -> str:
    return {"json": "JSON schema", "structural_tag": "tool-call format"}.get(spec.kind, spec.kind)
