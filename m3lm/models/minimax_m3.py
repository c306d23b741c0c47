"""MiniMax-M3 text decoder: GQA or MSA attention, dense MLP or MoE, and its checkpoint layouts.

Shape legend: T tokens (packed over sequences; B on a decode step), B sequences, H query heads,
K KV heads (= index heads), G = H/K, D head dim, R rotary dim, Di index head dim, C hidden,
E experts, A active experts, I expert width, V vocab, W the packed projections' width.

Attribute names mirror the release checkpoint keys (`language_model.` stripped), so a release
tensor lands on the parameter of the same name; `remap_key` is the one home of the other layouts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from m3lm.config import ModelArgs
from m3lm.distributed.parallel import SINGLE, ParallelConfig, all_gather, all_reduce
from m3lm.distributed.shard import check_mxfp8_split, head_ranges, part
from m3lm.kernels.moe import SPLIT_ROUTER_MIN_T, MoEOutput, moe, route, router_logits, split_bf16
from m3lm.kernels.q4 import Q4Weight
from m3lm.layers.batch import DecodeBatch, ForwardBatch
from m3lm.layers.heads import packed_heads, stack_norms
from m3lm.layers.linear import MXFP8Linear, pack_rows_, packed_linear, q4_extra, to_mxfp8_
from m3lm.layers.mlp import MLP
from m3lm.layers.msa_attention import MSAAttention
from m3lm.layers.norm import RMSNorm
from m3lm.layers.quantized import experts_to_mxfp8_
from m3lm.layers.rotary import norm_rope


class Attention(nn.Module):
    """GQA with per-head QK norm and partial RoPE; on sparse layers, MSA with a lightning indexer.

    Under tensor parallelism it holds only this rank's query heads and KV/index heads, and its
    o_proj output is a partial sum (the decoder layer all-reduces it).
    """

    def __init__(
        self, args: ModelArgs, layer_idx: int, dtype: torch.dtype, parallel: ParallelConfig = SINGLE
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self.sparse = args.sparse_layers[layer_idx]
        q_heads, kv_heads = head_ranges(args, parallel)
        self.n_heads, self.n_kv, self.head_dim = len(q_heads), len(kv_heads), args.head_dim
        self.scale = args.head_dim**-0.5
        self.rotary = (args.rotary_dim, args.rope_theta)
        c, h, k, d = args.hidden_size, self.n_heads, self.n_kv, self.head_dim
        self.q_proj = nn.Linear(c, h * d, bias=False, dtype=dtype)
        self.k_proj = nn.Linear(c, k * d, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(c, k * d, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(h * d, c, bias=False, dtype=dtype)
        self.q_norm = RMSNorm(d, args.rms_norm_eps, dtype)  # one vector shared by all heads
        self.k_norm = RMSNorm(d, args.rms_norm_eps, dtype)
        self.msa = args.msa if self.sparse else None
        self.dims = (h, k, d, args.index_head_dim if self.sparse else 0)  # as `decode_heads` takes them
        if self.sparse:
            di = args.index_head_dim
            self.index_q_proj = nn.Linear(c, k * di, bias=False, dtype=dtype)  # index head h = KV group h
            self.index_k_proj = nn.Linear(c, di, bias=False, dtype=dtype)  # one index-key head
            self.index_q_norm = RMSNorm(di, args.rms_norm_eps, dtype)
            self.index_k_norm = RMSNorm(di, args.rms_norm_eps, dtype)
        self.attn = MSAAttention(layer_idx, self.scale, self.msa)
        self.packed = self.stacked_norms = None  # set by `prepare_`

    def prepare_(self) -> None:
        """Pack the projections into one weight [W, C]; on the CPU in fp32, stack the heads' norms [N, D]."""
        self.packed, w = pack_rows_(*self._projections()), self.q_norm.weight
        cpu = self.packed is not None and not w.is_cuda and w.dtype == torch.float32
        self.stacked_norms = stack_norms(self._norms(), self.dims) if cpu else None

    def forward(self, x: torch.Tensor, batch: ForwardBatch | DecodeBatch) -> torch.Tensor:
        """x [T, C] -> [T, C]. RoPE comes from the batch's table (`batch.rope`), made after the
        projections are queued."""
        y, outs = self._products(x)  # [T, W] when prepared, else None; its column slices
        cos, sin = batch.rope(*self.rotary)  # [T, R/2]
        heads = None
        if self.stacked_norms is not None:  # prepared on the CPU: every head normed and rotated in one pass
            rope = batch.rope_rows(*self.rotary, self.head_dim)
            heads = packed_heads(y, self.stacked_norms, self.dims, rope, self.q_norm.eps)
        elif y is not None and isinstance(batch, DecodeBatch):  # the GPU's one launch: k, v into the caches
            heads = self.attn.decode_heads(y, self.dims, self._norms(), self.q_norm.eps, cos, sin, batch)
        q, k, v, iq, ik = heads or self._heads(outs, cos, sin)
        return self.o_proj(self.attn(q, k, v, iq, ik, batch).flatten(1))  # [T, C]

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
        """x [T, C] -> q [T, H, D], k and v [T, K, D] and, on sparse layers, index queries
        [T, K, Di] and keys [T, Di] (else None): projections, per-head norms and RoPE."""
        return self._heads(self._products(x)[1], cos, sin)

    def _projections(self) -> list[nn.Module]:
        sparse = [self.index_q_proj, self.index_k_proj] if self.sparse else []
        return [self.q_proj, self.k_proj, self.v_proj, *sparse]

    def _products(self, x: torch.Tensor) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """x [T, C] -> (the packed output [T, W], or None unprepared; the q, k, v (index q, index k)
        projections): one product over the packed weights, whose column slices are the projections."""
        layers = self._projections()
        if self.packed is None:
            return None, [lin(x) for lin in layers]
        y = packed_linear(x, self.packed)
        return y, list(y.split([lin.out_features for lin in layers], dim=-1))

    def _norms(self) -> tuple[torch.Tensor, ...]:
        heads = (self.q_norm, self.k_norm) + ((self.index_q_norm, self.index_k_norm) if self.sparse else ())
        return tuple(n.weight for n in heads)

    def _heads(self, outs: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor) -> tuple:
        """`project` from the projections `outs` (`_products`)."""
        t, eps = outs[0].shape[0], self.q_norm.eps
        norms = self._norms()
        q = norm_rope(outs[0].view(t, self.n_heads, -1), norms[0], eps, cos, sin)  # [T, H, D]
        k = norm_rope(outs[1].view(t, self.n_kv, -1), norms[1], eps, cos, sin)  # [T, K, D]
        v = outs[2].view(t, self.n_kv, -1)  # [T, K, D]
        if not self.sparse:
            return q, k, v, None, None
        iq = norm_rope(outs[3].view(t, self.n_kv, -1), norms[2], eps, cos, sin)  # [T, K, Di]
        ik = norm_rope(outs[4].view(t, 1, -1), norms[3], eps, cos, sin)[:, 0]  # [T, Di]
        return q, k, v, iq, ik


