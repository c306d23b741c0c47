"""Train the small MiniMax-M3 story model on the prepared corpus, then export it in the release layout.

The model is m3lm's own `MiniMaxM3`, built from the release-style config this script writes, and
trained through `training/forward.py`, which runs the same modules and layer functions as the
inference path with MSA engaged (after a short dense warm-up, as DeepSeek-V3.2 warms up its
indexer). Losses: next-token cross-entropy; the indexer's KL to the main attention's block mass
(it trains only the indexer, whose input is detached, so its weight only needs to keep it in
range); a small MoE balance term, plus DeepSeek-V3's bias update, which nudges each expert's
`e_score_correction_bias` toward equal load (the bias only picks experts, so it needs no gradient).

The corpus is about a million tokens and an H200 goes through it in seconds, so the run is many
epochs: dropout and weight decay regularise, the validation loss is measured every
`--eval-every` seconds, and the weights with the best one are exported. Each batch row starts at
a story's BOS at position 0 (as generation does) and runs on into the following stories of an
order reshuffled every epoch, so positions past the dense window see real, varied context.

Output (`--out DIR`): DIR/model (the checkpoint) and DIR/train_log.json (settings and curves).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from m3lm.config import parse_config, release_config
from m3lm.models.minimax_m3 import MiniMaxM3
from training.export import export_checkpoint
from training.forward import training_forward

# hidden 256, 6 layers (1 dense + 5 MoE/MSA), 8 experts top-2 + shared: 10.0M parameters, 20 MB bf16.
PRESETS: dict[str, dict[str, Any]] = {
    "story": {
        "hidden_size": 256,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rotary_dim": 32,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "dense_layers": 1,
        "dense_intermediate_size": 768,
        "intermediate_size": 160,
        "shared_intermediate_size": 256,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "index_head_dim": 64,
        "block_size": 16,
        "topk_blocks": 8,
        "local_blocks": 1,
    },
    "tiny": {  # for tests: MSA engages past 8 tokens
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rotary_dim": 8,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "dense_layers": 1,
        "dense_intermediate_size": 128,
        "intermediate_size": 32,
        "shared_intermediate_size": 32,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "index_head_dim": 16,
        "block_size": 4,
        "topk_blocks": 2,
        "local_blocks": 1,
    },
}


def init_weights_(model: MiniMaxM3, seed: int, std: float = 0.02) -> None:
    """GPT-2 style: normal(0, std), output projections scaled by 1/sqrt(2 * layers); norms and router
    bias zero (a zero Gemma norm weight is the identity)."""
    gen = torch.Generator().manual_seed(seed)
    out_std = std / math.sqrt(2 * model.args.num_hidden_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.zero_()
            else:
                s = out_std if name.endswith(("o_proj.weight", "down_proj.weight", "experts.w2")) else std
                p.copy_(torch.randn(p.shape, generator=gen) * s)


class StoryBatches:
    """Rows of seq_len + 1 tokens, each starting at a story's BOS, from a story order reshuffled every epoch.

    Everything stays on the device; a row that runs past the end of the stream wraps to its start.
    """

    def __init__(self, stream: torch.Tensor, bos_id: int, batch: int, seq_len: int, seed: int):
        self.stream, self.batch = stream, batch
        self.starts = torch.nonzero(stream == bos_id)[:, 0]  # [S] where each story begins
        self.lengths = torch.diff(self.starts, append=self.starts.new_tensor([stream.numel()]))
        self.gen = torch.Generator().manual_seed(seed)
        self.offsets = torch.arange(seq_len + 1, device=stream.device)
        if batch > len(self.starts):
            raise ValueError(f"batch size {batch} exceeds the {len(self.starts)} training stories")
        self.epoch = 0
        self._reshuffle()

    def _reshuffle(self) -> None:
        n = len(self.starts)
        perm = torch.randperm(n, generator=self.gen).to(self.stream.device)
        lengths = self.lengths[perm]
        new_starts = torch.cumsum(lengths, 0) - lengths
        shift = torch.repeat_interleave(
            self.starts[perm] - new_starts, lengths, output_size=self.stream.numel()
        )
        self.order = self.stream[shift + torch.arange(self.stream.numel(), device=self.stream.device)]
        # Rows in their own random order: consecutive stories would make a batch's rows overlap.
        self.row_starts = new_starts[torch.randperm(n, generator=self.gen).to(self.stream.device)]
        self.epoch, self.cursor = self.epoch + 1, 0

    def next(self) -> torch.Tensor:
        if self.cursor + self.batch > len(self.row_starts):
            self._reshuffle()
        rows = self.row_starts[self.cursor : self.cursor + self.batch]
        self.cursor += self.batch
        return self.order[(rows[:, None] + self.offsets) % self.order.numel()]  # [B, T+1]


def val_windows(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Consecutive windows [W, seq_len + 1] of the validation stream (each overlaps the next by one)."""
    n = (stream.numel() - 1) // seq_len
    idx = torch.arange(n, device=stream.device)[:, None] * seq_len + torch.arange(
        seq_len + 1, device=stream.device
    )
    return stream[idx]


