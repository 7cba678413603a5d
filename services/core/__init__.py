"""What every service shares, in sub-packages that depend downward only: `config` (the run
configuration), `observability` (logs, metrics, events, trackers), `transport` (bus, wire codec,
gRPC client, auth, message limits), `journal` (the LMDB task journal), `host` (GPUs, ports, the
private Redis, process lifelines) and `serving` (the process shell every service runs in). The
leaf modules `ids`, `faults`, `retry` and the generated `pb` import nothing else of `services`.

May import: services.core.pb
"""
