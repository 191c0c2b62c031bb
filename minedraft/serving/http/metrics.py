"""Prometheus metrics for one engine (prometheus_client, text format at GET /metrics).

Counters and gauges that the engine already keeps (requests by outcome, tokens, queue, KV blocks, acceptance per
draft position) are read from Engine.stats() at scrape time by a custom collector, so there is one source of
truth. Per-step timings (Td, Tv, step time, overlap efficiency) are histograms fed by the engine's StepStats.
Each app gets its own registry, so several servers in one process (tests) do not collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ...engine.step_stats import Step

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TIME_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_OVERLAP_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0, 1.25)


class _EngineCollector:
    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        e = self.engine
        up = GaugeMetricFamily("minedraft_engine_up", "1 while both workers are alive and the engine serves")
        up.add_metric([], 1.0 if e.health()["ok"] else 0.0)
        yield up
        if e.scheduler is None:
            return
        s = e.stats()
        req = CounterMetricFamily("minedraft_requests", "Engine requests by outcome", labels=["outcome"])
        for outcome in ("finished", "aborted", "failed"):
            req.add_metric([outcome], s[outcome])
        yield req
        for name, key, doc in (("output_tokens", "output_tokens", "Tokens generated"),
                               ("draft_tokens", "draft_tokens", "Draft tokens proposed"),
                               ("accepted_tokens", "accepted_tokens", "Draft tokens accepted by the verifier"),
                               ("steps", "steps", "Verify steps"),
                               ("prefill_tokens", "prefill_tokens", "Prompt tokens the verifier computed (the rest "
                                "came from the prefix cache)"),
                               ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the "
                                "prefix cache (all but each prompt's last)"),
                               ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache"),
                               ("prefix_cache_evictions", "prefix_cache_evictions", "Cached KV blocks evicted to "
                                "make room")):
            yield CounterMetricFamily(f"minedraft_{name}", doc, value=s[key])
        for name, key, doc in (("requests_running", "running", "Requests admitted to the two batches"),
                               ("requests_waiting", "waiting", "Requests waiting for admission"),
                               ("kv_blocks_free", "kv_blocks_free", "KV cache blocks free (per model)"),
                               ("kv_blocks_total", "kv_blocks_total", "KV cache blocks in all (per model)"),
                               ("prefix_cache_blocks", "prefix_cache_blocks", "KV blocks holding a cached prefix "
                                "(in use or kept for reuse)"),
                               ("prefix_cache_hit_rate", "prefix_cache_hit_rate", "prefix_cache_hits / "
                                "prefix_cache_queries (tokens)")):
            yield GaugeMetricFamily(f"minedraft_{name}", doc, value=s[key])
        drafted = CounterMetricFamily("minedraft_position_drafted", "Draft tokens proposed at each draft "
                                      "position (0 = first)", labels=["position"])
        accepted = CounterMetricFamily("minedraft_position_accepted", "Draft tokens accepted at each draft "
                                       "position", labels=["position"])
        rate = GaugeMetricFamily("minedraft_acceptance_by_position", "accepted / drafted at each draft position",
                                 labels=["position"])
        for i, (d, a) in enumerate(zip(s["drafted_by_position"], s["accepted_by_position"])):
            drafted.add_metric([str(i)], d)
            accepted.add_metric([str(i)], a)
            rate.add_metric([str(i)], a / d if d else 0.0)
        yield drafted
        yield accepted
        yield rate
        by_src = CounterMetricFamily("minedraft_source_drafted", "Draft tokens proposed by draft source (suffix "
                                     "drafts: suffix, or model for a hybrid's model rows)", labels=["source"])
        acc_src = CounterMetricFamily("minedraft_source_accepted", "Draft tokens accepted by draft source",
                                      labels=["source"])
        for src, d in sorted(s["drafted_by_source"].items()):
            by_src.add_metric([src], d)
            acc_src.add_metric([src], s["accepted_by_source"].get(src, 0))
        yield by_src
        yield acc_src


class Metrics:
    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        r = self.registry
        self.http = Counter("minedraft_http_requests", "HTTP requests by route and status code",
                            ["route", "status"], registry=r)
        self.td = Histogram("minedraft_draft_seconds", "Td: time to draft one batch", buckets=_TIME_BUCKETS,
                            registry=r)
        self.tv = Histogram("minedraft_verify_seconds", "Tv: time to verify one batch", buckets=_TIME_BUCKETS,
                            registry=r)
        self.step = Histogram("minedraft_step_seconds", "Wall time per verify step", buckets=_TIME_BUCKETS,
                              registry=r)
        self.overlap = Histogram("minedraft_overlap_efficiency", "max(Td, Tv) / step time per step",
                                 buckets=_OVERLAP_BUCKETS, registry=r)
        if engine.step_stats is not None:
            engine.step_stats.subscribers.append(self.observe)

    def observe(self, st: Step) -> None:
        if st.drafted:  # empty drafts (autoregressive mode) have no draft time to speak of
            self.td.observe(st.draft_s)
        self.tv.observe(st.verify_s)
        self.step.observe(st.step_s)
        self.overlap.observe(st.overlap)

    def render(self) -> bytes:
        return generate_latest(self.registry)
