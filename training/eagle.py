"""Train the story model's EAGLE-3 drafter on the CPU, then write it in the published format.

1. Collect once: the story model (`--target`, default m3lm.DEFAULT_MODEL) reads windows of
   training stories (each from a story's BOS, as generation starts); its residual stream
   entering the drafter's layers (`LAYERS`) and its top-`TOP` next-token log-probabilities at
   every position are kept.
2. Train the head with training-time test unrolling: step 0 reads the target's features at
   position s and the token at s + 1; step j reads the head's own output of step j - 1 at
   s - 1, as drafting does, and attends to step-0 keys up to s - j and to the keys of steps
   1..j on the diagonal (the keys a drafted position sees at inference). Every step learns the
   target's distribution of the token at s + 2 (soft cross-entropy on the kept top-`TOP`).
   Embedding and lm_head are the target's (frozen, not stored), so the head is small.
3. Write DIR/config.json and DIR/model.safetensors (bf16), loadable by
   `--speculative-config '{"method": "eagle3", "model": DIR}'`.

    PYTHONPATH=. python3 training/eagle.py --out m3lm/assets/story-eagle3 --minutes 12
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

import m3lm
from m3lm.layers.batch import ForwardBatch
from m3lm.models.eagle3 import Eagle3, EagleArgs, published_config, rope
from training.prepare_data import BOS, EOS, default_data_dir, load_stories

LAYERS = [2, 4, 6]  # the residual stream entering layers 2 and 4, and the last layer's output
TOP = 24  # target log-probabilities kept per position
SIZES = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}


def windows(target_dir: Path, data_dir: Path, length: int, count: int, val_every: int = 40) -> np.ndarray:
    """`count` windows [count, length] of training stories, each starting at a story's BOS."""
    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    stories, _ = load_stories(data_dir, cased_only=False, limit=None)
    stories = list(dict.fromkeys(stories))
    train = [s for i, s in enumerate(stories) if (i + 1) % val_every]  # prepare_data's split
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    stream = np.concatenate([np.array([bos, *e.ids, eos]) for e in tok.encode_batch(train)])
    starts = np.flatnonzero(stream[: len(stream) - length] == bos)
    pick = np.random.default_rng(0).choice(starts, size=min(count, len(starts)), replace=False)
    return np.stack([stream[s : s + length] for s in pick])


