"""The two phases that run rlfleet's own parts apart, as scripts for a child process of their own:
vLLM alone (the engine the actor starts, driven by `LLM.generate`) and the trainer and reference alone."""

from __future__ import annotations

VLLM_ALONE = r'''
import json, statistics, sys, time
from pathlib import Path
from services.models.io.loading import load_tokenizer
from services.models.engines.vllm_engine import VLLMEngine
from bench.vs_trl.workload import W, synthetic_task
model, out, workload, opts = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
tok = load_tokenizer(model)
task = synthetic_task(workload)
ids = [tok(task.prompt(i).text)["input_ids"] for i in range(W["prompts_per_step"])]
# The very engine rlfleet's actor starts (its options, environment and sampler), driven by vLLM's own
# LLM.generate with no rlfleet code in the loop; its compiled graphs are the fleet's, cached on the host.
llm = VLLMEngine.from_path(model, dtype="bfloat16", seed=0, **opts).llm
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
prompts = [TokensPrompt(prompt_token_ids=p) for p in ids for _ in range(W["group"])]
res = {}
for name, kw in (("plain", {}), ("logprobs", {"logprobs": 0})):
    ps = SamplingParams(max_tokens=W["completion_tokens"], min_tokens=W["completion_tokens"], temperature=1.0,
                        detokenize=False, **kw)
    llm.generate(prompts, ps, use_tqdm=False)
    times, toks = [], []
    for _ in range(2):
        t = time.perf_counter()
        outs = llm.generate(prompts, ps, use_tqdm=False)
        times.append(time.perf_counter() - t)
        toks.append(sum(len(o.outputs[0].token_ids) for o in outs))
    res[name] = {"seconds": times, "tokens": toks,
                 "tokens_per_s": statistics.median(n / s for n, s in zip(toks, times))}
    print(name, res[name]["tokens_per_s"], flush=True)
out.write_text(json.dumps(res))
'''


TRAIN_ALONE = r'''
import json, statistics, sys, time
import torch
from pathlib import Path
from services.core.config.run import parse_config
from services.dist.build import build_model, build_trainer
from services.models.io.loading import load_causal_lm
from services.reference.scorer import ReferenceScorer
from bench.rollouts import random_rollout
cfg, out, steps = parse_config(json.loads(sys.argv[1]), source="train-alone"), sys.argv[2], json.loads(sys.argv[3])
dev = cfg.endpoint("actor").device
sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
# The actor's trainer and the reference service's scorer, built as those services build them, on one
# step's batch of the workload's shape (full-length responses, as min_tokens makes them), the GPU their own.
policy = build_model(cfg, "actor", dev)
trainer = build_trainer(cfg, "actor", policy)
a = cfg.algo
scorer = ReferenceScorer(load_causal_lm(Path(cfg.models.policy.path), dtype=cfg.models.policy.dtype, device=dev),
                         cfg.generation.temperature, micro_batch=a.micro_batch_size, micro_tokens=a.micro_batch_tokens,
                         pack=a.pack_sequences, chunk_tokens=a.logprob_chunk_tokens, compile=a.compile)
b = steps["rows"]
roll = random_rollout([steps["prompt_tokens"]] * b, [steps["completion_tokens"]] * b, int(policy.config.vocab_size),
                      low=4, group_size=a.group_size, advantages=True, versions=torch.zeros(b, dtype=torch.long))
res = {"train_s": [], "reference_s": []}
for i in range(steps["warmup"] + steps["steps"]):
    sync(); t = time.perf_counter()
    roll.ref_logprobs = scorer.score(roll)
    sync(); ref_s = time.perf_counter() - t
    t = time.perf_counter()
    # One version behind, as a batch of a fleet at max_staleness 1 reaches the trainer.
    trainer.train_step(roll, step=i, current_version=1)
    sync(); train_s = time.perf_counter() - t
    if i >= steps["warmup"]:
        res["train_s"].append(train_s); res["reference_s"].append(ref_s)
res.update(train_median_s=statistics.median(res["train_s"]), reference_median_s=statistics.median(res["reference_s"]),
           peak_gib=torch.cuda.max_memory_allocated() / 2**30 if dev.startswith("cuda") else None)
print("train", res["train_median_s"], "reference", res["reference_median_s"], flush=True)
open(out, "w").write(json.dumps(res))
'''
