"""bench/replica_check.py (the one-H200 check of issue 15) in a CPU dry run, weights by broadcast:
two replicas both take each sync, hold the trainer's checksums, agree on greedy completions and
score like the trainer. The
script runs once per GPU session, so it must not rot in between."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.shares_host  # engine processes, no fleet; bounded by a generous timeout

REPO = Path(__file__).resolve().parents[2]


def test_replica_check_dry_run_syncs_both_replicas_by_broadcast(tmp_path: Path) -> None:
    env = {**os.environ, "BENCH_DRY": "1", "BENCH_WORK": str(tmp_path / "work")}
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "bench.replica_check", "--out", str(out), "--transfer", "collective",
                        "--sweep-mb", "1,2"],
                       env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    result = json.loads((out / "replica-check-collective.json").read_text())
    assert result["ok"] and result["dry"] and result["weight_transfer"] == "collective"
    assert [r["checks"] for r in result["rounds"]] == [
        {"versions": True, "greedy_equal_across_replicas": True, "checksums_equal": True, "logprobs": True}] * 2
    # Equal weights checked directly: every tensor of both replicas against the trainer's, after each sync.
    sums = [x for r in result["rounds"] for x in r["checksums"]]
    assert [x["replica"] for x in sums] == [0, 1, 0, 1] and all(x["checked"] > 0 and x["unpaired"] == 0 for x in sums)
    assert {m["weight_transfer"] for m in result["describe"]["members"]} == {"collective"}
    # The bucket sweep: two timed syncs per size, each reaching both replicas, checksums checked.
    assert [(r["bucket_mb"], r["version"]) for r in result["sweep"]] == [(1, 3), (1, 4), (2, 5), (2, 6)]
    assert all(len(r["replicas"]) == 2 and all(x["checksums_checked"] > 0 for x in r["replicas"])
               for r in result["sweep"])
