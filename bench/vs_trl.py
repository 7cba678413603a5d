"""rlfleet against TRL on one GPU, same model, data and hyper-parameters, in one run (issue 7).

    python -m bench.vs_trl run --out bench/results          # on a GPU host: every phase, then the report
    python -m bench.vs_trl report --results FILE.json       # re-render BENCHMARKS.md and plots from a run
    BENCH_DRY=1 python -m bench.vs_trl run --out DIR        # CPU dry run of the harness (measures nothing)

Workload: a Qwen2.5-0.5B-shaped Qwen2 (hidden 896, 24 layers, 14 heads, 2 KV heads, vocab 151,936),
random weights, bf16; prompts of exactly 64 tokens (`services.tasks.synthetic`), completions of 256
tokens, GRPO with groups of 8 and 256 completions per step, KL 0.04 (k3, in the loss), lr 1e-6, one
epoch, one optimizer step per step, micro-batches of 16 sequences.

Phases, each its own process so that each starts with the GPU to itself, in order of value, each under
a time cap and all under `--deadline-s`, so a short lease still yields the most important rows:

1. `trl`: TRL 1.16 `GRPOTrainer` (`bench.trl_peer`; generation with `model.generate`).
2. `fleet-vllm-grpo-proc`: `rlfleet up` with every service on the GPU, `engine: vllm` and
   `generation.process: true` (the engine in a child process of the actor, its own GIL).
3. `fleet-vllm-grpo`: the same with the engine inside the actor's process.
4. `vllm-alone`: vLLM's own `LLM.generate` on the same 256 prompts: plain, with per-token log-probs,
   and with log-probs plus per-request seeds (what the fleet's engine asks for).
5. `fleet-vllm-ppo`: PPO with a critic (engine in its own process).
6. `fleet-hf-grpo`: the fleet with the transformers engine.

Steady state drops the first `--warmup` steps and takes medians over `--steps` steps. GPU utilization
is sampled with NVML every 100 ms by this process for the whole run and averaged over each phase's
steady window. The fleet's per-stage seconds per step are differences of the services'
`rlfleet_stage_latency_seconds` sums, scraped at the start and end of the steady window, divided by the
steps in between; advantage seconds come from the controller's metrics rows.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
WORK = Path(os.environ.get("BENCH_WORK", "/tmp/rlfleet-vs-trl"))
DRY = os.environ.get("BENCH_DRY") == "1"

QWEN05: dict[str, Any] = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                              intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768,
                              rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True)
W: dict[str, Any] = dict(prompts_per_step=32, group=8, prompt_tokens=64, completion_tokens=256, micro_batch=16,
                         kl_coef=0.04, lr=1e-6, steps=10, warmup=2)
if DRY:
    QWEN05.update(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=504)
    W.update(prompts_per_step=2, group=2, prompt_tokens=8, completion_tokens=8, micro_batch=2, steps=2, warmup=1)
N_SPECIAL = 4  # <pad> <s> </s> <unk> of the word-level tokenizer
STAGES = ("generate", "reference", "reward", "critic", "advantage", "actor_train", "critic_train", "weight_sync")
PORTS = {"controller": 0, "actor": 1, "critic": 2, "reward": 3, "reference": 4}
MARK_BEGIN, MARK_END = "<!-- vs_trl:begin -->", "<!-- vs_trl:end -->"


def say(*a: Any) -> None:
    print(f"[vs_trl {time.strftime('%H:%M:%S')}]", *a, flush=True)


# -- GPU utilization ---------------------------------------------------------------------------------
class GpuSampler(threading.Thread):
    """NVML utilization and memory of GPU 0 every `period` seconds; silent (no samples) without NVML."""

    def __init__(self, period: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.period, self.stop = period, threading.Event()
        self.samples: list[tuple[float, float, float]] = []
        self.name = ""
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml: Any = pynvml
            self.h = pynvml.nvmlDeviceGetHandleByIndex(0)
            raw = pynvml.nvmlDeviceGetName(self.h)
            self.name = raw.decode() if isinstance(raw, bytes) else str(raw)
        except Exception:
            self.nvml = None

    def run(self) -> None:
        while self.nvml is not None and not self.stop.is_set():
            try:
                u = self.nvml.nvmlDeviceGetUtilizationRates(self.h)
                m = self.nvml.nvmlDeviceGetMemoryInfo(self.h)
                self.samples.append((time.time(), float(u.gpu), m.used / 2**30))
            except Exception:
                pass
            time.sleep(self.period)

    def between(self, t0: float, t1: float) -> list[tuple[float, float, float]]:
        return [s for s in self.samples if t0 <= s[0] <= t1]


def mean_util(samples: list[tuple[float, float, float]]) -> float | None:
    return statistics.fmean(s[1] for s in samples) if samples else None


# -- model and data ---------------------------------------------------------------------------------
def build_model(path: Path) -> None:
    """Random-weight Qwen2 in bf16 plus a word tokenizer whose vocabulary is the model's (every id decodes)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from services.models.tokenizer import build_tokenizer_from_vocab

    if (path / "config.json").exists():
        return
    task = synthetic_task()
    tok = build_tokenizer_from_vocab(task.vocab(), "word")
    cfg = Qwen2Config(**QWEN05, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    assert len(tok) == cfg.vocab_size, (len(tok), cfg.vocab_size)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)  # type: ignore[arg-type]
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(path)