class Experts(nn.Module):
    """Routed experts stacked along E: w1 gate, w3 up [E, I, C]; w2 down [E, C, I].

    With expert parallelism a rank holds experts first .. first+E/N-1; without, every expert's I/N.
    Quantised (`layers.quantized`): 8-bit, the same local shapes in e4m3 plus E8M0 scales
    `w*_scale` [E, O, In/32]; or 4-bit codes with their scales (`self.q4`: format and group).
    """

    def __init__(self, args: ModelArgs, dtype: torch.dtype, parallel: ParallelConfig = SINGLE):
        super().__init__()
        e, c, i = args.num_local_experts, args.hidden_size, args.intermediate_size
        self.first, self.partitioned = 0, parallel.ep and parallel.world > 1
        if self.partitioned:
            self.first, last = part(e, parallel, "num_local_experts")
            e = last - self.first
        elif parallel.world > 1:
            lo, hi = part(i, parallel, "intermediate_size")
            i = hi - lo
        self.w1 = nn.Parameter(torch.empty(e, i, c, dtype=dtype))
        self.w3 = nn.Parameter(torch.empty(e, i, c, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(e, c, i, dtype=dtype))

    def stacked(self) -> tuple[torch.Tensor | Q4Weight, ...]:
        """(w1, w3, w2), or each 8-bit one followed by its scales, or three `Q4Weight`s, as
        `kernels.moe.moe` takes them."""
        if hasattr(self, "q4"):
            return tuple(
                Q4Weight(getattr(self, n), getattr(self, n + "_scale"), q4_extra(self, n), *self.q4)
                for n in ("w1", "w3", "w2")
            )
        if self.w1.dtype == torch.float8_e4m3fn:
            return self.w1, self.w1_scale, self.w3, self.w3_scale, self.w2, self.w2_scale
        return self.w1, self.w3, self.w2


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype, parallel: ParallelConfig = SINGLE):
        super().__init__()
        self.top_k, self.scaling = args.num_experts_per_tok, args.routed_scaling_factor
        self.alpha, self.limit = args.swiglu_alpha, args.swiglu_limit
        # The router stays fp32 whatever the compute dtype: the release stores and runs it so.
        self.gate = nn.Linear(args.hidden_size, args.num_local_experts, bias=False, dtype=torch.float32)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(args.num_local_experts, dtype=torch.float32))
        self.experts = Experts(args, dtype, parallel)
        self.shared_experts = MLP(
            args.hidden_size, _width(args.shared_intermediate_size, parallel), args.swiglu_alpha,
            args.swiglu_limit, dtype,
        )  # fmt: skip
        self.router_split = self.shared_fp8 = None  # set by `prepare_`

    def prepare_(self) -> None:
        """The shared expert packed; its MXFP8 (gate, gate scales, up, up scales, down, down scales)
        when it has a routed expert's shape, so that it can join their per-pair launches; on the
        GPU the router's exact bf16 slices [3, E, C] (`router_logits`)."""
        sh, ex, w = self.shared_experts, self.experts, self.gate.weight
        sh.prepare_()
        lins = (sh.gate_proj, sh.up_proj, sh.down_proj)
        shapes = (sh.gate_proj.weight.shape, sh.down_proj.weight.shape) == (ex.w1.shape[1:], ex.w2.shape[1:])
        fp8 = shapes and all(isinstance(lin, MXFP8Linear) for lin in lins)
        self.shared_fp8 = tuple(t for lin in lins for t in (lin.weight, lin.weight_scale)) if fp8 else None
        self.router_split = split_bf16(w.detach()) if w.is_cuda else None

    def forward(self, x: torch.Tensor) -> torch.Tensor | MoEOutput:
        """x [T, C] -> the output [T, C], or on the GPU's pair path the pairs not yet summed."""
        # The router's bf16 slices serve GPU prefills; tested first: a CPU trace takes no shape guard.
        split = self.router_split is not None and x.shape[0] >= SPLIT_ROUTER_MIN_T
        logits = router_logits(x, self.gate.weight, self.router_split if split else None)  # [T, E] fp32
        weights, ids = route(logits, self.e_score_correction_bias, self.top_k)  # [T, A]
        ex = self.experts
        return moe(
            x, weights, ids, ex.stacked(), self.shared_experts, self.alpha, self.limit, self.scaling,
            first=ex.first if ex.partitioned else None, shared_fp8=self.shared_fp8,
        )  # fmt: skip


