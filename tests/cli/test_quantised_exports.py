"""The embedded model exported to each published layout writes the same greedy text as its
dequantised twin, through `m3lm generate` and `m3lm serve`: dequantised at load (the CPU's
default) and kept as stored (`--quant keep`: 4-bit and MXFP8 weights multiplied as published)."""

import httpx
import pytest

import m3lm
from tests.support.cli import cli
from tests.support.processes import Serve
from tests.support.quant_exports import (
    checkpoint_source,
    ct_mxfp4_export,
    flash_export,
    mlx_export,
    modelopt_nvfp4_export,
)

EXPORTS = {
    "MLX 4-bit": lambda root, source: mlx_export(root, 4, 32, {}, source),
    "Model Optimizer NVFP4": lambda root, source: modelopt_nvfp4_export(root, False, source),
    "compressed-tensors MXFP4": ct_mxfp4_export,
    "M3.1-Flash mix": flash_export,
}
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def source():
    return checkpoint_source(m3lm.DEFAULT_MODEL)


@pytest.mark.parametrize("quant", ["auto", "keep"])
@pytest.mark.parametrize("layout", EXPORTS)
def test_generate_writes_the_twins_text(tmp_path, source, layout, quant):
    export = EXPORTS[layout](tmp_path, source)
    args = ("generate", "--prompt", PROMPT, "--max-tokens", "24", "--temperature", "0", "--compile", "off")
    got = cli(*args, "--model", str(export.path), "--quant", quant)
    want = cli(*args, "--model", str(export.twin))
    assert got.returncode == 0 and want.returncode == 0, got.stderr + want.stderr
    assert got.stdout == want.stdout and len(got.stdout) > len(PROMPT) + 20


@pytest.mark.parametrize("layout", EXPORTS)
def test_serve_writes_the_twins_text(tmp_path, source, layout):
    export = EXPORTS[layout](tmp_path, source)
    texts = []
    for folder, quant in ((export.path, "keep"), (export.twin, "auto")):
        server = Serve(
            "--model", str(folder), "--served-model-name", "m", "--compile", "off", "--quant", quant
        )
        try:
            server.wait_healthy()
            body = {"model": "m", "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        finally:
            server.kill()
    assert texts[0] == texts[1] and len(texts[0]) > 20
