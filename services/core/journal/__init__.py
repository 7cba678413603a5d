"""The controller's task journal in LMDB, the run's source of truth: task records and their legal
transitions, replay batches, dropped tasks, the LMDB plumbing (shared with the actor's outbox) and
the binding of a journal to its run's checkpoints.

May import: services.core.config, services.core.ids, services.core.faults
"""
