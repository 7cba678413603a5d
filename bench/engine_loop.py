"""rlfleet's engine loop against vLLM's own `LLM.generate`, one engine, one step's prompts (0.5B shape).

    python -m bench.engine_loop OUT.json        # on a GPU host with vLLM (bench/gpu_host.sh)

One `VLLMEngine` started as the fleet's actor starts it (the 0.5B repeats' options and caches), then,
three rounds of each: `LLM.generate` unseeded and seeded per row (FINAL_ONLY outputs), and
`VLLMEngine.generate` with each request reporting once at its end (FINAL_ONLY, rlfleet's) or at every
token (DELTA, rlfleet's before 2026-12-03); tokens/s and NVML utilisation during each call, a
cProfile of one call per output kind, and an abort half-way through (the completions keep what they
generated). The prefix cache is never reset here, so after ~8 calls it is full and every allocation
evicts: rounds 2 and 3 measure that regime, round 1 the fleet's (its weight sync empties the cache).
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.vs_trl.caches import phase_env
from bench.vs_trl.config import engine_options
from bench.vs_trl.phases import select
from bench.vs_trl.workload import W, build_model, synthetic_task


def main() -> None:
    os.environ.update(phase_env(select("fleet-0.5b-r1")[0]))  # the fleet repeats' caches: vLLM loads its graphs
    import pynvml
    from vllm import SamplingParams as VSP
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from services.models.engine import SamplingParams
    from services.models.engines.vllm_engine import VLLMEngine
    from services.models.io.loading import load_tokenizer

    out = Path(sys.argv[1])
    model = build_model("0.5b")
    tok = load_tokenizer(model)
    task = synthetic_task("0.5b")
    ids = [tok(task.prompt(i).text)["input_ids"] for i in range(W["prompts_per_step"])]
    prompts = [p for p in ids for _ in range(W["group"])]
    eng = VLLMEngine.from_path(model, dtype="bfloat16", seed=0, **engine_options("0.5b"))
    llm = eng.llm
    pynvml.nvmlInit()
    gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
    params = SamplingParams(temperature=1.0, max_new_tokens=W["completion_tokens"], seed=7, logprobs=False)

    def timed(fn: Callable[[], int]) -> dict[str, Any]:
        """Tokens, seconds, tokens/s and mean NVML utilisation of one call."""
        samples: list[float] = []
        stop = threading.Event()

        def poll() -> None:
            while not stop.is_set():
                samples.append(float(pynvml.nvmlDeviceGetUtilizationRates(gpu).gpu))
                time.sleep(0.05)

        t = threading.Thread(target=poll)
        t.start()
        t0 = time.perf_counter()
        n = fn()
        dt = time.perf_counter() - t0
        stop.set()
        t.join()
        util = statistics.fmean(samples[2:]) if len(samples) > 3 else None
        return {"tokens": n, "s": round(dt, 3), "tok_s": round(n / dt), "util": util}

    def ours(kind: Any) -> int:
        """rlfleet's engine loop with every request reporting as `kind` says."""
        orig = eng.sampling_params

        def with_kind(p: SamplingParams, row: int) -> Any:
            x = orig(p, row)
            x.output_kind = kind
            return x

        eng.sampling_params = with_kind  # type: ignore[method-assign,assignment]
        try:
            outs = eng.generate(prompts, params)
        finally:
            eng.sampling_params = orig  # type: ignore[method-assign]
        return sum(len(c.token_ids) for c in outs)

    def theirs(seeded: bool) -> int:
        vp = [VSP(max_tokens=W["completion_tokens"], temperature=1.0, detokenize=False,
                  **({"seed": 1000 + i} if seeded else {})) for i in range(len(prompts))]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], vp, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    variants: dict[str, Callable[[], int]] = {
        "llm_generate_unseeded": lambda: theirs(False),
        "llm_generate_seeded": lambda: theirs(True),
        "engine_final_only": lambda: ours(RequestOutputKind.FINAL_ONLY),
        "engine_delta": lambda: ours(RequestOutputKind.DELTA),
    }
    res: dict[str, Any] = {}
    for rnd in range(3):
        for name, fn in variants.items():
            if rnd == 0:
                fn()  # compiles and captures nothing new, but fills the allocator's pools
            res.setdefault(name, []).append(timed(fn))
            print(name, res[name][-1], flush=True)
    for name, kind in (("engine_final_only", RequestOutputKind.FINAL_ONLY), ("engine_delta", RequestOutputKind.DELTA)):
        prof = cProfile.Profile()
        prof.enable()
        ours(kind)
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(35)
        res[f"profile_{name}"] = text.getvalue()[-9000:]
    # An abort half-way: every completion keeps the tokens it had (read from vLLM's output state).
    aborter = threading.Timer(0.4, eng.abort)
    aborter.start()
    outs = eng.generate(prompts, params)
    aborter.join()
    lens = [len(c.token_ids) for c in outs]
    res["abort"] = {"reasons": sorted({c.finish_reason for c in outs}), "lens": [min(lens), max(lens)]}
    print("abort", res["abort"], flush=True)
    out.write_text(json.dumps(res, indent=1))
    eng.close()


if __name__ == "__main__":
    main()
