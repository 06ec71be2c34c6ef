"""GET /metrics: the engine's state read at every scrape, and the time to first token the routes observe."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from astrai_core.inference.engine import EngineClient

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# metric name (after "astrai_") -> (key of Engine.stats(), help text)
GAUGES = {"requests_running": ("running", "Requests in the running batch"),
          "requests_waiting": ("waiting", "Requests waiting to be admitted"),
          "kv_blocks_total": ("kv_blocks_total", "KV cache blocks in the pool"),
          "kv_blocks_used": ("kv_blocks_used", "KV cache blocks held by requests"),
          "kv_blocks_free": ("kv_blocks_free", "KV cache blocks free to allocate"),
          "kv_cache_bytes": ("kv_bytes", "Memory of the preallocated KV block pool")}
COUNTERS = {"prefix_cache_hits": ("prefix_cache_hits", "Prompt KV blocks found in the prefix cache"),
            "prefix_cache_queries": ("prefix_cache_queries", "Prompt KV blocks looked up in the prefix cache"),
            "prompt_tokens": ("prompt_tokens_total", "Prompt tokens submitted"),
            "generation_tokens": ("generated_tokens_total", "Tokens generated"),
            "requests_finished": ("requests_finished_total", "Requests the engine finished"),
            "preemptions": ("preemptions_total", "Requests preempted for KV blocks (recomputed later)")}


class EngineCollector:
    """Reads engine.stats() at every scrape (prometheus_client's custom-collector protocol)."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine

    def collect(self):
        s = self.engine.stats()
        for name, (key, doc) in GAUGES.items():
            if key in s:
                yield GaugeMetricFamily(f"astrai_{name}", doc, value=s[key])
        for name, (key, doc) in COUNTERS.items():
            if key in s:
                yield CounterMetricFamily(f"astrai_{name}", doc, value=s[key])
        yield GaugeMetricFamily("astrai_engine_alive", "1 while the engine loop runs", value=int(self.engine.alive))
        yield GaugeMetricFamily("astrai_torch_threads", "torch intra-op threads of the engine",
                                value=s["torch_threads"])


def metrics_registry(engine: EngineClient) -> tuple[CollectorRegistry, Histogram]:
    """A registry of its own per app (so two apps in one process do not collide), and its TTFT histogram."""
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    ttft = Histogram("astrai_time_to_first_token_seconds", "From a request's arrival to its first token",
                     registry=registry, buckets=TTFT_BUCKETS)
    return registry, ttft
