"""``GET /metrics``: the engine's gauges and counters in Prometheus' text format (prometheus_client), read at each
scrape from the latest stats the engine process sent (serve/core.py's ``engine_stats``, at most 0.1 s old). Names: ``tilespec_requests_running``, ``tilespec_requests_waiting``, ``tilespec_batch_slots``,
``tilespec_draft_acceptance_rate``, ``tilespec_kv_cache_bytes`` (paged engine), ``tilespec_drafting{rows="R"}`` (the load switch's choice per step row count),
and ``tilespec_<counter>_total`` for each engine counter."""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

COUNTERS = {"steps": "decode steps", "defrags": "cache defragmentations", "prefill_tokens": "prompt tokens prefilled",
            "generated_tokens": "tokens generated", "drafted": "draft tokens verified",
            "accepted": "draft tokens accepted", "spec_steps": "decode steps that verified drafts",
            "requests_finished": "requests that ended by EOS, a stop or their length",
            "requests_cancelled": "requests cancelled (client gone, stop string, shutdown)",
            "decode_graph_steps": "steps of decode rows alone, replayed as CUDA graphs (paged engine)",
            "preemptions": "requests preempted when K/V blocks ran out, recomputed later (paged engine)",
            "admissions_deferred": "steps that held waiting requests back so their prefills coalesce (paged engine)",
            "steps_drafter_off": "steps whose draft gate ran no drafter: without it they were faster (paged engine)",
            "steps_overlapped": "steps launched before the previous step's tokens reached the host (paged engine)",
            "host_plan_seconds": "engine host seconds planning steps: gate, drafts, schedule, inputs (paged engine)",
            "host_launch_seconds": "engine host seconds launching forwards and verify (paged engine)",
            "host_wait_seconds": "engine host seconds waiting for a step in flight (paged engine)",
            "host_commit_seconds": "engine host seconds committing the tokens of steps in flight (paged engine)",
            "gc_full_collections": "full garbage collections in the engine process (each pauses its step loop)",
            "gc_full_collection_seconds": "seconds the engine process spent in full garbage collections",
            "graphs_traced_serving": "graphs torch.compile traced after start-up (each stalled the steps; the warm-up "
                                     "should leave none)"}


class EngineCollector:
    """A prometheus_client collector over ``client``'s latest engine stats."""

    def __init__(self, client):
        self.client = client

    def collect(self):
        stats, info = self.client.stats, self.client.info
        yield GaugeMetricFamily("tilespec_requests_running", "requests holding a batch row",
                                value=stats.get("running", 0))
        yield GaugeMetricFamily("tilespec_requests_waiting", "requests queued for a batch row",
                                value=self.client.queued)
        yield GaugeMetricFamily("tilespec_batch_slots", "batch rows (--max-batch)", value=info.get("max_batch", 0))
        if "kv_bytes_in_use" in stats:        # the paged engine: K/V memory follows the tokens in flight
            yield GaugeMetricFamily("tilespec_kv_cache_bytes", "bytes of K/V blocks held by requests",
                                    value=stats["kv_bytes_in_use"])
        counters = stats.get("counters", {})
        for name, value in counters.items():
            yield CounterMetricFamily(f"tilespec_{name}", COUNTERS.get(name, name.replace("_", " ")), value=value)
        drafted = counters.get("drafted", 0)
        yield GaugeMetricFamily("tilespec_draft_acceptance_rate", "accepted / drafted tokens since start",
                                value=counters.get("accepted", 0) / drafted if drafted else 0.0)
        drafting = GaugeMetricFamily("tilespec_drafting", "1 where the load switch drafts at this step row count",
                                     labels=["rows"])
        for rows, on in stats.get("drafting", {}).items():
            drafting.add_metric([rows], on)
        yield drafting


def metrics_registry(client) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(client))
    return registry


def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    """(the text exposition, its content type)."""
    return generate_latest(registry), CONTENT_TYPE_LATEST
