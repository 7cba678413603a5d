"""Invariant 5, bounded resources: queue depths, RSS and disk in every `resources` event within
`Limits`, and the tasks in flight, replayed from `admitted` / `trained` / `dead` events, never
above the admission window.

An event's `rss_bytes` is an int (the emitting process, labelled `process`) or a dict per service.
Its `disk_bytes` is an int, or a dict shaped like `Journal.usage()` (its `file_bytes` is the usage;
`map_size` is address space and `disk_free_bytes` is free space, so neither counts), or any other
dict, whose values are summed. The lowest `disk_free_bytes` seen is reported."""

from __future__ import annotations

from typing import Any

from services.audit.limits import Limits
from services.audit.results import MAX_EXAMPLES, Checks, is_int, is_num
from services.core.observability.events import Event

# Keys of `Journal.usage()` that are not disk the run occupies.
_NOT_USAGE = frozenset({"map_size", "disk_free_bytes", "used_bytes"})


def disk_usage(v: Any) -> tuple[int | None, int | None]:
    """(bytes used, bytes free or None) from a `disk_bytes` field; (None, None) when malformed."""
    if is_num(v):
        return (int(v), None) if v >= 0 else (None, None)
    if not isinstance(v, dict) or not all(is_num(x) and x >= 0 for x in v.values()):
        return None, None
    free = v.get("disk_free_bytes")
    if "file_bytes" in v:  # Journal.usage(): the data file is what the journal occupies
        return int(v["file_bytes"]), None if free is None else int(free)
    return int(sum(x for k, x in v.items() if k not in _NOT_USAGE)), None if free is None else int(free)


class ResourceLedger:
    """`admitted` is the set of task ids admitted so far (owned by the task ledger, read here)."""

    def __init__(self, checks: Checks, limits: Limits, admitted: set[str]) -> None:
        self.c = checks
        self.lim = limits
        self.admitted = admitted
        self.terminal_ids: set[str] = set()
        self.in_flight = 0
        self.in_flight_max = 0
        self.in_flight_excess: list[str] = []
        self.in_flight_excess_count = 0
        self.queue_max: dict[str, int] = {}
        self.rss_max: dict[str, int] = {}
        self.disk_max: int | None = None
        self.disk_free_min: int | None = None
        self.resources_events = 0

    # -- tasks in flight, replayed ---------------------------------------------------------------

    def on_admitted(self, new_ids: list[str], ts: float) -> None:
        """`new_ids`: the tasks this event admitted for the first time."""
        self.in_flight += sum(1 for tid in new_ids if tid not in self.terminal_ids)
        self.in_flight_max = max(self.in_flight_max, self.in_flight)
        if self.in_flight > self.lim.in_flight_ceiling:
            self.in_flight_excess_count += 1
            if len(self.in_flight_excess) < MAX_EXAMPLES:
                self.in_flight_excess.append(
                    f"{self.in_flight} tasks in flight after the admitted event at ts {ts}"
                    f" (ceiling {self.lim.in_flight_ceiling})"
                )

    def terminal(self, tid: str) -> None:
        """`tid` ended (trained, dead or dropped); counted once however often the log says so."""
        if tid not in self.terminal_ids:
            self.terminal_ids.add(tid)
            if tid in self.admitted:
                self.in_flight -= 1

    # -- resources events --------------------------------------------------------------------------

    def on_resources(self, ev: Event) -> None:
        self.resources_events += 1
        self._queues(ev)
        self._rss(ev)
        self._disk(ev)

    def _queues(self, ev: Event) -> None:
        depths = ev.fields["queue_depths"]
        if not isinstance(depths, dict):
            self.c.malformed_event(ev, "queue_depths is not a dict stream -> depth")
            return
        for stream, depth in depths.items():
            if not is_int(depth) or depth < 0:
                self.c.malformed_event(ev, f"queue depth of {stream!r} is {depth!r}")
                continue
            self.queue_max[stream] = max(self.queue_max.get(stream, 0), depth)
            limit = self.lim.queue_limit(stream)
            if limit is not None and depth > limit:
                self.c[5].fail("queue_over_limit", f"{stream} depth {depth} > {limit} at ts {ev.ts}")

    def _rss(self, ev: Event) -> None:
        rss = ev.fields["rss_bytes"]
        rss_map = {"process": rss} if not isinstance(rss, dict) else rss
        for svc, b in rss_map.items():
            if not is_num(b) or b < 0:
                self.c.malformed_event(ev, f"rss of {svc!r} is {b!r}")
                continue
            self.rss_max[svc] = max(self.rss_max.get(svc, 0), int(b))
            limit = self.lim.rss_limit(svc)
            if limit is not None and b > limit:
                self.c[5].fail("rss_over_limit", f"{svc} rss {int(b)} bytes > {limit} at ts {ev.ts}")

    def _disk(self, ev: Event) -> None:
        disk = ev.fields["disk_bytes"]
        used, free = disk_usage(disk)
        if used is None:
            self.c.malformed_event(ev, f"disk_bytes is {disk!r}")
            return
        if free is not None:
            self.disk_free_min = free if self.disk_free_min is None else min(self.disk_free_min, free)
        self.disk_max = used if self.disk_max is None else max(self.disk_max, used)
        if self.lim.disk_bytes is not None and used > self.lim.disk_bytes:
            self.c[5].fail("disk_over_limit", f"disk {used} bytes > {self.lim.disk_bytes} at ts {ev.ts}")

    # -- after both passes -------------------------------------------------------------------------

    def finish(self, log_behind_journal: bool, warnings: list[str]) -> None:
        c5 = self.c[5]
        if self.in_flight_excess_count:
            if log_behind_journal:
                # Lost trained/dead/dropped events keep tasks "in flight" in the replay; do not blame admission.
                warnings.append(
                    f"in flight replayed from events exceeded the ceiling {self.lim.in_flight_ceiling}"
                    f" {self.in_flight_excess_count} times, but the log misses terminal events the journal has,"
                    " so the replay overcounts; not counted as a violation"
                )
            else:
                for msg in self.in_flight_excess:
                    c5.fail("in_flight_over_limit", msg)
                c5.violations["in_flight_over_limit"] += self.in_flight_excess_count - len(self.in_flight_excess)
        c5.stats["resources events"] = self.resources_events
        c5.stats["max queue depth"] = {
            s: f"{d} (limit {self.lim.queue_limit(s) if self.lim.queue_limit(s) is not None else 'unbounded'})"
            for s, d in sorted(self.queue_max.items())
        } or "none"
        c5.stats["max in flight"] = f"{self.in_flight_max} (ceiling {self.lim.in_flight_ceiling})"
        c5.stats["max rss bytes"] = dict(sorted(self.rss_max.items())) or "none"
        c5.stats["max disk bytes"] = self.disk_max if self.disk_max is not None else "none"
        if self.disk_free_min is not None:
            c5.stats["min disk free bytes"] = self.disk_free_min
        if self.lim.rss_bytes is None:
            c5.notes.append("no rss limit given (limits['rss_bytes']); maxima reported only")
        if self.lim.disk_bytes is None:
            c5.notes.append("no disk limit given (limits['disk_bytes']); maxima reported only")
        if not self.resources_events:
            c5.notes.append("no resources events in the log; queue, rss and disk not checked")
