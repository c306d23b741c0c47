"""Tensor and expert parallelism: the shard plan, sharded loading, and gloo groups of 2 and 4
processes whose logits and greedy generations equal the single-process ones (fp32)."""

import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from m3lm.config import EngineConfig, ModelArgs
from m3lm.core import SamplingParams
from m3lm.distributed import steps
from m3lm.distributed.parallel import ParallelConfig, init_group
from m3lm.distributed.shard import head_ranges, local_shape, localize, param_shard
from m3lm.engine.engine import LLMEngine
from m3lm.engine.follower import follow
from m3lm.engine.launch import free_port
from m3lm.errors import ConfigError
from m3lm.layers.linear import weight_bytes
from m3lm.loader import load_model
from m3lm.models.minimax_m3 import MiniMaxM3
from tests.support.checkpoints import TP_MX_SPEC as MX_SPEC
from tests.support.checkpoints import TP_SPEC as SPEC
from tests.support.checkpoints import (
    Spec,
    hf_model,
    hf_vl_config,
    mxfp8_release,
    quantize_hf,
    release_config,
    to_hf_layout,
    to_release,
    write_checkpoint,
    write_m3_tokenizer,
    write_mxfp8_release,
)
from tests.support.paths import PATIENCE_S, REPO, fixture_dirs

PROMPTS = [[(7 * i + 3) % 90 + 1 for i in range(19)], [(5 * i + 1) % 90 + 1 for i in range(11)]]
IDS = torch.tensor([PROMPTS[0] + PROMPTS[0][:5]])  # 24 tokens: past top-k x block, so MSA selects


def _args() -> ModelArgs:
    return ModelArgs.from_dict(release_config(SPEC))


@pytest.fixture(scope="module")
def random_dir(tmp_path_factory):
    """A tiny random release-layout checkpoint in 2 shards, so the suite stands alone."""
    path = tmp_path_factory.mktemp("random")
    return write_checkpoint(
        path, to_release(hf_model(SPEC, seed=3).state_dict(), SPEC), release_config(SPEC), 2
    )


@pytest.fixture(scope="module")
def mxfp8_dir(tmp_path_factory):
    """A random MXFP8 release export of MX_SPEC in 3 shards."""
    return write_mxfp8_release(tmp_path_factory.mktemp("mxfp8"), MX_SPEC, seed=5, shards=3)


# --- the shard plan (pure) ----------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("ep", [False, True])
def test_shard_plan_matches_the_sharded_model(world, ep):
    args = _args()
    with torch.device("meta"):
        full = dict(MiniMaxM3(args).named_parameters())
        covered = {n: torch.zeros(p.shape, dtype=torch.int32, device="cpu") for n, p in full.items()}
        for rank in range(world):
            pc = ParallelConfig(world, rank, ep)
            local = dict(MiniMaxM3(args, parallel=pc).named_parameters())
            assert local.keys() == full.keys()
            for name, p in local.items():
                shard = param_shard(name, tuple(full[name].shape), args, pc)
                assert tuple(p.shape) == local_shape(tuple(full[name].shape), shard), name
                covered[name][shard or ()] += 1
    for name, count in covered.items():
        # Split tensors are covered exactly once; replicated ones (norms, router, index_k) by all.
        kv = (
            name.endswith(("k_proj.weight", "v_proj.weight", "index_q_proj.weight")) and "index_k" not in name
        )
        lo, hi = int(count.min()), int(count.max())
        if kv and world > args.num_key_value_heads:
            assert lo == hi == world // args.num_key_value_heads, name
        else:
            assert lo == hi and lo in (1, world), name
    assert int(covered["lm_head.weight"].max()) == 1 and int(covered["model.norm.weight"].min()) == world


