"""`BusQueues`: what the bus knows about its queues rather than its messages: per-group backlog
and the fill ratio the actor's backpressure reads, the versions the controller publishes, trimming
acknowledged entries, and stream depths. A mixin of `Bus`, using its connection and `_run`."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeVar

import redis.asyncio as aioredis
from redis import exceptions as rexc

from services.core.transport.streams import StreamKeys, as_str, log_event, next_id, parse_id

T = TypeVar("T")

# When Redis cannot report a group's lag, we count entries after its last-delivered id, up to this
# many: enough to saturate any sensible fill ratio without scanning a huge stream.
LAG_SCAN_CAP: Final = 100_000


class BusQueues:
    _client: aioredis.Redis
    keys: StreamKeys
    _groups: dict[str, set[str]]

    if TYPE_CHECKING:  # provided by Bus; declared only for the type checker

        async def _run(self, op: str, call: Awaitable[T], *, extra_s: float = 0.0) -> T: ...

    # -- backpressure -----------------------------------------------------------------------------
    async def group_backlog(self, stream: str, group: str) -> tuple[int, int]:
        """(lag, pending) of one group: entries not yet delivered, and delivered but not acked."""
        return (await self._backlogs(stream, [group]))[group]

    async def fill_ratio(self, stream: str, groups: Sequence[str], capacity: int) -> float:
        """The slowest group's (lag + pending) / capacity; the actor pauses above the high watermark."""
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if not groups:
            return 0.0
        backlogs = await self._backlogs(stream, groups)
        return max(lag + pending for lag, pending in backlogs.values()) / capacity

    async def backlog(self, stream: str, groups: Sequence[str]) -> int:
        """Entries some of `groups` has not yet acknowledged (the largest lag + pending)."""
        if not groups:
            return 0
        return max(lag + pending for lag, pending in (await self._backlogs(stream, groups)).values())

    async def _backlogs(self, stream: str, groups: Sequence[str]) -> dict[str, tuple[int, int]]:
        infos = await self._group_infos(stream)
        out: dict[str, tuple[int, int]] = {}
        for group in groups:
            info = infos.get(group)
            if info is None:
                # A missing group will be (re)created at id 0 and then owes the whole stream.
                length = int(await self._run("backlog", self._client.xlen(stream)))
                out[group] = (length, 0)
                continue
            lag = info.get("lag")
            if lag is None:
                # Redis < 7 has no lag; Redis 7 reports nil after deletions inside the range.
                lag = await self._count_after(stream, as_str(info["last-delivered-id"]))
            out[group] = (int(lag), int(info["pending"]))
        return out

    async def _count_after(self, stream: str, last_id: str) -> int:
        entries = await self._run(
            "backlog", self._client.xrange(stream, min=f"({last_id}", max="+", count=LAG_SCAN_CAP)
        )
        return len(entries or [])

    async def _group_infos(self, stream: str) -> dict[str, dict[str, Any]]:
        try:
            infos = await self._run("group_info", self._client.xinfo_groups(stream))
        except rexc.ResponseError as err:
            if "no such key" in str(err).lower():
                return {}
            raise
        return {as_str(info["name"]): info for info in infos}

    # -- acknowledged versions --------------------------------------------------------------------
    async def set_versions(self, versions: Mapping[str, int]) -> None:
        """Publish the versions the controller has acknowledged per trainable service, so a
        replacement can tell when it has caught up (it reports ready only at the current version)."""
        if versions:
            await self._run("set_versions", self._client.hset(
                f"{self.keys.prefix}:versions", mapping={k: int(v) for k, v in versions.items()}))

    async def get_versions(self) -> dict[str, int]:
        raw = await self._run("get_versions", self._client.hgetall(f"{self.keys.prefix}:versions"))
        return {(k.decode() if isinstance(k, bytes) else str(k)): int(v) for k, v in raw.items()}

    # -- housekeeping -----------------------------------------------------------------------------
    async def trim_acked(self, stream: str) -> int:
        """Drop entries every group has acknowledged; returns how many were removed.

        The bound is the smallest id still needed by any group: its oldest pending entry, or the
        entry after its last-delivered id. Both only move forward, so reading them slightly before
        the XTRIM can only make the trim more conservative. A stream without groups is never
        trimmed (nothing says its entries were consumed), nor is one where a group this process
        created has gone missing."""
        infos = await self._group_infos(stream)
        if not infos:
            return 0
        missing = self._groups.get(stream, set()) - set(infos)
        if missing:
            log_event(logging.WARNING, "bus.trim_skipped", stream=stream, missing_groups=",".join(sorted(missing)))
            return 0
        async with self._client.pipeline(transaction=False) as pipe:
            for group in infos:
                pipe.xpending(stream, group)
            summaries = await self._run("trim", pipe.execute())
        bound: tuple[int, int] | None = None
        for (_, info), summary in zip(infos.items(), summaries, strict=True):
            need = next_id(parse_id(as_str(info["last-delivered-id"])))
            if int(summary["pending"]) and summary["min"] is not None:
                need = min(need, parse_id(as_str(summary["min"])))
            bound = need if bound is None else min(bound, need)
        assert bound is not None
        removed = int(
            await self._run(
                "trim",
                self._client.xtrim(stream, minid=f"{bound[0]}-{bound[1]}", approximate=False),
            )
        )
        if removed:
            log_event(logging.INFO, "bus.trimmed", stream=stream, removed=removed, min_id=f"{bound[0]}-{bound[1]}")
        return removed

    async def stream_depths(self) -> dict[str, int]:
        """Entries per stream of this run, by short name (prompts, rollouts, scores, dead)."""
        names = self.keys.streams()
        async with self._client.pipeline(transaction=False) as pipe:
            for key in names.values():
                pipe.xlen(key)
            lengths = await self._run("stream_depths", pipe.execute())
        return {name: int(n) for name, n in zip(names, lengths, strict=True)}
