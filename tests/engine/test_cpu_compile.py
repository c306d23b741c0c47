"""The CPU's compiled decode steps (`EngineConfig.cpu_compile`, programs kept on disk): the tokens
and log-probabilities of the eager reference before and after the programs land, programs that a
later engine loads without building, one program for every model of a shape, and eager decoding
where a program cannot be had."""

import json
import logging

import pytest
import torch

from m3lm.config import EngineConfig
from m3lm.core import SamplingParams
from m3lm.engine import cpu_compile, cpu_program
from m3lm.engine.cpu_compile import CompiledDecode
from m3lm.engine.engine import LLMEngine
from m3lm.engine.warmup import warm_up
from tests.support.checkpoints import Spec, hf_model, release_config, to_release, write_checkpoint

# Mixed lengths: with blocks of 4 and top-3 the tiny model's selection engages past 12 tokens, and
# the tables grow from 1 page to 13 while these decode.
PROMPTS = [[5, 9, 2], [7] * 9, list(range(1, 15)), list(range(30, 1, -1))]
NEW = 20


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A programs folder of this module's own (the builds are part of what it tests)."""
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("programs")
        mp.setenv("M3LM_CACHE_DIR", str(path))
        yield path / "cpu-steps"


def engine_for(model, mode: str, seqs: int = 4) -> LLMEngine:
    cfg = EngineConfig(max_num_seqs=seqs, max_model_len=64, kv_cache_tokens=4 * 64, cpu_compile=mode)
    return LLMEngine(model, None, cfg, {})


def generate(engine: LLMEngine, prompts, together: bool = True) -> list[tuple[list[int], list[float]]]:
    """Greedy ids and their log-probabilities: all prompts at once, or one after another."""
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=0)
    groups = [prompts] if together else [[p] for p in prompts]
    out = []
    for group in groups:
        seqs = [engine.add_request(p, params) for p in group]
        lps = {s.request_id: [] for s in seqs}
        while engine.has_unfinished():
            for o in engine.step():
                lps[o.request_id] += [lp.logprob for lp in o.new_logprobs]
        out += [(s.output_ids, lps[s.request_id]) for s in seqs]
    return out


def assert_same(got, want):
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    for (_, lp), (_, ref) in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(ref), atol=1e-4, rtol=0)


def wait_for_build(graphs: CompiledDecode) -> None:
    """Until the engine's background build has landed or stopped (no time limit: a slow machine
    makes this slow, never red)."""
    while graphs.pending:
        graphs.poll()
        if graphs.pending:
            cpu_compile.time.sleep(cpu_compile.POLL_S)


@pytest.fixture(scope="module")
def eager(tiny):
    engine = engine_for(tiny, "off")
    assert engine.runner.graphs is None
    return generate(engine, PROMPTS) + generate(engine, PROMPTS, together=False)


@pytest.fixture(scope="module")
def built(tiny, eager, cache_dir):
    """An engine on an empty programs folder ("auto"): what it decoded while its programs were
    building, and the engine once they landed."""
    engine = engine_for(tiny, "auto")
    graphs = engine.runner.graphs
    assert isinstance(graphs, CompiledDecode) and not graphs.programs
    while_building = generate(engine, PROMPTS[:2])
    wait_for_build(graphs)
    return engine, while_building


def test_an_engine_decodes_op_by_op_while_its_programs_build(built, eager):
    engine, while_building = built
    assert engine.runner.graphs.builder is not None  # it started the build
    assert_same(while_building, eager[:2])


def test_compiled_programs_give_the_eager_tokens_and_logprobs(built, eager):
    engine, _ = built
    graphs = engine.runner.graphs
    assert graphs.failed is None and sorted(graphs.programs) == [1, 2]  # a batch of one, and larger
    assert_same(generate(engine, PROMPTS) + generate(engine, PROMPTS, together=False), eager)


def test_a_later_engine_loads_the_programs_without_building(built, tiny, eager, monkeypatch):
    monkeypatch.setattr(CompiledDecode, "_build", lambda self, buckets: pytest.fail("built again"))
    engine = engine_for(tiny, "auto")
    report = warm_up(engine, progress=False)
    assert report.graphs == 2 and sorted(engine.runner.graphs.programs) == [1, 2]
    assert_same(generate(engine, PROMPTS), eager[: len(PROMPTS)])


