"""The process shell every service runs in: `runtime` (gRPC + HTTP in one asyncio loop, readiness,
drain), `shell` (embedded uvicorn, watchdog, sockets, the state file), `http_routes`, `entry`
(`python -m services.<name>`) and `worker` (the consumer loop with the fleet's delivery rules).

May import: services.core.config, services.core.observability, services.core.transport,
services.core.journal, services.core.host, services.core.ids, services.core.faults,
services.core.retry, services.core.pb
"""
