"""Invariant 4, monotonic versions: per service (per `service[replica]` when a `replica` field is
present) `version_served` never decreases nor falls below a checkpoint that service reported;
checkpoint versions and steps never decrease; the log never claims a version the journal did not
acknowledge; `trained` steps go 1, 2, 3... without repeat, step backwards or gap, and the policy
version they train never decreases; the journal keeps the replay batch of every step after the
oldest checkpoint of a trainable service (what a restarted service is replayed from)."""

from __future__ import annotations

from services.audit.results import Checks, is_int, ranges, span
from services.core.journal.journal import Journal
from services.core.observability.events import Event


def _service_key(ev: Event) -> str | None:
    svc = ev.fields["service"]
    if not isinstance(svc, str) or not svc:
        return None
    replica = ev.fields.get("replica")
    return svc if replica is None else f"{svc}[{replica}]"


class VersionLedger:
    def __init__(self, checks: Checks) -> None:
        self.c = checks
        self.event_steps: set[int] = set()
        self.trained_events = 0
        self.last_step = 0
        self.known_steps: set[int] = set()  # steps that happened, by the log or the journal
        self.last_trained_version: int | None = None
        self.served: dict[str, int] = {}
        self.ckpt_version: dict[str, int] = {}
        self.ckpt_step: dict[str, int] = {}

    # -- events ------------------------------------------------------------------------------------

    def on_trained(self, step: int, version: int) -> None:
        """Steps 1, 2, 3... in log order, and the policy version they trained never going back."""
        c4 = self.c[4]
        self.trained_events += 1
        if step in self.event_steps:
            c4.fail("step_repeat", f"a second trained event for step {step}")
        elif step < self.last_step:
            c4.fail("step_backwards", f"trained event for step {step} after step {self.last_step}")
        self.event_steps.add(step)
        self.last_step = max(self.last_step, step)
        if self.last_trained_version is not None and version < self.last_trained_version:
            c4.fail(
                "trained_version_backwards",
                f"step {step} trained policy version {version} after version {self.last_trained_version}",
            )
        self.last_trained_version = (
            version if self.last_trained_version is None else max(self.last_trained_version, version)
        )

    def on_version_served(self, ev: Event) -> None:
        key, v = _service_key(ev), ev.fields["version"]
        if key is None or not is_int(v):
            self.c.malformed_event(ev, f"service {ev.fields['service']!r} / version {v!r}")
            return
        last = self.served.get(key)
        if last is not None and v < last:
            self.c[4].fail("version_backwards", f"{key} served version {v} after serving version {last}")
        elif v < self.ckpt_version.get(key, -1):
            self.c[4].fail(
                "below_checkpoint",
                f"{key} served version {v}, older than its checkpoint of version {self.ckpt_version[key]}",
            )
        self.served[key] = v if last is None else max(last, v)

    def on_checkpoint(self, ev: Event) -> None:
        key, v, step = _service_key(ev), ev.fields["version"], ev.fields["step"]
        if key is None or not is_int(v) or not is_int(step):
            self.c.malformed_event(ev, f"service {ev.fields['service']!r} / version {v!r} / step {step!r}")
            return
        lv, ls = self.ckpt_version.get(key), self.ckpt_step.get(key)
        if lv is not None and v < lv:
            self.c[4].fail("checkpoint_backwards", f"{key} checkpoint of version {v} after one of version {lv}")
        if ls is not None and step < ls:
            self.c[4].fail("checkpoint_backwards", f"{key} checkpoint at step {step} after one at step {ls}")
        self.ckpt_version[key] = v if lv is None else max(lv, v)
        self.ckpt_step[key] = step if ls is None else max(ls, step)

    # -- cross-checks against the journal, after both passes ------------------------------------------

    def check_steps(self, journal_step: int, journal_steps: set[int], warnings: list[str]) -> None:
        """No gap in the union of event steps and journal `trained_step`s up to the journal's step
        (a step only in the journal is a lost event: a warning), and no event step beyond it."""
        c4 = self.c[4]
        event_steps = self.event_steps
        top = max([journal_step, *event_steps, *journal_steps], default=0)
        known = event_steps | journal_steps
        self.known_steps = known
        for a, b in ranges([s for s in range(1, top + 1) if s not in known]):
            c4.fail("step_gap", f"{span(a, b)} missing: no trained event and no journal task trained in it")
        for s in sorted(event_steps):
            if s > journal_step:
                c4.fail("step_not_in_journal", f"trained event for step {s}, beyond the journal's step {journal_step}")
        only_journal = sorted(journal_steps - event_steps)
        if only_journal:
            spans = ", ".join(span(a, b) for a, b in ranges(only_journal)[:5])
            warnings.append(f"journal has tasks trained in {spans} with no trained event (events lost in a crash?)")
        c4.stats["trained events"] = self.trained_events
        c4.stats["last event step"] = self.last_step
        c4.stats["journal step"] = journal_step

    def check_versions(self, acked: dict[str, int]) -> None:
        """The highest version served by a service the journal tracks is <= `Journal.versions[service]`."""
        c4 = self.c[4]
        for key, v in sorted(self.served.items()):
            svc = key.split("[", 1)[0]
            if svc in acked:
                if v > acked[svc]:
                    c4.fail(
                        "served_unacknowledged",
                        f"{key} served version {v} but the journal acknowledged only version {acked[svc]}",
                    )
            else:
                c4.notes.append(f"{key}: served versions not cross-checked (the journal tracks no version for it)")
        c4.stats["max version served"] = dict(sorted(self.served.items())) or "none"
        c4.stats["journal versions"] = dict(sorted(acked.items())) or "none"
        if self.ckpt_version:
            c4.stats["last checkpoint"] = {
                k: f"v{self.ckpt_version[k]}@step{self.ckpt_step[k]}" for k in sorted(self.ckpt_version)
            }

    def check_replay(self, j: Journal, journal_step: int, warnings: list[str]) -> None:
        """A restarted service replays the batches after its checkpoint, so the journal must still
        hold every one of them. Runs after `check_steps`."""
        c4 = self.c[4]
        ckpts = j.checkpoint_steps
        if not ckpts:
            return
        oldest = min(ckpts.values())
        # A step that never happened (a step_gap, reported already) has no batch to replay.
        needed = [s for s in range(oldest + 1, journal_step + 1) if s in self.known_steps]
        if not needed:
            c4.notes.append(f"replay: every trainable service checkpointed at or after step {journal_step}")
            return
        # One batch at a time: these can be large, and only their presence matters.
        missing = [s for s in needed if j.get_batch(s) is None]
        if len(missing) == len(needed):
            warnings.append(
                f"journal stores no training batch for steps {oldest + 1}..{journal_step} (after the oldest"
                f" checkpoint, {ckpts}); a restarted service could not be replayed. Not counted as a"
                " violation: the writer may not store batches at all"
            )
            return
        if j.get_batch(0) is not None:
            # mark_trained refuses step 0, so a batch under key 0 was stored by its pre-step number.
            c4.notes.append(
                "a training batch is stored under step 0, which no training step has: batches look keyed"
                " one step early (put_batch(journal.step) instead of put_batch(journal.step + 1))"
            )
        for a, b in ranges(missing):
            c4.fail("replay_gap", f"journal lacks the training batch of {span(a, b)}, needed after checkpoints {ckpts}")