def synthetic_task() -> Any:
    from services.tasks.synthetic import SyntheticTask

    return SyntheticTask({"prompt_tokens": W["prompt_tokens"], "completion_tokens": W["completion_tokens"],
                          "words": QWEN05["vocab_size"] - N_SPECIAL})


# -- phases -----------------------------------------------------------------------------------------
def run_proc(cmd: list[str], log: Path, timeout_s: float, env: dict[str, str] | None = None) -> int:
    say("$", " ".join(cmd), f"(cap {timeout_s:.0f} s, log {log})")
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env or os.environ.copy(),
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return 124


def _kill_group(proc: subprocess.Popen[Any]) -> None:
    import signal

    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def phase_trl(model: Path, cap: float, gpu: GpuSampler) -> dict[str, Any]:
    out, log = WORK / "trl.json", WORK / "trl.log"
    cmd = [sys.executable, "-m", "bench.trl_peer", "--model", str(model), "--out", str(out),
           "--steps", str(W["steps"]), "--warmup", str(W["warmup"]), "--prompts-per-step", str(W["prompts_per_step"]),
           "--group", str(W["group"]), "--prompt-tokens", str(W["prompt_tokens"]),
           "--completion-tokens", str(W["completion_tokens"]), "--micro-batch", str(W["micro_batch"]),
           "--kl-coef", str(W["kl_coef"]), "--lr", str(W["lr"])]
    if DRY:
        cmd += ["--device", "cpu", "--words", str(QWEN05["vocab_size"] - N_SPECIAL)]
    t0 = time.time()
    rc = run_proc(cmd, log, cap)
    res: dict[str, Any] = {"rc": rc, "t0": t0, "t1": time.time(), "log_tail": tail(log)}
    if not out.exists():
        return res
    data = json.loads(out.read_text())
    res["raw"] = {k: v for k, v in data.items() if k not in ("traceback",)}
    if not data.get("ok"):
        return res
    steps = data["steps"][W["warmup"]:]
    st = data["steady"]
    w0, w1 = steps[0]["wall_begin"], steps[-1]["wall_end"]
    res.update(ok=True, window=(w0, w1), samples_per_s=st["samples_per_s"], tokens_per_s=st["tokens_per_s"],
               median_step_s=st["median_step_s"], steps_measured=st["steps_measured"],
               gpu_util=mean_util(gpu.between(w0, w1)),
               stages=_trl_stages(steps))
    return res


