"""Prometheus metrics for one service, on its own registry.

Every service exports the same metric names (a dashboard panel works for any service) and a
`service` label on every sample. The `service` label is added when the registry is collected rather
than declared on each metric, so call sites never pass it:

    m = ServiceMetrics("actor")
    m.tokens.labels(phase="generate").inc(n)           # rate() -> tokens/s
    with m.time_stage("generate"): ...                 # rlfleet_stage_latency_seconds{stage}
    m.queue_depth.labels(stream="rollouts", group="reward").set(depth)
    m.render()                                          # Prometheus text for /metrics

A private registry (not prometheus_client's global one) keeps tests and multiple runtimes in one
process from colliding on names.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric

__all__ = ["CONTENT_TYPE_LATEST", "METRIC_NAMES", "ServiceMetrics", "ServiceRegistry"]

# From a 5 ms reward call to a 10 minute training step on a large model.
LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)

# Exposed names (counters gain `_total` in the exposition; listed here as scraped).
METRIC_NAMES = (
    "rlfleet_tokens_total",
    "rlfleet_samples_total",
    "rlfleet_stage_latency_seconds",
    "rlfleet_queue_depth",
    "rlfleet_fill_ratio",
    "rlfleet_backpressure",
    "rlfleet_policy_version",
    "rlfleet_staleness",
    "rlfleet_reward_mean",
    "rlfleet_kl",
    "rlfleet_loss",
    "rlfleet_restarts_total",
    "rlfleet_dead_letters_total",
    "rlfleet_in_flight",
    "rlfleet_admission_open",
    "rlfleet_ready",
    "rlfleet_gpu_utilization",
    "rlfleet_gpu_memory_bytes",
)


class ServiceRegistry(CollectorRegistry):
    """A registry that stamps constant labels (here `service`) on every sample it exposes."""

    def __init__(self, const_labels: dict[str, str]) -> None:
        super().__init__(auto_describe=True)
        self._const_labels = dict(const_labels)

    def collect(self) -> Iterable[Metric]:
        for metric in super().collect():
            out = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            out.samples = [s._replace(labels={**s.labels, **self._const_labels}) for s in metric.samples]
            yield out


class ServiceMetrics:
    """The fleet's metric set for one service. Attributes are plain prometheus_client metrics."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.registry = ServiceRegistry({"service": service})
        r = self.registry

        # Throughput: rates of these counters are tokens/s and samples/s. `phase` is what the
        # service did with them: generate (actor), train (actor, critic), score (scorers).
        self.tokens = Counter("rlfleet_tokens", "Tokens processed", ["phase"], registry=r)
        self.samples = Counter("rlfleet_samples", "Samples (sequences) processed", ["phase"], registry=r)
        self.stage_latency = Histogram(
            "rlfleet_stage_latency_seconds",
            "Wall time of one unit of work per pipeline stage",
            ["stage"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

        # Flow control.
        self.queue_depth = Gauge(
            "rlfleet_queue_depth",
            "Entries waiting (lag + pending) per stream and group",
            ["stream", "group"],
            registry=r,
        )
        self.fill_ratio = Gauge(
            "rlfleet_fill_ratio", "Downstream fill of the slowest scoring group over its capacity", registry=r
        )
        self.backpressure = Gauge("rlfleet_backpressure", "1 while generation is held by backpressure", registry=r)
        self.in_flight = Gauge("rlfleet_in_flight", "Admitted tasks not yet trained or dead", registry=r)
        self.admission_open = Gauge(
            "rlfleet_admission_open",
            "1 while the controller admits new prompts (staleness bound)",
            registry=r,
        )

        # Learning progress.
        self.policy_version = Gauge("rlfleet_policy_version", "Policy version this service serves", registry=r)
        self.staleness = Gauge(
            "rlfleet_staleness", "Trained-at minus generated-at version of the last batch", registry=r
        )
        self.reward_mean = Gauge("rlfleet_reward_mean", "Mean reward of the last batch", registry=r)
        self.kl = Gauge("rlfleet_kl", "Mean KL to the reference policy of the last batch", registry=r)
        self.loss = Gauge(
            "rlfleet_loss", "Last training loss by kind (policy, value, entropy, ...)", ["kind"], registry=r
        )
        self.eval_reward = Gauge(
            "rlfleet_eval_reward", "Mean reward on the held-out prompts at the last evaluation", ["mode"], registry=r
        )
        self.eval_accuracy = Gauge(
            "rlfleet_eval_accuracy", "Fraction of held-out prompts solved at the last evaluation", ["mode"],
            registry=r,
        )

        # Faults. `target` is the service seen restarting (the controller observes the fleet);
        # a service that restarts itself from a checkpoint counts itself.
        self.restarts = Counter("rlfleet_restarts", "Service restarts observed", ["target"], registry=r)
        self.dead_letters = Counter(
            "rlfleet_dead_letters", "Messages moved to the dead-letter stream", ["reason"], registry=r
        )
        self.ready = Gauge("rlfleet_ready", "1 while the service reports ready", registry=r)
        # Dynamic sampling (controller): groups left out of training, by kind (filtered, surplus),
        # and the prompts the last step admitted to fill its batch.
        self.dropped_groups = Counter(
            "rlfleet_dropped_groups", "Groups dynamic sampling left out of training", ["kind"], registry=r
        )
        self.step_prompts = Gauge("rlfleet_step_admitted_prompts", "Prompts admitted for the last step", registry=r)

        # Filled by services.core.observability.gpu.GpuMonitor where NVML finds a GPU; absent otherwise.
        self.gpu_utilization = Gauge(
            "rlfleet_gpu_utilization",
            "GPU busy fraction over the last NVML sample period (0-1)",
            ["gpu"],
            registry=r,
        )
        self.gpu_memory_bytes = Gauge(
            "rlfleet_gpu_memory_bytes", "GPU memory by kind (used, total)", ["gpu", "kind"], registry=r
        )

    @contextmanager
    def time_stage(self, stage: str) -> Iterator[None]:
        """Observe the wall time of the `with` body into rlfleet_stage_latency_seconds{stage}.

        Observed also when the body raises: a failing stage still cost the time.
        """
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.stage_latency.labels(stage=stage).observe(time.perf_counter() - t0)

    def render(self) -> bytes:
        """Prometheus text exposition of this service's registry."""
        return generate_latest(self.registry)
