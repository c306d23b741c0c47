"""Prometheus metrics, with vLLM's names under the `m3lm:` prefix.

One registry per server (tests run several in one process). The engine's outputs update them
as they arrive (`observe_stats`, `observe_output`); the app counts admission rejections.
The load gauges and the cache's settings, which routers read to place requests (llm-d's and the
Gateway API inference extension's scorers, among others), are also exported under vLLM's own
`vllm:` names: one value each, two names (`Load`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily

from m3lm.core import StepOutput
from m3lm.wire import ReadyInfo, Stats

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

# the load gauges, each exported as m3lm:NAME and vllm:NAME (the routers' spelling)
LOAD = {
    "num_requests_running": "Requests in the running batch",
    "num_requests_waiting": "Requests waiting to run",
    "kv_cache_usage_perc": "Fraction of KV-cache pages in use (1 = full)",
}
PREFIXES = ("m3lm", "vllm")


def cache_config_labels(info: ReadyInfo) -> dict[str, str]:
    """`cache_config_info`'s labels, as vLLM names them: a block is one page of `page_size`
    positions (K, V and MSA index keys together)."""
    return {
        "block_size": str(info.page_size),
        "num_gpu_blocks": str(info.kv_tokens // max(info.page_size, 1)),
        "cache_dtype": info.kv_dtype,
        "index_cache_dtype": info.index_dtype,
        "enable_prefix_caching": str(info.prefix_caching),
        "prefix_caching_hash_algo": "sha256",
    }


class Load:
    """A collector of the load gauges and the cache's settings under both prefixes (values set
    from any thread; each is read whole when scraped)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.values = dict.fromkeys(LOAD, 0.0)
        self.cache_config: dict[str, str] | None = None  # known once the engine is ready

    def collect(self):
        for prefix in PREFIXES:
            for key, doc in LOAD.items():
                g = GaugeMetricFamily(f"{prefix}:{key}", doc, labels=["model_name"])
                g.add_metric([self.model_name], self.values[key])
                yield g
            if (labels := self.cache_config) is not None:
                g = GaugeMetricFamily(
                    f"{prefix}:cache_config_info", "The KV cache's settings (value 1)", labels=list(labels)
                )
                g.add_metric(list(labels.values()), 1.0)
                yield g


class Metrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self.load = Load(model_name)
        r.register(self.load)
        self.prompt_tokens = Counter("m3lm:prompt_tokens", "Prefilled prompt tokens", labels, registry=r)
        self.generation_tokens = Counter("m3lm:generation_tokens", "Generated tokens", labels, registry=r)
        self.prefix_queries = Counter(
            "m3lm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", labels, registry=r
        )
        self.prefix_hits = Counter(
            "m3lm:prefix_cache_hits", "Prompt tokens found in the prefix cache", labels, registry=r
        )
        self.preemptions = Counter(
            "m3lm:num_preemptions", "Sequences preempted for pages", labels, registry=r
        )
        self.rejections = Counter(
            "m3lm:admission_rejections", "Requests refused with 503", labels, registry=r
        )
        self.ttft = Histogram(
            "m3lm:time_to_first_token_seconds", "Time to first token", labels, buckets=_LATENCY, registry=r
        )
        self.itl = Histogram(
            "m3lm:inter_token_latency_seconds", "Time between tokens", labels, buckets=_LATENCY, registry=r
        )
        self.e2e = Histogram(
            "m3lm:e2e_request_latency_seconds", "Request latency", labels, buckets=_LATENCY, registry=r
        )
        self.queue = Histogram(
            "m3lm:request_queue_time_seconds",
            "Time waiting to be scheduled",
            labels,
            buckets=_LATENCY,
            registry=r,
        )
        self.spec_drafts = Counter(
            "m3lm:spec_decode_num_drafts", "Verification steps of a sequence with drafts", labels, registry=r
        )
        self.spec_draft_tokens = Counter(
            "m3lm:spec_decode_num_draft_tokens", "Drafted tokens verified", labels, registry=r
        )
        self.spec_accepted = Counter(
            "m3lm:spec_decode_num_accepted_tokens", "Drafted tokens accepted", labels, registry=r
        )
        self.spec_accepted_per_pos = Counter(
            "m3lm:spec_decode_num_accepted_tokens_per_pos",
            "Drafted tokens accepted, by their position among a step's drafts",
            [*labels, "position"],
            registry=r,
        )
        self.name = model_name
        self._preempted = 0
        self._spec = (0, 0, 0, [])  # the engine's speculation counters last seen
        self._prefix = (0, 0)  # the scheduler's (prompt, cached) token counts last seen

    def observe_stats(self, stats: Stats) -> None:
        """The gauges and counters the engine reports after a step (any thread)."""
        m = self.name
        self.load.values.update(
            num_requests_running=stats.running,
            num_requests_waiting=stats.waiting,
            kv_cache_usage_perc=stats.kv_used / max(stats.kv_pages, 1),
        )
        prefix = (stats.prompt_tokens, stats.cached_tokens)
        self.prefix_queries.labels(m).inc(max(prefix[0] - self._prefix[0], 0))
        self.prefix_hits.labels(m).inc(max(prefix[1] - self._prefix[1], 0))
        self._prefix = prefix
        if stats.preemptions > self._preempted:
            self.preemptions.labels(m).inc(stats.preemptions - self._preempted)
            self._preempted = stats.preemptions
        self._observe_spec(stats)

    def _observe_spec(self, stats: Stats) -> None:
        m, (drafts, tokens, accepted, per_pos) = self.name, self._spec
        if stats.spec_drafts <= drafts:
            return
        self.spec_drafts.labels(m).inc(stats.spec_drafts - drafts)
        self.spec_draft_tokens.labels(m).inc(stats.spec_draft_tokens - tokens)
        self.spec_accepted.labels(m).inc(stats.spec_accepted_tokens - accepted)
        for pos, n in enumerate(stats.spec_accepted_per_pos):
            before = per_pos[pos] if pos < len(per_pos) else 0
            self.spec_accepted_per_pos.labels(m, str(pos)).inc(n - before)
        self._spec = (
            stats.spec_drafts,
            stats.spec_draft_tokens,
            stats.spec_accepted_tokens,
            list(stats.spec_accepted_per_pos),
        )

    def observe_output(
        self, stream, out: StepOutput, previous: float | None, queued_s: float | None, now: float
    ) -> None:
        """One request's output, received at `now` by its stream (a `RequestStream`) whose token
        before came at `previous` (None: these are its first)."""
        m = self.name
        if out.new_token_ids:
            self.generation_tokens.labels(m).inc(len(out.new_token_ids))
            if previous is None:
                self.prompt_tokens.labels(m).inc(len(stream.prompt_ids))
                self.ttft.labels(m).observe(now - stream.arrival)
                if queued_s is not None:
                    self.queue.labels(m).observe(queued_s)
            else:
                self.itl.labels(m).observe(now - previous)
        if out.finished:
            self.observe_end(stream, now)

    def observe_end(self, stream, now: float) -> None:
        """A request's reply ended at `now` (the engine finished it, or a stop string did)."""
        self.e2e.labels(self.name).observe(now - stream.arrival)

    def render(self, info: ReadyInfo | None = None) -> bytes:
        """The exposition text; `info` (the engine's, once ready) gives the cache's settings."""
        if info is not None and self.load.cache_config is None:
            self.load.cache_config = cache_config_labels(info)
        return generate_latest(self.registry)
