"""EAGLE-3 drafters in the published checkpoint format (`LlamaForCausalLMEagle3`).

A drafter is one Llama decoder layer beside the target. Its input at position t is the token
at t + 1 and a feature of position t: for a position the target computed, `fc` of the target's
residual stream entering three of its layers (`eagle_aux_hidden_state_layer_ids`, each first
RMS-normed when `fc_norm` is set); for a drafted position, the drafter's own output at t - 1
(after its final norm when `norm_output` is set, else before it). The layer's q/k/v read the
normed token embedding concatenated with the normed feature (so they take 2C inputs); its
final norm and lm_head give the next token (ids mapped through `d2t` when the drafter has a
smaller vocabulary). Embedding and lm_head are the drafter's own, or the target's when the
checkpoint has none. Keys and values of the target's positions go to a paged pool that shares
the target's block tables; those of drafted positions stay local to one drafting call.

Checkpoint tensors: `midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight`,
`midlayer.self_attn.{q,k,v,o}_proj.weight`, `midlayer.mlp.{gate,up,down}_proj.weight`,
`fc.weight`, `norm.weight`, optionally `fc_norm.{0,1,2}.weight`, `embed_tokens.weight`,
`lm_head.weight`, `d2t`, `t2d` (a `model.` prefix and `model.layers.0.` for `midlayer.` are
read too). Anything else, a missing tensor or a wrong shape is a one-line `CheckpointError`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from m3lm.errors import CheckpointError

if TYPE_CHECKING:
    from m3lm.config import ModelArgs

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclass(frozen=True)
class EagleArgs:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float
    rope_theta: float
    layer_ids: tuple[int, ...]  # target layers whose input residual stream is captured
    norm_before_residual: bool = False
    fc_norm: bool = False
    norm_output: bool = False

    @classmethod
    def from_dict(cls, c: dict, target_layers: int, where: str = "config.json") -> EagleArgs:
        arch = c.get("architectures") or []
        if not any(a in ARCHITECTURES for a in arch):
            raise CheckpointError(
                f"{where}: architectures = {arch!r} is not an EAGLE-3 drafter (expected {ARCHITECTURES[0]})"
            )

        def need(key: str, kind=int):
            v = c.get(key)
            if not isinstance(v, kind) or isinstance(v, bool) or (kind is int and v < 1):
                raise CheckpointError(f"{where}: {key} = {v!r} must be a positive {kind.__name__}")
            return v

        if c.get("num_hidden_layers", 1) != 1:
            raise CheckpointError(
                f"{where}: num_hidden_layers = {c['num_hidden_layers']!r}: a drafter has one layer"
            )
        if c.get("rope_scaling") not in (None, {}):
            raise CheckpointError(f"{where}: rope_scaling = {c['rope_scaling']!r} is not supported")
        hidden, heads = need("hidden_size"), need("num_attention_heads")
        eagle = c.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids", c.get("eagle_aux_hidden_state_layer_ids"))
        if ids is None:
            ids = [2, target_layers // 2, target_layers - 3]  # the EAGLE-3 default
        if (
            not isinstance(ids, list)
            or len(ids) != 3
            or not all(isinstance(i, int) and 0 <= i <= target_layers for i in ids)
        ):
            raise CheckpointError(
                f"{where}: eagle_aux_hidden_state_layer_ids = {ids!r} must be three layer ids in "
                f"[0, {target_layers}] (the target's layers)"
            )
        vocab = need("vocab_size")
        return cls(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or hidden // heads,
            intermediate_size=need("intermediate_size"),
            vocab_size=vocab,
            draft_vocab_size=c.get("draft_vocab_size") or vocab,
            target_hidden_size=c.get("target_hidden_size") or hidden,
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            rope_theta=float(c.get("rope_theta", 10000.0)),
            layer_ids=tuple(ids),
            norm_before_residual=bool(c.get("norm_before_residual", False)),
            fc_norm=bool(eagle.get("fc_norm", c.get("fc_norm", False))),
            norm_output=bool(eagle.get("norm_output", c.get("norm_output", False))),
        )


class LlamaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * y).to(x.dtype)


def rope_table(pos: torch.Tensor, d: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, 1, D] of Llama's rotary embedding over heads of D at positions pos [T]."""
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=pos.device, dtype=torch.float32) / d)
    ang = pos.float()[:, None] * inv[None]  # [T, D/2]
    return torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float, table=None) -> torch.Tensor:
    """Llama's rotary embedding over the whole head: x [T, H, D] at positions pos [T] (`table`:
    their `rope_table`, when already made)."""
    d = x.shape[-1]
    cos, sin = table if table is not None else rope_table(pos, d, theta)
    xf = x.float()
    rotated = torch.cat([-xf[..., d // 2 :], xf[..., : d // 2]], -1)
    return (xf * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, a: EagleArgs, dtype: torch.dtype):
        super().__init__()
        c, h, k, d = a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.h, self.k, self.d, self.theta = h, k, d, a.rope_theta
        self.q_proj = nn.Linear(2 * c, h * d, bias=False, dtype=dtype)
        self.k_proj = nn.Linear(2 * c, k * d, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(2 * c, k * d, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(h * d, c, bias=False, dtype=dtype)


class MLP(nn.Module):
    def __init__(self, c: int, i: int, dtype: torch.dtype):
        super().__init__()
        self.gate_proj = nn.Linear(c, i, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(c, i, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(i, c, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, a: EagleArgs, dtype: torch.dtype):
        super().__init__()
        c = a.hidden_size
        self.input_layernorm = LlamaRMSNorm(c, a.rms_norm_eps, dtype)
        self.hidden_norm = LlamaRMSNorm(c, a.rms_norm_eps, dtype)
        self.post_attention_layernorm = LlamaRMSNorm(c, a.rms_norm_eps, dtype)
        self.self_attn = Attention(a, dtype)
        self.mlp = MLP(c, a.intermediate_size, dtype)


class Eagle3(nn.Module):
    """The drafter's weights and its step. `embed_tokens`/`lm_head` are None when it shares the
    target's (`bind`)."""

    def __init__(self, a: EagleArgs, dtype: torch.dtype = torch.float32, own_embed=True, own_head=True):
        super().__init__()
        self.args = a
        c, ct = a.hidden_size, a.target_hidden_size
        self.fc = nn.Linear(3 * ct, c, bias=False, dtype=dtype)
        self.fc_norm = (
            nn.ModuleList(LlamaRMSNorm(ct, a.rms_norm_eps, dtype) for _ in range(3)) if a.fc_norm else None
        )
        self.midlayer = MidLayer(a, dtype)
        self.norm = LlamaRMSNorm(c, a.rms_norm_eps, dtype)
        self.embed_tokens = nn.Embedding(a.vocab_size, c, dtype=dtype) if own_embed else None
        self.lm_head = nn.Linear(c, a.draft_vocab_size, bias=False, dtype=dtype) if own_head else None
        self.register_buffer("d2t", torch.zeros(a.draft_vocab_size, dtype=torch.long))
        self._shared = (self.embed_tokens, self.lm_head)  # a tuple: not registered as submodules

    def bind(self, target) -> None:
        """Use the target's embedding and lm_head where the drafter has none of its own."""
        embed = self.embed_tokens if self.embed_tokens is not None else target.model.embed_tokens
        self._shared = (embed, self.lm_head if self.lm_head is not None else target.lm_head)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._shared[0](tokens)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        return self._shared[1](x)

    def features(self, captured: torch.Tensor) -> torch.Tensor:
        """The target's captured states [T, 3 Ct] -> the drafter's features [T, C]."""
        if self.fc_norm is not None:
            parts = captured.chunk(3, -1)
            captured = torch.cat([n(p) for n, p in zip(self.fc_norm, parts, strict=True)], -1)
        return self.fc(captured.to(self.fc.weight.dtype))

    def qkv(
        self, tokens: torch.Tensor, feats: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer up to its attention: tokens [T] (each position's next token), feats [T, C]
        and positions [T] -> rotated q [T, H, D], k [T, K, D], v [T, K, D] and the residual
        stream [T, C] that the attention's output joins (`finish`)."""
        layer, a = self.midlayer, self.args
        e = layer.input_layernorm(self._embed(tokens).to(feats.dtype))
        if a.norm_before_residual:
            h = residual = layer.hidden_norm(feats)
        else:
            residual, h = feats, layer.hidden_norm(feats)
        x = torch.cat([e, h], -1)  # [T, 2C]
        at = layer.self_attn
        T = x.shape[0]
        table = rope_table(pos, at.d, at.theta)
        q = rope(at.q_proj(x).view(T, at.h, at.d), pos, at.theta, table)
        k = rope(at.k_proj(x).view(T, at.k, at.d), pos, at.theta, table)
        return q, k, at.v_proj(x).view(T, at.k, at.d), residual

    def finish(self, o: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer after its attention: o [T, H, D] and the residual stream [T, C] -> (the
        feature for the next position [T, C], the final-normed states [T, C] `logits` reads)."""
        layer = self.midlayer
        h = layer.self_attn.o_proj(o.reshape(o.shape[0], -1)) + residual
        h = layer.mlp(layer.post_attention_layernorm(h)) + h
        normed = self.norm(h)
        return (normed if self.args.norm_output else h), normed

    @property
    def scale(self) -> float:
        """The attention's softmax scale, 1 / sqrt(head_dim)."""
        return 1.0 / math.sqrt(self.args.head_dim)

    def step(
        self,
        tokens: torch.Tensor,
        feats: torch.Tensor,
        pos: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """T consecutive positions of one sequence: tokens [T] (each position's next token),
        feats [T, C], positions [T], and the keys/values of the positions before them [P, K, D]
        -> (the feature for the next position [T, C], the final-normed states [T, C] that
        `logits` reads, k, v [T, K, D])."""
        q, k, v, residual = self.qkv(tokens, feats, pos)
        keys, values = torch.cat([past[0], k]), torch.cat([past[1], v])  # [P + T, K, D]
        P, T = past[0].shape[0], q.shape[0]
        mask = torch.arange(P + T, device=q.device)[None] <= (P + torch.arange(T, device=q.device))[:, None]
        rep = q.shape[1] // k.shape[1]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            keys.repeat_interleave(rep, 1).transpose(0, 1),
            values.repeat_interleave(rep, 1).transpose(0, 1),
            attn_mask=mask,
        )  # [H, T, D], scaled by `scale`
        return *self.finish(o.transpose(0, 1), residual), k, v

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., Vd] (fp32) of final-normed states."""
        return self._head(normed).float()

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids (`d2t` holds the offsets)."""
        return draft_ids + self.d2t[draft_ids]


def load_eagle3(path: str | Path, target, dtype: torch.dtype, device) -> Eagle3:
    """Read a drafter directory (config.json and safetensors) for `target` (a MiniMaxM3), with
    the strict checks of the target's loader; any problem is a one-line CheckpointError."""
    path = Path(path)
    t = target.args
    a = EagleArgs.from_dict(_read_config(path), t.num_hidden_layers, str(path / "config.json"))
    _check_sizes(path, a, t)
    tensors = _read_tensors(path)
    own_embed, own_head = "embed_tokens.weight" in tensors, "lm_head.weight" in tensors
    if not own_embed and a.hidden_size != t.hidden_size:
        raise CheckpointError(f"{path}: no embed_tokens.weight, and the target's embedding has another width")
    if not own_head and (a.hidden_size != t.hidden_size or a.draft_vocab_size != t.vocab_size):
        raise CheckpointError(f"{path}: no lm_head.weight, and the target's lm_head has another shape")
    model = Eagle3(a, dtype, own_embed, own_head)
    _fill(path, model, tensors)
    mapped = model.d2t + torch.arange(a.draft_vocab_size)
    if int(mapped.min()) < 0 or int(mapped.max()) >= t.vocab_size:
        raise CheckpointError(f"{path}: d2t maps draft ids outside the target's vocabulary")
    model.to(device)
    model.bind(target)
    return model.eval()


def _read_config(path: Path) -> dict:
    """The drafter directory's config.json, as a JSON object; CheckpointError if it is not one."""
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json (an EAGLE-3 drafter directory has one)")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path / 'config.json'}: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path / 'config.json'}: not a JSON object")
    return config


def _check_sizes(path: Path, a: EagleArgs, t: ModelArgs) -> None:
    """CheckpointError unless the drafter reads hidden states of the target's width and shares
    its vocabulary."""
    if a.target_hidden_size != t.hidden_size:
        raise CheckpointError(
            f"{path}: the drafter reads hidden states of size {a.target_hidden_size} "
            f"(target_hidden_size or hidden_size) but the target's hidden_size is {t.hidden_size}"
        )
    if a.vocab_size != t.vocab_size:
        raise CheckpointError(f"{path}: vocab_size = {a.vocab_size} but the target's is {t.vocab_size}")


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors files, by m3lm's drafter names (`t2d` left
    out: `d2t` implies it)."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no .safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            for key in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[_name(key)] = st.get_tensor(key)
    tensors.pop("t2d", None)  # implied by d2t
    return tensors


def _fill(path: Path, model: Eagle3, tensors: dict[str, torch.Tensor]) -> None:
    """Copy each tensor into its parameter (or `d2t`); CheckpointError for a tensor the drafter
    has no place for, one of another shape, or a parameter no tensor fills."""
    params = dict(model.named_parameters()) | {"d2t": model.d2t}
    for name, value in tensors.items():
        if name not in params:
            raise CheckpointError(f"{path}: unexpected tensor {name!r} for an EAGLE-3 drafter")
        if tuple(value.shape) != tuple(params[name].shape):
            raise CheckpointError(
                f"{path}: {name} has shape {tuple(value.shape)}, expected {tuple(params[name].shape)} from config.json"
            )
        with torch.no_grad():
            params[name].copy_(value)
    missing = sorted(set(params) - set(tensors) - {"d2t"})
    if missing:
        raise CheckpointError(f"{path}: missing tensor {missing[0]} ({len(missing)} missing)")


def _name(key: str) -> str:
    for old, new in (("model.layers.0.", "midlayer."), ("model.", "")):
        if key.startswith(old):
            return new + key[len(old) :]
    return key


def published_config(
    *,
    hidden_size: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int,
    intermediate_size: int,
    vocab_size: int,
    layer_ids: list[int],
) -> dict:
    """A drafter config.json as published, for these sizes."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "max_position_embeddings": 196608,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "vocab_size": vocab_size,
        "draft_vocab_size": vocab_size,
        "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": layer_ids, "use_aux_hidden_state": True},
    }


def random_drafter(path: str | Path, config: dict, seed: int = 0, std: float = 0.02, shared=()) -> Path:
    """Write a drafter of `config` with seeded random weights (own embedding and lm_head unless
    named in `shared`), in the published layout."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    a = EagleArgs.from_dict(config, max(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]))
    model = Eagle3(a, torch.float32, "embed_tokens" not in shared, "lm_head" not in shared)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in sorted(model.named_parameters()):
        w = (
            1.0 + torch.randn(p.shape, generator=gen) * std
            if name.endswith("norm.weight") or "_norm." in name
            else None
        )
        out[name] = (w if w is not None else torch.randn(p.shape, generator=gen) * std).to(torch.bfloat16)
    save_file({k: v.contiguous() for k, v in out.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
