"""`load_format="dummy"`: a model from config.json alone, random and deterministic; no tokenizer on request."""

import json

import pytest
import torch

import m3lm
from m3lm.config import EngineConfig
from m3lm.core import SamplingParams
from m3lm.engine.engine import LLMEngine
from m3lm.loader import random_weights_
from m3lm.models.minimax_m3 import MiniMaxM3
from tests.support.checkpoints import Spec, release_config
from tests.support.cli import one_line_error

SPEC = Spec()


def config_only(path, config=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or release_config(SPEC)))
    return path


def test_a_folder_with_only_config_json_builds_a_finite_deterministic_model(tmp_path):
    path = config_only(tmp_path / "m")
    a, tok = m3lm.load(path, device="cpu", load_format="dummy")
    b, _ = m3lm.load(path, device="cpu", load_format="dummy")
    assert tok is None and a.args.vocab_size == SPEC.vocab
    ids = torch.arange(40)[None] % SPEC.vocab
    la, lb = a(ids), b(ids)
    assert torch.isfinite(la).all() and la.std() > 0
    assert torch.equal(la, lb)
    for (name, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(p, q), name


def test_dummy_model_generates_through_the_engine(tmp_path):
    model, _ = m3lm.load(config_only(tmp_path / "m"), device="cpu", load_format="dummy")
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=2, max_model_len=64))
    engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    out = [o for _ in range(50) if engine.has_unfinished() for o in engine.step()]
    tokens = [t for o in out for t in o.new_token_ids]
    assert len(tokens) == 6 and all(0 <= t < SPEC.vocab for t in tokens)
    assert out[-1].finish_reason == "length"


def test_dummy_mxfp8_has_the_layout_of_a_loaded_mxfp8_model(tmp_path):
    cfg = release_config(SPEC)
    cfg["quantization_config"] = {"quant_method": "mxfp8", "weight_block_size": [1, 32]}
    model, _ = m3lm.load(config_only(tmp_path / "q", cfg), device="cpu", quant="mxfp8", load_format="dummy")
    with torch.device("meta"):
        want = MiniMaxM3(model.args, dtype=torch.float32, quant="mxfp8")
    got = {n: (p.shape, p.dtype) for n, p in model.named_parameters()}
    assert got == {n: (p.shape, p.dtype) for n, p in want.named_parameters()}
    assert any(d == torch.float8_e4m3fn for _, d in got.values())
    scales = [p for n, p in model.named_parameters() if n.endswith("_scale")]
    assert scales and all((s != 255).all() for s in scales)  # no NaN-encoding scale
    assert torch.isfinite(model(torch.arange(20)[None] % SPEC.vocab)).all()


def test_dummy_on_the_cpu_with_an_mxfp8_config_is_plain_as_a_loaded_one(tmp_path):
    cfg = release_config(SPEC)
    cfg["quantization_config"] = {"quant_method": "mxfp8", "weight_block_size": [1, 32]}
    model, _ = m3lm.load(config_only(tmp_path / "q", cfg), device="cpu", load_format="dummy")
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_random_weights_scale():
    with torch.device("meta"):
        model = MiniMaxM3(m3lm.ModelArgs.from_dict(release_config(SPEC)))
    random_weights_(model.to_empty(device="cpu"), seed=3)
    for name, p in model.named_parameters():
        want = 0.001 if name.endswith("e_score_correction_bias") else 0.1 if p.dim() == 1 else 0.02
        assert p.std().item() == pytest.approx(want, rel=0.5), name


def test_skip_tokenizer_init_gives_none():
    model, tok = m3lm.load(m3lm.DEFAULT_MODEL, device="cpu", skip_tokenizer_init=True)
    assert tok is None and model.args.vocab_size > 0
    assert m3lm.load(m3lm.DEFAULT_MODEL, device="cpu")[1] is not None


def test_unknown_load_format_is_refused(tmp_path):
    with pytest.raises(ValueError, match="load_format = 'npz'"):
        m3lm.load(config_only(tmp_path / "m"), device="cpu", load_format="npz")


def test_default_load_format_still_needs_weights(tmp_path):
    with pytest.raises(m3lm.CheckpointError, match="no model.safetensors"):
        m3lm.load(config_only(tmp_path / "m"), device="cpu")


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_generate_and_chat_refuse_skip_tokenizer_init(command, capsys):
    extra = ["--prompt", "x"] if command == "generate" else []
    err = one_line_error(capsys, [command, *extra, "--device", "cpu", "--skip-tokenizer-init"])
    assert "needs a tokenizer" in err and "--skip-tokenizer-init" in err


def test_generate_on_a_dummy_model_without_tokenizer_files_is_refused(tmp_path, capsys):
    path = config_only(tmp_path / "m")
    err = one_line_error(
        capsys, ["generate", "--model", str(path), "--prompt", "x", "--load-format", "dummy"]
    )
    assert "no tokenizer" in err


def test_dummy_under_tensor_parallelism_is_refused(tmp_path, capsys):
    path = str(config_only(tmp_path / "m"))
    argv = [
        "generate",
        "--model",
        path,
        "--prompt",
        "x",
        "--load-format",
        "dummy",
        "--tensor-parallel-size",
        "2",
    ]
    assert "--tensor-parallel-size 1" in one_line_error(capsys, argv)


@pytest.mark.cuda
def test_dummy_on_the_gpu_is_deterministic_and_finite(tmp_path):
    path = config_only(tmp_path / "m")
    a, _ = m3lm.load(path, device="cuda", load_format="dummy")
    b, _ = m3lm.load(path, device="cuda", load_format="dummy")
    ids = (torch.arange(40, device="cuda") % SPEC.vocab)[None]
    la = a(ids)
    assert a.lm_head.weight.dtype == torch.bfloat16 and torch.isfinite(la).all()
    assert torch.equal(la, b(ids))


@pytest.mark.cuda
def test_dummy_mxfp8_on_the_gpu_stays_8_bit(tmp_path):
    cfg = release_config(SPEC)
    cfg["quantization_config"] = {"quant_method": "mxfp8", "weight_block_size": [1, 32]}
    model, _ = m3lm.load(config_only(tmp_path / "q", cfg), device="cuda", load_format="dummy")
    assert any(p.dtype == torch.float8_e4m3fn for p in model.parameters())
    assert torch.isfinite(model((torch.arange(40, device="cuda") % SPEC.vocab)[None])).all()


def test_offline_llm_on_dummy_weights_takes_token_ids(tmp_path):
    from m3lm.llm import LLM

    llm = LLM(config_only(tmp_path / "m"), device="cpu", load_format="dummy", max_model_len=64)
    out = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]
