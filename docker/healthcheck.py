"""Container HEALTHCHECK: exit 0 when the service's /readyz answers 200.

The port comes from the resolved fleet config (RLFLEET_CONFIG, default RUN_DIR/fleet.yaml) under
services.<RLFLEET_SERVICE>.http_port; RLFLEET_HEALTH_URL overrides the whole URL. Standard library
plus PyYAML only, and quick: Docker runs it every few seconds.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def url() -> str:
    if os.environ.get("RLFLEET_HEALTH_URL"):
        return os.environ["RLFLEET_HEALTH_URL"]
    import yaml

    service = os.environ["RLFLEET_SERVICE"]
    path = os.environ.get("RLFLEET_CONFIG", "/var/lib/rlfleet/run/fleet.yaml")
    with open(path) as f:
        cfg = yaml.safe_load(f) or {}
    ep = (cfg.get("services") or {}).get(service) or {}
    host = ep.get("host") or "127.0.0.1"
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    port = int(ep.get("http_port") or 0)
    if not port:
        raise SystemExit(f"no http_port for {service} in {path}")
    return f"http://[{host}]:{port}/readyz" if ":" in host else f"http://{host}:{port}/readyz"


def main() -> int:
    try:
        target = url()
        with urllib.request.urlopen(target, timeout=3) as r:
            return 0 if r.status == 200 else 1
    except urllib.error.HTTPError as e:
        print(f"not ready: {e.code} {e.read()[:300]!r}", file=sys.stderr)
        return 1
    except Exception as e:
        print(f"unhealthy: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
