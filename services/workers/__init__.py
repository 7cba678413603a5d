"""What the worker services (actor, critic, reward, reference) share above `core`: the gRPC calls
every one of them answers alike (`servicer`), the version gate, idempotent training and
checkpoint cadence of the trainable ones (`trainable`), and the shape of a scoring service
(`scoring`).

May import: services.core, services.rl, services.models, services.tasks
"""