class Validator:
    """Validation loss with MSA engaged, as the exported model runs; keeps the best weights seen."""

    def __init__(self, windows: torch.Tensor, batch: int, autocast: torch.autocast):
        self.windows, self.batch, self.autocast = windows, batch, autocast
        self.evals: list[dict[str, float]] = []
        self.best: dict[str, float] = {"val_loss": float("inf")}
        self.best_state: dict[str, torch.Tensor] | None = None

    @torch.no_grad()
    def __call__(self, model: MiniMaxM3, step: int, elapsed: float) -> None:
        model.eval()
        lm = kl = 0.0
        for s in range(0, len(self.windows), self.batch):
            w = self.windows[s : s + self.batch]
            with self.autocast:
                out = training_forward(model, w[:, :-1], w[:, 1:], sparse=True)
            lm += out.lm_loss.item() * len(w)
            kl += out.indexer_kl.item() * len(w)
        model.train()
        rec = {"step": step, "time": round(elapsed, 1), "val_loss": lm / len(self.windows)}
        rec["val_indexer_kl"] = kl / len(self.windows)
        self.evals.append(rec)
        mark = ""
        if rec["val_loss"] < self.best["val_loss"]:
            self.best, mark = rec, " (best)"
            self.best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        print(
            f"eval  {step:6d} {elapsed:6.0f}s val loss {rec['val_loss']:.4f} indexer KL {rec['val_indexer_kl']:.4f}{mark}"
        )


def param_groups(model: MiniMaxM3, weight_decay: float) -> tuple[list[dict], list, list]:
    """AdamW groups (decay on matrices only) and the main / indexer parameter lists, clipped apart.

    The router's correction bias is left out: it moves by the load rule, not by gradients.
    """
    main, indexer, groups = [], [], {}
    for name, p in model.named_parameters():
        if name.endswith("e_score_correction_bias"):
            p.requires_grad_(False)
            continue
        (indexer if ".index_" in name else main).append(p)
        key = ("index" if ".index_" in name else "main", p.dim() >= 2)
        groups.setdefault(key, []).append(p)
    return (
        [{"params": ps, "weight_decay": weight_decay if decay else 0.0} for (_, decay), ps in groups.items()],
        main,
        indexer,
    )


def lr_at(step: int, progress: float, a: argparse.Namespace) -> float:
    """Linear warm-up over steps, then cosine over the fraction of the budget spent, to min_lr_frac."""
    warm = min(1.0, (step + 1) / max(1, a.warmup))
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return a.lr * warm * (a.min_lr_frac + (1 - a.min_lr_frac) * cos)


