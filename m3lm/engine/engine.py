"""The engine loop: admit requests, schedule a step, run it, sample, stop.

`LLMEngine.step()` advances every running request by one scheduled chunk and returns what each
request gained (new token ids; text is the caller's, `m3lm.text`) or that it finished. Everything that touches tensors is
in the runner and the sampler; the scheduler and block manager are pure Python.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from m3lm.cache.block_manager import BlockManager
from m3lm.cache.kv_cache import KVCache
from m3lm.cache.pool import PoolPlan, graph_reserve, plan_pool
from m3lm.config import EngineConfig
from m3lm.core import SamplingParams, StepOutput, TokenLogprob, validate_request
from m3lm.device import to_device
from m3lm.distributed import steps
from m3lm.engine.constraints import Constraint, Grammars, Masks, StepMasks
from m3lm.engine.drafter import EagleDrafter
from m3lm.engine.memory import peak_activation_bytes, profile_batches
from m3lm.engine.runner import ModelRunner
from m3lm.engine.scheduler import Scheduler
from m3lm.engine.sequence import Sequence
from m3lm.engine.speculation import Speculator, rollback
from m3lm.errors import ConfigError
from m3lm.layers.linear import weight_bytes
from m3lm.models.minimax_m3 import MiniMaxM3
from m3lm.sampler import Sampler, logprobs, make_generator
from m3lm.threads import library_threads

log = logging.getLogger("m3lm.engine")
GIB = 1 << 30
MAX_GRAPH_ROWS = 256  # rows of the largest decode graph; a larger step runs eagerly
GRAMMAR_COMPILE_BUDGET_S = 60.0  # a request waits this long for its grammar at most


@dataclass(frozen=True)
class EngineInfo:
    """What the engine runs with, as the startup log states it."""

    device: str
    dtype: str
    weight_bytes: int
    pool_tokens: int  # the KV pool's capacity in positions
    pool_bytes: int
    pool_source: str  # what sized it: gpu_memory_utilization, kv_cache_memory, kv_cache_tokens, cpu default
    max_model_len: int
    max_concurrency: float  # sequences of max_model_len the pool holds at once
    peak_activation_bytes: int | None  # measured on a GPU when the pool is sized from its memory
    budget_bytes: int | None = None  # what the GPU's memory left for the pool, if it sized it

    def summary(self) -> str:
        peak, budget = self.peak_activation_bytes, self.budget_bytes
        of = f" of a {budget / GIB:.2f} GiB budget" if budget else ""
        return (
            f"engine on {self.device} ({self.dtype}): weights {self.weight_bytes / GIB:.2f} GiB, "
            f"peak activation {'-' if peak is None else f'{peak / GIB:.2f} GiB'}; KV pool "
            f"{self.pool_tokens:,} tokens in {self.pool_bytes / GIB:.2f} GiB{of} (from {self.pool_source}), "
            f"{self.max_concurrency:.2f} concurrent sequences of max_model_len {self.max_model_len:,}"
        )


# Models past this size are not compiled for the CPU: the build makes a model of the same shape.
COMPILE_MAX_BYTES = 4 << 30


def compilable(model: MiniMaxM3, config: EngineConfig) -> bool:
    """Whether the CPU's compiled decode step (`engine.cpu_compile`) can run this model: one
    rank, exact MSA, plain float weights (none kept in 8 or 4 bits), and small enough to build
    beside it."""
    return (
        model.parallel.world == 1
        and config.msa_dense_window is None
        and all(p.is_floating_point() and p.element_size() > 1 for p in model.parameters())
        and sum(weight_bytes(model).values()) <= COMPILE_MAX_BYTES
    )


def eos_ids_of(tokenizer, generation_config: dict | None, extra=()) -> frozenset[int]:
    ids = set(getattr(tokenizer, "eos_token_ids", ()) or ()) | set(extra)
    eos = (generation_config or {}).get("eos_token_id")
    ids.update([eos] if isinstance(eos, int) else eos or [])
    return frozenset(ids)


class LLMEngine:
    def __init__(
        self,
        model: MiniMaxM3,
        tokenizer=None,
        config: EngineConfig | None = None,
        generation_config: dict | None = None,
        eos_ids=(),
        grammar_tokenizer: Callable[[], object] | None = None,
    ):
        """`eos_ids`: stop tokens beyond the tokenizer's and generation_config's (a server's
        engine has no tokenizer of its own); `grammar_tokenizer` loads the tokenizer structured
        output compiles its grammars against, when the engine has none (called when first needed).
        On the CPU the first engine of a model sets torch's threads (`threads.library_threads`)."""
        library_threads(model)
        self.model, self.tokenizer = model, tokenizer
        self.config = config = config or EngineConfig()
        self.generation_config = (
            generation_config if generation_config is not None else getattr(model, "generation_config", {})
        )
        args = model.args
        weight = model.lm_head.weight
        self.device = weight.device
        parallel = model.parallel
        # Decode graphs are single-process only: collectives are not captured into them.
        use_graphs = (
            parallel.world == 1
            and self.device.type == "cuda"
            and config.cuda_graphs
            and config.msa_dense_window is None
        )
        head = self._load_drafter()  # before the pool is sized: its weights count among the weights
        extra = EagleDrafter.bytes_per_page(head, args.index_block_size) if head is not None else 0
        spec = config.speculative_config
        # a decode row per position: with speculation a sequence verifies 1 + k of them a step
        decode_rows = config.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0))
        graph_rows = min(decode_rows, MAX_GRAPH_ROWS)
        pool = self._plan_pool(graph_rows if use_graphs else 0, extra)
        self.max_model_len, num_pages, page = pool.max_model_len, pool.pages, args.index_block_size
        kv_heads = model.model.layers[0].self_attn.n_kv  # this rank's, under tensor parallelism
        # One spare page beyond the block manager's: padding rows of graph-captured steps write there.
        self.cache = KVCache(args, num_pages + 1, self.device, weight.dtype, config.index_cache_fp8, kv_heads)
        max_pages = -(-self.max_model_len // page)  # a sequence's pages at most
        init = steps.Init(num_pages + 1, config.msa_dense_window, config.index_cache_fp8, max_pages)
        steps.send(parallel, init)  # followers size theirs
        events = config.kv_events_config is not None and config.kv_events_config.enabled
        self.blocks = BlockManager(num_pages, page, config.prefix_caching, events)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens)
        graphs = None
        if use_graphs:
            from m3lm.engine.cuda_graphs import DecodeGraphs

            capture = head.args.layer_ids if head is not None else ()
            graphs = DecodeGraphs(model, self.cache, graph_rows, max_pages, num_pages, capture)
        elif config.cpu_compile != "off" and self.device.type == "cpu" and compilable(model, config):
            from m3lm.engine.cpu_compile import CompiledDecode

            graphs = CompiledDecode(model, self.cache, decode_rows, num_pages, max_pages, config.cpu_compile)
        self.runner = ModelRunner(model, self.cache, config.msa_dense_window, graphs, max_pages)
        self.speculator = self._speculator(head, num_pages + 1, max_pages if use_graphs else 0)
        self.sampler = Sampler()
        self.eos_ids = eos_ids_of(tokenizer, self.generation_config, eos_ids)
        source = (lambda: tokenizer) if tokenizer is not None else grammar_tokenizer
        self.grammars = Grammars(source, args.vocab_size, self.eos_ids) if source is not None else None
        self.masks = Masks(args.vocab_size, self.device)
        self._compiling: list[Sequence] = []  # requests whose grammar is compiling
        self.requests: dict[str, Sequence] = {}
        self._ids = itertools.count()  # sequence ids
        self._request_ids = itertools.count()  # of requests added without one: req-0, req-1, ...
        self.kv_events = None  # the publisher of the prefix cache's events, when asked for
        if events:  # last: a failed start leaves no thread or bound address behind
            from m3lm.engine.kv_events import KVEventPublisher

            self.kv_events = KVEventPublisher(config.kv_events_config, page)
        log.info("%s", self.info.summary())

    def _load_drafter(self):
        """The EAGLE-3 head of `EngineConfig.speculative_config`, loaded beside the model (None
        without one)."""
        spec = self.config.speculative_config
        if spec is None or spec.method != "eagle3":
            return None
        from m3lm.models.eagle3 import load_eagle3

        return load_eagle3(spec.model, self.model, self.model.lm_head.weight.dtype, self.device)

    def _speculator(self, head, num_pages: int, graph_pages: int) -> Speculator | None:
        """The speculative decoding of `EngineConfig.speculative_config`: with an EAGLE-3 `head`,
        its key/value pool of `num_pages` pages, and the runner capturing the layers it reads;
        with `graph_pages` (tables of that width) its drafting replayed from CUDA graphs."""
        spec = self.config.speculative_config
        if spec is None:
            return None
        drafter = None
        if head is not None:
            drafter = EagleDrafter(head, num_pages, self.model.args.index_block_size, self.device)
            self.runner.capture = head.args.layer_ids
            if graph_pages:
                from m3lm.engine.drafter import DraftGraphs

                batch = min(self.config.max_num_seqs, MAX_GRAPH_ROWS)
                drafter.graphs = DraftGraphs(drafter, batch, graph_pages, spec.num_speculative_tokens)
        return Speculator(spec, drafter)

    def _plan_pool(self, graph_rows: int, drafter_bytes_per_page: int = 0) -> PoolPlan:
        """Size the KV pool (`plan_pool`); on a GPU sized from its memory, after measuring the
        peak activation of the largest step and keeping back what decode graphs of up to
        `graph_rows` rows (0: none) need. A drafter's pool has as many pages as the model's, so
        its bytes per page count in each page's. Sets `self.info`."""
        model, config = self.model, self.config
        args, weight = model.args, model.lm_head.weight
        kv_heads = model.model.layers[0].self_attn.n_kv
        max_pos = args.max_position_embeddings
        explicit = config.kv_cache_tokens is not None or config.kv_cache_memory is not None
        figures, peak = {}, None
        if self.device.type == "cuda" and not explicit:
            longest = min(config.max_model_len or max_pos, max_pos)
            batches = profile_batches(config.max_num_batched_tokens, config.max_num_seqs, longest)
            peak = peak_activation_bytes(model, batches, config.index_cache_fp8, config.msa_dense_window)
            reserve = graph_reserve(graph_rows, args.vocab_size) if graph_rows else 0
            figures = {
                "total_bytes": torch.cuda.get_device_properties(self.device).total_memory,
                "utilization": config.gpu_memory_utilization,
                "weight_bytes": torch.cuda.memory_allocated(self.device),
                "peak_activation_bytes": peak,
                "reserve_bytes": reserve,
            }
        plan = plan_pool(
            bytes_per_page=KVCache.bytes_per_page(args, weight.dtype, config.index_cache_fp8, kv_heads)
            + drafter_bytes_per_page,
            page_size=args.index_block_size,
            max_positions=max_pos,
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
            explicit_tokens=config.kv_cache_tokens,
            explicit_bytes=config.kv_cache_memory,
            **figures,
        )
        need = plan.bytes // plan.pages * (plan.pages + 1)  # and the spare page
        free = _free_bytes(self.device)
        if self.device.type == "cuda" and need > free:
            raise ConfigError(
                f"the KV cache needs {need / GIB:.2f} GiB but the GPU has {free / GIB:.2f} GiB free "
                "(another process, or another engine in this one?); lower --gpu-memory-utilization "
                "or set --kv-cache-memory"
            )
        if self.device.type == "cpu" and free is not None and need > free:
            raise ConfigError(
                f"the KV cache needs {need / GIB:.2f} GiB but this machine has {free / GIB:.2f} GiB "
                "of memory available; lower --kv-cache-memory or --kv-cache-tokens (or --max-num-seqs "
                "and --max-model-len, which size the default)"
            )
        if config.max_model_len is not None and config.max_model_len > max_pos:
            log.warning(
                "max_model_len = %d is above the model's %d positions (max_position_embeddings in "
                "config.json): the context is %d tokens",
                config.max_model_len,
                max_pos,
                max_pos,
            )
        if config.max_model_len is None and plan.max_model_len < max_pos:
            log.info(
                "max_model_len = %d: what the KV pool holds (the model allows %d; set --max-model-len "
                "and the pool's size to change it)",
                plan.max_model_len,
                max_pos,
            )
        self.info = EngineInfo(
            device=str(self.device),
            dtype=str(weight.dtype).removeprefix("torch."),
            weight_bytes=sum(weight_bytes(model).values()),
            pool_tokens=plan.tokens,
            pool_bytes=plan.bytes,
            pool_source=plan.source,
            max_model_len=plan.max_model_len,
            max_concurrency=plan.max_concurrency,
            peak_activation_bytes=peak,
            budget_bytes=plan.budget_bytes,
        )
        return plan

    def default_params(self, **overrides) -> SamplingParams:
        return SamplingParams.from_generation_config(self.generation_config, **overrides)

    def validate(self, prompt_ids: list[int], params: SamplingParams | None = None) -> None:
        """Raise ValueError for an empty, too long or out-of-vocabulary prompt, or a logit bias
        outside the vocabulary (reads no engine state)."""
        validate_request(prompt_ids, params, self.max_model_len, self.model.args.vocab_size)

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> Sequence:
        """Queue a request; raises ValueError for an empty, too long or out-of-vocabulary prompt."""
        request_id = request_id if request_id is not None else f"req-{next(self._request_ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_ids = [int(t) for t in prompt_ids]
        self.validate(prompt_ids, params)
        seq = Sequence(
            seq_id=next(self._ids),
            request_id=request_id,
            prompt_ids=prompt_ids,
            params=params,
            output_limit=min(params.max_tokens, self.max_model_len - len(prompt_ids)),
            generator=make_generator(params.seed, self.device),
        )
        if params.structured is not None or params.thinking is not None:
            seq.constraint = self._constraint(params)
            if not seq.constraint.ready:
                self._compiling.append(seq)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def _constraint(self, params: SamplingParams) -> Constraint:
        if params.structured is not None and self.grammars is None:
            raise ValueError("structured output needs the checkpoint's tokenizer")
        grammar = self.grammars.submit(params.structured) if params.structured is not None else None
        return Constraint(grammar, params.thinking)

    def _start_grammars(self) -> list[StepOutput]:
        """Give each request whose grammar has compiled its matcher; fail those that could not
        compile, or not within the compile budget (the grammar is then remembered as refused);
        cancel the compiles no request waits for any more."""
        results, waiting, left = [], [], []
        now = time.monotonic()
        for seq in self._compiling:
            c = seq.constraint
            if seq.finished:
                left.append(seq)
            elif c.compiling and now - c.since > GRAMMAR_COMPILE_BUDGET_S:
                error = self.grammars.refuse(
                    seq.params.structured,
                    f"structured output: the grammar took longer than {GRAMMAR_COMPILE_BUDGET_S:g} s to "
                    "compile (this server's budget): simplify it",
                )
                results.append(self.fail(seq, error))
                left.append(seq)
            elif c.compiling:
                waiting.append(seq)
            elif (error := c.start()) is not None:
                results.append(self.fail(seq, error))
        awaited = {id(s.constraint._grammar) for s in waiting}
        for seq in left:
            if id(seq.constraint._grammar) not in awaited:
                self.grammars.release(seq.params.structured, seq.constraint._grammar)
        self._compiling = waiting
        return results

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its pages (no-op when it is unknown or already done)."""
        seq = self.requests.pop(request_id, None)
        if seq is not None and not seq.finished:
            self.scheduler.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def reset_prefix_cache(self) -> None:
        """Forget every cached page's name (running requests keep their pages)."""
        self.blocks.reset()
        self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.publish(self.blocks.take_events())

    def step(self) -> list[StepOutput]:
        results = self._step()
        self._publish_kv_events()
        return results

    def _step(self) -> list[StepOutput]:
        started = self._start_grammars() if self._compiling else []
        plan = self.scheduler.schedule()
        if not plan:
            if self._compiling:  # nothing else to do: wait a little for a compile, never spin
                futures = [s.constraint._grammar for s in self._compiling]
                concurrent.futures.wait(futures, 0.01, concurrent.futures.FIRST_COMPLETED)
            return started
        tables = [self.blocks.table(seq.seq_id) for seq, _ in plan]
        ready, logits, scored = self.runner.run(plan, tables)
        # the rows `_sample` takes: their grammars' masks are filled while the forward runs
        sampled = [s for s in ready if not s.draft_ids and s.output_limit > 0]
        masks = self.masks.fill([s.constraint for s in sampled])
        for seq, _ in plan:  # name the pages this step filled, for later prompts with the same prefix
            self.blocks.seal(seq.seq_id, seq.num_cached - len(seq.draft_ids), seq.tokens)
        n_rows = sum(1 + len(s.draft_ids) for s in ready)
        if scored:
            _score_prompts(logits[n_rows:], scored)
            logits = logits[:n_rows]
        scored_only = [self._scored_only(s) for s in ready if s.output_limit == 0]
        if scored_only:  # prompts scored with nothing to generate: they end without a sample
            keep = [i for i, s in enumerate(ready) if s.output_limit > 0]  # none of them has drafts
            ready, logits = [ready[i] for i in keep], logits[keep]
        results = started + scored_only
        if any(s.draft_ids for s in ready):
            ready, logits = self._verify(ready, logits, results)
        if ready:
            assert ready == sampled
            self._sample(ready, logits, results, masks)
        if self.speculator is not None:
            self.speculator.propose([s for s, _ in plan], self.blocks, self.runner)
        return results

    def _verify(self, ready: list[Sequence], logits: torch.Tensor, results: list[StepOutput]):
        """Verify the drafts of the sequences that hold some (`Speculator.verify`), append what
        each emits to `results`; returns the other sequences and their rows of `logits`."""
        plain, plain_rows, spec, spec_rows, at = [], [], [], [], 0
        for s in ready:
            n = 1 + len(s.draft_ids)
            (spec if s.draft_ids else plain).append(s)
            (spec_rows if s.draft_ids else plain_rows).extend(range(at, at + n))
            at += n
        if plain:  # rows of both kinds: each kind's rows gathered
            spec_logits, logits = (
                logits[to_device(spec_rows, logits.device)],
                logits[to_device(plain_rows, logits.device)],
            )
        else:
            spec_logits = logits
        verified = self.speculator.verify(self.sampler, spec, spec_logits)
        for seq, v in zip(spec, verified, strict=True):
            if not v.finite:
                results.append(self.fail(seq, "the model produced non-finite logits"))
                continue
            rollback(self.blocks, seq, v)
            try:
                out = None
                for token, lp in zip(v.tokens, v.logprobs, strict=True):
                    one = self._append(seq, token, lp)
                    out = one if out is None else out.extend(one)
                    if one.finished:
                        break
                results.append(out)
            except Exception as e:  # a fault in one request's text handling ends that request only
                results.append(self.fail(seq, f"{type(e).__name__}: {e}"))
        return plain, logits if plain else logits[:0]

    def _sample(
        self, ready: list[Sequence], logits: torch.Tensor, results: list[StepOutput], masks: StepMasks | None
    ) -> None:
        """Sample one token for each sequence from its row of `logits`, under its row of `masks`
        (`Masks.fill` of their constraints); append them to `results`."""
        finite = torch.isfinite(logits).all(dim=-1)  # of the model's logits, before any mask
        if masks is not None:
            masks.apply(logits)
        out = self.sampler(
            logits,
            [s.params for s in ready],
            [s.prompt_ids for s in ready],
            [s.output_ids for s in ready],
            [s.generator for s in ready],
        )
        # The one host transfer of these rows: sampled ids, and which rows had non-finite logits.
        token_ids, ok = torch.stack([out.token_ids, finite.to(out.token_ids.dtype)]).tolist()
        lps = _logprobs(out, ready, token_ids)
        for i, seq in enumerate(ready):
            if not ok[i]:
                results.append(self.fail(seq, "the model produced non-finite logits"))
                continue
            try:
                results.append(self._append(seq, token_ids[i], lps[i]))
            except Exception as e:  # a fault in one request's handling (its grammar) ends it only
                results.append(self.fail(seq, f"{type(e).__name__}: {e}"))

    def fail(self, seq: Sequence, message: str) -> StepOutput:
        """End one request with finish_reason "error"; the others go on."""
        seq.error = message
        self.scheduler.finish(seq, "error")
        self.requests.pop(seq.request_id, None)
        return StepOutput(
            seq.request_id,
            finished=True,
            finish_reason="error",
            error=message,
            queued_s=_queued(seq, not seq.output_ids),
        )

    def _scored_only(self, seq: Sequence) -> StepOutput:
        """End a request whose prompt is scored and that generates nothing (max_tokens 0)."""
        self.scheduler.finish(seq, "length")
        self.requests.pop(seq.request_id, None)
        return StepOutput(
            seq.request_id,
            finished=True,
            finish_reason="length",
            prompt_logprobs=seq.prompt_logprobs,
            queued_s=_queued(seq, True),
        )

    def _append(self, seq: Sequence, token: int, lp: TokenLogprob | None) -> StepOutput:
        p = seq.params
        first = not seq.output_ids
        if seq.constraint is not None and not seq.constraint.accept(token):
            raise ValueError(f"structured output: the grammar refused token {token}")
        seq.output_ids.append(token)
        res = StepOutput(
            seq.request_id, [token], num_prefix_cached=seq.num_prefix_cached, queued_s=_queued(seq, first)
        )
        if first and p.prompt_logprobs is not None:
            res.prompt_logprobs = seq.prompt_logprobs
        if lp is not None:
            seq.logprobs.append(lp)
            res.new_logprobs.append(lp)
        stop_token = token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids)
        if seq.constraint is not None and seq.constraint.terminated:
            stop_token = True  # the grammar is complete (its stop token, or nothing can follow)
        reason = "stop" if stop_token else "length" if len(seq.output_ids) >= seq.output_limit else None
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self.requests.pop(seq.request_id, None)
            res.finished, res.finish_reason = True, reason
        return res


