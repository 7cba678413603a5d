#!/usr/bin/env python
"""Generate (or check) the Python code for the wire contract.

    python scripts/gen_proto.py            # regenerate services/core/pb/ from protos/rlfleet/v1/
    python scripts/gen_proto.py --check    # exit 1, listing the files, if the committed code drifted
    python scripts/gen_proto.py --out DIR  # write under DIR/services/core/pb/ instead

The proto lives under protos/rlfleet/v1/ but is compiled through the import-path remap
`-Iservices/core/pb=protos/rlfleet/v1`, so protoc believes the file is
`services/core/pb/rlfleet.proto`: the modules land in services/core/pb/ and import each other as
`services.core.pb.rlfleet_pb2`, with no hand edits to generated files.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO / "protos" / "rlfleet" / "v1"
PACKAGE_DIR = Path("services") / "core" / "pb"  # relative to an output root
PROTO_FILES = ("rlfleet.proto",)
# Files in services/core/pb/ that are written by hand, not by protoc.
HAND_WRITTEN = frozenset({"__init__.py"})


def _protoc(out_root: Path) -> list[Path]:
    """Run protoc once into an empty `out_root`; returns the files it wrote, relative to it."""
    from grpc_tools import protoc  # imported late so that `--help` works without grpcio-tools

    well_known = resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PACKAGE_DIR.as_posix()}={PROTO_DIR}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--pyi_out={out_root}",
        *[(PACKAGE_DIR / name).as_posix() for name in PROTO_FILES],
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise SystemExit(f"protoc failed (exit {rc}): {' '.join(args[1:])}")
    return sorted(p.relative_to(out_root) for p in out_root.rglob("*") if p.is_file())


def generate(out_root: Path) -> list[Path]:
    """Regenerate the modules under `out_root`/services/core/pb/; returns the files written."""
    with tempfile.TemporaryDirectory(prefix="rlfleet-proto-") as tmp:
        written = _protoc(Path(tmp))
        for rel in written:
            dest = out_root / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(tmp) / rel, dest)
    return written


def check(committed_root: Path = REPO) -> list[str]:
    """Regenerate into a temporary directory; returns one line per file that differs from the
    committed copy under `committed_root` (empty when everything matches)."""
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="rlfleet-proto-") as tmp:
        fresh_root = Path(tmp)
        fresh = _protoc(fresh_root)
        for rel in fresh:
            committed = committed_root / rel
            if not committed.is_file():
                problems.append(f"{rel}: missing (run scripts/gen_proto.py)")
            elif committed.read_bytes() != (fresh_root / rel).read_bytes():
                problems.append(f"{rel}: differs from the code generated from {PROTO_DIR.relative_to(REPO)}")
        expected = {rel.name for rel in fresh} | HAND_WRITTEN
        pkg = committed_root / PACKAGE_DIR
        for p in sorted(pkg.iterdir()) if pkg.is_dir() else []:
            if p.is_file() and p.suffix in (".py", ".pyi") and p.name not in expected:
                problems.append(f"{PACKAGE_DIR / p.name}: stale generated file (no .proto produces it)")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO,
                    help="output root; files land in OUT/services/core/pb/ (default: the repository)")
    ap.add_argument("--check", action="store_true",
                    help="do not write; exit 1 listing the files under --out that differ from fresh output")
    ns = ap.parse_args(argv)
    if ns.check:
        problems = check(ns.out)
        for line in problems:
            print(line, file=sys.stderr)
        if problems:
            print("generated protobuf code is out of date: run `python scripts/gen_proto.py`",
                  file=sys.stderr)
            return 1
        print("generated protobuf code matches protos/rlfleet/v1")
        return 0
    for rel in generate(ns.out):
        print(ns.out / rel)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
