from __future__ import annotations

import re
import types
from typing import Any

import pytest

from services.core.observability.gpu import GpuMonitor
from services.core.observability.metrics import METRIC_NAMES, ServiceMetrics


def value(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample in Prometheus text, or None when absent."""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(3) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(m.group(4))
    return None


def test_every_fleet_metric_name_is_exposed() -> None:
    text = ServiceMetrics("critic").render().decode()
    for name in METRIC_NAMES:
        assert f"# TYPE {name.removesuffix('_total')} " in text or f"# TYPE {name} " in text, name


def test_metrics_move_and_carry_the_service_label() -> None:
    m = ServiceMetrics("actor")
    m.tokens.labels(phase="generate").inc(100)
    m.tokens.labels(phase="generate").inc(28)
    m.samples.labels(phase="generate").inc(8)
    m.queue_depth.labels(stream="rollouts", group="reward").set(5)
    m.backpressure.set(1)
    m.policy_version.set(7)
    m.loss.labels(kind="policy").set(0.25)
    m.dead_letters.labels(reason="bad_shape").inc()
    with m.time_stage("generate"):
        pass
    text = m.render().decode()
    assert value(text, "rlfleet_tokens_total", service="actor", phase="generate") == 128
    assert value(text, "rlfleet_samples_total", service="actor", phase="generate") == 8
    assert value(text, "rlfleet_queue_depth", service="actor", stream="rollouts", group="reward") == 5
    assert value(text, "rlfleet_backpressure", service="actor") == 1
    assert value(text, "rlfleet_policy_version", service="actor") == 7
    assert value(text, "rlfleet_loss", service="actor", kind="policy") == 0.25
    assert value(text, "rlfleet_dead_letters_total", service="actor", reason="bad_shape") == 1
    assert value(text, "rlfleet_stage_latency_seconds_count", service="actor", stage="generate") == 1
    # Every sample has the service label, none are left without it.
    samples = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert samples and all('service="actor"' in ln for ln in samples)


def test_stage_timer_observes_even_when_the_stage_raises() -> None:
    m = ServiceMetrics("reward")
    with pytest.raises(ValueError), m.time_stage("score"):
        raise ValueError("bad batch")
    text = m.render().decode()
    assert value(text, "rlfleet_stage_latency_seconds_count", stage="score") == 1


def test_two_services_in_one_process_do_not_collide() -> None:
    a, b = ServiceMetrics("actor"), ServiceMetrics("critic")
    a.policy_version.set(3)
    b.policy_version.set(5)
    assert value(a.render().decode(), "rlfleet_policy_version", service="actor") == 3
    assert value(b.render().decode(), "rlfleet_policy_version", service="critic") == 5


# --- GPU --------------------------------------------------------------------------------------------


def test_gpu_monitor_degrades_cleanly_without_nvml() -> None:
    m = ServiceMetrics("reward")
    gpu = GpuMonitor(m, nvml=None)
    assert not gpu.available
    assert gpu.reason
    assert gpu.sample() == []
    assert gpu.update() == 0
    gpu.close()
    assert value(m.render().decode(), "rlfleet_gpu_utilization") is None


def test_gpu_monitor_on_this_machine_never_raises() -> None:
    # Whatever this host has (no pynvml, no driver, or real GPUs), construction and update work.
    m = ServiceMetrics("reward")
    gpu = GpuMonitor(m)
    assert gpu.update() >= 0
    gpu.close()


class _NVMLError(Exception):
    pass


def _fake_nvml(count: int, fail_init: bool = False) -> Any:
    nvml = types.SimpleNamespace()

    def init() -> None:
        if fail_init:
            raise _NVMLError("driver not loaded")

    nvml.nvmlInit = init
    nvml.nvmlShutdown = lambda: None
    nvml.nvmlDeviceGetCount = lambda: count
    nvml.nvmlDeviceGetHandleByIndex = lambda i: f"h{i}"
    nvml.nvmlDeviceGetUUID = lambda h: f"GPU-uuid-{h[1:]}"
    nvml.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=40 + int(h[1:]))
    nvml.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=1 << 30, total=80 << 30)
    return nvml


def test_gpu_monitor_reports_no_gpu_when_nvml_init_fails() -> None:
    gpu = GpuMonitor(ServiceMetrics("actor"), nvml=_fake_nvml(2, fail_init=True))
    assert not gpu.available
    assert "NVML unavailable" in str(gpu.reason)
    assert gpu.update() == 0


def test_gpu_monitor_fills_gauges_for_visible_gpus_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,GPU-uuid-3")
    m = ServiceMetrics("actor")
    gpu = GpuMonitor(m, nvml=_fake_nvml(4))
    assert gpu.available
    assert gpu.update() == 2
    text = m.render().decode()
    assert value(text, "rlfleet_gpu_utilization", gpu="2", service="actor") == pytest.approx(0.42)
    assert value(text, "rlfleet_gpu_utilization", gpu="3") == pytest.approx(0.43)
    assert value(text, "rlfleet_gpu_utilization", gpu="0") is None
    assert value(text, "rlfleet_gpu_memory_bytes", gpu="2", kind="total") == 80 << 30
