"""The rlfleet-vs-TRL harness (issue 16): the report's arithmetic on known numbers, and the CPU dry run of
every phase (tiny model, transformers engine), so that the one GPU call does not fail on something a CPU
could have caught."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.vs_trl import figures, render, targets

# Dry runs bounded only by generous timeouts (the one fleet a dry run starts measures nothing).
pytestmark = pytest.mark.shares_host

REPO = Path(__file__).resolve().parents[2]
QWEN05 = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
              intermediate_size=4864, vocab_size=151936)
W = dict(prompts_per_step=32, group=8, prompt_tokens=64, completion_tokens=256, steps=5, warmup=2)


def test_matmul_parameters_of_the_qwen2_shape() -> None:
    # Per block: q and o 896², k and v 896·128, gate/up/down 896·4864; plus the 151,936 x 896 LM head.
    per_block = 2 * 896 * 896 + 2 * 896 * 128 + 3 * 896 * 4864
    assert figures.matmul_params(QWEN05) == 24 * per_block + 151936 * 896 == 493_961_216


def test_train_flops_are_six_n_per_token_plus_attention_plus_the_proximal_forward() -> None:
    n, attn = figures.matmul_params(QWEN05), 24 * 896 * 320
    assert figures.train_flops(QWEN05, 256, 320) == 256 * 320 * (6 * n + 12 * attn)
    assert figures.train_flops(QWEN05, 256, 320, off_policy=1.0) == 256 * 320 * (8 * n + 16 * attn)


def _fleet(sps: float, first: float, util: float = 90.0) -> dict[str, Any]:
    step = 256 / sps
    return {"ok": True, "samples_per_s": sps, "tokens_per_s": sps * 256, "median_step_s": step, "first_step_s": first,
            "gpu_util": util, "train_s": 1.0, "off_policy": 1.0, "response_len": 256.0, "engine_start_s": 20.0,
            "stages": {"generate": step * 0.6, "actor_train": 1.0}}


def _result(reps05: list[float], reps15: list[float]) -> dict[str, Any]:
    ph: dict[str, Any] = {"trl-vllm-0.5b": {**_fleet(40.0, 40.0), "stages": {}},
                          "trl-vllm-1.5b": {**_fleet(25.0, 45.0), "stages": {}},
                          "vllm-alone-0.5b": {"ok": True, "variants": {"plain": {"tokens_per_s": 50_000.0}}},
                          "fleet-0.5b-chunked": _fleet(90.0, 60.0)}
    for w, sps in (("0.5b", reps05), ("1.5b", reps15)):
        for i, v in enumerate(sps, 1):
            ph[f"fleet-{w}-r{i}"] = _fleet(v, 60.0 + i)
    return {"command": "python -m bench.vs_trl run", "gpu": "H200", "versions": {"torch": "x"}, "workload": W,
            "shapes": {"0.5b": QWEN05, "1.5b": QWEN05}, "phases": ph}


def test_summary_takes_the_median_of_the_repeats_and_derives_mfu_and_the_floor() -> None:
    s = figures.workload_summary(_result([80.0, 88.0, 84.0], [40.0, 41.0, 42.0]), "0.5b")
    assert s["samples_per_s"] == 84.0 and s["ratio"] == pytest.approx(84.0 / 40.0)
    assert s["spread"] == pytest.approx(8.0 / 84.0)
    assert s["first_step_s"] == 62.0
    assert s["mfu"] == pytest.approx(figures.train_flops(QWEN05, 256, 320, 1.0) / 989e12)
    floor = 256 * 256 / 50_000 + figures.train_flops(QWEN05, 256, 320) / (0.5 * 989e12)
    assert s["floor"]["step_s"] == pytest.approx(floor)
    assert s["floor_fraction"] == pytest.approx(floor / (256 / 84.0))


def test_the_trainer_alone_gives_its_own_mfu_and_the_three_stages_end_to_end_against_the_fleets_step() -> None:
    res = _result([80.0, 88.0, 84.0], [40.0, 41.0, 42.0])
    res["phases"]["train-alone-0.5b"] = {"ok": True, "train_median_s": 1.2, "reference_median_s": 0.3}
    s = figures.workload_summary(res, "0.5b")
    assert s["alone"]["mfu"] == pytest.approx(figures.train_flops(QWEN05, 256, 320) / (1.2 * 989e12))
    serial = 256 * 256 / 50_000 + 1.2 + 0.3
    assert s["alone"]["serial_step_s"] == pytest.approx(serial)
    line = render._alone_line(s, res["phases"]["train-alone-0.5b"])
    assert "train 1.20 s" in line and "reference 0.30 s" in line and f"{serial:.2f} s a step" in line
    assert f"({256 / 84.0 / serial:.0%} of it)" in line
    # Not run: the line says so, in the words of what stopped it.
    missing = render._alone_line(figures.workload_summary(res, "1.5b"), {})
    assert missing == "- Trainer and reference alone: not measured (not run)."


def test_targets_say_met_or_missed_and_what_holds_a_miss_back() -> None:
    lines = targets.targets(_result([80.0, 88.0, 84.0], [30.0, 40.0, 35.0]))
    by = {line.split(":")[0] + ":" + line.split(":")[1]: line for line in lines}
    assert "**met**" in by["- 0.5b: rlfleet GRPO over TRL with vLLM, samples/s"]  # 2.10x >= 2x
    miss = by["- 1.5b: rlfleet GRPO over TRL with vLLM, samples/s"]  # 1.40x < 1.6x
    assert "**missed**" in miss and "the step must drop from 7.31 s to 6.40 s" in miss and "generate" in miss
    assert "**met**" in by["- 0.5b: spread of the 3 repeats ((max − min) / median)"]
    assert "**missed**" in by["- 1.5b: spread of the 3 repeats ((max − min) / median)"]  # 29%
    assert "**met**" in by["- 1.5b: time to first step, rlfleet minus TRL with vLLM"]  # 62 - 45 = 17 s
    assert "**met**" in by["- 0.5b: time to first step, rlfleet minus TRL with vLLM"]  # 62 - 40 = 22 s
    slow = _result([80.0, 88.0, 84.0], [30.0, 40.0, 35.0])
    slow["phases"]["trl-vllm-1.5b"]["first_step_s"] = 20.0
    (late,) = [line for line in targets.targets(slow) if line.startswith("- 1.5b: time to first step")]
    assert ("42 s (target 30 s): **missed**; rlfleet 62 s (median of the 3 repeats; its vLLM engine process 20 s"
            " of it), TRL 20 s (its run); every repeat: 61, 62, 63") in late
    md = render.render(_result([80.0, 88.0, 84.0], [30.0, 40.0, 35.0]))
    assert "| **rlfleet, median of 3** (spread 10%) | **84.0** |" in md
    assert "| chunked log-probs (`algo.logprob_chunk_tokens: 1024`) | 90.0 | 1.07× |" in md
    assert "| vLLM's per-token log-probs and default CUDA-graph sizes" in md
    assert f"| {render.LEVER_LABEL['rep2']} | not measured: not run |" in md
    assert render.LEVER_LABEL["eager"] not in md  # a 1.5B lever: not in the 0.5B table
    assert "### Levers (1.5B" not in md  # another shape lists only the levers it ran


def test_a_lever_run_at_15b_gets_a_table_of_its_own_against_the_15b_repeats() -> None:
    res = _result([80.0, 88.0, 84.0], [30.0, 40.0, 35.0])
    res["phases"]["fleet-1.5b-eager"] = _fleet(42.0, 90.0)
    md = render.render(res)
    table = md[md.index("### Levers (1.5B"):]
    assert f"| {render.LEVER_LABEL['eager']} | 42.0 | 1.20× |" in table
    assert "chunked" not in table.split("\n\n")[1]  # only the levers run at 1.5B


def test_time_to_first_step_compares_repeats_that_compiled_vllm_with_a_peer_that_compiled_too() -> None:
    # On a fresh host the first launch of a configuration compiles vLLM's graphs (about a minute); later
    # launches load them. TRL's one run compiled, so it is held against the repeat that compiled, not
    # against the median of two repeats that found the cache warm.
    res = _result([80.0, 88.0, 84.0], [40.0, 41.0, 42.0])
    ph = res["phases"]
    ph["trl-vllm-0.5b"].update(first_step_s=100.0, vllm_compile="cold")
    for r, (first, state) in {"r1": (150.0, "cold"), "r2": (90.0, "cached"), "r3": (95.0, "cached")}.items():
        ph[f"fleet-0.5b-{r}"].update(first_step_s=first, vllm_compile=state)
    (line,) = [x for x in targets.targets(res) if x.startswith("- 0.5b: time to first step")]
    assert line.startswith("- 0.5b: time to first step, rlfleet minus TRL with vLLM: 50 s (target 30 s): **missed**")
    assert "rlfleet 150 s (the repeat with vLLM compiling;" in line
    assert "TRL 100 s (its run with vLLM compiling)" in line
    assert "every repeat: 150 (compiled), 90, 95" in line
    ph["trl-vllm-0.5b"]["vllm_compile"] = "cached"  # then the warm repeats are the ones to compare
    (line,) = [x for x in targets.targets(res) if x.startswith("- 0.5b: time to first step")]
    assert "-8 s (target 30 s): **met**; rlfleet 92 s (median of the 2 repeats with vLLM's compile cache warm" in line
    assert "| rlfleet GRPO, vLLM in its own process, r1 | 80.0 | 20,480 | 3.20 | 150 (compiled) |" in render.render(res)


def test_the_ratio_is_taken_to_trls_fastest_run_and_a_peer_measured_again_is_its_next_repeat(
        tmp_path: Path) -> None:
    # TRL with vLLM ran at 57.2 and 35.6 samples/s minutes apart (2026-12-02): a second call that measures
    # it again adds a repeat; the ratio holds against its fastest run, the median's ratio is said beside it.
    a, b = _result([80.0, 88.0, 84.0], [40.0, 41.0, 42.0]), _result([80.0, 88.0, 84.0], [40.0, 41.0, 42.0])
    a["phases"]["trl-vllm-0.5b"].update(samples_per_s=42.0, first_step_s=50.0, vllm_compile="cold",
                                        stages={"GRPOTrainer.vLLM.generate": 2.0},
                                        host={"before": {"loadavg": [3.0, 1.0, 1.0], "cpu_mhz": 2000},
                                              "after": {"loadavg": [9.5, 2.0, 1.0], "cpu_mhz": 1500}})
    b["phases"] = {"trl-vllm-0.5b": {**_fleet(30.0, 45.0), "stages": {}, "vllm_compile": "cached"}}
    for name, r in (("a.json", a), ("b.json", b)):
        (tmp_path / name).write_text(json.dumps(r))
    m = figures.merge([tmp_path / "a.json", tmp_path / "b.json"])
    assert m["phases"]["trl-vllm-0.5b"]["samples_per_s"] == 42.0
    assert m["phases"]["trl-vllm-0.5b-r2"]["samples_per_s"] == 30.0
    s = figures.workload_summary(m, "0.5b")
    assert s["ratio"] == pytest.approx(84.0 / 42.0) and s["ratio_median"] == pytest.approx(84.0 / 36.0)
    (line,) = [x for x in targets.targets(m) if x.startswith("- 0.5b: rlfleet GRPO over TRL")]
    assert line.startswith("- 0.5b: rlfleet GRPO over TRL with vLLM, samples/s: 2.00× (target 2.00×): **met**;"
                           " against TRL's fastest of 2 runs (42.0 samples/s; runs 42.0, 30.0); against the median"
                           " of its runs 2.33×")
    md = render.render(m)
    assert "| TRL GRPOTrainer, vLLM colocated, run 2 | 30.0 |" in md
    assert "| **TRL with vLLM, fastest of 2** (spread 33%; median 36.0) | **42.0** |" in md
    # What else the host did around each run: a busy or throttled host is told from a slow peer.
    assert ("- TRL's own per-step timers (run 1, 42.0 samples/s) (median s): generate 2.00; host load 3.0 → 9.5,"
            " CPU 2000 → 1500 MHz") in md
    # Time to first step like with like on both sides; the larger gap of cold and warm is the verdict.
    for r, state in (("r1", "cold"), ("r2", "cached"), ("r3", "cached")):
        m["phases"][f"fleet-0.5b-{r}"]["vllm_compile"] = state
    (line,) = [x for x in targets.targets(m) if x.startswith("- 0.5b: time to first step")]
    assert line.startswith("- 0.5b: time to first step, rlfleet minus TRL with vLLM: 18 s (target 30 s): **met**;"
                           " rlfleet 61 s (the repeat with vLLM compiling;")
    assert "TRL 50 s (its run with vLLM compiling)" in line and "TRL 45 s (its run with vLLM's compile cache" in line
    assert "every TRL run: 50 (compiled), 45" in line


def test_merge_keeps_a_measured_phase_over_a_later_failure(tmp_path: Path) -> None:
    a, b = _result([80.0], [40.0]), _result([70.0], [40.0])
    b["phases"]["fleet-0.5b-r1"] = {"error": "cut off"}
    b["phases"]["fleet-0.5b-r2"] = _fleet(75.0, 60.0)
    for name, r in (("a.json", a), ("b.json", b)):
        (tmp_path / name).write_text(json.dumps(r))
    m = figures.merge([tmp_path / "a.json", tmp_path / "b.json"])
    assert m["phases"]["fleet-0.5b-r1"]["samples_per_s"] == 80.0 and m["phases"]["fleet-0.5b-r2"]["ok"]
    assert m["files"] == ["a.json", "b.json"] and len(m["commands"]) == 2


def test_a_phase_without_figures_says_what_stopped_it_and_a_later_skip_keeps_that_reason(tmp_path: Path) -> None:
    died = {"rc": 1, "seconds": 22.0, "error": "only 0 steady steps recorded",
            "log_tail": "rlfleet up: preparing x\nrlfleet up: controller exited with code 1 while starting:"
                        " ModuleNotFoundError: No module named 'tenacity' (log: /tmp/x/logs/controller.log)\n"}
    a, b = _result([80.0], [40.0]), _result([80.0], [40.0])
    a["phases"]["fleet-1.5b-r1"] = died
    b["phases"]["fleet-1.5b-r1"] = {"skipped": "4 s left of the 510 s deadline"}
    b["phases"]["fleet-0.5b-r3"] = {"rc": 124, "seconds": 123.3, "error": "only 0 steady steps recorded"}
    for name, r in (("a.json", a), ("b.json", b)):
        (tmp_path / name).write_text(json.dumps(r))
    m = figures.merge([tmp_path / "a.json", tmp_path / "b.json"])
    assert m["phases"]["fleet-1.5b-r1"] == died
    md = render.render(m)
    assert ("| rlfleet GRPO, vLLM in its own process, r1 | not measured: exit 1: rlfleet up: controller exited with"
            " code 1 while starting: ModuleNotFoundError: No module named 'tenacity' |") in md
    assert "r3 | not measured: cut off by the call's deadline after 123 s |" in md


def test_every_group_fits_one_device_call_and_the_target_rows_come_first() -> None:
    proc = subprocess.run([sys.executable, "-m", "bench.vs_trl", "plan"], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "BENCH_DRY": ""})
    assert proc.returncode == 0, proc.stderr
    groups = [line for line in proc.stdout.splitlines() if "group " in line]
    names = [g.split("group ")[1].split(":")[0] for g in groups]
    assert names == ["1.5b", "0.5b", "peers", "peers2", "levers2", "levers"]
    minutes = [float(g.split("~")[1].split(" min")[0]) for g in groups]
    assert all(m < 9.7 for m in minutes), minutes  # a call is 10 min, start and transfers included


def test_the_fleet_repeats_run_rlfleets_configuration_and_the_lp_lever_takes_it_back() -> None:
    from bench.vs_trl.config import fleet_config
    from bench.vs_trl.phases import select

    (rep1,) = select("fleet-0.5b-r1")
    (lp,) = select("fleet-0.5b-lp")
    base = fleet_config(rep1, Path("/m"), 0, dry=False)["generation"]
    assert base["behaviour_logprobs"] == "trainer" and base["vllm"]["cudagraph_max_batch"] == 256
    assert base["vllm"]["kv_cache_gib"] == 8  # no memory profiling: the trainer builds while vLLM starts
    old = fleet_config(lp, Path("/m"), 0, dry=False)["generation"]
    assert old["behaviour_logprobs"] == "engine" and "cudagraph_max_batch" not in old["vllm"]
    assert lp.group == "levers" and select("levers")[0] == lp  # the first lever a session has time for
    (stale2,) = select("fleet-0.5b-stale2")
    assert fleet_config(stale2, Path("/m"), 0, dry=False)["flow"]["max_staleness"] == 2
    assert fleet_config(rep1, Path("/m"), 0, dry=False)["flow"]["max_staleness"] == 1
    (mps,) = select("fleet-0.5b-mps")
    assert fleet_config(mps, Path("/m"), 0, dry=False)["run"]["cuda_mps"] is True
    assert "cuda_mps" not in fleet_config(rep1, Path("/m"), 0, dry=False)["run"]
    # 0.75x on 2026-12-03: out of the four calls a session runs, the last lever of the last group.
    assert mps not in select("peers2") and select("levers")[-1] == mps
    # 0.5B: an eager trainer and reference; the lever `compiled` takes it back, `rep2` adds an engine.
    assert "replicas" not in base and fleet_config(rep1, Path("/m"), 0, dry=False)["algo"]["compile"] is False
    (compiled,) = select("fleet-0.5b-compiled")
    (two,) = select("fleet-0.5b-rep2")
    assert fleet_config(compiled, Path("/m"), 0, dry=False)["algo"]["compile"] is True
    assert fleet_config(two, Path("/m"), 0, dry=False)["generation"]["replicas"] == 2
    assert select("levers2")[:2] == [compiled, two]
    # 1.5B: one engine, compiled (rlfleet's defaults); `eager` is its lever.
    (big,) = select("fleet-1.5b-r1")
    big_cfg = fleet_config(big, Path("/m"), 0, dry=False)
    assert "replicas" not in big_cfg["generation"] and "compile" not in big_cfg["algo"]
    (eager,) = select("fleet-1.5b-eager")
    assert fleet_config(eager, Path("/m"), 0, dry=False)["algo"]["compile"] is False
    assert "fleet-0.5b-eager" not in {p.name for p in select("all")}
    (nopc,) = select("fleet-0.5b-nopc")
    assert fleet_config(nopc, Path("/m"), 0, dry=False)["generation"]["vllm"]["prefix_caching"] is False
    assert "prefix_caching" not in base["vllm"]


def test_fleet_phases_take_loopback_ports_of_their_own_below_the_ephemeral_range() -> None:
    # Fixed ports in Linux's ephemeral range (32768-60999) can be taken as the local end of any outgoing
    # connection between the launcher's check and the service's bind (a repeat failed so on 2026-12-04).
    from bench.vs_trl.config import PORTS, port_base
    from bench.vs_trl.phases import select

    n = len(select("all"))
    ranges = [range(port_base(i), port_base(i) + 10 + len(PORTS)) for i in range(n)]
    assert all(r.start >= 1024 and r.stop <= 32768 for r in ranges)
    assert len({p for r in ranges for p in r}) == sum(len(r) for r in ranges)  # no two phases share a port


def test_a_run_refuses_fewer_measured_steps_than_a_median_and_a_spread_need(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "bench.vs_trl", "run", "--phases", "0.5b", "--steps", "1",
                           "--out", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "BENCH_DRY": "1", "BENCH_WORK": str(tmp_path / "work")})
    assert proc.returncode == 2 and "--steps must be >= 2" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_each_framework_compiles_into_caches_of_its_own_and_its_later_launches_reuse_them() -> None:
    # On 2026-12-02 TRL ran after rlfleet on one shared cache: its "cold" vLLM start found the kernels
    # rlfleet had compiled. Each framework's first launch must compile from cold, as a user's first run does.
    from bench.vs_trl.caches import phase_env
    from bench.vs_trl.phases import select

    env = {p.name: phase_env(p) for p in select("all")}
    keys = ("HOME", "XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
    trl, fleet = env["trl-vllm-0.5b"], env["fleet-0.5b-r1"]
    assert all(trl[k] != fleet[k] for k in keys) and "VLLM_CACHE_ROOT" not in trl
    assert all(env["fleet-1.5b-r2"][k] == env["vllm-alone-0.5b"][k] == fleet[k] for k in keys)
    assert all(env["trl-0.5b"][k] == trl[k] for k in keys)


def test_a_run_stops_in_seconds_naming_what_the_host_cannot_import(tmp_path: Path) -> None:
    from bench.vs_trl.host import missing_modules

    assert missing_modules(dry=True) == []  # this checkout's services all import
    shadow = tmp_path / "shadow"  # a package that fails to import, like a GPU host without tenacity
    (shadow / "tenacity").mkdir(parents=True)
    (shadow / "tenacity" / "__init__.py").write_text("raise ImportError('No module named tenacity')\n")
    env = {**os.environ, "BENCH_DRY": "1", "BENCH_WORK": str(tmp_path / "work"),
           "PYTHONPATH": f"{shadow}{os.pathsep}{REPO}"}
    proc = subprocess.run([sys.executable, "-m", "bench.vs_trl", "run", "--phases", "0.5b", "--out",
                           str(tmp_path / "out")], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and "services.controller.server: No module named tenacity" in err[0], err
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("vs_trl-*.json"))


@pytest.mark.slow
def test_dry_run_exercises_every_phase_and_renders_the_report(tmp_path: Path) -> None:
    pytest.importorskip("trl", reason="TRL is the peer; without it there is nothing to compare")
    env = {**os.environ, "BENCH_DRY": "1", "BENCH_WORK": str(tmp_path / "work"), "CUDA_VISIBLE_DEVICES": ""}
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "bench.vs_trl", "run", "--phases", "all", "--out", str(out),
                           "--deadline-s", "400"], cwd=REPO, env=env, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = out.glob("vs_trl-*.json")
    res = json.loads(path.read_text())
    ph = res["phases"]
    from bench.vs_trl.phases import phases

    names = [p.name for p in phases()]
    assert set(ph) == set(names)
    for p in phases():
        got = ph[p.name]
        if p.kind == "vllm-alone":
            assert got["error"] == "vllm is not installed"
            continue
        if p.kind == "train-alone":
            assert got.get("ok") and len(got["train_s"]) == res["workload"]["steps"] and got["reference_median_s"] > 0
            continue
        assert got.get("ok"), (p.name, got.get("error"), got.get("log_tail"))
        assert got["samples_per_s"] > 0 and got["steps_measured"] >= 2 and got["first_step_s"] > 0
        if p.kind == "fleet":
            assert got["gpu_config_ok"] and got["gpu_engine"] == p.engine and got["gpu_algo"] == p.algo
    # One TRL run and one fleet launch stand in for all: the others name the run they reuse.
    order = [p.name for p in phases()]
    first_trl = next(n for n in order if n.startswith("trl"))
    first_fleet = next(n for n in order if n.startswith("fleet"))
    assert {v.get("reused_from") for k, v in ph.items() if k.startswith("trl")} == {None, first_trl}
    assert {v.get("reused_from") for k, v in ph.items() if k.startswith("fleet")} == {None, first_fleet}
    # The dry fleet is PPO with every service: the critic's stages are timed too.
    assert {"generate", "reference", "reward", "critic", "actor_train", "critic_train", "weight_sync",
            "advantage"} <= set(ph[first_fleet]["stages"])
    cfg = ph[first_fleet]["config"]
    assert cfg["algo"]["logprob_chunk_tokens"] > 0
    assert cfg["generation"]["process"] is True and cfg["generation"]["behaviour_logprobs"] == "trainer"
    # Stopped once its last measured step was in: the launcher and every service it started are gone.
    fleet = ph[first_fleet]
    assert fleet["stopped_after_measuring"] is True and fleet["rc"] == 0
    assert not (tmp_path / "work" / first_fleet / "export").exists()
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "work")], capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout

    # The TRL peer's own JSON (what the GPU run's TRL phases write).
    trl = json.loads((tmp_path / "work" / f"{first_trl}.json").read_text())
    w = res["workload"]
    per_step = w["prompts_per_step"] * w["group"]
    assert trl["ok"] is True and trl["framework"] == "trl" and trl["device"] == "cpu"
    assert trl["trl_version"] and trl["transformers_version"] and trl["torch_version"]
    for key in ("prompts_per_step", "group", "micro_batch", "steps", "warmup", "prompt_tokens", "completion_tokens"):
        assert trl["config"][key] == w[key], key
    assert trl["config"]["completions_per_step"] == per_step
    assert trl["grpo_config"]["generation_batch_size"] == per_step
    steps = trl["steps"]
    assert [s["step"] for s in steps] == list(range(1, w["warmup"] + w["steps"] + 1))
    assert all(a["t_end"] <= b["t_begin"] for a, b in itertools.pairwise(steps))
    # min_new_tokens forces every completion to the full budget.
    assert trl["exact_length_completions"] is True and trl["completion_tokens_source"] == "trl_logged_mean_length"
    assert [s["completion_tokens"] for s in steps] == [per_step * w["completion_tokens"]] * len(steps)
    assert trl["steady"]["tokens_per_s"] == pytest.approx(trl["steady"]["samples_per_s"] * w["completion_tokens"])

    md = (out / "vs_trl.md").read_text()
    assert "| TRL GRPOTrainer, vLLM colocated" in md and "Dry run on a CPU" in md
    assert "rlfleet's repeats ran with `generation.engine: transformers` in its own process," in md
    assert md.count("**rlfleet, median of 3**") == 2 and "### Levers" in md
    assert md.count("- Trainer and reference alone (one step's batch, the GPU their own): train ") == 2
    assert "0.5b: rlfleet GRPO over TRL with vLLM, samples/s" in md


def test_the_start_up_timeline_reads_each_services_json_log(tmp_path: Path) -> None:
    import io
    import logging

    from bench.vs_trl.logs import engine_start_s, startup_timeline
    from services.core.observability.logs import JsonFormatter

    logs = tmp_path / "logs"
    logs.mkdir()
    t0 = 1_796_170_000.0

    def line(service: str, at: float, msg: str, **extra: Any) -> str:
        rec = logging.LogRecord("x", logging.INFO, __file__, 0, msg, None, None)
        rec.created, rec.msecs = at, (at % 1) * 1000
        rec.__dict__.update(extra)
        return JsonFormatter(service).format(rec)

    buf = io.StringIO()
    buf.write("INFO 12-01 vLLM's own plain line\n")
    # Two engine replicas start together (the set is up with the last) while the trainer is built.
    for at, msg, extra in ((t0 + 9.5, "serving", {}), (t0 + 66.0, "engine process started", {"seconds": 54.0}),
                           (t0 + 68.5, "trainer built while the engine starts", {"seconds": 57.1}),
                           (t0 + 70.2, "engine process started", {"seconds": 58.4}),
                           (t0 + 71.0, "state changed", {"from": "starting", "to": "ready"})):
        buf.write(line("actor", at, msg, **extra) + "\n")
    (logs / "actor.log").write_text(buf.getvalue())
    (logs / "reward.log").write_text(line("reward", t0 + 6.0, "serving") + "\n"
                                     + line("reward", t0 + 8.0, "state changed", to="ready") + "\n")
    # The controller could not reach the actor until 95 s, 24 s after the actor was ready.
    (logs / "controller.log").write_text("\n".join(
        [line("controller", t0 + 5.0, "state changed", to="ready")]
        + [line("controller", t0 + t, "rpc failed, retrying", method="/rlfleet.v1.Actor/GetState")
           for t in (6.0, 40.0, 95.0)]) + "\n")
    (logs / "launcher.log").write_text("\n".join(
        line("launcher", t0 + t, msg, **extra) for t, msg, extra in (
            (1.5, "preflight passed", {"seconds": 1.4}), (3.0, "redis started", {}), (4.0, "models prepared", {}),
            (4.2, "service started", {"child": "reward"}), (4.4, "service started", {"child": "actor"}),
            (71.5, "all services ready", {}))) + "\n")
    tl = startup_timeline(tmp_path, t0)
    assert tl == {"actor": {"first_log_s": 9.5, "ready_s": 71.0, "engine_s": 58.4, "trainer_s": 57.1},
                  "controller": {"first_log_s": 5.0, "ready_s": 5.0, "last_rpc_retry_s": 95.0},
                  "launcher": {"first_log_s": 1.5, "services_started_s": 4.2, "ready_s": 71.5},
                  "reward": {"first_log_s": 6.0, "ready_s": 8.0}}
    assert engine_start_s(tmp_path) == 58.4
    md = render.render({**_result([80.0], [40.0]), "phases": {
        **_result([80.0], [40.0])["phases"], "fleet-0.5b-r1": {**_fleet(80.0, 60.0), "startup": tl}}})
    assert ("controller 5 → 5 (an RPC to a peer failed until 95), reward 6 → 8, actor 10 → 71"
            " (engine process 58 s) (trainer built and compiled beside it 57 s), launcher 2 → 72"
            " (services started at 4)") in md



def test_the_report_names_the_cpus_the_run_had_and_the_gpus_numa_node() -> None:
    res = _result([80.0, 88.0, 84.0], [40.0, 41.0, 42.0])
    res["cpu_topology"] = {"cpus_allowed": 16, "numa_nodes": {"node0": "0-63", "node1": "64-127"},
                           "gpu_local_cpus": {"0000:1b:00.0": "0-63"}}
    md = render.render(res)
    assert "; 16 CPUs allowed, NUMA node0 0-63, node1 64-127, the GPU's local CPUs 0-63." in md
    del res["cpu_topology"]  # results written before the field existed still render
    assert "CPUs allowed" not in render.render(res)


def test_the_compiles_of_a_step_and_their_guard_failures_are_read_from_the_service_logs(tmp_path: Path) -> None:
    import logging

    from bench.vs_trl.logs import step_compiles
    from services.core.observability.logs import JsonFormatter

    (tmp_path / "logs").mkdir()
    rec = logging.LogRecord("services.models.nets.logprobs", logging.INFO, __file__, 0, "compiled during a step",
                            None, None)
    rec.__dict__.update(role="actor", graphs=1, seconds=8.6,
                        guard_failures=["0/3: tensor 'args[0]' size mismatch at index 1. expected 320, actual 318"])
    (tmp_path / "logs" / "actor.log").write_text(
        "INFO vLLM's own plain line\n" + JsonFormatter("actor").format(rec) + "\n")
    (tmp_path / "logs" / "reward.log").write_text("")
    assert step_compiles(tmp_path) == [{"role": "actor", "graphs": 1, "seconds": 8.6, "guard_failures": [
        "0/3: tensor 'args[0]' size mismatch at index 1. expected 320, actual 318"]}]
    assert step_compiles(tmp_path / "no-run") == []


def test_a_repeat_that_compiled_after_its_warm_up_is_named_in_the_report_with_the_guard_that_failed() -> None:
    guard = "0/9: tensor 'args[0]' size mismatch at index 1. expected 14, actual 320"
    compiled = {**_fleet(80.0, 60.0), "compiled_in_steps": {"2": 1},
                "step_compiles": [{"role": "actor", "graphs": 1, "seconds": 10.7, "guard_failures": [guard]}]}
    md = render.render({**_result([80.0], [40.0]), "phases": {**_result([80.0], [40.0])["phases"],
                                                          "fleet-0.5b-r1": compiled}})
    assert (f"- Compiled during a step, after the warm-up: r1 step 2 (1 graph) in a 10.7 s train step"
            f" (first failed guard: `{guard}`).") in md
    assert "Compiled during a step" not in render.render(_result([80.0], [40.0]))
