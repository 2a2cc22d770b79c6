"""``GET /metrics``: the engine's gauges and counters in Prometheus' text format (prometheus_client), read at each
scrape from the :class:`~tilespec.serve.worker.EngineWorker` (no copies kept: the engine's ``counters`` dict is the
source). Names: ``tilespec_requests_running``, ``tilespec_requests_waiting``, ``tilespec_batch_slots``,
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
            "preemptions": "requests preempted when K/V blocks ran out, recomputed later (paged engine)"}


class EngineCollector:
    """A prometheus_client collector over ``worker``'s engine."""

    def __init__(self, worker):
        self.worker = worker

    def collect(self):
        eng = self.worker.engine
        yield GaugeMetricFamily("tilespec_requests_running", "requests holding a batch row", value=eng.running)
        yield GaugeMetricFamily("tilespec_requests_waiting", "requests queued for a batch row",
                                value=len(eng.waiting) + self.worker.queued)
        yield GaugeMetricFamily("tilespec_batch_slots", "batch rows (--max-batch)", value=eng.max_batch)
        if hasattr(eng, "kv_bytes_in_use"):        # the paged engine: K/V memory follows the tokens in flight
            yield GaugeMetricFamily("tilespec_kv_cache_bytes", "bytes of K/V blocks held by requests",
                                    value=eng.kv_bytes_in_use())
        for name, value in eng.counters.items():
            yield CounterMetricFamily(f"tilespec_{name}", COUNTERS.get(name, name.replace("_", " ")), value=value)
        drafted = eng.counters["drafted"]
        yield GaugeMetricFamily("tilespec_draft_acceptance_rate", "accepted / drafted tokens since start",
                                value=eng.counters["accepted"] / drafted if drafted else 0.0)
        drafting = GaugeMetricFamily("tilespec_drafting", "1 where the load switch drafts at this step row count",
                                     labels=["rows"])
        for rows, entry in (eng.switch.state().items() if eng.switch is not None else ()):
            drafting.add_metric([str(rows)], int(entry["drafting"]))
        yield drafting


def metrics_registry(worker) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(worker))
    return registry


def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    """(the text exposition, its content type)."""
    return generate_latest(registry), CONTENT_TYPE_LATEST
