"""rlfleet against TRL on one GPU, same model, data and hyper-parameters, in one run (issues 7, 16).

    python -m bench.vs_trl plan                                   # the phases, their groups and time estimates
    python -m bench.vs_trl run --phases peers --out DIR           # on a GPU host: one group per device call
    python -m bench.vs_trl report --results A.json B.json ...     # merge calls, render BENCHMARKS.md and plots
    BENCH_DRY=1 python -m bench.vs_trl run --out DIR              # CPU dry run of every phase (measures nothing)

Workloads: Qwen2-shaped models with random weights in bf16, the 0.5B shape (hidden 896, 24 layers, 14
heads, 2 KV heads, intermediate 4864) and the 1.5B shape (hidden 1536, 28 layers, 12 heads, 2 KV heads,
intermediate 8960), vocabulary 151,936; prompts of exactly 64 tokens (`services.tasks.synthetic`),
completions of exactly 256 tokens, GRPO with groups of 8 and 256 completions per step, KL 0.04 (k3, in
the loss), lr 1e-6, one epoch, one optimizer step per step, micro-batches of 16 sequences.

Phases (each its own process, so each starts with the GPU to itself), grouped so that one group fits one
device call of at most 10 minutes (`plan` prints the estimates, seconds measured on the H200 run of
2026-12-02), in the order one 30-minute device session runs them: `1.5b` (the three 1.5B fleet
repeats, vLLM alone, trainer and reference alone), `0.5b` (the same at 0.5B), `peers` (TRL with vLLM,
both workloads, and a second run at 0.5B), `peers2` (TRL with vLLM's other repeats, TRL with
generate); `levers2` (`compiled`, `rep2`, then `stale2`) and `levers` (`lp`, the 0.5B fleet with vLLM's
log-prob output, `chunked`, then `mps`) get what is left. A run first checks, in seconds, that every service and both
peers import on the host, and skips a phase that would not finish before `--deadline-s`.

- `trl-vllm-<w>`, `-r2`, `-r3`: TRL 1.16 `GRPOTrainer` with vLLM colocated (`bench.trl_peer --use-vllm`): the
  peer, repeated like rlfleet (ratios are taken to its fastest run; `figures`).
- `fleet-<w>-r1..r3`: `rlfleet up`, every service on the GPU, `engine: vllm` in its own process, three
  times: median and spread. rlfleet's configuration for this workload (`config.py`: `FLEET_GENERATION`,
  `FLEET_VLLM`, `FLEET_SHAPE`): the trainer's proximal log-probs score every batch (`generation.behaviour_logprobs:
  trainer`, no per-token log-probs from vLLM) and vLLM captures CUDA graphs up to the 256 sequences of a
  step; at 0.5B the trainer and the reference run eagerly (`algo.compile: false`), at 1.5B compiled. A
  phase is stopped as soon as its last measured step is in: no final checkpoint or export.
- `vllm-alone-<w>`: the engine the fleet's actor starts (same options, environment and sampler), driven by
  vLLM's own `LLM.generate` on one step's prompts, plain and with per-token log-probs: the generation
  floor. It runs after the fleet repeats of its shape, so it loads their compiled graphs.
- `train-alone-<w>`: the repeats' trainer and reference scorer (built as the actor and the reference
  service build them) on one step's batch, the GPU their own: their own speed, apart from the cost of
  sharing the GPU with generation.
- `trl-0.5b`: TRL with `model.generate` (the second peer row).
- `fleet-0.5b-<lever>`: one change to `fleet-0.5b`: `lp` (vLLM's per-token log-probs and its default
  CUDA-graph sizes: the configuration of the 2026-12-01 run), `compiled` (algo.compile true: the trainer
  and the reference compiled), `rep2` (generation.replicas 2: two engine processes on the GPU), `nopc`
  (generation.vllm.prefix_caching false), `stale2` (flow.max_staleness 2), `chunked`
  (algo.logprob_chunk_tokens), `mps` (run.cuda_mps: the services as clients of a CUDA MPS daemon); at
  1.5B `eager` (algo.compile false: no torch.compile). Fused AdamW, a
  lever until the 13:08 run of 2026-12-02 (+6%), is rlfleet's default since, as it is transformers' (TRL's
  optimizer); torch.compile, a lever until 2026-12-03 (1.30-1.41x at 1.5B, 1.04-1.09x at 0.5B), too.
- `extra` (not default): PPO with a critic, the transformers engine, the engine inside the actor.

Steady state drops the first `--warmup` steps and takes medians over the rest. Time to first step runs
from the phase's process launch to the end of the first optimizer step. GPU utilization is sampled with
NVML every 100 ms and averaged over each phase's steady window. The fleet's seconds per stage are
differences of the services' `rlfleet_stage_latency_seconds` sums over the steady window per step.
A dry run (BENCH_DRY=1) shrinks both shapes to one tiny model, runs TRL once on the CPU for both TRL
kinds, and starts ONE fleet for every fleet phase (`fleet_config(dry=True)`: PPO with every service,
the transformers engine in its own process, the levers a CPU can run); each fleet phase still builds
and validates the config the GPU run will start. It proves the harness, not the numbers.

The package: `workload` (shapes, hyper-parameters, model and prompts), `phases` (the phases, levers, groups
and estimates), `config` (a fleet phase's `rlfleet up` config), the runners (`fleet_run` for the fleet,
`runners` for the others and the dispatch, `children` the scripts of the phases run apart), what they use
(`procs`, `caches`, `gpu`, `logs`, `host`), the report (`figures`, `targets`, `cells`, `render`, `report`)
and the command line (`cli`).
"""
