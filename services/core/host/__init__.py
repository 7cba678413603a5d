"""What a fleet needs of its host: the GPUs (NVML or an inventory file) and their placement into
device groups, CUDA MPS, free distinct ports, the private `redis-server`, the lifeline that
ties started processes to the launcher, and the zygote that CPU services start as forks of.

May import: services.core.config, services.core.observability
"""
