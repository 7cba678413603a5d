"""How messages travel between services: Redis Streams (`bus`, `bus_queues`, `streams`), tensors
on the wire (`codec`), the semantic limits of a message (`limits`), the gRPC client side (`rpc`)
and shared-token authentication (`auth`).

May import: services.core.config, services.core.observability, services.core.ids,
services.core.retry, services.core.pb
"""
