"""The `algo` section: the RL algorithm, its loss and its defaults per algorithm."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from services.core.config.base import Strict as _Strict

BehaviourCorrection = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none"]

AlgoName = Literal["ppo", "grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
KLName = Literal["k1", "k2", "k3", "low_var_kl", "abs"]
LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
# Algorithms that compare each response with the others sampled for its prompt.
GROUP_ALGOS = ("grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp_baseline")
# What each algorithm means beyond its advantage estimator, as published; a field the user sets wins.
ALGO_DEFAULTS: dict[str, dict[str, Any]] = {
    # Dr. GRPO (Liu et al. 2025): no std normalisation, constant loss normaliser.
    "dr_grpo": {"norm_std": False, "loss_agg": "seq_mean_token_sum_norm"},
    # DAPO (Yu et al. 2025): clip-higher (0.2 / 0.28), token-level loss, soft overlong punishment,
    # dynamic sampling.
    "dapo": {"clip_eps_high": 0.28, "loss_agg": "token_mean", "dynamic_sampling": True},
    # GSPO (Zheng et al. 2025): sequence-level ratio, clipped at 3e-4 / 4e-4, sequence-mean loss.
    "gspo": {"clip_eps": 3e-4, "clip_eps_high": 4e-4, "loss_agg": "seq_mean_token_mean"},
}


class AlgoSection(_Strict):
    name: AlgoName = "grpo"
    """Advantage estimator and objective; `dr_grpo`, `dapo` and `gspo` also change the defaults of
    the fields named in ALGO_DEFAULTS."""
    group_size: Annotated[int, Field(ge=1)] = 8
    kl_coef: Annotated[float, Field(ge=0)] = 0.0
    kl_estimator: KLName = "k3"
    """KL estimator of the KL-in-loss penalty (`kl_in: loss`)."""
    kl_estimator_reward: KLName = "k1"
    """KL estimator subtracted from the reward (`kl_in: reward`); k1 as verl's default."""
    kl_clamp: Annotated[float, Field(gt=0)] | None = 10.0
    """Bound on each token's KL estimate (verl, OpenRLHF: 10); null leaves it unbounded."""
    kl_in: Literal["reward", "loss"] = "loss"
    clip_eps: Annotated[float, Field(gt=0, lt=1)] = 0.2
    clip_eps_high: Annotated[float, Field(gt=0, lt=10)] | None = None
    dual_clip_c: Annotated[float, Field(gt=1)] | None = None
    """Dual-clip PPO (Ye et al. 2020): the loss of a negative-advantage token is at most -c * A."""
    value_clip: Annotated[float, Field(gt=0)] = 0.2
    gamma: Annotated[float, Field(ge=0, le=1)] = 1.0
    lam: Annotated[float, Field(ge=0, le=1)] = 0.95
    norm_std: bool | None = None
    """Divide group advantages by the group's std (GRPO); null means the algorithm's own choice
    (off for dr_grpo, on otherwise)."""
    loss_agg: LossAgg = "token_mean"
    loss_norm_len: Annotated[int, Field(ge=1)] | None = None
    """Constant divisor of `seq_mean_token_sum_norm`; null means generation.max_new_tokens."""
    overlong_buffer_len: Annotated[int, Field(ge=1)] | None = None
    """DAPO's overlong window: responses longer than max_new_tokens - this many tokens lose reward
    linearly, up to `overlong_penalty_factor` at max_new_tokens. null: off (dapo: a quarter of the
    generation budget)."""
    overlong_penalty_factor: Annotated[float, Field(ge=0)] = 1.0
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (eq. 11): a group whose rewards (the reward stage's scores, before
    overlong shaping and KL) are all equal within `dynamic_sampling_tol` is dropped, never trained,
    and more prompts are admitted until the step has batch.prompts_per_step kept groups. On by
    default for dapo; needs a group algorithm."""
    dynamic_sampling_tol: Annotated[float, Field(ge=0)] = 1e-6
    """Rewards of one group closer than this (max - min) count as equal."""
    dynamic_sampling_max_rounds: Annotated[int, Field(ge=1)] = 10
    """Bound on dynamic sampling (the role of verl's max_num_gen_batches): one step may drop at most
    this many times batch.prompts_per_step groups as all-equal. A step that reaches it without its
    batch stops the run with an error naming this field, instead of sampling forever (the data is
    too easy or too hard for the policy)."""
    entropy_coef: Annotated[float, Field(ge=0)] = 0.0
    ppo_epochs: Annotated[int, Field(ge=1)] = 1
    minibatch_size: Annotated[int, Field(ge=1)] = 32
    # Sequences per forward pass of the trainers (gradients accumulate over them, one optimizer step
    # per minibatch) and of the reference and critic scorers; 0 means a whole minibatch or message
    # at once. Bounds the [micro, tokens, vocab] log-prob tensors on large vocabularies.
    micro_batch_size: Annotated[int, Field(ge=0)] = 0
    micro_batch_tokens: Annotated[int, Field(ge=0)] = 0
    """Token budget per forward pass instead of a row count (0: off; excludes micro_batch_size):
    sequences of similar length share a micro-batch, rows x its width <= budget, each cut to its
    own width, so padding costs what lengths differ by, not the rollout's widest row."""
    pack_sequences: bool = False
    """With micro_batch_tokens: several sequences per row (positions restart, attention never
    crosses a sequence), which removes most of the remaining padding."""
    lr: Annotated[float, Field(gt=0)] = 1e-4
    critic_lr: Annotated[float, Field(gt=0)] = 1e-3
    max_grad_norm: Annotated[float, Field(gt=0)] = 1.0
    decoupled: bool = True
    """Decoupled PPO (Hilton et al. 2022; AReaL): every batch, on-policy too, is clipped against the
    proximal policy (the trainer's own log-probs at the weights before this step) and each token's
    loss is weighted by `behaviour_correction` of proximal/behaviour (the engine's log-probs). The
    clip then acts on what the update changes, never on the engine's numeric mismatch. false: the
    classic PPO ratio, clipped against the engine's log-probs themselves, with no weight (the
    mismatch, and a stale batch's lag, pass through the clip). Without engine log-probs
    (generation.behaviour_logprobs "trainer") every batch clips against the proximal policy and
    nothing is weighted: neither field then acts."""
    proximal: Literal["current", "sampled"] = "current"
    """The proximal policy a decoupled batch is clipped against. `current`: the weights before this
    optimizer step (AReaL's decoupled PPO; with one optimizer step per batch the ratio is then 1 and
    the clip never acts, only the correction weights a stale batch). `sampled`: the trainer's own
    log-probs at the weights that sampled each row (it keeps a copy of the last flow.max_staleness
    versions' trainable weights), so the clip bounds how far the policy has moved since sampling, as
    PPO's epochs are bounded, and the correction weights only the engine's numeric mismatch: TRL's
    objective on its second pass over a batch. Costs a no-grad forward of the stale rows and that many
    copies of the trainable weights; one trainer rank only."""
    behaviour_correction: BehaviourCorrection = "sequence_mask"
    """How proximal/behaviour weights the loss (decoupled). `token_truncate`: each token's own ratio,
    clamped into [behaviour_weight_floor, behaviour_weight_cap] (truncated importance sampling, as
    IMPALA and AReaL); `token_mask`: a token whose ratio lies outside that range leaves the gradient;
    `sequence_truncate` / `sequence_mask`: one ratio per response, the product of its tokens'
    ratios, clamped / masked the same way; `sequence_mask` with cap 3 is TRL 1.16's default
    correction of vLLM's mismatch (`vllm_importance_sampling_mode`); `none`: no weight."""
    behaviour_weight_cap: Annotated[float, Field(gt=1)] | None = 3.0
    """Upper bound of the behaviour weight (truncate: clamped to it; mask: dropped above it); null: none."""
    behaviour_weight_floor: Annotated[float, Field(ge=0, lt=1)] | None = None
    """Lower bound of the behaviour weight (truncate: raised to it; mask: dropped below it); null: none.
    A token the engine found far likelier than the trainer does gets a weight near 0 without it."""
    advantage_eps: Annotated[float, Field(gt=0, le=1)] = 1e-4
    """Added to a group's reward std before dividing by it (GRPO): a group whose rewards differ by
    little more than rounding (partial credit that depends on length) gets small advantages, not
    unit ones. 1e-4 as TRL; the field used 1e-6 before 2026-12-04."""
    # Trainer speed levers (issue 16), each measured by a lever of bench/vs_trl/phases.py.
    logprob_chunk_tokens: Annotated[int, Field(ge=0)] = 0
    """Response tokens per pass of the LM head when the trainer and the reference compute log-probs and
    entropy: 0 builds the whole [micro-batch, tokens, vocabulary] logits at once; > 0 never does (same
    numbers; each chunk is recomputed in the backward pass)."""
    fused_optimizer: bool = True
    """AdamW's fused implementation (one kernel over all parameters; the same steps as the loop over
    tensors, and what transformers' Trainer, hence TRL, uses by default); false: torch's foreach loop."""
    compile: bool | None = None
    """torch.compile the trainer's and the reference's model: the decoder block by block (one compiled
    code for all layers) and the vocabulary-sized log-prob and entropy steps as fused kernels. Unset:
    on for a role on one CUDA GPU (on an H200, 1.3-1.4x the fleet's samples/s at 1.5B, BENCHMARKS.md),
    off on the CPU (Inductor's C++ builds take minutes, longer than a small CPU run gains) and for a
    role sharded over several GPUs (untested with FSDP). Both compile at start-up, on small batches of
    two shapes, so that the first step runs compiled code (Inductor's on-disk cache speeds restarts).
    false suits a small model whose generation is cheap: at 0.5B on an H200 the compile gained 4-9% but
    its cold start (~60 s) set the time to the first step, and the eager trainer paced the step more
    evenly (BENCHMARKS.md, 2026-12-04)."""

    tf32: bool | None = None
    """TF32 tensor cores for the fp32 matmuls of the trainer, critic and reference on a CUDA GPU
    (`torch.set_float32_matmul_precision("high")`): inputs rounded to 10 mantissa bits, products
    accumulated in fp32; weights, gradients, optimizer state and the log-softmax stay fp32, and the
    engine samples in its own dtype anyway. Unset: on for a CUDA device (PyTorch's advice for Ampere
    and newer; an fp32 trainer of a small model is bound by its matmuls), off on the CPU, where it
    does nothing. false keeps every fp32 matmul at full precision."""
    autocast: Literal["bfloat16"] | None = None
    """Mixed precision for the policy trainer's and the critic's forward and backward passes:
    `bfloat16` runs their matmuls under `torch.autocast` in bf16 (twice TF32's tensor-core rate, half
    the activations' memory traffic) while the weights, gradients and AdamW state stay in the model's
    dtype and the log-softmax, losses and reductions in fp32; as the mixed precision of verl's and
    OpenRLHF's trainers, and bf16 as vLLM samples. null: every pass in the model's dtype. bf16 needs no
    loss scaling (its exponent range is fp32's), so float16 is not offered."""

    @model_validator(mode="before")
    @classmethod
    def _algorithm_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            defaults = ALGO_DEFAULTS.get(str(data.get("name", "grpo")), {})
            data = {**defaults, **data}
        return data

    @model_validator(mode="after")
    def _groups(self) -> AlgoSection:
        if self.name in GROUP_ALGOS and self.group_size < 2:
            raise ValueError(f"{self.name} needs group_size >= 2 (got {self.group_size})")
        if self.micro_batch_tokens and self.micro_batch_size:
            raise ValueError("micro_batch_size and micro_batch_tokens exclude each other: set one, the other 0")
        if self.pack_sequences and not self.micro_batch_tokens:
            raise ValueError("pack_sequences needs micro_batch_tokens > 0 (the token budget of a packed micro-batch)")
        if (self.behaviour_correction.endswith("truncate") and self.behaviour_weight_cap is None
                and self.behaviour_weight_floor is None):
            raise ValueError(f"behaviour_correction {self.behaviour_correction} needs behaviour_weight_cap or"
                             " behaviour_weight_floor: a truncation without bounds is no correction")
        if self.dynamic_sampling and self.name not in GROUP_ALGOS:
            raise ValueError(f"dynamic_sampling compares the responses of one prompt, which {self.name} does not"
                             f" sample as a group; use one of {', '.join(GROUP_ALGOS)}")
        return self

    @property
    def group_norm_std(self) -> bool:
        return self.norm_std if self.norm_std is not None else self.name != "dr_grpo"

    @property
    def ratio_level(self) -> Literal["token", "sequence"]:
        return "sequence" if self.name == "gspo" else "token"

    @property
    def needs_critic(self) -> bool:
        return self.name == "ppo"

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0
