"""A results file holds its latest run: a new run replaces it, a run's later sections follow."""

import subprocess
import sys

from tests.support.paths import REPO

WRITE = """
import sys
from pathlib import Path
from m3lm.bench.report import write_section
for body in sys.argv[2:]:
    write_section(Path(sys.argv[1]), "Title", "cmd", ["detail"], body)
"""


def run(out, *bodies):
    subprocess.run(
        [sys.executable, "-c", WRITE, str(out), *bodies], check=True, cwd=REPO, capture_output=True
    )


def test_a_new_run_replaces_the_file_and_its_sections_follow_one_another(tmp_path):
    out = tmp_path / "r.md"
    run(out, "first run, table one", "first run, table two")
    text = out.read_text()
    assert text.startswith("# Title\n\n## ") and text.count("## ") == 2
    assert text.index("table one") < text.index("table two") and "Command: `cmd`" in text
    run(out, "second run")
    text = out.read_text()
    assert text.startswith("# Title\n\n## ") and text.count("## ") == 1
    assert "second run" in text and "first run" not in text