class DecoderLayer(nn.Module):
    def __init__(
        self, args: ModelArgs, layer_idx: int, dtype: torch.dtype, parallel: ParallelConfig = SINGLE
    ):
        super().__init__()
        self.parallel = parallel
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.self_attn = Attention(args, layer_idx, dtype, parallel)
        if args.moe_layers[layer_idx]:
            self.block_sparse_moe = MoE(args, dtype, parallel)
        else:
            self.mlp = MLP(
                args.hidden_size, _width(args.dense_intermediate_size, parallel), args.swiglu_alpha,
                args.swiglu_limit, dtype,
            )  # fmt: skip

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor, batch: ForwardBatch | DecodeBatch
    ) -> tuple[torch.Tensor | MoEOutput, torch.Tensor]:
        """(input norm x [T, C] of the residual stream [T, C]) -> (this layer's MLP/MoE output, not
        yet added; the residual stream). The next norm adds that output (`RMSNorm(x, residual)`):
        on one GPU a MoE's pairs are summed in that same pass (`MoEOutput`). The caller applies
        the input norm, so that the previous output is freed before this layer runs."""
        # Under tensor parallelism both branches leave partial sums over this rank's heads/width.
        x = all_reduce(self.self_attn(x, batch), self.parallel)
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.ffn(x)
        if self.parallel.world > 1:
            x = all_reduce(x.sum() if isinstance(x, MoEOutput) else x, self.parallel)
        return x, residual

    @property
    def ffn(self) -> nn.Module:
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp


