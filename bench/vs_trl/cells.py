"""How the report writes a figure: a number (a dash where none), seconds to the first step (marked where
vLLM compiled), and why a phase has no figures, in the words of what stopped it."""

from __future__ import annotations

from typing import Any


def num(x: Any, nd: int = 1) -> str:
    return "—" if x is None else f"{x:,.{nd}f}"


def why_not(p: dict[str, Any]) -> str:
    """Why a phase has no figures, in the words of what stopped it."""
    if not p:
        return "not run"
    if p.get("skipped"):
        return str(p["skipped"])
    if p.get("rc") == 124:
        return f"cut off by the call's deadline after {p.get('seconds', 0):.0f} s"
    if p.get("rc") not in (None, 0):
        # The launcher's (or peer's) own last line names the cause: "controller exited ... ModuleNotFoundError".
        last = next((ln.strip() for ln in reversed(str(p.get("log_tail", "")).splitlines()) if ln.strip()), "")
        return f"exit {p['rc']}: {last.split(' (log: ')[0][:200]}" if last else f"exit {p['rc']}"
    return str(p.get("error") or f"exit {p.get('rc')}")


def first_step_cell(p: dict[str, Any]) -> str:
    """Seconds to the first step, marked where vLLM compiled its graphs first (no cache for its config)."""
    return num(p.get("first_step_s"), 0) + (" (compiled)" if p.get("vllm_compile") == "cold" else "")