def _queued(seq: Sequence, first: bool) -> float | None:
    """A request's wait before it was first scheduled, on its first output."""
    if not first or seq.first_scheduled_time is None:
        return None
    return seq.first_scheduled_time - seq.arrival


def _free_bytes(device: torch.device) -> int | None:
    """Memory the pool can still take: on a GPU what is free plus what torch holds unused; on the
    CPU what the machine (and its memory cgroup, if one limits it) has available; None if unknown."""
    if device.type == "cuda":
        held = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + held
    if device.type != "cpu":
        return None
    return available_ram()


def available_ram() -> int | None:
    """MemAvailable, lowered to what a cgroup v2 memory limit leaves; None where neither is known."""
    figures = []
    try:
        with open("/proc/meminfo") as f:
            figures += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            figures.append(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(figures) if figures else None


def _score_prompts(logits: torch.Tensor, scored: list[tuple[Sequence, range]]) -> None:
    """Append to each sequence the logprobs of the prompt tokens its rows of `logits` [P, V]
    score (row j of a sequence: its position at[j], scoring the token after it)."""
    targets = [seq.prompt_ids[p + 1] for seq, at in scored for p in at]
    k = max(seq.params.prompt_logprobs for seq, _ in scored)
    chosen, top_ids, top_lp, ranks = logprobs(
        logits, torch.tensor(targets, device=logits.device), k, ranks=True
    )
    chosen, top_ids, top_lp, ranks = chosen.tolist(), top_ids.tolist(), top_lp.tolist(), ranks.tolist()
    j = 0
    for seq, at in scored:
        kk = seq.params.prompt_logprobs
        for _ in at:
            top = list(zip(top_ids[j][:kk], top_lp[j][:kk], strict=True))
            seq.prompt_logprobs.append(TokenLogprob(targets[j], chosen[j], top, ranks[j]))
            j += 1


def _logprobs(out, ready: list[Sequence], token_ids: list[int]) -> list[TokenLogprob | None]:
    if out.logprobs is None:
        return [None] * len(ready)
    chosen = out.logprobs.tolist()
    top_ids, top_lp = out.top_ids.tolist(), out.top_logprobs.tolist()
    res = []
    for i, seq in enumerate(ready):
        k = seq.params.logprobs
        if k is None:
            res.append(None)
            continue
        res.append(
            TokenLogprob(token_ids[i], chosen[i], list(zip(top_ids[i][:k], top_lp[i][:k], strict=True)))
        )
    return res
