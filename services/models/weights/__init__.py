"""Weight syncs from a trainer to an engine: what `update_weights` accepts (`sync`), the exact
checksums every engine reports after a sync (`check`), the transfer to an engine's process over
torch.distributed (`transfer`) and its route, decided without torch (`route`).

May import: services.core, services.rl, services.models.engine, services.models.errors
"""
