"""litellm's `anthropic/` provider with `response_format` (a pydantic model) against `m3lm serve`:
litellm turns the format into a forced tool call on `/v1/messages`, and every reply must be an
object the model validates (a bounded string among its fields), at temperature 1 with thinking
left at its default.

    python3 benchmarks/litellm_structured.py --litellm-python PATH/TO/python --out benchmarks/results/litellm_structured.md

litellm is not a dependency of m3lm: install it in an environment of its own
(`python3 -m venv V && V/bin/pip install litellm`) and pass that environment's interpreter.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from serve_bench import REPO, Server, commit

from m3lm.bench.report import machine, write_section

KEY = "sk-litellm"
STORY = REPO / "m3lm" / "assets" / "story"

# run by litellm's interpreter: argv = url, key, requests; prints one JSON line
CLIENT = """
import json, sys
from typing import Literal

import litellm
from pydantic import BaseModel, Field, ValidationError


class Weather(BaseModel):
    city: Literal["paris", "rome", "oslo"]
    degrees: int = Field(ge=-30, le=45)
    summary: str = Field(min_length=1, max_length=12)


url, key, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
bad = []
for i in range(n):
    r = litellm.completion(
        model="anthropic/story", api_base=url, api_key=key, response_format=Weather,
        messages=[{"role": "user", "content": "What is the weather?"}], max_tokens=400, temperature=1,
    )
    text = r.choices[0].message.content
    try:
        Weather.model_validate_json(text)
    except ValidationError as e:
        bad.append(f"{text!r:.120}: {e.errors()[0]['msg']}")
print(json.dumps({"sent": n, "bad": bad}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--litellm-python", required=True, help="an interpreter with litellm installed")
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    server = Server(str(STORY), KEY, ["--max-model-len", "4096"])
    try:
        server.wait_healthy(time.monotonic() + 600)
        run = subprocess.run(
            [a.litellm_python, "-c", CLIENT, server.url, KEY, str(a.requests)], capture_output=True, text=True
        )
    finally:
        server.stop()
    if run.returncode:
        sys.exit(f"the litellm client failed ({run.returncode}):\n{run.stderr[-3000:]}")
    got = json.loads(run.stdout.strip().splitlines()[-1])
    ask = "import importlib.metadata as m; print(m.version('litellm'))"
    version = subprocess.run([a.litellm_python, "-c", ask], capture_output=True, text=True).stdout.strip()
    valid = got["sent"] - len(got["bad"])
    body = "\n".join(
        [
            f"litellm {version}, `anthropic/story` with `response_format` (a pydantic model with an enum, "
            "a bounded integer and a string of 1-12 characters), `max_tokens` 400, temperature 1, "
            "thinking at the template's default:",
            "",
            f"**{valid} / {got['sent']} replies validate.**",
            *(f"- {b}" for b in got["bad"]),
        ]
    )
    print(body)
    if a.out:
        cmd = f"python3 benchmarks/litellm_structured.py --litellm-python PATH --out {a.out}"
        details = [f"Machine: {machine()}", f"Tree: {commit(REPO)}", f"Server: `{' '.join(server.argv)}`"]
        write_section(a.out, "litellm's Anthropic provider with response_format", cmd, details, body)
    if valid != got["sent"]:
        sys.exit("a reply did not validate")


if __name__ == "__main__":
    main()
