"""Checksums of a weight sync (issue 34): after every sync each engine process reports a checksum of
every parameter it now holds, the trainer's side computes the same over what it sent, and a
mismatch fails the sync (`WeightsMismatch`): the engine is not trusted again and its version is not
published. "Equal weights" is then checked directly, not through greedy text.

The checksum. Engines keep their own layout: vLLM fuses q/k/v into one `qkv_proj` and gate/up into
`gate_up_proj` (concatenated along the output dim), pads vocabularies with zero rows, and holds one
tensor for tied names. So the checksum is one that concatenation, zero padding and aliasing leave
intact, and that is exact, so that the comparison needs no tolerance: the bytes of the tensor in the
engine's dtype, read as signed 16-bit words (bytes for a dtype of one byte), and summed as integers
(int64): S1 = sum(w), S2 = sum(w*w). Integer sums are associative, so the result does not depend on
the order of a reduction (GPU against CPU, fused against split); a fused parameter's sums are the
sums of its parts; zero padding adds nothing. A changed bit changes S1 (one ulp moves one word by 1);
a tensor left at its old value, zeroed, or filled with another tensor's values changes S1 or S2
unless its words keep both sums, which stale or garbage data does not do. What it cannot see by
design is a permutation inside one parameter (the price of being layout-blind).

The reference is computed per tensor on what the trainer sent, cast to the dtype the engine holds it
in (the cast the engine itself would do, round-to-nearest-even on both sides), on the trainer's
device, from the trainer's tensors (for a broadcast: the planned, cast tensors, not the host copies
staged for gloo, so a staging fault shows). The cost: one reduction pass per tensor on the device
each side (in chunks of `CHUNK` words, so the largest temporary is 8 * CHUNK bytes), and one host
transfer of two integers per tensor at the end; no host copy of the model.

Why two replicas disagreed after a broadcast sync on one H200 (issue 34; read from the code, to be
confirmed by these checksums on the GPU): `Sender.send` built each gloo bucket with
`torch.cat([t.to("cpu", non_blocking=True) ...])`. A non-blocking copy from CUDA to the host goes into
pinned memory that torch hands back before the copy has run, and `cat` read it on the CPU at once. It
read whatever the pinned block held: the caching host allocator recycles the blocks of the previous
sync by size, so mostly the previous version's values of the same tensor (nearly right: log-probs
within 0.1 nats of the trainer), and which copies were still in flight depends on timing, so each
replica (each has its own sender) got a different mix. Version 1 came out right because its blocks
were new, and cudaHostAlloc synchronizes the device, so few copies were in flight when `cat` read
them; from version 2 the blocks came from the cache, without a sync. IPC never stages on the host, so
it passed. Ruled out, from the code: a bucket reused before its broadcast finished (each bucket is a
new tensor and `wait()` returns after gloo has sent it), one replica receiving while another casts
(the replicas are synced one after the other, each through its own group), the receiver's copy to
its GPU (from pageable memory, which CUDA stages before the call returns), and a cast done
differently per replica (the cast happens once, on the trainer's side, in `plan`). The fix stages
each bucket into one host buffer and waits for the copies before the broadcast
(`weight_transfer.stage`).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from services.models.engine import EngineError

log = logging.getLogger(__name__)

Sums = tuple[int, int]
CHUNK = 1 << 24  # words per reduction: 128 MiB of int64 at most, on the tensor's device
# Test-only fault (see `corrupt`): "<version>:<parameter>[:<process-name suffix>]", comma-separated.
FAULT_ENV = "RLFLEET_FAULT_WEIGHTS"


class WeightsMismatch(EngineError):
    """A weight sync whose checksums disagree: the engine holds weights the trainer did not send."""

    def __init__(self, message: str, *, version: int, parameter: str, held: Sums | None, sent: Sums | None) -> None:
        super().__init__(message)
        self.version, self.parameter, self.held, self.sent = version, parameter, held, sent


@dataclass(frozen=True)
class Held:
    """One parameter an engine holds: its own `name`, its dtype, its sums, and the trainer's tensors it
    is made of (`parts`, concatenated; each part the names of one alias group, any of which was sent)."""

    name: str
    dtype: str
    sums: Sums
    parts: tuple[tuple[str, ...], ...]


def _words(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().contiguous().reshape(-1)
    if flat.element_size() % 2 == 0:
        return flat.view(torch.int16)
    return flat.view(torch.uint8)  # bool, int8, uint8, float8: one byte each


def _sums_on_device(t: torch.Tensor) -> torch.Tensor:
    """[S1, S2] of `t` as an int64 tensor on its device (no host sync)."""
    w = _words(t)
    out = torch.zeros(2, dtype=torch.int64, device=w.device)
    for start in range(0, w.numel(), CHUNK):
        x = w[start:start + CHUNK].to(torch.int64)
        out[0] += x.sum()
        out[1] += (x * x).sum()
    return out


def sums_of(tensors: Iterable[torch.Tensor]) -> list[Sums]:
    """The checksum of each tensor, with one host transfer per device for all of them. Lazily: a
    generator of cast copies holds one copy at a time, not a second model."""
    rows = [_sums_on_device(t) for t in tensors]
    by_device: dict[torch.device, list[int]] = {}
    for i, r in enumerate(rows):
        by_device.setdefault(r.device, []).append(i)
    out: list[Sums] = [(0, 0)] * len(rows)
    for idx in by_device.values():
        values = torch.stack([rows[i] for i in idx]).cpu().tolist()
        for i, (s1, s2) in zip(idx, values, strict=True):
            out[i] = (int(s1), int(s2))
    return out


def held_by_state(state: Mapping[str, torch.Tensor], groups: Iterable[Sequence[str]]) -> list[Held]:
    """What a model whose parameters carry the trainer's names holds: one entry per alias group."""
    groups = [list(g) for g in groups]
    tensors = [state[g[0]] for g in groups]
    return [Held(g[0], str(t.dtype).removeprefix("torch."), s, (tuple(g),))
            for g, t, s in zip(groups, tensors, sums_of(tensors), strict=True)]


