"""Prometheus metrics with vLLM's names under the prefix `tinyvllm:` (vLLM's dashboards work after a prefix change),
each labelled with `model_name`. Counters and histograms are fed by the engine thread after every step; the gauges
are read from the engine's newest state when scraped, so they fall back to idle as soon as requests end."""
from __future__ import annotations
from collections.abc import Callable
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from tinyvllm.engine.output_processor import IterationStats
from tinyvllm.engine.request import SchedulerStats

PREFIX = "tinyvllm:"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)


class PrometheusStatLogger:
  def __init__(self, model_name: str, speculative: bool = False):
    self.registry = CollectorRegistry()   # one per server: nothing global
    labels, reg = ["model_name"], self.registry
    def gauge(name, doc): return Gauge(PREFIX + name, doc, labels, registry=reg).labels(model_name)
    def counter(name, doc): return Counter(PREFIX + name, doc, labels, registry=reg).labels(model_name)
    def histogram(name, doc, buckets): return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=reg).labels(model_name)
    self.running = gauge("num_requests_running", "Requests in the running batch")
    self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled")
    self.kv_usage = gauge("kv_cache_usage_perc", "KV cache usage: referenced blocks / all blocks (1 = full)")
    self.preemptions = counter("num_preemptions", "Sequences preempted (their KV cache dropped, recomputed later)")
    self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that produced their first token")
    self.generation_tokens = counter("generation_tokens", "Generated tokens")
    self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
    self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
    self._success = Counter(PREFIX + "request_success", "Finished requests by finish reason", labels + ["finished_reason"],
                            registry=reg)
    self._model_name = model_name
    self.ttft = histogram("time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS)
    self.itl = histogram("inter_token_latency_seconds", "Time between steps that gave a request tokens", ITL_BUCKETS)
    self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish", E2E_BUCKETS)
    self.spec = None
    if speculative:
      self.spec = (counter("spec_decode_num_draft_tokens", "Draft tokens proposed"),
                   counter("spec_decode_num_accepted_tokens", "Draft tokens accepted"))

  def bind(self, current: Callable[[], SchedulerStats]) -> None:
    """Read the gauges from `current()` at every scrape."""
    self.running.set_function(lambda: current().num_running)
    self.waiting.set_function(lambda: current().num_waiting)
    self.kv_usage.set_function(lambda: current().kv_cache_usage)

  def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
    """Called in the engine thread after each step."""
    s, it = scheduler_stats, iteration_stats
    if s.num_preemptions: self.preemptions.inc(s.num_preemptions)
    if it.num_prompt_tokens: self.prompt_tokens.inc(it.num_prompt_tokens)
    if it.num_generation_tokens: self.generation_tokens.inc(it.num_generation_tokens)
    if s.prefix_cache_queries: self.prefix_queries.inc(s.prefix_cache_queries)
    if s.prefix_cache_hits: self.prefix_hits.inc(s.prefix_cache_hits)
    for t in it.time_to_first_tokens: self.ttft.observe(t)
    for t in it.inter_token_latencies: self.itl.observe(t)
    for f in it.finished:
      self._success.labels(self._model_name, f.finish_reason).inc()
      self.e2e.observe(f.e2e_latency)
    if self.spec and s.num_draft_tokens:
      self.spec[0].inc(s.num_draft_tokens)
      self.spec[1].inc(s.num_accepted_tokens)

  def render(self) -> bytes: return generate_latest(self.registry)
