"""The engine on the GPU (CUDA graphs, mixed steps, the prefix cache, MXFP8 weights) gives the
CPU's tokens; GPU only, with CPU twins in test_decode_batches and the engine tests."""

import pytest
import torch

import m3lm
from m3lm.config import EngineConfig
from m3lm.engine.engine import LLMEngine

pytestmark = pytest.mark.cuda
DEV = "cuda"
# Engines here take a small pool, not the GPU's memory, so that xdist workers can share the GPU.
POOL = 16384


def test_engine_graph_batches_match_cpu(tiny_path):
    cpu, _ = m3lm.load(tiny_path, device="cpu", dtype="float32")
    gpu, _ = m3lm.load(tiny_path, device=DEV, dtype="float32")
    prompts = [
        torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in (3, 17, 40, 9, 25)
    ]
    params = m3lm.SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)

    def run(model):
        engine = LLMEngine(model, None, EngineConfig(max_num_seqs=8, max_model_len=128, kv_cache_tokens=POOL))
        seqs = [engine.add_request(p, params) for p in prompts]
        while engine.has_unfinished():
            engine.step()
        return [s.output_ids for s in seqs], engine

    want, _ = run(cpu)
    got, engine = run(gpu)
    assert got == want
    assert (
        engine.runner.graphs is not None and engine.runner.graphs._graphs
    )  # decode steps went through graphs


def test_engine_mixed_steps_match_cpu(tiny_path, monkeypatch):
    """Prompts arriving while others decode: the decodes of those mixed steps attend as one batch
    (`decode_rows`), and every request gets the CPU's tokens."""
    from m3lm.engine import runner

    cpu, _ = m3lm.load(tiny_path, device="cpu", dtype="float32")
    gpu, _ = m3lm.load(tiny_path, device=DEV, dtype="float32")
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (21, 5, 33, 1, 14, 40)]
    params = m3lm.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    batched = []
    real = runner.decode_rows

    def spy(step, *args):
        dec = real(step, *args)
        batched.append((0 if dec is None else dec.positions.shape[0], len(step.q_lens)))
        return dec

    monkeypatch.setattr(runner, "decode_rows", spy)

    def run(model):
        engine = LLMEngine(model, None, EngineConfig(max_num_seqs=8, max_model_len=128, kv_cache_tokens=POOL))
        seqs = []
        for p in prompts:  # a new prompt every other step
            seqs.append(engine.add_request(p, params))
            engine.step()
            engine.step()
        while engine.has_unfinished():
            engine.step()
        return [s.output_ids for s in seqs]

    assert run(gpu) == run(cpu)
    assert sum(0 < b < n for b, n in batched) >= 4  # decodes batched beside a prefill


def test_engine_prefix_cache_on_gpu_matches_cpu(tiny_path):
    """Prompts that start on cached pages (shared, not consecutive) give the CPU's tokens."""
    cpu, _ = m3lm.load(tiny_path, device="cpu", dtype="float32")
    gpu, _ = m3lm.load(tiny_path, device=DEV, dtype="float32")
    gen = torch.Generator().manual_seed(11)
    shared = torch.randint(0, 96, (45,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, 96, (n,), generator=gen).tolist() for n in (6, 2, 20)] + [
        shared[:30]
    ]
    params = m3lm.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ref = LLMEngine(
        cpu, None, EngineConfig(max_num_seqs=8, max_model_len=128, kv_cache_tokens=POOL, prefix_caching=False)
    )
    want = [ref.add_request(p, params).output_ids for p in prompts]
    while ref.has_unfinished():
        ref.step()
    engine = LLMEngine(gpu, None, EngineConfig(max_num_seqs=8, max_model_len=128, kv_cache_tokens=POOL))
    got, cached = [], []
    for p in prompts:  # one after another: each starts on the pages the earlier ones left
        seq = engine.add_request(p, params)
        while engine.has_unfinished():
            engine.step()
        got.append(seq.output_ids)
        cached.append(seq.num_prefix_cached)
    assert got == want
    assert cached[0] == 0 and min(cached[1:]) > 0
    engine.blocks.check()


@pytest.mark.parametrize("index_fp8", [False, True])
def test_engine_graphs_with_mxfp8_weights_match_cpu(tiny_path, index_fp8):
    """Weights quantised at load (same bits on both devices), decode through CUDA graphs."""
    cpu, _ = m3lm.load(tiny_path, device="cpu", dtype="float32", quant="mxfp8")
    gpu, _ = m3lm.load(tiny_path, device=DEV, dtype="float32", quant="mxfp8")
    assert gpu.model.layers[1].self_attn.index_q_proj.weight.dtype == torch.float8_e4m3fn
    prompts = [
        torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 40, 25)
    ]
    params = m3lm.SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)

    def run(model):
        config = EngineConfig(
            max_num_seqs=4, max_model_len=128, kv_cache_tokens=POOL, index_cache_fp8=index_fp8
        )
        engine = LLMEngine(model, None, config)
        seqs = [engine.add_request(p, params) for p in prompts]
        while engine.has_unfinished():
            engine.step()
        return [s.output_ids for s in seqs], engine

    want, _ = run(cpu)
    got, engine = run(gpu)
    assert got == want
    assert engine.runner.graphs is not None and engine.runner.graphs._graphs


@pytest.mark.parametrize("method", ["eagle3", "ngram"])
def test_speculation_under_graphs_gives_the_cpus_tokens(tiny_path, tmp_path, method):
    """Verification steps replay the decode graphs (a row a verified position) and an EAGLE-3
    drafter's drafting its own graphs; greedy tokens are plain decoding's on the CPU."""
    from m3lm.models.eagle3 import random_drafter
    from tests.speculative.test_speculative import drafter_config, repetitive

    cpu, _ = m3lm.load(tiny_path, device="cpu", dtype="float32")
    gpu, _ = m3lm.load(tiny_path, device=DEV, dtype="float32")
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "eagle3":
        spec["model"] = str(random_drafter(tmp_path / "d", drafter_config(cpu), seed=1))
    else:
        spec |= {"prompt_lookup_min": 1, "prompt_lookup_max": 3}
    prompts = [repetitive(i) for i in range(3)] + [torch.randint(0, 96, (30,)).tolist()]
    params = m3lm.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def run(model, **config):
        engine = LLMEngine(
            model, None, EngineConfig(max_num_seqs=8, max_model_len=128, kv_cache_tokens=POOL, **config)
        )
        seqs = [engine.add_request(p, params) for p in prompts]
        while engine.has_unfinished():
            engine.step()
        return [s.output_ids for s in seqs], engine

    want, _ = run(cpu)
    got, engine = run(gpu, speculative_config=spec)
    assert got == want
    assert engine.speculator.stats.num_drafts > 0
    assert max(engine.runner.graphs._graphs) > len(prompts)  # steps of more rows than sequences
    if method == "eagle3":
        assert engine.speculator.drafter.graphs._graphs