@torch.inference_mode()
def collect(model, ids: np.ndarray, batch: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's captured states [N, L, 3C] (bf16) and top-TOP log-probs and ids [N, L, TOP]."""
    feats, top_lp, top_ids = [], [], []
    for i in range(0, len(ids), batch):
        x = torch.tensor(ids[i : i + batch], dtype=torch.long)
        b, t = x.shape
        fb = ForwardBatch.full(b, t)
        fb.capture = dict.fromkeys(LAYERS)
        logits = model.forward_batch(x.flatten(), fb).view(b, t, -1)
        feats.append(torch.cat([fb.capture[j] for j in LAYERS], -1).view(b, t, -1).bfloat16())
        lp, top = torch.log_softmax(logits, -1).topk(TOP, -1)
        top_lp.append(lp.half())
        top_ids.append(top.short())
    return torch.cat(feats), torch.cat(top_lp), torch.cat(top_ids)


def unrolled(head: Eagle3, feats: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Training-time test: the head's final-normed states [B, L-1, C] of each unrolled step
    (position s reads the token at s + 1; positions are 0 .. L-2), before the lm_head."""
    layer, a = head.midlayer, head.args
    at = layer.self_attn
    B, L1 = tokens.shape[0], tokens.shape[1] - 1
    pos = torch.arange(L1)
    e = layer.input_layernorm(head._embed(tokens[:, 1:]))  # [B, L-1, C]
    feat = head.features(feats[:, :L1].float())
    keys, values, outs = [], [], []
    rep, scale = at.h // at.k, at.d**-0.5
    causal = pos[None, :] <= pos[:, None]  # [L-1, L-1]
    for j in range(steps):
        if j:  # the previous step's output at s - 1 (position 0 has none: it reads zeros)
            feat = torch.cat([torch.zeros_like(feat[:, :1]), feat[:, :-1]], 1)
        h = layer.hidden_norm(feat)
        residual = h if a.norm_before_residual else feat
        x = torch.cat([e, h], -1)
        q = rope(at.q_proj(x).view(B * L1, at.h, at.d), pos.repeat(B), at.theta).view(B, L1, at.h, at.d)
        k = rope(at.k_proj(x).view(B * L1, at.k, at.d), pos.repeat(B), at.theta).view(B, L1, at.k, at.d)
        v = at.v_proj(x).view(B, L1, at.k, at.d)
        keys.append(k.repeat_interleave(rep, 2))
        values.append(v.repeat_interleave(rep, 2))
        # step-0 keys up to s - j, then the keys of steps 1..j at s - j + i (the diagonals)
        s0 = torch.einsum("bshd,buhd->bhsu", q, keys[0]) * scale
        s0 = s0.masked_fill(~(pos[None, :] <= pos[:, None] - j) if j else ~causal, float("-inf"))
        diag = []
        for i in range(1, j + 1):
            shift = j - i
            ki = torch.cat([torch.zeros_like(keys[i][:, :shift]), keys[i][:, : L1 - shift]], 1)
            d = (q * ki).sum(-1).transpose(1, 2) * scale  # [B, H, L-1]
            diag.append(d.masked_fill((pos < shift)[None, None], float("-inf")))
        scores = torch.cat([s0, *(d[..., None] for d in diag)], -1)
        p = torch.nan_to_num(scores.softmax(-1))
        o = torch.einsum("bhsu,buhd->bshd", p[..., :L1], values[0])
        for i in range(1, j + 1):
            shift = j - i
            vi = torch.cat([torch.zeros_like(values[i][:, :shift]), values[i][:, : L1 - shift]], 1)
            o = o + p[..., L1 + i - 1].transpose(1, 2)[..., None] * vi
        h = at.o_proj(o.reshape(B, L1, -1)) + residual
        h = layer.mlp(layer.post_attention_layernorm(h)) + h
        normed = head.norm(h)
        outs.append(normed)
        feat = normed if a.norm_output else h
    return outs


def soft_ce(logits: torch.Tensor, top_lp: torch.Tensor, top_ids: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the head's logits [..., V] against the target's top-TOP distribution."""
    target = torch.softmax(top_lp.float(), -1)  # renormalised over the kept ids
    lp = torch.log_softmax(logits.float(), -1).gather(-1, top_ids.long())
    return -(target * lp).sum(-1).mean()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", type=Path, default=m3lm.DEFAULT_MODEL)
    p.add_argument("--data-dir", type=Path, default=default_data_dir())
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--windows", type=int, default=1200)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--minutes", type=float, default=12.0, help="training time, collection not included")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--loss-positions", type=int, default=96, help="positions per window the loss reads")
    p.add_argument("--cache", type=Path, default=None, help="keep the collected target states here")
    p.add_argument("--steps", type=int, default=3, help="unrolled drafting steps")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--intermediate-size", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--init", type=Path, default=None, help="start from this drafter's weights")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    start = time.perf_counter()
    model, _ = m3lm.load(a.target, device="cpu", dtype=torch.float32)
    for prm in model.parameters():
        prm.requires_grad_(False)
    if a.cache is not None and a.cache.is_file():
        ids, feats, top_lp, top_ids = torch.load(a.cache)
        ids = ids.numpy()
    else:
        ids = windows(a.target, a.data_dir, a.length, a.windows)
        feats, top_lp, top_ids = collect(model, ids)
        if a.cache is not None:
            torch.save((torch.from_numpy(ids), feats, top_lp, top_ids), a.cache)
    collected = time.perf_counter() - start
    print(f"collected {ids.size:,} positions in {collected:.0f} s", flush=True)

    config = published_config(
        **SIZES,
        intermediate_size=a.intermediate_size,
        vocab_size=model.args.vocab_size,
        layer_ids=LAYERS,
    )
    config["max_position_embeddings"] = model.args.max_position_embeddings
    config["torch_dtype"] = "bfloat16"
    args = EagleArgs.from_dict(config, model.args.num_hidden_layers)
    head = Eagle3(args, torch.float32, own_embed=False, own_head=False)
    with torch.no_grad():
        for name, prm in head.named_parameters():
            if name.endswith("norm.weight"):
                prm.fill_(1.0)
            else:
                prm.normal_(0.0, 0.02)
    if a.init is not None:
        from safetensors.torch import load_file

        state = {k: v.float() for k, v in load_file(a.init / "model.safetensors").items()}
        missing, unexpected = head.load_state_dict(state, strict=False)
        if unexpected or set(missing) - {"d2t"}:
            raise SystemExit(
                f"{a.init}: not this drafter's weights (missing {missing}, unexpected {unexpected})"
            )
    head.bind(model)
    trainable = [prm for prm in head.parameters() if prm.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=a.lr, weight_decay=0.01, betas=(0.9, 0.95))
    tokens = torch.tensor(ids, dtype=torch.long)
    n, budget = len(tokens), a.minutes * 60
    log, step, t0 = [], 0, time.perf_counter()
    weights = [0.8**j for j in range(a.steps)]
    while (elapsed := time.perf_counter() - t0) < budget:
        lr = a.lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * elapsed / budget)))
        for g in opt.param_groups:
            g["lr"] = lr
        b = torch.randint(0, n, (a.batch_size,))
        states = unrolled(head, feats[b], tokens[b], a.steps)
        # a step's state at position s predicts the token at s + 2 (the target's row s + 1); the
        # lm_head (most of the cost) runs at a random subset of positions
        at = torch.randperm(a.length - 2)[: a.loss_positions]
        outs = [head._head(s[:, at]) for s in states]
        losses = [soft_ce(o, top_lp[b][:, at + 1], top_ids[b][:, at + 1]) for o in outs]
        loss = sum(w * x for w, x in zip(weights, losses, strict=True)) / sum(weights)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        if step % 25 == 0:
            with torch.no_grad():
                agree = [
                    (o.argmax(-1) == top_ids[b][:, at + 1, 0].long()).float().mean().item() for o in outs
                ]
            row = {
                "step": step,
                "s": round(elapsed, 1),
                "loss": [round(x.item(), 4) for x in losses],
                "top1": agree,
            }
            log.append(row)
            print(json.dumps(row), flush=True)
        step += 1
    export(head, config, a.out)
    result = {
        "command": "python3 training/eagle.py "
        + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
        "positions": int(ids.size),
        "collect_s": round(collected, 1),
        "train_s": round(time.perf_counter() - t0, 1),
        "steps": step,
        "log": log,
    }
    (a.out / "train_log.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def export(head: Eagle3, config: dict, out: Path) -> None:
    """The head's own tensors in the published layout, bf16, with its config.json."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: prm.detach().to(torch.bfloat16).contiguous()
        for name, prm in head.named_parameters()
        if not name.startswith(("embed_tokens", "lm_head"))
    }
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    main()
