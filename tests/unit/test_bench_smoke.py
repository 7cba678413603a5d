"""The data-plane benchmark still runs end to end (tiny sizes, no timing assertions, no local loop),
so that `python -m bench.data_plane` does not rot between the times someone runs it for real."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.data_plane import batches, stats
from bench.data_plane.cli import main
from bench.data_plane.config import PATHS
from services.core.host.redis_proc import redis_server_binary

TINY_ARGS = ["--batches", "3", "--rounds", "2", "--in-flight", "2", "--seqs", "8", "--prompt-len", "8",
             "--response-len", "16", "--tiny-hops", "3", "--no-local"]


def test_percentile_interpolates_and_handles_no_samples() -> None:
    assert stats.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert stats.percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    assert math.isnan(stats.percentile([], 50))
    assert stats.summary_ms([0.001, 0.003])["p50"] == pytest.approx(2.0)


def test_synthetic_batch_round_trips_through_the_codec() -> None:
    batch = batches.make_batch(8, 8, 16, group_size=4, seed=1)
    ro = batch.rollout
    assert ro.group_ids.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert bool(ro.response_mask[:, 0].all())  # every response has at least one token
    assert bool((ro.behaviour_logprobs[ro.response_mask] < 0).all())
    back = batches.decode_rollout(batches.encode_rollout(batch, "b0:x"), max_bytes=1 << 20)
    assert batches.same_rollout(back, ro)


def test_benchmark_runs_end_to_end_and_writes_its_results(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        redis_server_binary()
    except RuntimeError as err:
        pytest.skip(str(err))
    out = tmp_path / "results" / "data_plane-smoke.json"
    assert main([*TINY_ARGS, "--out", str(out)]) == 0

    res = json.loads(out.read_text())
    assert res["config"]["batches"] == 3 and res["config"]["seqs"] == 8
    for path in PATHS:
        assert len(res["latency"][path]["samples_s"]["latency"]) == 3
        assert res["throughput"][path]["batches"] == 3
        assert len(res["throughput"][path]["passes"]) == 2
    assert set(res["latency"]["rlfleet"]["samples_s"]) >= {"encode", "publish", "read", "decode", "ack"}
    assert res["redis"]["appendonly"] == "yes" and res["redis"]["appendfsync"] == "everysec"
    assert res["host"]["cpu_count"] >= 1 and res["host"]["redis_py"]
    tiny = res["tiny"]
    assert tiny["deliveries_per_step"]["prompt"] == tiny["messages_per_step"]
    assert tiny["transport_per_step_ms"] > 0
    assert res["local_loop"]["status"] == "skipped"
    assert tiny["step_comparison"]["status"] == "skipped"
    assert "ratio rlfleet/raw-sync" in capsys.readouterr().out
