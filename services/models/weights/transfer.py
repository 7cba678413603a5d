"""A weight sync from the trainer's process to an engine in a child process, over torch.distributed.

`ProcessEngine` passes tensors to its child by reference (shared memory, CUDA IPC), which needs the
child to see the trainer's GPU. An engine replica pinned to other GPUs (`generation.replicas` on a
device group) cannot open those handles, so its weights travel as collectives instead:

- The two processes form a process group of two (the trainer's side is rank 0), built directly on a
  c10d store the trainer's side serves on loopback: it stays apart from the trainer ranks' default
  group, and joining it is bounded by `timeout_s`. NCCL carries CUDA tensors from GPU to GPU; gloo
  carries CPU tensors (the CPU case, and what the tests run), or CUDA ones staged through host
  memory where NCCL cannot go (two processes on one GPU).
- A sync is planned once (`plan`): tensors, cast to the engine's dtype (the engine would cast them
  anyway, so half the bytes travel for a float32 trainer and a bfloat16 engine), are grouped into
  buckets of one dtype and about `bucket_bytes`. The plan (names, shapes, dtypes: no data) goes over
  the engine's pipe; each bucket is then one flat broadcast.
- The child streams the buckets into an engine that loads bucket by bucket
  (`engine.StreamingWeights`: both backends): the engine checks the whole plan's names and shapes
  before the first bucket, so a sync it refuses changes nothing, and the engine process holds a few
  buckets beside its model (the one it loads, two on the wire), never a second copy of the weights.
- Both sides keep two buckets in flight (issue 34, item 3): the sender stages bucket k+1 into one
  host buffer while bucket k leaves from the other; the receiver posts the next broadcast before it
  hands a bucket to the engine, and a CUDA engine behind gloo gets its buckets copied to its GPU from
  pinned buffers. The host buffers are made once and reused across syncs. A failure after the first bucket is
  `WeightsTorn`: the child exits and the actor fails fast. An engine without streaming gets every
  bucket first, then one strict `update_weights`.
- A peer that dies mid-sync makes the broadcast raise on the other side (gloo: at once; NCCL: within
  the group's timeout), so neither side hangs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, Protocol, cast

import torch
import torch.distributed as dist

from services.core.host.ports import c10d_store
from services.models.engine import WeightSyncError
from services.models.weights.route import TRANSFERS, route

log = logging.getLogger(__name__)

_PREFIX = "rlfleet-weights"


class _Group(Protocol):
    """The c10d backend object both sides broadcast through (ProcessGroupGloo / ProcessGroupNCCL)."""

    def broadcast(self, tensor: torch.Tensor, root: int) -> Any: ...


@dataclass(frozen=True)
class Link:
    """What the child needs to join its parent's group: the store's address, the backend, the bound."""

    host: str
    port: int
    backend: Literal["gloo", "nccl"]
    timeout_s: float


@dataclass(frozen=True)
class Bucket:
    """One flat broadcast: tensors of one dtype, in order, with their shapes."""

    dtype: str
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def numel(self) -> int:
        return sum(_numel(s) for s in self.shapes)


def resolve(transfer: str, *, shares_trainer_device: bool) -> Literal["ipc", "collective"]:
    """`weights.route.route`, refusing a name that is not a transfer."""
    how = route(transfer, shares_trainer_device=shares_trainer_device)
    if how is None:
        raise WeightSyncError(f"unknown weight transfer {transfer!r}: use one of {', '.join(TRANSFERS)}")
    return how


def backend_for(device: str, backend: str = "auto") -> Literal["gloo", "nccl"]:
    """The collective backend for an engine on `device`: `auto` is NCCL on CUDA, gloo on the CPU."""
    if backend == "gloo" or (backend == "auto" and not device.startswith("cuda")):
        return "gloo"
    if backend not in ("auto", "nccl"):
        raise WeightSyncError(f"unknown weight transfer backend {backend!r}: use auto, nccl or gloo")
    if not device.startswith("cuda"):
        raise WeightSyncError(f"weight transfer backend 'nccl' needs a CUDA engine, not {device!r}")
    return "nccl"


def plan(named: Iterable[tuple[str, torch.Tensor]], engine_dtype: torch.dtype | None,
         bucket_bytes: int) -> tuple[list[Bucket], list[list[torch.Tensor]]]:
    """Buckets of one dtype and about `bucket_bytes` each, and the tensors that fill them (floating
    tensors cast to `engine_dtype` when given)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, t in named:
        t = t.detach()
        if t.is_meta:
            # Checked before anything is sent: once the plan is out, the child waits for every bucket.
            raise WeightSyncError(f"weight transfer: {name!r} is a meta tensor (no data to send)")
        if engine_dtype is not None and t.is_floating_point() and t.dtype != engine_dtype:
            t = t.to(engine_dtype)
        by_dtype.setdefault(t.dtype, []).append((name, t))
    buckets: list[Bucket] = []
    tensors: list[list[torch.Tensor]] = []
    for dtype, items in by_dtype.items():
        for chunk in _chunks(items, bucket_bytes):
            buckets.append(Bucket(str(dtype).removeprefix("torch."), tuple(n for n, _ in chunk),
                                  tuple(tuple(t.shape) for _, t in chunk)))
            tensors.append([t for _, t in chunk])
    return buckets, tensors


