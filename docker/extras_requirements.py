"""The extras image's build (Dockerfile, EXTRAS) asks two things of pyproject.toml and pip:

    python extras_requirements.py tasks,track,lora /path/to/pyproject.toml
        the requirements of those optional extras, one a line; an extra that names another
        (`rlfleet[tasks]`) is expanded, an unknown one refused with the known ones named (exit
        status 2), so a typo in EXTRAS fails the build instead of building the base image again
    python extras_requirements.py --sdists /path/to/report.json
        from `pip install --dry-run --report`, the packages pip would build from source (no wheel
        on the index), as NAME==VERSION, one a line: the Dockerfile builds their wheels in a stage
        with a compiler, so none reaches the images

Standard library only: it runs in the image before anything is installed.
"""

from __future__ import annotations

import json
import re
import sys
import tomllib

SELF = re.compile(r"^\s*rlfleet\s*\[([^\]]*)\]\s*$")


def requirements(extras: list[str], project: dict) -> list[str]:
    optional: dict[str, list[str]] = project.get("optional-dependencies", {})
    out: list[str] = []
    seen: set[str] = set()

    def add(name: str) -> None:
        if name in seen:
            return
        if name not in optional:
            raise KeyError(name)
        seen.add(name)
        for req in optional[name]:
            m = SELF.match(req)
            if m:
                for inner in m.group(1).split(","):
                    add(inner.strip())
            elif req not in out:
                out.append(req)

    for name in extras:
        add(name)
    return out


def sdists(report: dict) -> list[str]:
    out = []
    for item in report.get("install", []):
        url = (item.get("download_info") or {}).get("url", "")
        if not url.split("#", 1)[0].endswith(".whl"):
            meta = item["metadata"]
            out.append(f"{meta['name']}=={meta['version']}")
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] == "--sdists":
        with open(argv[1]) as f:
            print("\n".join(sdists(json.load(f))))
        return 0
    names = [n.strip() for n in argv[0].split(",") if n.strip()]
    with open(argv[1], "rb") as f:
        project = tomllib.load(f)["project"]
    try:
        reqs = requirements(names, project)
    except KeyError as err:
        known = ", ".join(sorted(project.get("optional-dependencies", {})))
        print(f"EXTRAS: no extra {err.args[0]!r} in pyproject.toml; known: {known}", file=sys.stderr)
        return 2
    print("\n".join(reqs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
