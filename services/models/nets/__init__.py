"""What is computed on a model: per-token log-probs and entropy of responses (and `algo.compile`),
the value model (a backbone plus a scalar head), LoRA adapters through peft.

May import: services.core, services.rl, services.models.engine, services.models.errors,
services.models.io, services.models.weights
"""