def _chunks(items: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    chunk: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        if chunk and size + nbytes > bucket_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, t))
        size += nbytes
    if chunk:
        yield chunk


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def stage(bucket: Sequence[torch.Tensor], device: torch.device, into: torch.Tensor | None = None) -> torch.Tensor:
    """The bucket's tensors, flat and in order, in one tensor on `device`, whole when this returns.

    To a CUDA device (NCCL) the copies stay in stream order, and the process group waits for the
    stream. To the host (gloo) they are written into `into` (a host buffer of at least the bucket's
    bytes, reused across buckets and syncs; else a new one, pinned when they come from a GPU) and
    waited for before the broadcast reads it: a CUDA-to-host copy with non_blocking=True returns
    before it has run, and the former `torch.cat([t.to("cpu", non_blocking=True) ...])` read its
    pinned blocks at once, sending whatever they held before (issue 34: stale tensors, a different
    mix per replica)."""
    if device.type == "cuda":
        return torch.cat([t.reshape(-1).to(device, non_blocking=True) for t in bucket])
    dtype, numel = bucket[0].dtype, sum(t.numel() for t in bucket)
    gpus = {t.device for t in bucket if t.is_cuda}
    if into is None:
        flat = torch.empty(numel, dtype=dtype, pin_memory=bool(gpus))
    else:
        flat = into[:numel * dtype.itemsize].view(dtype)
    offset = 0
    for t in bucket:
        flat[offset:offset + t.numel()].copy_(t.reshape(-1), non_blocking=True)
        offset += t.numel()
    for gpu in gpus:
        torch.cuda.synchronize(gpu)
    return flat


class HostBuffers:
    """Two host buffers of bytes, reused bucket after bucket and sync after sync, so that one bucket
    is staged (or copied to the GPU) while the other is on the wire. Pinned when a GPU is involved:
    copies from and to pinned memory run at the bus's speed and asynchronously, and allocating
    pinned memory is slow (cudaHostAlloc), so it happens once, not per bucket. Grown, never shrunk."""

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self._bufs: list[torch.Tensor | None] = [None, None]

    def get(self, i: int, nbytes: int) -> torch.Tensor:
        buf = self._bufs[i % 2]
        if buf is None or buf.numel() < nbytes:
            self._bufs[i % 2] = None  # the old block goes back before the bigger one is asked for
            buf = self._bufs[i % 2] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        return buf


def _group(store: dist.Store, rank: int, backend: str, timeout_s: float) -> _Group:
    timeout = timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore(_PREFIX, store)
    if backend == "nccl":
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = timeout
        return cast(_Group, dist.ProcessGroupNCCL(prefixed, rank, 2, nccl_opts))
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = timeout
    return cast(_Group, dist.ProcessGroupGloo(prefixed, rank, 2, opts))


def _device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


class Sender:
    """The trainer's side: serves the store at once; joins the group at the first sync, when the
    child (told by the request on its pipe) joins too."""

    def __init__(self, backend: Literal["gloo", "nccl"], *, timeout_s: float = 300.0,
                 bucket_bytes: int = 64 * 2**20, engine_dtype: torch.dtype | None = None) -> None:
        try:
            store = c10d_store("127.0.0.1", 0, timedelta(seconds=timeout_s))
        except OSError as err:
            raise WeightSyncError(f"weight transfer: cannot listen on loopback: {err.strerror}") from None
        self._store: dist.TCPStore | None = store
        self.link = Link("127.0.0.1", int(store.port), backend, float(timeout_s))
        self.bucket_bytes, self.engine_dtype = int(bucket_bytes), engine_dtype
        self._pg: _Group | None = None
        self._host: HostBuffers | None = None  # the gloo staging buffers, made at the first sync

    def plan(self, named: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[Bucket], list[list[torch.Tensor]]]:
        return plan(named, self.engine_dtype, self.bucket_bytes)

    def send(self, tensors: list[list[torch.Tensor]]) -> int:
        """Broadcast each bucket (as planned); returns the bytes sent. Raises on a dead peer.

        Through gloo the buckets are pipelined: bucket k+1 is copied into one host buffer while
        bucket k leaves from the other, so the device-to-host copies hide behind the wire. A buffer
        is written again only after its broadcast has completed."""
        if self._pg is None:
            if self._store is None:
                raise WeightSyncError("weight transfer: the sender is closed")
            self._pg = _group(self._store, 0, self.link.backend, self.link.timeout_s)
        device, sent = _device(self.link.backend), 0
        if device.type == "cuda":
            for bucket in tensors:
                flat = stage(bucket, device)
                self._pg.broadcast(flat, 0).wait()
                sent += flat.numel() * flat.element_size()
            torch.cuda.synchronize(device)  # the trainer may overwrite its tensors as soon as this returns
            return sent
        if self._host is None:
            self._host = HostBuffers(pinned=any(t.is_cuda for b in tensors for t in b))
        pending: Any = None
        try:
            for i, bucket in enumerate(tensors):
                nbytes = sum(t.numel() for t in bucket) * bucket[0].element_size()
                flat = stage(bucket, device, into=self._host.get(i, nbytes))
                work = self._pg.broadcast(flat, 0)
                if pending is not None:
                    pending.wait()  # frees the buffer bucket i+1 is staged into
                pending = work
                sent += nbytes
        finally:
            if pending is not None:
                pending.wait()  # never leave a broadcast reading a buffer the next sync writes
        return sent

    def close(self) -> None:
        """Leave the group and stop serving the store (the engine process is gone or going)."""
        self._pg = None
        self._host = None
        self._store = None  # the last reference: the store's server stops