def _trl_stages(steps: list[dict[str, Any]]) -> dict[str, float]:
    """TRL's own profiling timers per step (median), mapped onto our stage names where they match."""
    per: dict[str, list[float]] = {}
    for s in steps:
        for k, v in (s.get("profile") or {}).items():
            if isinstance(v, int | float):
                per.setdefault(k, []).append(float(v))
    return {k: statistics.median(v) for k, v in per.items() if v}


FLEETS = ("fleet-vllm-grpo-proc", "fleet-vllm-grpo", "fleet-vllm-ppo", "fleet-hf-grpo")


def fleet_config(name: str, engine: str, algo: str, model: Path, process: bool = False) -> dict[str, Any]:
    base = 51100 + 20 * FLEETS.index(name)
    device = "cpu" if DRY else "cuda"
    svc: dict[str, dict[str, Any]] = {n: {"grpc_port": base + i, "http_port": base + 10 + i} for n, i in PORTS.items()}
    for n in ("actor", "critic", "reference"):
        svc[n]["device"] = device
    return {
        "run": {"name": name.replace("-", "_"), "dir": str(WORK / name), "seed": 0,
                "max_steps": W["warmup"] + W["steps"] + 1},
        "task": {"name": "synthetic", "eval_size": 0,
                 "params": {"prompt_tokens": W["prompt_tokens"], "completion_tokens": W["completion_tokens"],
                            "words": QWEN05["vocab_size"] - N_SPECIAL}},
        "models": {"policy": {"path": str(model), "dtype": "float32" if DRY else "bfloat16"}},
        "algo": {"name": algo, "group_size": W["group"], "kl_coef": W["kl_coef"], "kl_estimator": "k3",
                 "kl_in": "loss", "lr": W["lr"], "critic_lr": 1e-5, "ppo_epochs": 1,
                 "minibatch_size": W["prompts_per_step"] * W["group"], "micro_batch_size": W["micro_batch"]},
        # A dry run has no vLLM: the transformers engine stands in, so the harness itself is exercised.
        "generation": {"engine": "transformers" if DRY else engine, "device": device, "process": process,
                       "max_new_tokens": W["completion_tokens"], "temperature": 1.0,
                       "micro_batch": 0,  # vLLM: no cap on sequences per engine step
                       "vllm": {"gpu_memory_utilization": 0.2, "max_model_len": 512}},
        "batch": {"prompts_per_step": W["prompts_per_step"], "prompts_per_message": W["prompts_per_step"]},
        "services": svc,
        # Generation of step n+1 overlaps training of step n; nothing is resent during a slow start.
        "flow": {"max_staleness": 1, "resend_after_s": 900.0, "rpc_timeout_s": 900.0},
        "checkpoint": {"every": 1000},
    }


def scrape_stages(cfg: dict[str, Any]) -> dict[str, float]:
    """Sum of rlfleet_stage_latency_seconds per stage over every running service."""
    import httpx

    out: dict[str, float] = {}
    for ep in cfg["services"].values():
        try:
            text = httpx.get(f"http://127.0.0.1:{ep['http_port']}/metrics", timeout=5).text
        except Exception:
            continue
        for line in text.splitlines():
            m = re.match(r'^rlfleet_stage_latency_seconds_sum\{([^}]*)\} ([-+0-9.eE]+)$', line)
            if m:
                stage = re.search(r'stage="([^"]+)"', m.group(1))
                if stage:
                    out[stage.group(1)] = out.get(stage.group(1), 0.0) + float(m.group(2))
    return out


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a row being written
    return rows