def test_models_of_one_shape_share_the_programs_and_each_decodes_its_own(built, tiny, eager, tmp_path):
    # The programs hold no weights: each engine hands them its model's own.
    import m3lm

    s = Spec()
    path = write_checkpoint(tmp_path, to_release(hf_model(s, seed=22).state_dict(), s), release_config(s))
    other, _ = m3lm.load(path, device="cpu", dtype=torch.float32)
    other_eager = generate(engine_for(other, "off"), PROMPTS[:2])
    assert [ids for ids, _ in other_eager] != [ids for ids, _ in eager[:2]]  # the models differ
    engines = [engine_for(tiny, "auto"), engine_for(other, "auto")]
    for engine in engines:
        assert engine.runner.graphs.start() == [1, 2]
    for engine, want in [(engines[1], other_eager), (engines[0], eager[:2])] * 2:
        assert_same(generate(engine, PROMPTS[:2]), want)


def test_a_damaged_program_is_removed_and_built_again(built, tiny, eager, monkeypatch, caplog):
    graphs = engine_for(tiny, "auto", seqs=1).runner.graphs  # the batch of one's program only
    path = graphs.path(1)
    kept = path.read_bytes()
    builds = []
    monkeypatch.setattr(CompiledDecode, "_build", lambda self, buckets: builds.append(buckets))
    try:
        path.write_bytes(kept[: len(kept) // 2])  # cut short
        engine = engine_for(tiny, "auto", seqs=1)
        with caplog.at_level(logging.WARNING, logger="m3lm.engine"):
            got = generate(engine, PROMPTS[:1])
        assert "unusable" in caplog.text and not path.exists()
        assert builds == [[1]] and not engine.runner.graphs.programs
        assert_same(got, eager[:1])
    finally:
        path.write_bytes(kept)


def test_a_failed_build_leaves_a_note_and_eager_decoding(tiny, eager, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("M3LM_CACHE_DIR", str(tmp_path))

    def no_compiler(spec, path):
        raise RuntimeError("no C++ compiler found\nmore detail")

    monkeypatch.setattr(cpu_program, "build", no_compiler)
    monkeypatch.setattr(cpu_program.os, "nice", lambda n: 0)  # not this process's priority
    engine = engine_for(tiny, "auto", seqs=1)
    spec = engine.runner.graphs.specs[1]
    spec_file = spec.path().with_suffix(".json")  # where the engine leaves it for the build
    spec_file.parent.mkdir(parents=True)
    spec_file.write_text(json.dumps(spec.__dict__))
    assert cpu_program.main([str(spec_file)]) == 1
    assert spec.path().with_suffix(".failed").read_text() == "RuntimeError: no C++ compiler found\n"
    # The engine finds the note: no build, every step op by op, one warning.
    monkeypatch.setattr(CompiledDecode, "_build", lambda self, buckets: pytest.fail("built again"))
    with caplog.at_level(logging.WARNING, logger="m3lm.engine"):
        got = generate(engine, PROMPTS)
    assert engine.runner.graphs.failed == "RuntimeError: no C++ compiler found"
    assert caplog.text.count("decoding eagerly (RuntimeError: no C++ compiler found)") == 1
    assert_same(got, eager[: len(PROMPTS)])


def test_the_mode_is_checked_and_read_from_the_environment(monkeypatch):
    from m3lm.errors import ConfigError

    monkeypatch.setenv("M3LM_CPU_COMPILE", "wait")
    assert EngineConfig().cpu_compile == "wait"
    monkeypatch.delenv("M3LM_CPU_COMPILE")
    assert EngineConfig().cpu_compile == "auto"
    assert EngineConfig(cpu_compile=True).cpu_compile == "wait"
    assert EngineConfig(cpu_compile=False).cpu_compile == "off"
    with pytest.raises(ConfigError, match="cpu_compile = 'fast' must be one of auto, wait, off"):
        EngineConfig(cpu_compile="fast")
