"""GPU verification of the vLLM generation engine (issue 6), in one command on one GPU.

    python -m bench.vllm_check all --out DIR

Phases (each a separate process, so every vLLM engine starts in a clean process):

- `main`: a Qwen2.5-0.5B-shaped model (random weights, bf16, no tokenizer) saved to disk;
  (b) generation throughput at batch 256, 64-token prompts, 256 new tokens: transformers `generate`
  vs vLLM through `VLLMEngine.generate` (seeded, with log-probs) and vLLM's own `LLM.generate`;
  (c) log-prob agreement of engine vs trainer (`response_logprobs`, bf16 and fp32 forwards) at
  version 0 (random weights) and after each of 3 weight updates (10 AdamW steps of SFT on a fixed
  token text each, so the model turns "trained-looking": peaked on that text);
  (e) seconds per in-place weight sync (median of several, fp32 and bf16 sources);
  (d, part 1) stale KV: an update without the prefix-cache reset scores cached prompts wrongly;
  then scores a fixed sequence set and greedy completions at the final version for `fresh`.
- `fresh`: (d, part 2) a fresh engine loaded from the saved final weights scores the same sequences
  and greedy completions; max difference against the updated engine.
- `grpo --engine vllm|transformers`: (f) the tiny arithmetic GRPO run through `services.local.run_local`.
- `tests`: the vLLM tests (tests/unit/test_engine_vllm.py and a subset of the engine contract tests).

Every phase writes DIR/<phase>.json; `all` also writes DIR/vllm-summary.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import say

REPO = Path(__file__).resolve().parents[1]
# Models, run dirs and phase logs live here, outside --out (which holds only the JSON results and one
# combined log, so that it stays small).
WORK = Path(os.environ.get("VLLM_CHECK_WORK", "/tmp/vllm-check-work"))

QWEN05: dict[str, Any] = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
              intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
              rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151643)
ENGINE_OPTS: dict[str, Any] = dict(dtype="bfloat16", gpu_memory_utilization=0.35, max_model_len=2048,
                                   enforce_eager=False)
BATCH, PROMPT_LEN, NEW_TOKENS = 256, 64, 256
# VLLM_CHECK_DRY=1: a CPU dry run of the script's own logic (tiny model, the transformers engine in
# vLLM's place); it measures nothing.
DRY = os.environ.get("VLLM_CHECK_DRY") == "1"
if DRY:
    QWEN05.update(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=4000, bos_token_id=1, eos_token_id=1)
    BATCH, PROMPT_LEN, NEW_TOKENS = 8, 64, 8
GRPO_STEPS = int(os.environ.get("VLLM_CHECK_GRPO_STEPS", "200"))
VOCAB_HI = int(QWEN05["vocab_size"]) - 1000  # type: ignore[call-overload]


def dump(out: Path, name: str, data: Any) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(data, indent=1, sort_keys=True, default=float))


def diff_stats(a: Any, b: Any) -> dict[str, float]:
    import torch

    d = (torch.as_tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64)).abs().flatten()
    if d.numel() == 0:
        return {"n": 0}
    return {"n": int(d.numel()), "max": float(d.max()), "mean": float(d.mean()),
            "p99": float(torch.quantile(d.float()[: 2**24], 0.99))}


# -- phase main ------------------------------------------------------------------------------------
def phase_main(out: Path) -> dict[str, Any]:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from services.models.engine import SamplingParams, completions_to_rollout
    from services.models.engines.vllm_engine import VLLMEngine
    from services.models.nets.logprobs import response_logprobs

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cpu" if DRY else "cuda")
    res: dict[str, Any] = {"gpu": "dry run" if DRY else torch.cuda.get_device_name(0), "torch": torch.__version__}
    eos = int(QWEN05["eos_token_id"])  # type: ignore[call-overload]

    def cuda_sync() -> None:
        if not DRY:
            torch.cuda.synchronize()
    work = WORK
    model_dir = work / "qwen05-random"

    # (a) the model: fp32 master (trained below), bf16 copy (HF baseline + bf16 trainer forward).
    torch.manual_seed(0)
    config = Qwen2Config(**QWEN05)
    with torch.device(dev):
        master = Qwen2ForCausalLM(config)
    master.generation_config = GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    hf16 = copy.deepcopy(master).to(torch.bfloat16).eval()  # type: ignore[arg-type]
    hf16.save_pretrained(model_dir)
    res["params_M"] = sum(p.numel() for p in master.parameters()) / 1e6
    say("model saved", model_dir, f"{res['params_M']:.1f}M params")

    g = torch.Generator().manual_seed(1)
    bench_prompts = torch.randint(1000, VOCAB_HI, (BATCH, PROMPT_LEN), generator=g)

    # (b1) transformers generate on the same GPU.
    import transformers

    res["transformers"] = transformers.__version__
    ids = bench_prompts.to(dev)
    mask = torch.ones_like(ids)
    gen: dict[str, Any] = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=eos)
    with torch.no_grad():
        hf16.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, **gen)
        cuda_sync()
        t0 = time.perf_counter()
        o = hf16.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                          min_new_tokens=NEW_TOKENS, **gen)
        cuda_sync()
        dt = time.perf_counter() - t0
    n_hf = int((o.shape[1] - PROMPT_LEN) * o.shape[0])
    res["hf_generate"] = {"seconds": dt, "tokens": n_hf, "tokens_per_s": n_hf / dt}
    say("HF generate", res["hf_generate"])
    del o, ids, mask
    if not DRY:
        torch.cuda.empty_cache()

    # The engine (torch.compile + CUDA graphs).
    t0 = time.perf_counter()
    engine = _DryEngine.from_path(model_dir) if DRY else VLLMEngine.from_path(model_dir, **ENGINE_OPTS)
    res["engine_start_s"] = time.perf_counter() - t0
    res["engine"] = engine.describe()
    say("engine up", res["engine_start_s"], res["engine"]["scoring"])

    # (b2) throughput through the engine (seeded, log-probs) and through vLLM's own LLM.generate.
    prompts = bench_prompts.tolist()
    runs = []
    for k in range(3):
        engine.reset_prefix_cache()
        cuda_sync()
        t0 = time.perf_counter()
        comps = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, seed=10 + k))
        dt = time.perf_counter() - t0
        n = sum(len(c.token_ids) for c in comps)
        runs.append({"seconds": dt, "tokens": n, "tokens_per_s": n / dt,
                     "finish": {r: sum(c.finish_reason == r for c in comps) for r in ("stop", "length", "abort")}})
        say("engine.generate", runs[-1])
    res["vllm_engine_generate"] = runs
    raw: list[Any] = []
    try:
        import vllm
        from vllm.inputs import TokensPrompt

        sp = vllm.SamplingParams(temperature=1.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
        tp = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        for _ in range(2):
            engine.reset_prefix_cache()
            t0 = time.perf_counter()
            outs = engine.llm.generate(tp, sp, use_tqdm=False)  # type: ignore[union-attr]
            dt = time.perf_counter() - t0
            n = sum(len(x.outputs[0].token_ids) for x in outs)
            raw.append({"seconds": dt, "tokens": n, "tokens_per_s": n / dt})
            say("LLM.generate (unseeded, no logprobs, ignore_eos)", raw[-1])
    except Exception as e:  # the engine's own numbers above are the ones that matter
        raw.append({"error": repr(e)})
        say("LLM.generate failed", repr(e))
    res["vllm_llm_generate"] = raw
    dump(out, "vllm-main.json", res)

    # The HF-backend GRPO run (CPU only) runs beside the rest of this phase.
    # (the driver waits for its JSON; this phase does not wait for it).
    run_phase(["grpo", "--engine", "transformers", "--steps", str(GRPO_STEPS)], out, {"OMP_NUM_THREADS": "4"},
              "grpo-transformers.log")

    # (c) log-prob agreement, (e) sync time.
    def trainers() -> dict[str, Any]:
        hf16.load_state_dict(master.state_dict())  # bf16 copy of the current master
        return {"bf16": hf16, "fp32": master}

    rand_prompts = torch.randint(1000, VOCAB_HI, (64, 32), generator=g).tolist()
    text = torch.randint(1000, 1600, (1024,), generator=g)  # the fixed "text" the SFT memorises
    starts = torch.randint(0, 1024 - 160, (64,), generator=g).tolist()
    text_prompts = [text[s:s + 32].tolist() for s in starts]
    settings = {"t1": SamplingParams(temperature=1.0, max_new_tokens=64, seed=5),
                "t0.7_topk50_topp0.9": SamplingParams(temperature=0.7, top_k=50, top_p=0.9, max_new_tokens=64,
                                                      seed=6),
                "greedy": SamplingParams(temperature=0.0, max_new_tokens=64)}

    @torch.no_grad()
    def agreement(version: int) -> dict[str, Any]:
        tr = trainers()
        rows: dict[str, Any] = {}
        for pname, ps in (("random_prompts", rand_prompts), ("text_prompts", text_prompts)):
            for sname, params in settings.items():
                comps = engine.generate(ps, params)
                r = completions_to_rollout([str(i) for i in range(len(ps))], ps, comps, list(range(len(ps))),
                                           engine.version, 0)
                m = r.response_mask
                row: dict[str, Any] = {"tokens": int(m.sum()),
                                       "stops": sum(c.finish_reason == "stop" for c in comps)}
                for tname, model in tr.items():
                    lp, ent = response_logprobs(model, r.prompt_ids.to(dev), r.prompt_mask.to(dev),
                                                r.response_ids.to(dev), m.to(dev),
                                                temperature=params.temperature or 1.0, with_entropy=True)
                    row[f"vs_{tname}"] = diff_stats(r.behaviour_logprobs[m], lp.cpu()[m])
                    if tname == "fp32":
                        row["mean_entropy_fp32"] = float(ent.cpu()[m].mean())
                        row["mean_logprob_fp32"] = float(lp.cpu()[m].mean())
                rows[f"{pname}/{sname}"] = row
        say(f"agreement v{version}", {k: (v['vs_bf16'].get('max'), v['vs_fp32'].get('max'),
                                          round(v['mean_entropy_fp32'], 2)) for k, v in rows.items()})
        return rows

    opt = torch.optim.AdamW(master.parameters(), lr=3e-4, weight_decay=0.0)
    rows_t = torch.stack([text[s:s + 128] for s in torch.randint(0, 1024 - 128, (256,), generator=g).tolist()])

    def sft(steps: int) -> list[float]:
        master.train()
        losses = []
        for k in range(steps):
            batch = rows_t[(k * 32) % 256:(k * 32) % 256 + 32].to(dev)
            logits = master(input_ids=batch).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                                     batch[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(master.parameters(), 1.0)
            opt.step()
            losses.append(float(loss))
            del logits, loss
        master.eval()
        return losses

    try:
        versions = [{"version": 0, "agreement": agreement(0)}]
        for v in (1, 2, 3):
            losses = sft(10)
            t0 = time.perf_counter()
            engine.abort()
            engine.pause()
            engine.update_weights(master.state_dict().items(), v)
            engine.resume()
            sync_s = time.perf_counter() - t0
            versions.append({"version": v, "sft_loss_first_last": [losses[0], losses[-1]], "sync_s": sync_s,
                             "sync_detail": engine.last_sync, "agreement": agreement(v)})
            dump(out, "vllm-main.json", {**res, "versions": versions})
        res["versions"] = versions
    except Exception:  # record and go on: the later sections do not need this one
        import traceback

        res.setdefault("errors", {})["agreement"] = traceback.format_exc()
        say("agreement failed", traceback.format_exc())
    dump(out, "vllm-main.json", res)

    # (e) sync time: fp32 master source (cast on the fly) and bf16 source, several each.
    try:
        sync: dict[str, Any] = {}
        for src_name, model in (("fp32_source", master), ("bf16_source", hf16)):
            times, details = [], []
            for _ in range(6):
                cuda_sync()
                t0 = time.perf_counter()
                engine.update_weights(model.state_dict().items(), engine.version)
                times.append(time.perf_counter() - t0)
                details.append(engine.last_sync)
            sync[src_name] = {"seconds": times, "median_s": statistics.median(times[1:]), "details": details}
        for mb in (64, 2048):
            engine._bucket_bytes = mb * 2**20
            times = []
            for _ in range(4):
                t0 = time.perf_counter()
                engine.update_weights(hf16.state_dict().items(), engine.version)
                times.append(time.perf_counter() - t0)
            sync[f"bf16_source_bucket{mb}MB"] = {"seconds": times, "median_s": statistics.median(times[1:]),
                                                 "buckets": engine.last_sync.get("buckets")}
        engine._bucket_bytes = 512 * 2**20
        res["sync"] = sync
        say("sync", {k: round(v["median_s"], 4) for k, v in sync.items()})
        dump(out, "vllm-main.json", res)
    except Exception:  # record and go on: the later sections do not need this one
        import traceback

        res.setdefault("errors", {})["sync"] = traceback.format_exc()
        say("sync failed", traceback.format_exc())
    dump(out, "vllm-main.json", res)

    # (d part 1) stale KV without the prefix-cache reset.
    try:
        stale_prompts = [text[s:s + 64].tolist() for s in starts[:32]]  # 4 full KV blocks each
        greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
        engine.generate(stale_prompts, greedy)  # caches the prompts' KV under version 3
        losses = sft(10)
        cuda_sync()

        @torch.no_grad()
        def vs_fp32(comps: list[Any], ps: list[list[int]]) -> dict[str, float]:
            r = completions_to_rollout([str(i) for i in range(len(ps))], ps, comps, list(range(len(ps))), 0, 0)
            m = r.response_mask
            lp = response_logprobs(master, r.prompt_ids.to(dev), r.prompt_mask.to(dev), r.response_ids.to(dev),
                                   m.to(dev))
            return diff_stats(r.behaviour_logprobs[m], lp.cpu()[m])

        engine.update_weights(master.state_dict().items(), 4, reset_prefix_cache=False)
        stale = vs_fp32(engine.generate(stale_prompts, greedy), stale_prompts)
        engine.reset_prefix_cache()
        after_reset = vs_fp32(engine.generate(stale_prompts, greedy), stale_prompts)
        res["stale_kv"] = {"sft_loss_first_last": [losses[0], losses[-1]], "no_reset_vs_fp32": stale,
                           "after_reset_vs_fp32": after_reset}
        say("stale KV", res["stale_kv"])
    except Exception:  # record and go on: the later sections do not need this one
        import traceback

        res.setdefault("errors", {})["stale_kv"] = traceback.format_exc()
        say("stale_kv failed", traceback.format_exc())
    dump(out, "vllm-main.json", res)

    # (d part 1) what the updated engine says, for the fresh engine to match.
    engine.update_weights(master.state_dict().items(), 5)  # a normal sync (with the reset)
    score_seqs = [text[s:s + 96].tolist() for s in starts[:32]] + \
        torch.randint(1000, VOCAB_HI, (32, 96), generator=g).tolist()
    q_prompts = text_prompts[:32] + rand_prompts[:32]
    scores = engine.score(score_seqs)
    gcomps = engine.generate(q_prompts, SamplingParams(temperature=0.0, max_new_tokens=32))
    scomps = engine.generate(q_prompts, SamplingParams(temperature=1.0, max_new_tokens=32, seed=99))
    final_dir = work / "qwen05-final"
    hf16.load_state_dict(master.state_dict())
    hf16.save_pretrained(final_dir)
    dump(WORK, "updated.json", {
        "dir": str(final_dir), "score_seqs": score_seqs, "scores": scores, "q_prompts": q_prompts,
        "greedy": [[c.token_ids, c.logprobs] for c in gcomps], "sampled": [[c.token_ids, c.logprobs] for c in scomps]})
    res["final_version"] = engine.version
    dump(out, "vllm-main.json", res)
    engine.close()
    return res


class _DryEngine:
    """The transformers engine standing in for vLLM in a CPU dry run of this script."""

    def __init__(self, path: Path):
        from services.models.engines.hf_engine import TransformersEngine
        from services.models.io.loading import load_causal_lm

        self._e = TransformersEngine(load_causal_lm(path), [int(QWEN05["eos_token_id"])], 0)  # type: ignore
        self.last_sync: dict[str, Any] = {"buckets": 1}
        self._bucket_bytes = 0
        self.llm = None

    @classmethod
    def from_path(cls, path: Path, **_: Any) -> _DryEngine:
        return cls(path)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._e, name)

    def describe(self) -> dict[str, Any]:
        return {"scoring": "dry"}

    def update_weights(self, named: Any, version: int, reset_prefix_cache: bool = True) -> None:
        self._e.update_weights(named, version)

    def reset_prefix_cache(self) -> bool:
        return True

    def score(self, seqs: list[list[int]]) -> list[list[float]]:
        import torch

        ids = torch.tensor(seqs)
        with torch.no_grad():
            lp = torch.log_softmax(self._e.model(input_ids=ids).logits.float()[:, :-1], -1)
        return lp.gather(-1, ids[:, 1:, None]).squeeze(-1).tolist()

    def close(self) -> None:
        pass


# -- phase fresh -----------------------------------------------------------------------------------
def phase_fresh(out: Path) -> dict[str, Any]:
    from services.models.engine import SamplingParams
    from services.models.engines.vllm_engine import VLLMEngine

    upd = json.loads((WORK / "updated.json").read_text())
    t0 = time.perf_counter()
    engine = _DryEngine.from_path(Path(upd["dir"])) if DRY else VLLMEngine.from_path(Path(upd["dir"]), **ENGINE_OPTS)
    start_s = time.perf_counter() - t0
    scores = engine.score(upd["score_seqs"])
    gcomps = engine.generate(upd["q_prompts"], SamplingParams(temperature=0.0, max_new_tokens=32))
    scomps = engine.generate(upd["q_prompts"], SamplingParams(temperature=1.0, max_new_tokens=32, seed=99))
    flat = lambda xs: [x for row in xs for x in row]  # noqa: E731

    def comp_diff(name: str, comps: list[Any]) -> dict[str, Any]:
        same = [c.token_ids == u[0] for c, u in zip(comps, upd[name], strict=True)]
        lp = [(a, b) for c, u in zip(comps, upd[name], strict=True) if c.token_ids == u[0]
              for a, b in zip(c.logprobs, u[1], strict=True)]
        return {"same_tokens": sum(same), "of": len(same),
                "logprob_diff": diff_stats([a for a, _ in lp], [b for _, b in lp])}

    res = {"engine_start_s": start_s,
           "score_diff_fresh_vs_updated": diff_stats(flat(scores), flat(upd["scores"])),
           "greedy": comp_diff("greedy", gcomps), "sampled_seeded": comp_diff("sampled", scomps)}
    say("fresh vs updated", res)
    engine.close()
    return res


# -- phase grpo ------------------------------------------------------------------------------------
def phase_grpo(out: Path, engine_name: str, steps: int) -> dict[str, Any]:
    import torch

    from services.core.config.run import load_config
    from services.local import run_local

    if engine_name == "transformers":
        torch.set_num_threads(4)
    run_dir = WORK / f"grpo-{engine_name}"
    cfg = load_config(REPO / "examples" / "tiny-cpu.yaml", run__dir=str(run_dir), run__max_steps=steps,
                      run__eval_every=50, generation__engine=engine_name)
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()

    def on_step(r: dict[str, Any]) -> None:
        rows.append(r)
        if r["step"] % 25 == 0:
            dump(out, f"vllm-grpo-{engine_name}.json", {"partial": True, "steps": len(rows),
                                                        "reward_mean_per_step": [x["reward_mean"] for x in rows]})
        if r["step"] % 25 == 0 or "eval_reward" in r:
            say(engine_name, r["step"], round(r["reward_mean"], 3), r.get("eval_reward"), round(r["step_s"], 3))

    run_local(cfg, on_step)
    rewards = [r["reward_mean"] for r in rows]
    k = max(1, len(rewards) // 5)
    res = {"engine": engine_name, "steps": len(rows), "wall_s": time.perf_counter() - t0,
           "reward_first_fifth": sum(rewards[:k]) / k, "reward_last_fifth": sum(rewards[-k:]) / k,
           "eval_before": rows[0].get("eval_reward_before") if rows else None,
           "eval": {r["step"]: r["eval_reward"] for r in rows if "eval_reward" in r},
           "median_generate_s": statistics.median(r["generate_s"] for r in rows),
           "median_step_s": statistics.median(r["step_s"] for r in rows),
           "reward_mean_per_step": rewards,
           "config": "examples/tiny-cpu.yaml with generation.engine=" + engine_name}
    say("grpo", engine_name, {k: v for k, v in res.items() if k != "reward_mean_per_step"})
    return res


# -- driver ----------------------------------------------------------------------------------------
def run_phase(args: list[str], out: Path, env: dict[str, str] | None = None, log_name: str = ""
              ) -> subprocess.Popen[bytes]:
    log = open(WORK / (log_name or f"{args[0]}.log"), "w")  # noqa: SIM115 (the child's stdout)
    return subprocess.Popen([sys.executable, "-m", "bench.vllm_check", *args, "--out", str(out)], cwd=REPO,
                            env={**os.environ, **(env or {})}, stdout=log, stderr=subprocess.STDOUT)


def wait(p: subprocess.Popen[bytes], deadline: float) -> int | str:
    try:
        return p.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        return "killed at the deadline"


def combine_logs(out: Path) -> None:
    """All phase logs in one file under --out."""
    parts = []
    for name in ("main.log", "grpo-transformers.log", "fresh.log", "grpo-vllm.log", "tests.log"):
        f = WORK / name
        if f.is_file():
            parts.append(f"===== {name} =====\n{f.read_text(errors='replace')}")
    (out / "vllm-check-logs.txt").write_text("\n".join(parts))


def phase_all(out: Path, steps: int) -> dict[str, Any]:
    t0 = time.time()
    deadline = t0 + float(os.environ.get("VLLM_CHECK_BUDGET_S", "540"))
    rc: dict[str, Any] = {"main": wait(run_phase(["main"], out), deadline)}
    combine_logs(out)
    say("main", rc["main"])
    rc["fresh"] = wait(run_phase(["fresh"], out), deadline)
    combine_logs(out)
    say("fresh", rc["fresh"])
    small = {"RLFLEET_VLLM_ENFORCE_EAGER": "1", "RLFLEET_VLLM_GPU_MEMORY_UTILIZATION": "0.05",
             "RLFLEET_VLLM_KV_CACHE_MEMORY_BYTES": str(2 * 2**30)}
    skip = set(filter(None, os.environ.get("VLLM_CHECK_SKIP", "").split(",")))
    grpo = None if "grpo_vllm" in skip else run_phase(["grpo", "--engine", "vllm", "--steps", str(steps)], out,
                                                       small, "grpo-vllm.log")
    tests = None if "tests" in skip else subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout", "240",
         "tests/unit/test_engine_vllm.py", "tests/unit/test_engine_contract.py", "-k",
         "vllm and (test_engine_vllm or logprobs_equal or stop_tokens or max_new_tokens or changes_outputs"
         " or rejects_bad or abort_returns or bad_prompts or reproducible)"],
        cwd=REPO, env={**os.environ, **small, "RLFLEET_VLLM_KV_CACHE_MEMORY_BYTES": str(2**29)},
        stdout=open(WORK / "tests.log", "w"), stderr=subprocess.STDOUT)  # noqa: SIM115
    rc["grpo_vllm"] = wait(grpo, deadline) if grpo is not None else "skipped"
    rc["tests"] = wait(tests, deadline) if tests is not None else "skipped"
    hf_json = out / "vllm-grpo-transformers.json"
    while rc["main"] == 0 and time.time() < deadline and (
            not hf_json.is_file() or '"partial"' in hf_json.read_text()):
        time.sleep(2)
    combine_logs(out)
    summary: dict[str, Any] = {"return_codes": rc, "wall_s": time.time() - t0}
    for name in ("vllm-main.json", "vllm-fresh.json", "vllm-grpo-vllm.json", "vllm-grpo-transformers.json"):
        f = out / name
        summary[name] = json.loads(f.read_text()) if f.is_file() else None
    dump(out, "vllm-summary.json", summary)
    tail = (WORK / "tests.log").read_text(errors="replace")[-1500:] if (WORK / "tests.log").is_file() else ""
    print("tests:", tail, flush=True)
    print(json.dumps(_brief(summary), indent=1, default=float), flush=True)
    return summary


def _brief(summary: dict[str, Any]) -> dict[str, Any]:
    """The headline numbers (the JSON files hold everything)."""
    b: dict[str, Any] = {"rc": summary["return_codes"]}
    m = summary.get("vllm-main.json") or {}
    b["hf_tok_s"] = (m.get("hf_generate") or {}).get("tokens_per_s")
    b["engine_tok_s"] = [r.get("tokens_per_s") for r in m.get("vllm_engine_generate", [])]
    b["llm_tok_s"] = [r.get("tokens_per_s", r.get("error")) for r in m.get("vllm_llm_generate", [])]
    b["engine_start_s"] = m.get("engine_start_s")
    b["scoring"] = (m.get("engine") or {}).get("scoring")
    for v in m.get("versions", []):
        b[f"v{v['version']}"] = {k: (r["vs_bf16"].get("max"), r["vs_fp32"].get("max"), round(r["mean_entropy_fp32"], 2))
                                 for k, r in v["agreement"].items()}
        if "sync_s" in v:
            b[f"v{v['version']}_sync_s"] = v["sync_s"]
    b["sync_median_s"] = {k: v.get("median_s") for k, v in (m.get("sync") or {}).items()}
    b["stale_kv"] = m.get("stale_kv")
    b["fresh"] = summary.get("vllm-fresh.json")
    for e in ("vllm", "transformers"):
        g = summary.get(f"vllm-grpo-{e}.json") or {}
        b[f"grpo_{e}"] = {k: g.get(k) for k in ("steps", "reward_first_fifth", "reward_last_fifth", "eval_before",
                                               "eval", "median_step_s", "wall_s")}
    return b


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("phase", choices=["all", "main", "fresh", "grpo"])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--engine", default="vllm")
    ap.add_argument("--steps", type=int, default=GRPO_STEPS)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    if a.phase == "all":
        phase_all(a.out, a.steps)
    elif a.phase == "main":
        dump(a.out, "vllm-main.json", phase_main(a.out))
    elif a.phase == "fresh":
        dump(a.out, "vllm-fresh.json", phase_fresh(a.out))
    else:
        dump(a.out, f"vllm-grpo-{a.engine}.json", phase_grpo(a.out, a.engine, a.steps))


if __name__ == "__main__":
    main()
