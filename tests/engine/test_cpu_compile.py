"""The CPU's compiled decode step (`EngineConfig.cpu_compile`): the tokens and log-probabilities
of the eager reference, two graphs for every batch and width, no compiling after the warm-up, and
eager decoding where compiling fails."""

import logging

import pytest
import torch
from torch._dynamo.utils import counters

from m3lm.config import EngineConfig
from m3lm.core import SamplingParams
from m3lm.engine.cpu_compile import CompiledDecode
from m3lm.engine.engine import LLMEngine
from m3lm.engine.warmup import warm_up
from tests.support.checkpoints import Spec, hf_model, release_config, to_release, write_checkpoint

# Mixed lengths: with blocks of 4 and top-3 the tiny model's selection engages past 12 tokens, and
# the tables grow from 1 page to 13 while these decode.
PROMPTS = [[5, 9, 2], [7] * 9, list(range(1, 15)), list(range(30, 1, -1))]
NEW = 20


def engine_for(model, compiled: bool) -> LLMEngine:
    cfg = EngineConfig(max_num_seqs=4, max_model_len=64, kv_cache_tokens=4 * 64, cpu_compile=compiled)
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


@pytest.fixture(scope="module")
def eager(tiny):
    engine = engine_for(tiny, compiled=False)
    assert engine.runner.graphs is None
    return generate(engine, PROMPTS) + generate(engine, PROMPTS, together=False)


@pytest.fixture(scope="module")
def compiled(tiny):
    """A compiled engine after its warm-up, and how many graphs were made in all."""
    engine = engine_for(tiny, compiled=True)
    assert isinstance(engine.runner.graphs, CompiledDecode)
    report = warm_up(engine, progress=False)
    return engine, report, counters["stats"]["unique_graphs"]


def test_compiled_steps_give_the_eager_tokens_and_logprobs(eager, compiled):
    engine, report, _ = compiled
    assert report.graphs == 2  # a batch of one, and every larger batch
    got = generate(engine, PROMPTS) + generate(engine, PROMPTS, together=False)
    assert engine.runner.graphs.failed is None
    assert [ids for ids, _ in got] == [ids for ids, _ in eager]
    for (_, lp), (_, want) in zip(got, eager, strict=True):
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(want), atol=1e-4, rtol=0)


def test_no_graph_is_made_after_the_warm_up(compiled, monkeypatch):
    engine, _, graphs_after_warm_up = compiled
    stance = torch.compiler.set_stance

    def failing(name, **kw):  # a step that would need a new graph raises instead of running eagerly
        return stance("fail_on_recompile" if name == "eager_on_recompile" else name, **kw)

    monkeypatch.setattr(torch.compiler, "set_stance", failing)
    generate(engine, PROMPTS[:3])  # batches of 3, 2 and 1 as sequences finish; widths 1 to 9 pages
    generate(engine, [list(range(2, 40))], together=False)
    assert engine.runner.graphs.failed is None  # (a raise would have left eager decoding)
    assert counters["stats"]["unique_graphs"] == graphs_after_warm_up


def test_a_compile_that_fails_leaves_eager_decoding(tiny, eager, caplog, monkeypatch):
    engine = engine_for(tiny, compiled=True)
    graphs = engine.runner.graphs

    def no_compiler(*args):
        raise RuntimeError("no C++ compiler found\nmore detail")

    monkeypatch.setattr(graphs, "_compiled", no_compiler)
    with caplog.at_level(logging.WARNING, logger="m3lm.engine"):
        got = generate(engine, PROMPTS)
    assert graphs.failed == "RuntimeError: no C++ compiler found"
    assert "decoding eagerly (RuntimeError: no C++ compiler found)" in caplog.text
    assert got == eager[: len(PROMPTS)]


def test_engines_of_two_models_of_one_shape_each_decode_their_own(tiny, eager, tmp_path):
    # The graphs hold frozen weights and share torch's cache of compiled code: an engine on
    # another model of the same shapes must not run the first one's graphs.
    import m3lm

    s = Spec()
    path = write_checkpoint(tmp_path, to_release(hf_model(s, seed=22).state_dict(), s), release_config(s))
    other, _ = m3lm.load(path, device="cpu", dtype=torch.float32)
    other_eager = generate(engine_for(other, compiled=False), PROMPTS[:2])
    assert [ids for ids, _ in other_eager] != [ids for ids, _ in eager[:2]]  # the models differ
    engines = [engine_for(tiny, compiled=True), engine_for(other, compiled=True)]
    for engine in engines:
        warm_up(engine, progress=False)
    for engine, want in [(engines[1], other_eager), (engines[0], eager[:2])] * 2:
        assert [ids for ids, _ in generate(engine, PROMPTS[:2])] == [ids for ids, _ in want]