class Decoder(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype, parallel: ParallelConfig = SINGLE):
        super().__init__()
        self.parallel = parallel
        self.vocab_first, vocab_last = part(args.vocab_size, parallel, "vocab_size")
        # Left uninitialised (`_weight`): every weight is loaded or set after construction, and
        # nn.Embedding's own init on the meta device imports torch's compiler (over a second).
        rows = vocab_last - self.vocab_first
        self.embed_tokens = nn.Embedding(
            rows, args.hidden_size, _weight=torch.empty(rows, args.hidden_size, dtype=dtype)
        )
        self.layers = nn.ModuleList(
            DecoderLayer(args, i, dtype, parallel) for i in range(args.num_hidden_layers)
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)

    def embed_norm(self, tokens: torch.Tensor, fuse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens [T] -> (the first layer's input norm of their embeddings, the embeddings), both
        [T, C] (without layers: the embeddings, None); one pass on one GPU with `fuse`."""
        if not len(self.layers):
            return self.embed(tokens), None
        norm = self.layers[0].input_layernorm
        if fuse and tokens.is_cuda and self.parallel.world == 1:
            from m3lm.kernels import fused

            h, x = fused.embed_rms_norm(tokens, self.embed_tokens.weight, norm.weight, norm.eps)
            return x, h
        h = self.embed(tokens)
        return norm(h), h

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T] -> [T, C]; vocab-parallel: rows of other ranks are zero, then summed."""
        if self.parallel.world == 1:
            return self.embed_tokens(tokens)
        local = tokens - self.vocab_first
        mine = (local >= 0) & (local < self.embed_tokens.num_embeddings)  # [T]
        h = self.embed_tokens(torch.where(mine, local, 0)) * mine[:, None].to(self.embed_tokens.weight.dtype)
        return all_reduce(h, self.parallel)


def _width(n: int, parallel: ParallelConfig) -> int:
    """This rank's share of a column/row-parallel MLP width."""
    lo, hi = part(n, parallel, "intermediate width")
    return hi - lo


class MiniMaxM3(nn.Module):
    """The causal LM: `model(input_ids [B, T])` -> logits [B, T, V] (full causal forward, no cache)."""

    def __init__(
        self,
        args: ModelArgs,
        dtype: torch.dtype = torch.float32,
        quant: str | None = None,
        parallel: ParallelConfig = SINGLE,
    ):
        super().__init__()
        self.args, self.parallel = args, parallel
        self.model = Decoder(args, dtype, parallel)
        self.lm_head = nn.Linear(
            args.hidden_size, self.model.embed_tokens.num_embeddings, bias=False, dtype=dtype
        )
        if quant == "mxfp8":
            check_mxfp8_split(args, parallel)  # a rank's 8-bit shards hold whole 32-blocks of inputs
            keep_mxfp8_(self)
        elif quant is not None:
            raise ValueError(f"quant = {quant!r} is not supported (expected None or 'mxfp8')")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        b, t = input_ids.shape
        batch = ForwardBatch.full(b, t, input_ids.device)
        return self.forward_batch(input_ids.flatten(), batch).view(b, t, -1)

    def forward_batch(
        self, tokens: torch.Tensor, batch: ForwardBatch | DecodeBatch, logits_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Packed tokens [T] -> fp32 logits [T, V], or only at `logits_rows` [R] -> [R, V].

        A `DecodeBatch` (one new token for each of B sequences over the paged caches, on the GPU)
        has static shapes and no host synchronisation, so its step can be captured in a CUDA graph.
        """
        decode = isinstance(batch, DecodeBatch)
        capture = batch.capture
        x, residual = self.model.embed_norm(tokens, fuse=not decode)  # [T, C] each, no embedding scaling
        for i, layer in enumerate(self.model.layers):
            if i:  # the previous output joins the residual stream (a MoE's pairs, A times [T, C], freed)
                x, residual = layer.input_layernorm(x, residual)
            if capture is not None and i in capture:
                capture[i] = residual.clone()  # fused kernels may update the stream in place later
            x, residual = layer(x, residual, batch)
        if capture is not None and len(self.model.layers) in capture:
            capture[len(self.model.layers)] = self.model.norm(x, residual)[1].clone()
        if logits_rows is not None:
            x, residual = x[logits_rows], None if residual is None else residual[logits_rows]
        x = self.model.norm(x) if residual is None else self.model.norm(x, residual)[0]  # None: no layers
        return all_gather(self.lm_head(x).float(), self.parallel)  # [T, V]

    @torch.no_grad()
    def prepare_(self) -> MiniMaxM3:
        """What the forward reads besides the weights, made after their last change (loading, quantising,
        sharding, a move) and again after any later one; unprepared, the plain path runs."""
        for layer in self.model.layers:
            layer.self_attn.prepare_()
            layer.ffn.prepare_()
        return self


MXFP8_LINEARS = (
    ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj", "index_q_proj", "index_k_proj")),
    ("mlp", ("gate_proj", "up_proj", "down_proj")),
    ("block_sparse_moe.shared_experts", ("gate_proj", "up_proj", "down_proj")),
)


def keep_mxfp8_(model: MiniMaxM3, quantize: bool = False) -> MiniMaxM3:
    """Hold in 8 bits exactly what the MXFP8 release stores so: attention and indexer projections,
    dense MLP, shared and routed experts (embedding, lm_head, norms and router stay as they are).
    Empty weights for the loader, or `quantize` the current ones (the release's scheme). On a
    tensor-parallel shard the layers have their local shapes, so the 8-bit weights do too."""
    for layer in model.model.layers:
        for path, names in MXFP8_LINEARS:
            owner = layer.get_submodule(path) if hasattr(layer, path.split(".")[0]) else None
            if owner is not None:
                to_mxfp8_(owner, names, quantize)
        if hasattr(layer, "block_sparse_moe"):
            experts_to_mxfp8_(layer.block_sparse_moe.experts, quantize)
    return model


def random_init_(model: MiniMaxM3, std: float = 0.02, seed: int = 0) -> MiniMaxM3:
    """Fill every parameter with seeded normal noise (norms and router bias too), for tests and benchmarks."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model


# --- checkpoint layouts -------------------------------------------------------------------------

SKIP_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "patch_merge_mlp.",
    "mtp.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "model.mtp.",
    "language_model.mtp.",
    "language_model.model.mtp.",
    "model.language_model.mtp.",
)
PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
SWITCH = (("gate", "w1"), ("up", "w3"), ("down", "w2"))  # mlx-lm's stacked experts, `switch_mlp`
RENAMES = {
    "self_attn.indexer.q_proj.weight": "self_attn.index_q_proj.weight",
    "self_attn.indexer.k_proj.weight": "self_attn.index_k_proj.weight",
    "self_attn.indexer.q_norm.weight": "self_attn.index_q_norm.weight",
    "self_attn.indexer.k_norm.weight": "self_attn.index_k_norm.weight",
    "block_sparse_moe.gate.e_score_correction_bias": "block_sparse_moe.e_score_correction_bias",
    **{f"block_sparse_moe.switch_mlp.{p}_proj.weight": f"block_sparse_moe.experts.{w}" for p, w in SWITCH},
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")
_STACKED = re.compile(r"block_sparse_moe\.experts\.(w[123])")


@dataclass(frozen=True)
class Piece:
    """Part `index` of a checkpoint tensor goes to parameter `param` (slot `slot` of a stacked one)."""

    param: str
    slot: int | None = None
    index: tuple = ()


@dataclass(frozen=True)
class Remapped:  # the pieces, and the source shape they expect (None: the target is unknown)
    pieces: tuple[Piece, ...]
    shape: tuple[int, ...] | None


def remap_key(  # noqa: C901 (the checkpoints' naming quirks, kept in one place)
    name: str, shape: tuple[int, ...], args: ModelArgs, params: dict[str, tuple]
) -> Remapped | None:
    """Where checkpoint tensor `name` goes: None to skip it (vision, projector, MTP).

    Handles the release layout, the transformers re-save (fused gate_up, stacked experts, possibly
    with the shared expert packed as entry E), mlx-lm's and m3lm's own names (idempotent).
    `params` maps parameter names to shapes; a name that reaches no parameter comes back with shape None.
    """
    if name.startswith(SKIP_PREFIXES):
        return None
    for old, new in PREFIXES:
        if name.startswith(old):
            name = new + name[len(old) :]
            break
    m = _LAYER.fullmatch(name)
    if m is None:
        return Remapped((Piece(name),), params.get(name))
    layer, rest = int(m.group(1)), m.group(2)
    base = f"model.layers.{layer}."
    moe = layer < args.num_hidden_layers and args.moe_layers[layer]
    if moe and rest.startswith("mlp."):
        rest = "block_sparse_moe." + rest[len("mlp.") :]
    rest = RENAMES.get(rest, rest)

    if rest in ("mlp.gate_up_proj.weight", "block_sparse_moe.shared_experts.gate_up_proj.weight"):
        owner = base + rest[: -len("gate_up_proj.weight")]
        gate = params.get(owner + "gate_proj.weight")
        if gate is None:
            return Remapped((Piece(base + rest),), None)
        i = gate[0]
        halves = (
            Piece(owner + "gate_proj.weight", None, (slice(0, i),)),
            Piece(owner + "up_proj.weight", None, (slice(i, 2 * i),)),
        )
        return Remapped(halves, (2 * i, gate[1]))
    if moe and (e := _EXPERT.fullmatch(rest)):
        param = base + f"block_sparse_moe.experts.{e.group(2)}"
        return Remapped((Piece(param, int(e.group(1))),), params[param][1:] if param in params else None)
    if moe and _STACKED.fullmatch(rest) and base + rest in params:  # stacked [E, O, In]: m3lm's, mlx-lm's
        shape = params[base + rest]
        return Remapped(tuple(Piece(base + rest, e, (e,)) for e in range(shape[0])), shape)
    if moe and rest in ("block_sparse_moe.experts.gate_up_proj", "block_sparse_moe.experts.down_proj"):
        return _stacked(base, rest.rsplit(".", 1)[1], shape, args)
    return Remapped((Piece(base + rest),), params.get(base + rest))


def _stacked(base: str, kind: str, shape: tuple[int, ...], args: ModelArgs) -> Remapped:
    """transformers' stacked experts [E(+1), 2I, C] / [E(+1), C, I]; entry E is a packed shared expert."""
    n_exp, c, i = args.num_local_experts, args.hidden_size, args.intermediate_size
    packed = bool(shape) and shape[0] == n_exp + 1 and args.shared_intermediate_size == i
    rows = n_exp + 1 if packed else n_exp
    ex, sh = base + "block_sparse_moe.experts.", base + "block_sparse_moe.shared_experts."
    pieces = []
    if kind == "gate_up_proj":
        for e in range(n_exp):
            pieces += [Piece(ex + "w1", e, (e, slice(0, i))), Piece(ex + "w3", e, (e, slice(i, 2 * i)))]
        if packed:
            pieces += [
                Piece(sh + "gate_proj.weight", None, (n_exp, slice(0, i))),
                Piece(sh + "up_proj.weight", None, (n_exp, slice(i, 2 * i))),
            ]
        return Remapped(tuple(pieces), (rows, 2 * i, c))
    pieces = [Piece(ex + "w2", e, (e,)) for e in range(n_exp)]
    if packed:
        pieces.append(Piece(sh + "down_proj.weight", None, (n_exp,)))
    return Remapped(tuple(pieces), (rows, c, i))


def release_name(param: str, slot: int | None = None) -> str:
    """The release-layout key of a parameter (or of one expert's slice), for error messages."""
    if slot is not None:
        owner, w = param.rsplit(".", 1)
        return f"language_model.{owner}.{slot}.{w}.weight"
    return "language_model." + param
