"""The RL algorithms: the padded rollout layout every stage agrees on, advantages, losses, KL,
dynamic sampling, micro-batch plans, packing, the trainers and their warm-up, and the rollouts'
protobuf messages (`wire`). No I/O of its own.

May import: services.core, services.models
"""
