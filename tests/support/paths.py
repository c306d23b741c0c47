"""Where the tests find the repository and the golden fixtures, and how long they may wait."""

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(os.environ.get("M3LM_FIXTURES", REPO.parent / "shared" / "fixtures"))
# The outer bound on waiting for a process or a state (a server up, a drain done, a reply): tests
# wait on what they expect, never on the clock, so a busy machine makes them slow, not red; this
# bound only stops a test that would otherwise hang.
PATIENCE_S = float(os.environ.get("M3LM_TEST_PATIENCE_S", 1800))


def fixture_dirs() -> list[Path]:
    """Every golden checkpoint under ../shared/fixtures (none in a user's clone)."""
    if not FIXTURES.is_dir():
        return []
    return sorted(p for p in FIXTURES.iterdir() if (p / "expected.safetensors").is_file())


def golden_params():
    dirs = fixture_dirs()
    if not dirs:
        return [pytest.param(None, marks=pytest.mark.skip(reason=f"no golden fixtures at {FIXTURES}"))]
    return [pytest.param(d, id=d.name) for d in dirs]
