import importlib.util
import os
import re
import shutil
import tempfile
from collections import Counter

import pytest
import torch

from tests.support import interpreter_run
from tests.support.checkpoints import Spec, hf_model, release_config, to_release, write_checkpoint
from tests.support.targets import INTERPRETING

try:  # property tests draw the same examples every run, so a run's result does not depend on the
    # draw; HYPOTHESIS_PROFILE=explore draws new ones (a longer search)
    from hypothesis import settings

    settings.register_profile("m3lm", derandomize=True)
    settings.register_profile("explore", derandomize=False)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "m3lm"))
except ImportError:
    pass

HAS_TRITON = importlib.util.find_spec("triton") is not None

# Engines made by the tests decode op by op unless a test asks for compiled CPU programs (a build
# for each engine's shape would run beside every test); programs built are kept for the session
# only. Set before any test starts a server, whose processes inherit them.
os.environ.setdefault("M3LM_CPU_COMPILE", "off")
_CACHE = None if "M3LM_CACHE_DIR" in os.environ else tempfile.mkdtemp(prefix="m3lm-test-cache-")
os.environ.setdefault("M3LM_CACHE_DIR", _CACHE or "")


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    """A tiny random release-layout checkpoint (no tokenizer; read only)."""
    s = Spec()
    path = tmp_path_factory.mktemp("tiny")
    return write_checkpoint(path, to_release(hf_model(s, seed=5).state_dict(), s), release_config(s))


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """The model of a random MSA + MoE checkpoint whose sparsity engages after 12 tokens (blocks
    of 4, top-3), fp32 on the CPU."""
    import m3lm

    s = Spec()
    path = write_checkpoint(
        tmp_path_factory.mktemp("tiny"), to_release(hf_model(s, seed=21).state_dict(), s), release_config(s)
    )
    model, _ = m3lm.load(path, device="cpu", dtype=torch.float32)
    return model


def pytest_collection_modifyitems(config, items):
    no_gpu = None
    if not torch.cuda.is_available():
        no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    elif INTERPRETING:
        no_gpu = pytest.mark.skip(reason="TRITON_INTERPRET=1: Triton's kernels run in its interpreter")
    no_triton = pytest.mark.skip(reason="Triton is not installed (requirements/test.txt brings it)")
    for item in items:
        if "cuda" in item.keywords and no_gpu is not None:
            item.add_marker(no_gpu)
        if "interpreter" in item.keywords and not HAS_TRITON:
            item.add_marker(no_triton)


def _interpreted_here(item) -> bool:
    return "interpreter" in item.keywords and HAS_TRITON and not INTERPRETING


def pytest_collection_finish(session):
    nodeids = [item.nodeid for item in session.items if _interpreted_here(item)]
    if nodeids:  # the interpreter's cases start now, in a child process beside the rest of the suite
        interpreter_run.start(nodeids)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if not _interpreted_here(pyfuncitem):
        return None
    got = interpreter_run.result(pyfuncitem.nodeid)  # the child's outcome of this very case
    if got["outcome"] == "skipped":
        pytest.skip(got["text"])
    if got["outcome"] != "passed":
        pytest.fail(f"in Triton's interpreter (TRITON_INTERPRET=1):\n{got['text']}", pytrace=False)
    return True


def pytest_sessionfinish(session):
    interpreter_run.stop()
    if _CACHE is not None:
        shutil.rmtree(_CACHE, ignore_errors=True)


def pytest_terminal_summary(terminalreporter):
    """Skips counted by reason, one line each: which tests a machine without a GPU or the
    golden fixtures left out, without a line per test."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if isinstance(r.longrepr, tuple)]
    if not skipped:
        return
    reasons = Counter(re.sub(r"^Skipped: ", "", r.longrepr[2]) for r in skipped)
    terminalreporter.section(f"{len(skipped)} skipped, by reason", sep="-")
    for reason, n in reasons.most_common():
        terminalreporter.line(f"{n:5d}  {reason}")
