"""The README's Python examples, and docs/server.md's, run as written, on the embedded model (the
server examples against a real `m3lm serve`, its port being the only change)."""

import re
import subprocess
import sys
import textwrap

import pytest

from tests.support.paths import PATIENCE_S, REPO
from tests.support.processes import Serve

README = (REPO / "README.md").read_text()
SNIPPETS = re.findall(r"^```python\n(.*?)^```", README, re.M | re.S)
SERVER_DOC = [  # its server examples, some indented under a list item
    textwrap.dedent(code)
    for _, code in re.findall(
        r"^( *)```python\n(.*?)^\1```", (REPO / "docs" / "server.md").read_text(), re.M | re.S
    )
    if "127.0.0.1:8000" in code
]


def run(code: str, tmp_path) -> subprocess.CompletedProcess:
    """The snippet in a fresh interpreter, outside the repository."""
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=PATIENCE_S
    )
    assert r.returncode == 0, f"{code}\n{r.stderr[-3000:]}"
    return r


def test_the_readme_has_its_examples():
    assert len(SNIPPETS) == 5
    assert not any("/path/to" in s or '"NAME"' in s for s in SNIPPETS)


@pytest.mark.parametrize("index", [0, 1])
def test_a_python_example_runs(index, tmp_path):
    out = run(SNIPPETS[index], tmp_path).stdout
    assert len(out.split()) >= 5, out  # each prints generated text


def test_the_server_examples_run_against_m3lm_serve(tmp_path):
    """Chat completions, Responses and Anthropic's Messages (and docs/server.md's structured
    output), against one server; each prints what the model said."""
    codes = SNIPPETS[2:] + SERVER_DOC
    assert len(SERVER_DOC) >= 3
    assert all("http://127.0.0.1:8000" in c and 'api_key="KEY"' in c for c in codes)
    server = Serve("--api-key", "KEY")
    try:
        server.wait_healthy()
        outs = [run(c.replace("127.0.0.1:8000", f"127.0.0.1:{server.port}"), tmp_path).stdout for c in codes]
    finally:
        server.kill()
    assert all(out.strip() for out in outs), outs
