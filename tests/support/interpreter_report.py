"""A pytest plugin for the interpreter's child run: each case's outcome, written as JSON at the end."""

import json
import os

RESULTS: dict[str, dict] = {}


def pytest_runtest_logreport(report):
    if report.when != "call" and report.passed:
        return
    if RESULTS.get(report.nodeid, {}).get("outcome", "passed") != "passed":
        return  # the first failure stands (a teardown's after the call's)
    text = (
        report.longrepr[2] if report.skipped and isinstance(report.longrepr, tuple) else report.longreprtext
    )
    RESULTS[report.nodeid] = {"outcome": report.outcome, "text": text}


def pytest_sessionfinish(session):
    with open(os.environ["M3LM_INTERPRETER_REPORT"], "w") as f:
        json.dump(RESULTS, f)
