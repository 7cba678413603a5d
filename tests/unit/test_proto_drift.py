"""The generated code under services/core/pb/ is exactly what protos/rlfleet/v1 produces."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from services.core.pb import rlfleet_pb2 as pb
from services.core.pb import rlfleet_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gen_proto.py"


def load_gen_proto() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_proto", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generated_code_matches_proto() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--check"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr + done.stdout


def test_drift_check_notices_an_edited_file(tmp_path: Path) -> None:
    gen = load_gen_proto()
    pkg = tmp_path / "services" / "core" / "pb"
    shutil.copytree(REPO / "services" / "core" / "pb", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    assert gen.check(tmp_path) == []
    with (pkg / "rlfleet_pb2.py").open("a") as f:
        f.write("# hand edit\n")
    (pkg / "rlfleet_pb2_grpc.py").unlink()
    problems = "\n".join(gen.check(tmp_path))
    assert "rlfleet_pb2.py: differs" in problems and "rlfleet_pb2_grpc.py: missing" in problems


def test_every_top_level_message_has_schema_version() -> None:
    nested_only = {"Tensor", "SamplingParams", "Prompt"}
    for name, desc in pb.DESCRIPTOR.message_types_by_name.items():
        if name in nested_only:
            continue
        field = desc.fields_by_number.get(1)
        assert field is not None and field.name == "schema_version", name
        assert field.type == field.TYPE_UINT32, name


def test_services_expose_the_contract_rpcs() -> None:
    expected = {
        "Actor": {"Train", "UpdateWeights", "Generate", "GetState", "Drain"},
        "Critic": {"Train", "GetState", "Drain"},
        "Scorer": {"GetState", "Drain"},
        "Controller": {"GetState", "Drain"},
    }
    for service, methods in expected.items():
        assert set(pb.DESCRIPTOR.services_by_name[service].methods_by_name) == methods, service
        assert hasattr(pb_grpc, f"{service}Stub") and hasattr(pb_grpc, f"add_{service}Servicer_to_server")
