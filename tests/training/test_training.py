"""The story-model training code: text clean-up, the training forward against the inference forward,
and the whole pipeline (prepare -> train -> export -> m3lm.load -> generate -> evaluate) on a slice
of the corpus with a tiny config, on the CPU."""

import json

import pytest
import torch
from safetensors import safe_open

import m3lm
from m3lm.config import parse_config, release_config
from m3lm.models.minimax_m3 import MiniMaxM3
from tests.support.paths import REPO
from training import evaluate, prepare_data, train
from training.forward import training_forward
from training.text import Recaser, repair, split_stories

DATA = REPO.parent / "shared" / "data"
needs_data = pytest.mark.skipif(not (DATA / "tinystories-cased.txt").is_file(), reason=f"no corpus at {DATA}")


def test_repair_mojibake():
    broken = "â€œHi!â€ said Tomâ€™s mom â€” â€˜okâ€™â€¦ â€“ cafÃ© and muã±eca â«siâ»"
    assert repair(broken) == '"Hi!" said Tom\'s mom - \'ok\'... - café and muñeca "si"'


def test_split_stories():
    text = "One day.\n\nThen more. \n \nThe end.\nNext story\n starts here.\n\n\nLast."
    assert split_stories(text) == [
        "One day.\n\nThen more.\n\nThe end.",
        "Next story\n\nstarts here.\n\nLast.",
    ]


def test_recaser():
    cased = [
        'Lily saw Tom. "Hi, Tom!" said Lily. "I am here." They played.',
        "Tom and I ran. Lily ran too.",
    ] * 2
    recase = Recaser.learn(cased)
    assert recase('lily met a dog named rex. "hi, rex!" said lily. i ran. rex ran.') == (
        'Lily met a dog named Rex. "Hi, Rex!" said Lily. I ran. Rex ran.'
    )


def test_training_forward_matches_inference():
    """With MSA engaged (sequences past the dense window), the batched training forward computes the
    logits of the inference path; attending densely instead changes them."""
    config = release_config(vocab_size=97, **train.PRESETS["tiny"])
    model = MiniMaxM3(parse_config(config))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() > 1 else 0.1))
    model.eval()
    ids = torch.randint(0, 97, (2, 45), generator=gen)
    want = model(ids)
    got = training_forward(model, ids, sparse=True).logits
    assert (got - want).abs().max() < 1e-4 * want.abs().max()
    dense = training_forward(model, ids, sparse=False).logits
    assert (dense - want).abs().max() > 1e-2 * want.abs().max()


def test_the_training_losses_reach_every_weight_but_the_router_bias():
    """A model never prepared multiplies by its own parameters: the dense MLP's and the shared
    expert's gate and up learn too (a packed copy of them would take no gradient). The router
    bias moves by the load balance alone (`train.update_router_bias`)."""
    config = release_config(vocab_size=97, **train.PRESETS["tiny"])
    model = MiniMaxM3(parse_config(config)).train()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() > 1 else 0.1))
    ids = torch.randint(0, 97, (2, 46), generator=gen)
    out = training_forward(model, ids[:, :-1], ids[:, 1:], sparse=True)
    (out.lm_loss + out.indexer_kl + out.balance).backward()
    untouched = {n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()}
    assert untouched == {n for n, _ in model.named_parameters() if n.endswith("e_score_correction_bias")}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("story")
    meta = prepare_data.main(
        ["--data-dir", str(DATA), "--out", str(root / "data"), "--limit", "40", "--vocab-size", "512"]
    )
    log = train.main(
        ["--data", str(root / "data"), "--out", str(root / "run"), "--device", "cpu", "--preset", "tiny",
         "--seq-len", "48", "--batch-size", "6", "--max-steps", "30", "--warmup", "3", "--lr", "3e-3",
         "--dropout", "0", "--dense-warmup", "0", "--log-every", "5", "--eval-every", "1e9"]
    )  # fmt: skip
    return root, meta, log


@needs_data
def test_pipeline_trains(run):
    _, meta, log = run
    assert meta["vocab_size"] <= 512 and meta["bos_token_id"] != meta["eos_token_id"]
    first, last = log["history"][0], log["history"][-1]
    assert last["loss"] < first["loss"] - 0.5
    assert last["indexer_kl"] < 0.8 * first["indexer_kl"]
    assert log["steps"] == 30


