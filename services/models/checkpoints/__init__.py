"""Crash-safe checkpoints of a trainable service (written to a temporary directory, fsynced,
renamed, `latest` last; optimizer state without pickle; sharded DCP for several ranks) and the
export of one as a `save_pretrained` directory.

May import: services.core, services.rl, services.models.engine, services.models.errors,
services.models.io, services.models.nets
"""
