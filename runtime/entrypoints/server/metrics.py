"""Prometheus metrics of the server (one registry per app, exported at GET /metrics).

Counters and histograms are updated by the request handlers; the scheduler's gauges (queue depth,
running sequences, cache blocks, state-reuse hits) are read from the runtime's `stats()` at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RuntimeStatsCollector:
    """Scheduler gauges from `stats()`: waiting, running, blocks_used, blocks_total, reuse_hits, reuse_tokens,
    prefix_queried_tokens, prefix_hit_tokens, warm_prefill_tokens, and with a state offload offload_loaded_tokens, offload_files_rejected,
    offload_disk_bytes."""

    def __init__(self, stats: Callable[[], dict]) -> None:
        self.stats = stats

    def collect(self):
        s = self.stats()
        yield GaugeMetricFamily("moe_export_queue_depth", "requests waiting for admission", value=s["waiting"])
        yield GaugeMetricFamily("moe_export_running_sequences", "sequences being generated", value=s["running"])
        yield GaugeMetricFamily("moe_export_cache_blocks_used", "cache blocks in use", value=s["blocks_used"])
        yield GaugeMetricFamily("moe_export_cache_blocks_total", "cache blocks in the pool", value=s["blocks_total"])
        yield CounterMetricFamily("moe_export_state_reuse_hits", "requests that continued a kept sequence state",
                                  value=s["reuse_hits"])
        yield CounterMetricFamily("moe_export_state_reuse_tokens", "prompt tokens not prefilled thanks to state reuse",
                                  value=s["reuse_tokens"])
        yield CounterMetricFamily("moe_export_prefix_cache_queried_tokens",
                                  "prompt tokens of admitted requests looked up in the prefix cache",
                                  value=s["prefix_queried_tokens"])
        yield CounterMetricFamily("moe_export_prefix_cache_hit_tokens",
                                  "prompt tokens not prefilled thanks to a cached prefix or kept session",
                                  value=s["prefix_hit_tokens"])
        if "warm_prefill_tokens" in s:  # warm turns (`Scheduler.add_warm`; a dp layout sums its groups)
            yield CounterMetricFamily("moe_export_warm_prefill_tokens",
                                      "tokens prefilled between turns by warm turns (not by requests)",
                                      value=s["warm_prefill_tokens"])
        if s.get("offload_files_written") or s.get("offload_loaded_tokens"):  # `serve --store`: the state offload
            yield CounterMetricFamily("moe_export_offload_loaded_tokens",
                                      "prompt tokens whose state was loaded from the offload store", value=s["offload_loaded_tokens"])
            yield CounterMetricFamily("moe_export_offload_files_rejected",
                                      "offload files that failed their check (never loaded)", value=s["offload_files_rejected"])
            yield GaugeMetricFamily("moe_export_offload_disk_bytes", "bytes of offloaded state on disk",
                                    value=s["offload_disk_bytes"])
        if "expert_load" in s:  # dp layout: routed expert load over the world (`runtime.wide_ep`)
            load = s["expert_load"]
            yield CounterMetricFamily("moe_export_expert_routed_tokens", "top-k expert choices routed", value=load["routed"])
            imbalance = GaugeMetricFamily("moe_export_expert_load_max_over_mean",
                                          "busiest expert's routed tokens over the mean, per MoE layer", labels=["layer"])
            for layer, value in enumerate(load["max_over_mean"]):
                imbalance.add_metric([str(layer)], value)
            yield imbalance


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("moe_export_requests", "HTTP requests by route and status", ["route", "status"], registry=r)
        self.prompt_tokens = Counter("moe_export_prompt_tokens", "prompt tokens of completed requests", registry=r)
        self.completion_tokens = Counter("moe_export_completion_tokens", "generated tokens", registry=r)
        self.reasoning_tokens = Counter("moe_export_reasoning_tokens", "generated reasoning tokens", registry=r)
        self.reasoning_tokens_by_tier = Counter(
            "moe_export_reasoning_tokens_by_tier", "reasoning tokens by thinking tier", ["tier"], registry=r)
        self.requests_by_tier = Counter("moe_export_requests_by_tier", "generation requests by thinking tier (tier mix)",
                                        ["tier"], registry=r)
        self.ttft = Histogram("moe_export_time_to_first_token_seconds", "time from request to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("moe_export_inter_token_latency_seconds", "time between streamed token deltas",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.tool_calls = Counter("moe_export_tool_call_parses", "model tool calls by parse result", ["result"], registry=r)
        self.structured_failures = Counter(
            "moe_export_structured_output_failures", "constrained requests whose output is not a complete grammar sentence",
            registry=r)
        r.register(RuntimeStatsCollector(stats))

    def record_output(self, out, tier: str) -> None:
        """Token and tool-call counters of one finished generation (ChatOutput / GenerationOutput)."""
        u = out.usage
        self.prompt_tokens.inc(u["prompt_tokens"])
        self.completion_tokens.inc(u["completion_tokens"])
        self.reasoning_tokens.inc(u.get("reasoning_tokens", 0))
        self.reasoning_tokens_by_tier.labels(tier).inc(u.get("reasoning_tokens", 0))
        self.tool_calls.labels("success").inc(len(getattr(out, "tool_calls", None) or []))
        self.tool_calls.labels("failure").inc(getattr(out, "tool_call_parse_failures", 0))
