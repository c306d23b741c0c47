"""The server's structured-output checks as a bounded resource (`GrammarChecks`): their own
threads, a time budget, a share per API key, outcomes remembered. The check itself is replaced
by one the test holds until it lets it go, so nothing here depends on how fast a machine is."""

import asyncio
import threading

import pytest

from m3lm import grammar
from m3lm.core import StructuredOutput
from m3lm.server.grammar_checks import ChecksBusy, GrammarChecks


def spec(i: int) -> StructuredOutput:
    return StructuredOutput("regex", f"a{i}")


@pytest.fixture
def held(monkeypatch):
    """A check that blocks until released; records which specs ran, on which thread."""
    gate, ran = threading.Event(), []

    def check(s):
        ran.append((s, threading.current_thread().name))
        assert gate.wait(30)
        if s.value.endswith("9"):
            raise ValueError("no nines")

    monkeypatch.setattr(grammar, "check", check)
    yield gate, ran
    gate.set()


def test_a_check_past_its_budget_is_refused_and_remembered(held):
    gate, ran = held
    checks = GrammarChecks(workers=2, budget_s=1.0)

    async def main():
        with pytest.raises(ValueError, match="took longer than 1 s"):
            await checks.check(spec(1), "k")
        gate.set()
        with pytest.raises(ValueError, match="took longer"):  # remembered: not checked again
            await checks.check(spec(1), "k")
        await checks.check(spec(2), "k")  # others go on
        with pytest.raises(ValueError, match="no nines"):
            await checks.check(spec(9), "k")
        with pytest.raises(ValueError, match="no nines"):
            await checks.check(spec(9), "other")

    asyncio.run(main())
    assert [s for s, _ in ran] == [spec(1), spec(2), spec(9)]
    assert all(name.startswith("m3lm-grammar-check") for _, name in ran)
    checks.close()


def test_a_check_that_cannot_start_in_time_is_a_503_and_not_remembered(held):
    gate, _ = held
    checks = GrammarChecks(workers=2, budget_s=1.0, per_key=2)

    async def main():
        running = [asyncio.ensure_future(checks.check(spec(i), "k")) for i in (1, 2)]  # both threads
        await asyncio.sleep(0)
        with pytest.raises(ChecksBusy) as e:
            await checks.check(spec(3), "j")  # queued behind them past the budget
        assert e.value.status == 503
        for r in await asyncio.gather(*running, return_exceptions=True):
            assert isinstance(r, ValueError) and "took longer" in str(r)  # they ran past it
        gate.set()
        checks.budget_s = 60
        await checks.check(spec(3), "j")  # not remembered as refused: checked when it can be

    asyncio.run(main())
    checks.close()


def test_a_key_takes_turns_waits_within_a_bound_and_a_spec_is_checked_once(held):
    gate, ran = held
    checks = GrammarChecks(workers=2, budget_s=30, per_key=1, max_waiting=3)

    async def main():
        mine = [asyncio.ensure_future(checks.check(spec(i), "k")) for i in (1, 2, 3)]
        theirs = [asyncio.ensure_future(checks.check(spec(i), "j")) for i in (1, 4)]  # spec 1 shared
        await asyncio.sleep(0)
        with pytest.raises(ChecksBusy) as e:  # k has three waiting already
            await checks.check(spec(5), "k")
        assert e.value.status == 429
        gate.set()
        await asyncio.gather(*mine, *theirs)
        await checks.check(spec(5), "k")  # room again

    asyncio.run(main())
    order = [s for s, _ in ran]
    assert sorted(order, key=lambda s: s.value) == [spec(i) for i in (1, 2, 3, 4, 5)]  # spec 1 once
    assert [s for s in order if s in (spec(1), spec(2), spec(3))] == [spec(1), spec(2), spec(3)]
    checks.close()


def test_a_key_whose_own_checks_hold_its_turn_past_the_budget_gets_a_429(held):
    gate, _ = held
    checks = GrammarChecks(workers=2, budget_s=60, per_key=1)

    async def main():
        first = asyncio.ensure_future(checks.check(spec(1), "k"))  # holds the key's turn
        await asyncio.sleep(0)
        checks.budget_s = 0.5  # for the next request
        with pytest.raises(ChecksBusy) as e:
            await checks.check(spec(2), "k")
        assert e.value.status == 429
        gate.set()
        await first

    asyncio.run(main())
    checks.close()


def test_a_request_whose_client_left_while_it_waited_starts_no_check(held):
    gate, ran = held
    checks = GrammarChecks(workers=2, budget_s=60, per_key=1)

    async def left() -> bool:
        return True

    async def main():
        first = asyncio.ensure_future(checks.check(spec(1), "k"))  # holds the key's turn
        await asyncio.sleep(0)
        waiting = asyncio.ensure_future(checks.check(spec(2), "k", left))
        await asyncio.sleep(0)
        gate.set()
        await first
        with pytest.raises(ChecksBusy) as e:
            await waiting
        assert e.value.status == 499

    asyncio.run(main())
    assert [s for s, _ in ran] == [spec(1)]
    checks.close()
