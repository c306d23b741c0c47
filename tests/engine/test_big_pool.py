"""A KV pool past 2^31 elements per layer: page x page-stride offsets must not wrap (GPU only).

The decode graphs' padding rows write to the spare page, the pool's last, so a wrapped offset
would write into another sequence's page or outside the pool. The CPU twin of the arithmetic is
the engine's own generation tests; here the same greedy tokens must come from a small pool and
from one whose last pages sit past 2^31 elements.
"""

import pytest
import torch

import m3lm
from m3lm.config import EngineConfig
from m3lm.core import SamplingParams
from m3lm.engine.engine import LLMEngine

pytestmark = [pytest.mark.cuda, pytest.mark.whole_gpu]


def greedy(model, config: EngineConfig, prompts) -> tuple[list[list[int]], int]:
    """Greedy tokens of each prompt, and the elements of one layer's key pool."""
    engine = LLMEngine(model, None, config)
    per_layer = engine.cache.k[0].numel()
    seqs = [
        engine.add_request(p, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)) for p in prompts
    ]
    while engine.has_unfinished():
        engine.step()
    out = [list(s.output_ids) for s in seqs]
    del engine
    torch.cuda.empty_cache()
    return out, per_layer


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pool_past_int32_offsets_generates_the_same_tokens():
    import argparse

    from m3lm.cli import _default_model

    ns = argparse.Namespace(model=None)
    _default_model(ns)
    model, _ = m3lm.load(ns.model, device="cuda", dtype="bfloat16", skip_tokenizer_init=True)
    prompts = [[5 + i, 17, 23 + 2 * i, 9] for i in range(5)]  # 5 rows: the graph of 8 pads 3
    small, _ = greedy(model, EngineConfig(max_model_len=512, kv_cache_tokens=8192), prompts)
    big_tokens = (2**31 // (model.args.num_key_value_heads * model.args.head_dim)) + (1 << 20)
    big, per_layer = greedy(model, EngineConfig(max_model_len=512, kv_cache_tokens=big_tokens), prompts)
    assert per_layer > 2**31
    assert big == small
