import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

try:  # property tests draw the same examples every run, so a run's result does not depend on the
    # draw; HYPOTHESIS_PROFILE=explore draws new ones (a longer search)
    from hypothesis import settings

    settings.register_profile("m3lm", derandomize=True)
    settings.register_profile("explore", derandomize=False)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "m3lm"))
except ImportError:
    pass
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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    names = [
        item.callspec.params["name"]
        for item in session.items
        if getattr(item.module, "__name__", "") == "test_kernels_interpreted"
    ]
    if names:  # the interpreter's checks run beside the rest of the suite
        import test_kernels_interpreted

        test_kernels_interpreted.start_checks(names)
