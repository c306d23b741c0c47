"""`MiniMaxM3.prepare_`: what the forward derives from the weights (packed projections, the CPU's
stacked head norms, the GPU's router slices), made once after the weights' last change. A
prepared model computes what the plain path of a model never prepared computes (the reference),
up to the rounding of the CPU's one-pass heads; preparing again after a change to the weights
gives, bit for bit, what a model built with the changed weights and prepared once gives."""

import copy

import pytest
import torch

from m3lm.cache.kv_cache import KVCache
from m3lm.config import ModelArgs
from m3lm.distributed.steps import Step
from m3lm.engine.runner import forward_step
from m3lm.layers.quantized import quantize_q4_
from m3lm.models.minimax_m3 import MiniMaxM3, keep_mxfp8_, random_init_
from tests.support.checkpoints import Spec, release_config

SPEC = Spec(block=4, topk_blocks=2)  # 13 positions and more select blocks


def build(quant: str = "fp32", seed: int = 7, spec: Spec = SPEC) -> MiniMaxM3:
    """A random tiny model (dense + full attention, then MoE + MSA), unprepared; its decoder
    layers in MXFP8 or in a 4-bit export's layout where `quant` says."""
    model = random_init_(MiniMaxM3(ModelArgs.from_dict(release_config(spec))), std=0.1, seed=seed)
    if quant == "mxfp8":
        keep_mxfp8_(model, quantize=True)
    elif quant != "fp32":
        quantize_q4_(model, quant, group=32)
    return model.eval().requires_grad_(False)


def run(model: MiniMaxM3) -> torch.Tensor:
    """Full forwards of two sequences, then over a paged cache a prefill of two prompts and two
    steps of their decodes batched: every logit, in one tensor."""
    gen = torch.Generator().manual_seed(3)
    v = model.args.vocab_size
    ids = torch.randint(0, v, (2, 17), generator=gen)
    prompts = [torch.randint(0, v, (n,), generator=gen).tolist() for n in (14, 5)]
    cache = KVCache(model.args, 16, "cpu", torch.float32)
    tables, lens = [[0, 1, 2, 3, 4], [5, 6]], [14, 5]
    with torch.inference_mode():
        out = [model(ids).flatten(0, 1)]
        prefill = Step(prompts[0] + prompts[1], lens, [0, 0], [13, 18], tables)
        out.append(forward_step(model, cache, prefill, None))
        for i in range(2):
            out.append(forward_step(model, cache, Step([7 + i, 11 + i], [1, 1], lens, [0, 1], tables), None))
            lens = [n + 1 for n in lens]
    return torch.cat(out)


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    err = float((got - want).abs().max() / want.abs().max())
    assert err < 1e-5, err


@pytest.mark.parametrize("quant", ["fp32", "mxfp8", "mxfp4", "affine4"])
def test_a_prepared_model_computes_the_plain_path(quant):
    """The same logits, within the one-pass heads' rounding, packed into one product per kind of
    layer (float, MXFP8 or 4-bit) whose parameters become views of the packed weight."""
    model = build(quant)
    want = run(model)  # never prepared: every product and head on its own
    model.prepare_()
    for layer in model.model.layers:
        attn, ffn = layer.self_attn, layer.ffn
        assert attn.packed is not None and attn.stacked_norms is not None
        storage = attn.q_proj.weight.untyped_storage().data_ptr()
        assert attn.v_proj.weight.untyped_storage().data_ptr() == storage  # views of the packed weight
        assert (ffn.shared_experts if hasattr(ffn, "shared_experts") else ffn).gate_up is not None
        if hasattr(ffn, "shared_experts"):  # joins 8-bit routed experts of its shape, on the GPU
            assert (ffn.shared_fp8 is not None) == (quant == "mxfp8") and ffn.router_split is None
    assert_close(run(model), want)


def test_preparing_again_copies_nothing_and_changes_no_bit():
    model = build().prepare_()
    first = run(model)
    ptrs = [layer.self_attn.packed[0].data_ptr() for layer in model.model.layers]
    model.prepare_()
    assert [layer.self_attn.packed[0].data_ptr() for layer in model.model.layers] == ptrs
    assert torch.equal(run(model), first)


def test_weights_loaded_into_a_prepared_model_then_prepared_again():
    """In place (as a state dict loads), then `prepare_`: bit for bit the model built with those
    weights; a packed weight sees the copy at once, a stacked norm once prepared again."""
    model, other = build(seed=7).prepare_(), build(seed=8).prepare_()
    model.load_state_dict(other.state_dict())
    model.prepare_()
    assert torch.equal(run(model), run(other))


def test_parameters_replaced_after_prepare_then_prepared_again():
    """Every parameter a new tensor (a state dict loaded with assign=True, as a move to another
    device makes too), then `prepare_`: packed anew, bit for bit the model built with them."""
    model, other = build(seed=7).prepare_(), build(seed=8).prepare_()
    model.load_state_dict({k: v.clone() for k, v in other.state_dict().items()}, assign=True)
    model.prepare_()
    attn = model.model.layers[1].self_attn
    assert attn.packed[0].data_ptr() == attn.q_proj.weight.data_ptr()
    assert attn.k_proj.weight.untyped_storage().data_ptr() == attn.q_proj.weight.untyped_storage().data_ptr()
    assert torch.equal(run(model), run(other))


def test_index_heads_narrower_than_the_heads_keep_the_plain_heads():
    """The one-pass heads need every head as wide as the attention heads: a sparse layer whose
    index heads are not keeps the per-kind norms (the full-attention layer stacks its own)."""
    model = build(spec=Spec(block=4, topk_blocks=2, index_dim=8))
    want = run(model)
    model.prepare_()
    assert [layer.self_attn.stacked_norms is not None for layer in model.model.layers] == [True, False, False]
    assert_close(run(model), want)


def test_a_loaded_model_is_prepared(tiny):
    """`m3lm.load` prepares the model as its last step; preparing a copy again changes no bit."""
    assert all(layer.self_attn.packed is not None for layer in tiny.model.layers)
    again = copy.deepcopy(tiny).prepare_()
    ids = torch.arange(20)[None] % tiny.args.vocab_size
    with torch.inference_mode():
        assert torch.equal(again(ids), tiny(ids))