def test_kv_heads_follow_query_heads_when_replicated():
    args = _args()  # 8 q heads, 2 KV heads: at TP 4 ranks 0-1 keep KV head 0, ranks 2-3 head 1
    got = [head_ranges(args, ParallelConfig(4, r)) for r in range(4)]
    assert [(q.start, q.stop) for q, _ in got] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [kv.start for _, kv in got] == [0, 0, 1, 1] and all(len(kv) == 1 for _, kv in got)
    assert [(kv.start, kv.stop) for _, kv in (head_ranges(args, ParallelConfig(2, r)) for r in range(2))] == [
        (0, 1),
        (1, 2),
    ]


def test_sizes_that_do_not_divide_are_refused():
    with pytest.raises(
        ConfigError, match="num_attention_heads = 8 is not divisible by the tensor-parallel size 3"
    ):
        MiniMaxM3(_args(), parallel=ParallelConfig(3, 0))
    with pytest.raises(ConfigError, match="num_local_experts = 6"):
        MiniMaxM3(ModelArgs.from_dict(release_config(Spec())), parallel=ParallelConfig(4, 0, ep=True))


def test_localize_composes_pieces_with_shards():
    # fused [gate; up] of width 2 x 8, up half, rank 1 of 2 owns rows 4..8 of it -> source rows 12..16
    assert localize((slice(8, 16),), None, (16, 5), (slice(4, 8), slice(0, 5))) == (
        (slice(12, 16), slice(0, 5)),
        None,
    )
    # expert 5 of a stacked [E, I, C] tensor: with EP (rank owns experts 4..8) -> local slot 1
    assert localize((5,), 5, (8, 3, 2), (slice(4, 8), slice(0, 3), slice(0, 2))) == (
        (5, slice(0, 3), slice(0, 2)),
        1,
    )
    assert localize((), 2, (3, 2), (slice(4, 8), slice(0, 3), slice(0, 2))) is None  # another rank's expert
    # a release per-expert down [C, I] without EP: the rank's columns only
    assert localize((), 2, (2, 8), (slice(0, 8), slice(0, 2), slice(4, 8))) == ((slice(0, 2), slice(4, 8)), 2)


def test_step_messages_round_trip():
    step = steps.Step([5, 6, 7, 9], [3, 1], [0, 17], [2, 3], [[4, 2], [0, 1, 3, 8, 9]])
    header, payload = steps.encode_step(step)
    assert steps.decode_step(header, payload) == step
    for window in (None, 2.5):
        init = steps.Init(33, window, index_fp8=window is None, table_width=129)
        _, payload = steps.encode_init(init)
        assert payload.numel() == steps.INIT_SIZE
        assert steps.decode_init(payload) == init


# --- the sharded loader ---------------------------------------------------------------------------


def _layouts(tmp_path):
    sd = hf_model(SPEC, seed=4).state_dict()
    values, scales, _ = quantize_hf(sd)
    mx = release_config(SPEC)
    mx["text_config"]["quantization_config"] = {"quant_method": "mxfp8", "weight_block_size": [1, 32]}
    yield write_checkpoint(tmp_path / "hf", to_hf_layout(sd, SPEC, pack_shared=True), hf_vl_config(SPEC))
    yield write_checkpoint(tmp_path / "mx", mxfp8_release(values, scales, SPEC), mx, shards=3)
    yield from [d for d in fixture_dirs() if "mxfp8" in d.name]


def test_each_rank_reads_exactly_its_slice(tmp_path):
    """Packed shared expert (transformers layout) and MXFP8 slices not aligned to 32-blocks."""
    for path in _layouts(tmp_path):
        full = load_model(path, "cpu", torch.float32)
        ref = dict(full.named_parameters())
        for world, ep in ((2, False), (4, False), (4, True)):
            total = 0
            for rank in range(world):
                pc = ParallelConfig(world, rank, ep)
                model = load_model(path, "cpu", torch.float32, parallel=pc)
                for name, p in model.named_parameters():
                    shard = param_shard(name, tuple(ref[name].shape), full.args, pc)
                    assert torch.equal(p, ref[name][shard] if shard else ref[name]), (path.name, world, name)
                    total += p.numel()
            assert total < sum(p.numel() for p in ref.values()) * 1.25  # replicated: norms, router, index_k


