"""The models of a run's roles: resolve each role's directory once (`resolve`, `paths`), building
a tiny task model (`tiny`, `tokenizer`) or reward model (`reward_model`) there when asked.

May import: services.core, services.rl, services.tasks, services.models.engine,
services.models.errors, services.models.io, services.models.nets, services.models.engines
"""
