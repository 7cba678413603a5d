"""Write constraints.txt from a virtualenv: the exact version of every package in it, so `make setup`
(pip install -c constraints.txt) installs the same set wherever it runs.

    python scripts/freeze_constraints.py VENV [--out constraints.txt]

`make constraints` builds a fresh VENV with every extra the tests use and runs this. rlfleet itself
(the editable install) is left out. torch is written without its local build label (`2.13.0`, not
`2.13.0+cpu`): CPU hosts still install the CPU wheel (TORCH_SPEC, the wheel index), GPU hosts the
CUDA build of the same release.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Built by the build (`pip install -e .`), never a dependency to pin.
SKIP = {"rlfleet"}
# Local version labels (+cpu, +cu128) name a build of the release, which the host picks.
UNLABELLED = {"torch", "torchvision", "torchaudio"}
HEADER = """\
# Exact versions for `make setup` (pip install -c constraints.txt): torch, transformers, the base
# dependencies and the dev, tasks, track, lora and gguf extras, as one fresh virtualenv resolved them.
# Refresh with `make constraints` (a fresh venv, then scripts/freeze_constraints.py); do not edit by hand.
# Python {python}.
"""


def freeze(venv: Path) -> list[str]:
    python = venv / "bin" / "python"
    if not python.is_file():
        raise SystemExit(f"freeze_constraints: {python} not found: pass a virtualenv directory")
    out = subprocess.run([str(python), "-m", "pip", "freeze", "--exclude-editable", "--disable-pip-version-check"],
                         check=True, capture_output=True, text=True).stdout
    lines = []
    for raw in out.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line)
        if m is None:  # a URL or path install has no version pip can resolve elsewhere
            raise SystemExit(f"freeze_constraints: cannot pin {line!r}: install it from an index")
        name, version = m.group(1), m.group(2)
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in SKIP:
            continue
        if key in UNLABELLED:
            version = version.split("+", 1)[0]
        lines.append(f"{name}=={version}")
    return sorted(lines, key=str.lower)


def python_version(venv: Path) -> str:
    return subprocess.run([str(venv / "bin" / "python"), "-c", "import sys; print(sys.version.split()[0])"],
                          check=True, capture_output=True, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("venv", type=Path)
    ap.add_argument("--out", type=Path, default=ROOT / "constraints.txt")
    a = ap.parse_args(argv)
    pins = freeze(a.venv)
    for required in ("torch", "transformers"):
        if not any(p.lower().startswith(f"{required}==") for p in pins):
            raise SystemExit(f"freeze_constraints: {a.venv} has no {required}: not the venv `make setup` builds")
    a.out.write_text(HEADER.format(python=python_version(a.venv)) + "\n".join(pins) + "\n")
    print(f"freeze_constraints: {len(pins)} pins -> {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