# --- gloo groups --------------------------------------------------------------------------------


def _engine_greedy(model, max_tokens: int = 6, drafted: list | None = None, **config) -> list[list[int]]:
    """Two requests batched, prefilled in chunks of 8 tokens, `max_tokens` greedy tokens each
    (`drafted`: gets the number of draft tokens, with speculation)."""
    config = {"max_num_seqs": 2, "max_num_batched_tokens": 8, "max_model_len": 64, **config}
    engine = LLMEngine(model, None, EngineConfig(**config))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in PROMPTS]
    while engine.has_unfinished():
        engine.step()
    if drafted is not None:
        drafted.append(engine.speculator.stats.num_draft_tokens)
    return [s.output_ids for s in seqs]


def _rank_main(rank: int, world: int, port: int, cases: list, out: str) -> None:
    torch.set_num_threads(1)
    pc = init_group(ParallelConfig(world, rank), "gloo", f"tcp://127.0.0.1:{port}", 60.0)
    results = {}
    for name, path, ep, quant in cases:
        model = load_model(path, "cpu", torch.float32, quant=quant, parallel=replace(pc, ep=ep))
        with torch.inference_mode():
            logits = model(IDS)  # every rank runs the same full forward
        dtypes = {n: p.dtype for n, p in model.named_parameters()}
        results[f"{name}-ep{int(ep)}"] = {"bytes": weight_bytes(model), "dtypes": dtypes}
        if rank == 0:
            results[f"{name}-ep{int(ep)}"].update(logits=logits, greedy=_engine_greedy(model))
            steps.send(model.parallel, None)
        else:
            assert follow(model) > 0
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


def run_group(world: int, cases: list, tmp_path) -> list[dict]:
    """Load and run each case (name, path, ep, quant) on a gloo group of `world` processes: per rank,
    "{name}-ep{0|1}" -> resident bytes and parameter dtypes (rank 0: also logits and greedy ids)."""
    out = tmp_path / "results"
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, cases, str(out))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * world
    return [torch.load(f"{out}.{r}") for r in range(world)]


def assert_equal_to_single_process(result: dict, ref_model, what) -> None:
    """Sharded logits within 1e-5 (relative to the largest) of the single process's; same greedy ids."""
    with torch.inference_mode():
        ref = ref_model(IDS)
    err = float((result["logits"] - ref).abs().max() / ref.abs().max())
    assert err < 1e-5, (what, err)
    assert result["greedy"] == _engine_greedy(ref_model), what


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_logits_and_greedy_equal_single_process(world, random_dir, mxfp8_dir, tmp_path):
    """Float shards (a random checkpoint and every golden fixture) and 8-bit shards of an MXFP8 export (quant="mxfp8":
    e4m3 weights dequantised on the fly on the CPU), each with and without expert parallelism."""
    dirs = [("random", random_dir, "auto")]
    dirs += [(d.name, d, "auto") for d in fixture_dirs()]  # every golden fixture (MXFP8 dequantised)
    dirs.append(("mxfp8", mxfp8_dir, "mxfp8"))
    cases = [(name, str(path), ep, quant) for name, path, quant in dirs for ep in (False, True)]
    ranks = run_group(world, cases, tmp_path)
    assert len(ranks[0]) == len(cases)
    for name, path, quant in dirs:
        model = load_model(path, "cpu", torch.float32, quant=quant)
        for ep in (False, True):
            assert_equal_to_single_process(ranks[0][f"{name}-ep{int(ep)}"], model, (name, ep))
            if quant == "mxfp8":
                _check_8_bit_ranks([r[f"{name}-ep{int(ep)}"] for r in ranks], model)