class Receiver:
    """The engine child's side. `device` is where the engine holds its weights: a CUDA engine that
    receives through gloo gets each bucket on its GPU (received into a pinned host buffer, copied
    while the next bucket arrives), so the engine's own copy is device to device."""

    def __init__(self, link: Link, device: str | torch.device | None = None) -> None:
        self.link = link
        self._store = dist.TCPStore(link.host, link.port, None, is_master=False,
                                    timeout=timedelta(seconds=link.timeout_s), use_libuv=True)
        self._pg: _Group | None = None
        target = torch.device(device) if device is not None else None
        self._to_gpu = link.backend == "gloo" and target is not None and target.type == "cuda"
        self._target = target
        self._host = HostBuffers(pinned=True) if self._to_gpu else None

    def stream(self, buckets: Sequence[Bucket]) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The plan's buckets as they arrive, each as (name, tensor) views of its own flat tensor,
        which the caller may keep. The next bucket's broadcast is posted before a bucket is handed
        out, so it arrives while the engine loads this one. The sender broadcasts every bucket
        whatever the engine does with them, so a caller that stops early must `drain` the rest."""
        if self._pg is None:
            self._pg = _group(self._store, 1, self.link.backend, self.link.timeout_s)
        dtypes = []
        for b in buckets:
            dtype = getattr(torch, b.dtype, None)
            if not isinstance(dtype, torch.dtype):
                raise WeightSyncError(f"weight transfer: unknown dtype {b.dtype!r}")
            dtypes.append(dtype)
        pending: list[tuple[Any, torch.Tensor]] = []  # posted broadcasts, oldest first, at most two
        try:
            for i in range(min(2, len(buckets))):
                pending.append(self._post(i, buckets[i], dtypes[i]))
            for i, b in enumerate(buckets):
                work, flat = pending.pop(0)
                work.wait()
                flat = self._landed(flat, dtypes[i])
                if i + 2 < len(buckets):  # this bucket's host buffer is free again (copied or not reused)
                    pending.append(self._post(i + 2, buckets[i + 2], dtypes[i + 2]))
                yield [(name, part.view(shape)) for name, shape, part
                       in zip(b.names, b.shapes, flat.split([_numel(s) for s in b.shapes]), strict=True)]
        finally:
            for work, _ in pending:  # a caller that stopped: posted broadcasts still complete
                with contextlib.suppress(RuntimeError):
                    work.wait()

    def _post(self, i: int, b: Bucket, dtype: torch.dtype) -> tuple[Any, torch.Tensor]:
        assert self._pg is not None
        if self._host is not None:
            flat = self._host.get(i, b.numel * dtype.itemsize)[:b.numel * dtype.itemsize].view(dtype)
        else:
            flat = torch.empty(b.numel, dtype=dtype, device=_device(self.link.backend))
        return self._pg.broadcast(flat, 0), flat

    def _landed(self, flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A received bucket where the engine holds its weights. From the pinned buffer the copy to
        the GPU is asynchronous: it is waited for here, before the buffer can be received into again
        (two buckets on), which costs nothing the next broadcast does not hide."""
        if not self._to_gpu:
            return flat
        out = torch.empty(flat.numel(), dtype=dtype, device=self._target)
        out.copy_(flat, non_blocking=True)
        torch.cuda.current_stream(out.device).synchronize()
        return out

    @staticmethod
    def drain(stream: Iterator[list[tuple[str, torch.Tensor]]]) -> None:
        """Receive (and drop) what is left of a stream; a stream that failed is already over."""
        with contextlib.suppress(RuntimeError):
            for _ in stream:
                pass