@needs_data
def test_checkpoint_is_release_layout(run):
    root, meta, log = run
    ckpt = root / "run" / "model"
    config = json.loads((ckpt / "config.json").read_text())
    text = config["text_config"]
    assert config["model_type"] == "minimax_m3_vl" and text["hidden_act"] == "swigluoai"
    assert text["moe_layer_freq"] == [0, 1, 1] == text["sparse_attention_config"]["sparse_attention_freq"]
    generation = json.loads((ckpt / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (
        meta["bos_token_id"],
        meta["eos_token_id"],
    )
    with safe_open(ckpt / "model.safetensors", framework="pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
    assert all(k.startswith("language_model.") for k in dtypes)
    assert "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight" in dtypes
    assert not any(k.endswith(("experts.w1", "experts.w2", "experts.w3")) for k in dtypes)
    for k, dtype in dtypes.items():
        fp32 = k.endswith(("block_sparse_moe.gate.weight", "e_score_correction_bias"))
        assert dtype == ("F32" if fp32 else "BF16"), k

    model, tok = m3lm.load(ckpt, device="cpu", dtype=torch.float32)  # the strict loader
    assert sum(p.numel() for p in model.parameters()) == log["parameters"]
    logits = model(torch.tensor([[meta["bos_token_id"], 5, 6, 7]]))
    assert logits.shape == (1, 4, model.args.vocab_size) and torch.isfinite(logits).all()
    out = m3lm.generate(model, tok, "]~!b[Once upon a time", max_tokens=12, temperature=0.0)
    assert out.generation_tokens >= 1 and out.text
    again = m3lm.generate(model, tok, [meta["bos_token_id"]], max_tokens=12, temperature=0.0)
    assert again.token_ids and all(0 <= t < model.args.vocab_size for t in again.token_ids)


@needs_data
def test_evaluate_report(run):
    root, _, _ = run
    out = root / "eval.md"
    report = evaluate.main(
        [str(root / "run" / "model"), "--data", str(root / "data"), "--device", "cpu", "--seq-len", "32",
         "--windows", "3", "--samples", "1", "--max-tokens", "8", "--out", str(out)]
    )  # fmt: skip
    assert out.read_text() == report
    assert "| MSA (trained indexer) |" in report and "| dense (indexer bypassed) |" in report
    assert "| mean |" in report  # the attention-mass table has rows for the sparse layers


def test_the_drafters_unrolled_training_forward_is_the_drafting_forward():
    """Step j of training/eagle.py's unrolled forward at position s gives the logits drafting
    gives at its j-th chained step after taking in positions 0 .. s - j (the keys it sees, and
    the features it reads, are the same)."""
    from m3lm.models.eagle3 import Eagle3, EagleArgs, published_config
    from training.eagle import unrolled

    config = published_config(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=48, vocab_size=50, layer_ids=[0, 1, 2],
    )  # fmt: skip
    head = Eagle3(EagleArgs.from_dict(config, 2))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    head.bind(None)
    L = 12
    tokens = torch.randint(0, 50, (1, L), generator=g)
    feats = torch.randn(1, L, 96, generator=g)
    states = unrolled(head, feats, tokens, 3)
    with torch.no_grad():
        for j in range(3):
            s = 7
            t = s - j  # drafting took in 0 .. t with the target's features
            empty = torch.zeros(0, 2, 8)
            feat, normed, k, v = head.step(
                tokens[0, 1 : t + 2], head.features(feats[0, : t + 1]), torch.arange(t + 1), (empty, empty)
            )
            keys, values, feat = k, v, feat[-1:]
            for i in range(j):  # chained steps at t + 1 .. s, reading the true next tokens
                feat, normed, k, v = head.step(
                    tokens[0, t + 2 + i : t + 3 + i], feat, torch.tensor([t + 1 + i]), (keys, values)
                )
                keys, values = torch.cat([keys, k]), torch.cat([values, v])
            want = head.logits(normed[-1])
            got = head._head(states[j][0, s])
            assert torch.allclose(got, want, atol=1e-4), (j, (got - want).abs().max())