def _check_8_bit_ranks(ranks: list[dict], single) -> None:
    """float8 exactly where the single process has it; about 1/N of its 8-bit bytes per rank."""
    world, full = len(ranks), weight_bytes(single)
    for r in ranks:
        assert r["dtypes"] == {n: p.dtype for n, p in single.named_parameters()}
        size = r["bytes"]
        assert size["uint8"] * 32 == size["float8_e4m3fn"]
        # 1/N, plus the replicated index-key head (and the KV heads two ranks share at N = 4)
        assert full["float8_e4m3fn"] / world <= size["float8_e4m3fn"] < 1.05 * full["float8_e4m3fn"] / world
        assert size["float32"] < 0.7 * full["float32"]  # vocab rows split; norms and router replicated


def _speculative_rank_main(rank: int, world: int, port: int, path: str, configs: dict, out: str) -> None:
    torch.set_num_threads(1)
    pc = init_group(ParallelConfig(world, rank), "gloo", f"tcp://127.0.0.1:{port}", 60.0)
    model = load_model(path, "cpu", torch.float32, parallel=pc)
    if rank == 0:  # the drafter (replicated, rank 0 only) reads the full hidden states the ranks agree on
        drafted = []
        greedy = {
            name: _engine_greedy(model, 12, drafted, speculative_config=c) for name, c in configs.items()
        }
        steps.send(model.parallel, None)
        torch.save((greedy, drafted), out)
    else:
        assert follow(model) > 0
    dist.destroy_process_group()


def test_speculative_greedy_under_tensor_parallelism_equals_plain_single_process(random_dir, tmp_path):
    """Verification steps of k + 1 positions go to every rank like any other step; rank 0 drafts
    (prompt lookup, and an EAGLE-3 head in the published format) and the tokens do not change."""
    from m3lm.models.eagle3 import published_config, random_drafter

    a = _args()
    drafter = random_drafter(
        tmp_path / "drafter",
        published_config(
            hidden_size=a.hidden_size, num_attention_heads=a.hidden_size // 16, num_key_value_heads=2,
            head_dim=16, intermediate_size=2 * a.hidden_size, vocab_size=a.vocab_size, layer_ids=[0, 1, 2],
        ),
        seed=2,
    )  # fmt: skip
    configs = {
        "ngram": {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        },
        "eagle3": {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": 3},
    }
    out, port = str(tmp_path / "greedy"), free_port()
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_speculative_rank_main, args=(r, 2, port, str(random_dir), configs, out))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(PATIENCE_S)
    assert [p.exitcode for p in procs] == [0, 0]
    got, drafted = torch.load(out)
    want = _engine_greedy(load_model(random_dir, "cpu", torch.float32), 12)
    assert got == {"ngram": want, "eagle3": want}
    assert drafted[1] >= 3 * 11 * len(PROMPTS) // 4  # the head drafted k tokens in most steps


def test_a_failed_worker_stops_generate_with_a_clear_error(tmp_path):
    """Rank 1's slice of lm_head holds NaN: its load fails, and rank 0 must not wait forever."""
    vocab = 384  # the model's rows; the tokenizer uses fewer ids
    assert write_m3_tokenizer(tmp_path) <= vocab
    spec = replace(SPEC, vocab=vocab)
    tensors = to_release(hf_model(spec, seed=1).state_dict(), spec)
    tensors["language_model.lm_head.weight"][vocab // 2 :] = float("nan")
    write_checkpoint(tmp_path, tensors, release_config(spec))
    cmd = [sys.executable, "-m", "m3lm", "generate", "--model", str(tmp_path), "--prompt", "once upon"]
    r = subprocess.run(
        [*cmd, "--tensor-parallel-size", "2", "--max-tokens", "4"],
        capture_output=True,
        text=True,
        timeout=PATIENCE_S,
        cwd=REPO,
    )
    assert r.returncode == 1, r.stderr
    assert "tensor-parallel rank 1" in r.stderr and "NaN" in r.stderr, r.stderr
    assert "worker rank 1 exited with code 1" in r.stderr, r.stderr