def phase_fleet(name: str, engine: str, algo: str, model: Path, cap: float, gpu: GpuSampler,
                process: bool = False) -> dict[str, Any]:
    cfg = fleet_config(name, engine, algo, model, process)
    run_dir = Path(cfg["run"]["dir"])
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cfg_path = WORK / f"{name}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    log = WORK / f"{name}.log"
    cmd = [sys.executable, "-m", "services.cli", "up", "--config", str(cfg_path), "--ready-timeout", str(int(cap))]
    say("$", " ".join(cmd), f"(cap {cap:.0f} s, log {log})")
    t0 = time.time()
    snaps: dict[int, tuple[float, dict[str, float]]] = {}
    first, last = W["warmup"], W["warmup"] + W["steps"]
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        deadline = time.monotonic() + cap
        while proc.poll() is None and time.monotonic() < deadline:
            rows = read_rows(run_dir / "metrics.jsonl")
            done = max((int(r["step"]) for r in rows), default=0)
            for k in (first, last):
                if done >= k and k not in snaps:
                    snaps[k] = (time.time(), scrape_stages(cfg))
            time.sleep(0.2)
        rc = proc.poll()
        if rc is None:
            _kill_group(proc)
            rc = 124
    res: dict[str, Any] = {"rc": rc, "t0": t0, "t1": time.time(), "log_tail": tail(log), "config": cfg}
    rows = [r for r in read_rows(run_dir / "metrics.jsonl") if "step_s" in r]
    res["rows"] = rows
    steady = [r for r in rows if first < int(r["step"]) <= last]
    if len(steady) < max(2, W["steps"] // 2):
        res["error"] = f"only {len(steady)} steady steps recorded"
        return res
    step_s = statistics.median(float(r["step_s"]) for r in steady)
    samples = statistics.median(int(r["samples"]) for r in steady)
    tokens = statistics.median(int(r["tokens"]) for r in steady)
    w0 = next(float(r["time"]) for r in rows if int(r["step"]) == first) if any(
        int(r["step"]) == first for r in rows) else float(steady[0]["time"]) - float(steady[0]["step_s"])
    w1 = float(steady[-1]["time"])
    stages: dict[str, float] = {"advantage": statistics.median(float(r.get("advantage_s", 0.0)) for r in steady)}
    if first in snaps and last in snaps:
        a, b = snaps[first][1], snaps[last][1]
        n = last - first
        for k in b:
            stages[k] = (b[k] - a.get(k, 0.0)) / n
    gen_s = stages.get("generate")
    res.update(ok=True, window=(w0, w1), steps_measured=len(steady), median_step_s=step_s,
               samples_per_s=samples / step_s, tokens_per_s=tokens / step_s,
               window_samples_per_s=sum(int(r["samples"]) for r in steady) / (w1 - w0) if w1 > w0 else None,
               stages=stages, generate_tokens_per_s=(tokens / gen_s) if gen_s else None,
               gpu_util=mean_util(gpu.between(w0, w1)))
    return res


VLLM_ALONE = r'''
import json, statistics, sys, time
from pathlib import Path
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from services.models.loading import load_tokenizer
from bench.vs_trl import W, synthetic_task
model, out = Path(sys.argv[1]), Path(sys.argv[2])
tok = load_tokenizer(model)
task = synthetic_task()
ids = [tok(task.prompt(i).text)["input_ids"] for i in range(W["prompts_per_step"])]
prompts = [TokensPrompt(prompt_token_ids=p) for p in ids for _ in range(W["group"])]
llm = LLM(model=str(model), skip_tokenizer_init=True, dtype="bfloat16", gpu_memory_utilization=0.2,
          max_model_len=512, seed=0)
res = {}
for name, kw in (("plain", {}), ("logprobs", {"logprobs": 0}), ("logprobs_seeded", {"logprobs": 0, "seeded": True})):
    seeded = kw.pop("seeded", False)
    def params(i):
        return SamplingParams(max_tokens=W["completion_tokens"], temperature=1.0, detokenize=False,
                              seed=(i * 7919 + 1) if seeded else None, **kw)
    ps = [params(i) for i in range(len(prompts))]
    llm.generate(prompts, ps, use_tqdm=False)
    times, toks = [], []
    for _ in range(3):
        t = time.perf_counter()
        outs = llm.generate(prompts, ps, use_tqdm=False)
        times.append(time.perf_counter() - t)
        toks.append(sum(len(o.outputs[0].token_ids) for o in outs))
    rates = [n / s for n, s in zip(toks, times)]
    res[name] = {"seconds": times, "tokens": toks, "tokens_per_s": statistics.median(rates)}
    print(name, res[name]["tokens_per_s"], flush=True)
out.write_text(json.dumps(res))
'''


def phase_vllm_alone(model: Path, cap: float, gpu: GpuSampler) -> dict[str, Any]:
    out, log = WORK / "vllm-alone.json", WORK / "vllm-alone.log"
    t0 = time.time()
    try:
        import vllm  # noqa: F401
    except ImportError:
        return {"rc": None, "t0": t0, "t1": t0, "error": "vllm is not installed"}
    rc = run_proc([sys.executable, "-c", VLLM_ALONE, str(model), str(out)], log, cap)
    res: dict[str, Any] = {"rc": rc, "t0": t0, "t1": time.time(), "log_tail": tail(log)}
    if out.exists():
        res.update(ok=True, variants=json.loads(out.read_text()))
    return res


# -- orchestration ----------------------------------------------------------------------------------
def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for mod in ("torch", "transformers", "trl", "vllm", "accelerate", "datasets"):
        try:
            out[mod] = str(__import__(mod).__version__)
        except Exception:
            out[mod] = "absent"
    return out


def cmd_run(args: argparse.Namespace) -> int:
    WORK.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    gpu = GpuSampler()
    gpu.start()
    result: dict[str, Any] = {"command": " ".join(["python -m bench.vs_trl", *sys.argv[1:]]), "dry": DRY,
                              "gpu": gpu.name or "none", "versions": versions(), "workload": W,
                              "model": {k: QWEN05[k] for k in ("hidden_size", "num_hidden_layers",
                                                               "num_attention_heads", "num_key_value_heads",
                                                               "vocab_size")},
                              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "phases": {}}
    model = WORK / "model"
    say("building the model")
    build_model(model)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = args.out / f"vs_trl-{stamp}.json"
    plan: list[tuple[str, float, Any]] = [
        ("trl", 200, lambda cap: phase_trl(model, cap, gpu)),
        ("fleet-vllm-grpo-proc", 220,
         lambda cap: phase_fleet("fleet-vllm-grpo-proc", "vllm", "grpo", model, cap, gpu, process=True)),
        ("fleet-vllm-grpo", 220, lambda cap: phase_fleet("fleet-vllm-grpo", "vllm", "grpo", model, cap, gpu)),
        ("vllm-alone", 120, lambda cap: phase_vllm_alone(model, cap, gpu)),
        ("fleet-vllm-ppo", 220,
         lambda cap: phase_fleet("fleet-vllm-ppo", "vllm", "ppo", model, cap, gpu, process=True)),
        ("fleet-hf-grpo", 300, lambda cap: phase_fleet("fleet-hf-grpo", "transformers", "grpo", model, cap, gpu)),
    ]
    only = set(args.only.split(",")) if args.only else None
    for name, cap, fn in plan:
        if only is not None and name not in only:
            continue
        left = args.deadline_s - (time.monotonic() - start)
        if left < 45:
            result["phases"][name] = {"skipped": f"{left:.0f} s left of the {args.deadline_s:.0f} s deadline"}
            continue
        say(f"phase {name}")
        try:
            result["phases"][name] = fn(min(cap, left - 15))
        except Exception as err:  # one broken phase must not cost the others
            result["phases"][name] = {"error": f"{type(err).__name__}: {err}"}
        p = result["phases"][name]
        say(f"phase {name}: " + json.dumps({k: p.get(k) for k in ("rc", "ok", "samples_per_s", "gpu_util", "error")}))
        result["gpu_samples"] = gpu.samples
        path.write_text(json.dumps(result, default=str))  # after every phase: a cut-off run keeps what it has
    gpu.stop.set()
    result["gpu_samples"] = gpu.samples
    path.write_text(json.dumps(result, default=str))
    say(f"wrote {path}")
    report(path, args.out, update_benchmarks=args.update_benchmarks)
    return 0


# -- report -----------------------------------------------------------------------------------------
def _f(x: Any, nd: int = 1) -> str:
    return "—" if x is None else f"{x:,.{nd}f}"


def render(res: dict[str, Any], json_name: str) -> str:
    ph = res["phases"]
    trl = ph.get("trl", {})
    base = trl.get("samples_per_s")
    lines = [
        MARK_BEGIN,
        "## rlfleet vs TRL on one GPU (issue 7)\n",
        "```\n" + res["command"] + "\n```\n",
        f"GPU: {res['gpu']}; " + ", ".join(f"{k} {v}" for k, v in res["versions"].items())
        + f". Raw numbers: `bench/results/{json_name}`; utilization plots `bench/results/util-*.png`.\n",
        f"Workload: Qwen2-shaped model {res['model']}, random weights, bf16; {res['workload']['prompt_tokens']}-token "
        f"prompts, {res['workload']['completion_tokens']}-token completions, groups of {res['workload']['group']}, "
        f"{res['workload']['prompts_per_step'] * res['workload']['group']} completions per step, medians over "
        f"{res['workload']['steps']} steps after {res['workload']['warmup']} warm-up steps.\n",
        "| configuration | samples/s | tokens/s | step s | mean GPU util % | vs TRL |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    labels = {"trl": "TRL GRPOTrainer (generate)",
              "fleet-vllm-grpo-proc": "rlfleet GRPO, engine: vllm in its own process",
              "fleet-vllm-grpo": "rlfleet GRPO, engine: vllm",
              "fleet-vllm-ppo": "rlfleet PPO + critic, engine: vllm",
              "fleet-hf-grpo": "rlfleet GRPO, engine: transformers"}
    for key, label in labels.items():
        if key not in ph:
            continue  # not a phase of this run (an older harness)
        p = ph[key]
        if not p.get("ok"):
            why = p.get("skipped") or p.get("error") or f"exit {p.get('rc')}"
            lines.append(f"| {label} | not measured: {why} | | | | |")
            continue
        ratio = p["samples_per_s"] / base if base else None
        vs = _f(ratio, 2) + "×" if ratio else "—"
        lines.append(f"| {label} | {_f(p['samples_per_s'])} | {_f(p['tokens_per_s'], 0)} | {_f(p['median_step_s'], 2)}"
                     f" | {_f(p.get('gpu_util'))} | {vs} |")
    lines += ["", "Seconds per step by stage (fleet: service histograms over the steady window; stages overlap"
              " across services, so they need not add up to the step):", "",
              "| configuration | " + " | ".join(STAGES) + " |", "| --- |" + " ---: |" * len(STAGES)]
    for key in FLEETS:
        p = ph.get(key, {})
        if p.get("ok"):
            st = p.get("stages", {})
            lines.append(f"| {labels[key]} | " + " | ".join(_f(st.get(s), 2) for s in STAGES) + " |")
    if trl.get("ok") and trl.get("stages"):
        lines += ["", "TRL's own per-step timers (median seconds): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in sorted(trl["stages"].items()))]
    va = ph.get("vllm-alone", {})
    if va.get("ok"):
        v = va["variants"]
        lines += ["", "Generation, 256 sequences × 256 tokens: vLLM `LLM.generate` alone "
                  + ", ".join(f"{k} {_f(x['tokens_per_s'], 0)} tok/s" for k, x in v.items())]
        for key in FLEETS[:3]:
            g = ph.get(key, {}).get("generate_tokens_per_s")
            ref = v.get("logprobs", {}).get("tokens_per_s")
            if g and ref:
                lines.append(f"- {labels[key]}: generate stage {_f(g, 0)} tok/s = {g / ref:.2f}× vLLM alone"
                             " with log-probs")
    lines += ["", "Targets (issue 7), from this run:", "", *targets(ph)]
    lines.append(MARK_END)
    return "\n".join(lines) + "\n"


def targets(ph: dict[str, Any]) -> list[str]:
    """Each target of issue 7 with its measured value and met / missed (or not measured)."""
    trl = ph.get("trl", {})
    # The faster of the two vLLM GRPO fleets (engine in the actor's process or in its own).
    measured = [ph[k] for k in FLEETS[:2] if ph.get(k, {}).get("ok")]
    fleet: dict[str, Any] = max(measured, key=lambda p: p["samples_per_s"], default={})
    alone = ph.get("vllm-alone", {}).get("variants", {}).get("logprobs", {}).get("tokens_per_s")
    out = []

    def line(what: str, value: float | None, goal: float, fmt: str, higher: bool = True) -> None:
        if value is None:
            out.append(f"- {what}: not measured")
            return
        met = value >= goal if higher else value <= goal
        out.append(f"- {what}: {fmt.format(value)} (target {fmt.format(goal)}): {'met' if met else 'missed'}")

    ratio = (fleet["samples_per_s"] / trl["samples_per_s"]) if fleet.get("ok") and trl.get("ok") else None
    line("rlfleet `engine: vllm` GRPO samples/s over TRL's", ratio, 2.5, "{:.2f}×")
    line("mean GPU utilization in rlfleet's steady state", fleet.get("gpu_util"), 80.0, "{:.1f}%")
    gen = fleet.get("generate_tokens_per_s")
    line("fleet generation stage over standalone vLLM (same sampling: per-token log-probs)",
         gen / alone if gen and alone else None, 0.9, "{:.2f}×")
    return out


def plots(res: dict[str, Any], out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    samples = res.get("gpu_samples") or []
    made = []
    for key, p in res["phases"].items():
        if "t0" not in p:
            continue
        pts = [(t - p["t0"], u) for t, u, _ in samples if p["t0"] <= t <= p["t1"]]
        fig, ax = plt.subplots(figsize=(7, 2.6), dpi=80)
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], lw=0.8)
        if p.get("window"):
            ax.axvspan(p["window"][0] - p["t0"], p["window"][1] - p["t0"], alpha=0.15, color="green",
                       label=f"steady: mean {_f(p.get('gpu_util'))}%")
            ax.legend(loc="lower right", fontsize=8)
        ax.set_ylim(0, 105)
        ax.set_xlabel("seconds since phase start")
        ax.set_ylabel("GPU util %")
        ax.set_title(f"{key} ({res['gpu']})", fontsize=9)
        fig.tight_layout()
        path = out / f"util-{key}.png"
        fig.savefig(path)
        plt.close(fig)
        made.append(path)
    return made


def report(path: Path, out: Path, update_benchmarks: bool) -> None:
    res = json.loads(path.read_text())
    out.mkdir(parents=True, exist_ok=True)
    md = render(res, path.name)
    (out / "vs_trl.md").write_text(md)
    made = plots(res, out)
    say(f"report: {out / 'vs_trl.md'}; plots: {', '.join(p.name for p in made) or 'none (no matplotlib)'}")
    if update_benchmarks:
        bm = REPO / "BENCHMARKS.md"
        text = bm.read_text()
        if MARK_BEGIN in text and MARK_END in text:
            text = text[: text.index(MARK_BEGIN)] + md + text[text.index(MARK_END) + len(MARK_END) + 1:]
        else:
            text = text.rstrip("\n") + "\n\n" + md
        bm.write_text(text)
    print(md)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.vs_trl", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run every phase (GPU host), then write the report")
    r.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    r.add_argument("--deadline-s", type=float, default=1500.0, help="skip phases that would start after this")
    r.add_argument("--only", default=None, help="comma-separated phases to run")
    r.add_argument("--update-benchmarks", action="store_true", help="rewrite the section in BENCHMARKS.md")
    rep = sub.add_parser("report", help="render BENCHMARKS.md's section and the plots from a results JSON")
    rep.add_argument("--results", type=Path, required=True)
    rep.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    rep.add_argument("--update-benchmarks", action="store_true")
    args = ap.parse_args(argv)
    if args.cmd == "run":
        return cmd_run(args)
    report(args.results, args.out, args.update_benchmarks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
