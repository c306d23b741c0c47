"""The command line as users run it: in a subprocess (`cli`) or in this process (`one_line_error`)."""

import json
import os
import subprocess
import sys

from m3lm.cli import main
from tests.support.checkpoints import (
    Spec,
    hf_model,
    release_config,
    to_release,
    write_checkpoint,
    write_m3_tokenizer,
)
from tests.support.paths import PATIENCE_S


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """`python -m m3lm ARGS` in a subprocess, its output decoded as it came."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "m3lm", *args],
        input=stdin and stdin.encode(),
        capture_output=True,
        timeout=PATIENCE_S,
        env=env,
    )
    # Decoded without newline translation: generated text may contain a bare "\r".
    return subprocess.CompletedProcess(r.args, r.returncode, r.stdout.decode(), r.stderr.decode())


def tiny_checkpoint(path, config=None, tokenizer_template=None):
    """A small release-layout checkpoint (optionally with an M3 tokenizer and its own chat template)."""
    s = Spec()
    write_checkpoint(path, to_release(hf_model(s).state_dict(), s), config or release_config(s))
    if tokenizer_template is not None:
        write_m3_tokenizer(path)
        cfg = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": tokenizer_template}))
    return path


def one_line_error(capsys, argv: list[str]) -> str:
    """Run the CLI in-process; an exception escaping `main` (a traceback) fails the test."""
    assert main(argv) == 1
    err = capsys.readouterr().err.rsplit("\r", 1)[-1]  # after the progress bar's last redraw
    assert err.startswith("m3lm: error: ") and err.count("\n") == 1, err
    return err