def _cast(t: torch.Tensor, dtype: str) -> torch.Tensor:
    want = getattr(torch, dtype, None)
    if isinstance(want, torch.dtype) and t.is_floating_point() and t.dtype != want:
        return t.detach().to(want)
    return t.detach()


@dataclass(frozen=True)
class Verdict:
    """The comparison of one sync: tensors compared, and what could not be paired either way."""

    checked: int
    unsent: tuple[str, ...]  # engine parameters made of names the trainer did not send
    unheld: tuple[str, ...]  # names sent that no engine parameter is made of


def verify(held: Sequence[Held], sent: Mapping[str, torch.Tensor], version: int, who: str = "the engine") -> Verdict:
    """Compare what the engine holds with the trainer's `sent` tensors; raise `WeightsMismatch` at the
    first parameter whose sums differ (naming it, `who` holds it, and both values)."""
    refs: list[tuple[str, str]] = []  # (name sent, dtype held): cast one at a time in `sums_of`
    plan: list[tuple[Held, list[int]]] = []
    unsent: list[str] = []
    covered: set[str] = set()
    for h in held:
        idx: list[int] = []
        for part in h.parts:
            name = next((n for n in part if n in sent), None)
            if name is None:
                break
            covered.update(part)
            idx.append(len(refs))
            refs.append((name, h.dtype))
        if len(idx) < len(h.parts):
            unsent.append(h.name)
            continue
        plan.append((h, idx))
    sums = sums_of(_cast(sent[n], dtype) for n, dtype in refs)
    for h, idx in plan:
        ref = (sum(sums[i][0] for i in idx), sum(sums[i][1] for i in idx))
        if ref != h.sums:
            parts = " + ".join(p[0] for p in h.parts)
            made = f" (made of {parts})" if len(h.parts) > 1 or h.parts[0][0] != h.name else ""
            raise WeightsMismatch(
                f"weight sync to version {version} failed its checksum check: {who} holds {h.name}{made}"
                f" with checksum {h.sums}, the trainer sent {ref}",
                version=version, parameter=h.name, held=h.sums, sent=ref)
    unheld = tuple(sorted(n for n in sent if n not in covered))
    return Verdict(len(plan), tuple(unsent), unheld)


def unfuse(name: str, packed: Mapping[str, Sequence[str]]) -> tuple[str, ...]:
    """The trainer's names a fused engine parameter is made of, in order: with vLLM's
    `packed_modules_mapping` ({"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}) the parameter
    `model.layers.0.self_attn.qkv_proj.weight` is q_proj's, k_proj's and v_proj's weight."""
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p in packed:
            return tuple(".".join([*parts[:i], sub, *parts[i + 1:]]) for sub in packed[p])
    return (name,)


# -- test-only fault: a replica that loads one tensor slightly wrong -------------------------------
def corrupt(named: Iterable[tuple[str, torch.Tensor]], version: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors, with one of them moved by one unit in the last place of its first element when
    `RLFLEET_FAULT_WEIGHTS` names this sync ("<version>:<parameter>[:<process-name suffix>]"), as
    a broken transfer or loader would leave it. A copy: a shared-memory tensor is the trainer's own."""
    spec = os.environ.get(FAULT_ENV, "")
    target = _fault_target(spec, version)
    for name, t in named:
        if name == target:
            t = t.detach().clone()
            w = _words(t)
            w[0] ^= 1
            log.warning("fault: a weight perturbed before loading", extra={"parameter": name, "version": version})
        yield name, t


def _fault_target(spec: str, version: int) -> str | None:
    for entry in filter(None, spec.split(",")):
        fields = entry.split(":")
        if len(fields) < 2 or fields[0] != str(version):
            continue
        if len(fields) > 2 and not multiprocessing.current_process().name.endswith(fields[2]):
            continue
        return fields[1]
    return None


def verdict_numbers(v: Verdict, seconds: float) -> dict[str, float]:
    """The numbers of a verdict for `last_sync` (status and the bench read them)."""
    return {"checksums_checked": float(v.checked), "checksums_unpaired": float(len(v.unsent) + len(v.unheld)),
            "checksum_seconds": seconds}


def held_by(engine: object) -> list[Held] | None:
    """The engine's checksums after a sync, None for an engine that cannot report them."""
    fn = getattr(engine, "weight_checksums", None)
    return list(fn()) if callable(fn) else None