def update_router_bias(model: MiniMaxM3, counts: list[torch.Tensor], rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing: raise the bias of under-loaded experts, lower the others."""
    moes = [layer.block_sparse_moe for layer in model.model.layers if hasattr(layer, "block_sparse_moe")]
    with torch.no_grad():
        for m, c in zip(moes, counts, strict=True):
            m.e_score_correction_bias.add_(rate * torch.sign(c.mean() - c))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, required=True, help="prepare_data.py's output directory")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", choices=sorted(PRESETS), default="story")
    p.add_argument("--minutes", type=float, default=6.0, help="wall-clock budget of the training loop")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps as well")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr-frac", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=200, help="warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument(
        "--dense-warmup", type=float, default=0.05, help="fraction of the budget with dense attention"
    )
    p.add_argument("--indexer-weight", type=float, default=1.0)
    p.add_argument("--balance-weight", type=float, default=1e-3)
    p.add_argument("--bias-rate", type=float, default=1e-3, help="router bias step per training step")
    p.add_argument("--eval-every", type=float, default=10.0, help="seconds between validation passes")
    p.add_argument("--log-every", type=int, default=50, help="steps between log lines")
    p.add_argument(
        "--temperature", type=float, default=0.8, help="sampling default written to generation_config"
    )
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    device = torch.device(a.device)
    torch.manual_seed(a.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    # bf16 autocast on the GPU; fp32 on the CPU, where bf16 matmuls are slow.
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    meta = json.loads((a.data / "meta.json").read_text())
    config = release_config(vocab_size=meta["vocab_size"], **PRESETS[a.preset])
    args = parse_config(config)
    model = MiniMaxM3(args, dtype=torch.float32)
    init_weights_(model, a.seed)
    model.to(device).train()
    n_params = sum(p.numel() for p in model.parameters())

    train = torch.from_numpy(np.load(a.data / "train.npy").astype(np.int64)).to(device)
    val = val_windows(torch.from_numpy(np.load(a.data / "val.npy").astype(np.int64)).to(device), a.seq_len)
    if len(val) == 0:
        raise ValueError(f"the validation stream holds fewer than {a.seq_len + 1} tokens")
    batches = StoryBatches(train, meta["bos_token_id"], a.batch_size, a.seq_len, a.seed)
    groups, main_params, indexer_params = param_groups(model, a.weight_decay)
    opt = torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    print(
        f"{n_params / 1e6:.2f}M parameters, {train.numel():,} training tokens, {len(val)} validation windows, "
        f"{a.batch_size}x{a.seq_len} tokens per step on {device}"
    )

    budget = a.minutes * 60
    validate = Validator(val, a.batch_size, autocast)
    history: list[dict[str, float]] = []
    names = ("loss", "indexer_kl", "balance", "max_load")  # max_load: busiest expert / mean, per MoE layer
    sums = torch.zeros(len(names), device=device)
    n_sum, step, tokens, last_tokens = 0, 0, 0, 0
    start = last_log = last_eval = time.perf_counter()
    while True:
        elapsed = time.perf_counter() - start
        progress = max(elapsed / budget, step / a.max_steps if a.max_steps else 0.0)
        if progress >= 1.0:
            break
        lr = lr_at(step, progress, a)
        for g in opt.param_groups:
            g["lr"] = lr
        rows = batches.next()
        with autocast:
            out = training_forward(
                model, rows[:, :-1], rows[:, 1:], sparse=progress >= a.dense_warmup, dropout=a.dropout
            )
        loss = out.lm_loss + a.indexer_weight * out.indexer_kl + a.balance_weight * out.balance
        loss.backward()
        torch.nn.utils.clip_grad_norm_(main_params, 1.0)
        torch.nn.utils.clip_grad_norm_(indexer_params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if out.expert_counts:
            update_router_bias(model, out.expert_counts, a.bias_rate)
            load = torch.stack([c.max() / c.mean() for c in out.expert_counts]).mean()
        else:
            load = torch.ones((), device=device)
        sums += torch.stack([out.lm_loss, out.indexer_kl, out.balance, load]).detach()
        n_sum += 1
        step += 1
        tokens += rows.numel() - rows.shape[0]

        now = time.perf_counter()
        if step % a.log_every == 0 or step == a.max_steps:
            means = dict(zip(names, (sums / n_sum).tolist(), strict=True))
            rec = {"step": step, "time": round(now - start, 1), "lr": lr, "tokens": tokens, **means}
            rec["tok_per_s"] = (tokens - last_tokens) / (now - last_log)
            history.append(rec)
            print(
                f"step {step:6d} {now - start:6.0f}s lr {lr:.2e} loss {means['loss']:.4f} "
                f"indexer KL {means['indexer_kl']:.4f} balance {means['balance']:.3f} "
                f"max load {means['max_load']:.2f} {rec['tok_per_s'] / 1e3:.0f}k tok/s epoch {batches.epoch}"
            )
            sums.zero_()
            n_sum, last_log, last_tokens = 0, now, tokens
        if now - last_eval >= a.eval_every and progress >= a.dense_warmup:
            validate(model, step, now - start)
            last_eval = time.perf_counter()

    if not validate.evals or validate.evals[-1]["step"] != step:
        validate(model, step, time.perf_counter() - start)
    model.load_state_dict(validate.best_state)
    ckpt = export_checkpoint(
        model,
        config,
        a.data / "tokenizer",
        a.out / "model",
        meta["bos_token_id"],
        meta["eos_token_id"],
        a.temperature,
    )
    log = {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
        "config": config,
        "parameters": n_params,
        "steps": step,
        "tokens": tokens,
        "epochs": batches.epoch,
        "seconds": time.perf_counter() - start,
        "best": validate.best,
        "history": history,
        "evals": validate.evals,
    }
    (a.out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    print(
        f"best val loss {validate.best['val_loss']:.4f} at step {validate.best['step']}; checkpoint in {ckpt}"
    )
    return log


if __name__ == "__main__":
    main()
