"""What the campaign's workers record, and the checker that judges it.

Every worker writes down, for each hold, the *believed interval*: from the moment the acquire's
reply said "acquired" to just after its last passing ``check()``, and the fence the store gave
(and when the acquire was sent: the holder's lease counts from then). The belief starts at the
reply, not at the send: a rival's acquire sent while the holder still works, and granted after
the holder's release (a Redis call in flight, a SQL statement waiting for the holder's row
lock), would otherwise count as an overlap that never was. ``time.monotonic()`` is
``CLOCK_MONOTONIC`` on Linux: one clock for the whole host, so the intervals of threads and of
separate processes are on the same time line.

The checker asserts the store's promise over all workers' histories:

* no two believed intervals of one key overlap;
* fences strictly increase between successive holders of a key (ordered by interval start);
* for a key taken with ``acquire_slot`` and a limit of N holder slots: at no moment do more than
  N believed intervals of the key overlap, no two of one slot's store key overlap, and fences
  grow across all the key's slots: a hold whose acquire was sent after another's reply came (so
  the store saw the other first) has the greater fence (holds whose acquire round trips overlap
  are in no order the history can know, so no order is asserted between them);
* every error a caller saw is a ``SingletaskError``; a ``BackendError`` raised while handling
  another error (the driver's) chains it as its ``__cause__``;
* no call blocked for longer than the store's bound (its configured timeouts).

Faults that the store documents as losing locks (a memcached restart, which keeps nothing) are
*amnesties*: an overlap between a hold that began before one and a hold that began after it is
reported as a documented loss, not a violation, provided the old holder stopped believing within
one lease after the fault ended (its next renewal finds the lock gone).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = ["CallError", "Fault", "Hold", "Report", "check"]


@dataclass(frozen=True)
class Hold:
    """One believed holding interval of ``key`` by ``worker``."""

    key: str
    worker: str
    sent: float  # monotonic, just before the acquire was sent (where the holder's lease starts)
    start: float  # monotonic, when the acquire's reply said "acquired" (where the belief starts)
    end: float  # monotonic, just after the last passing check()
    fence: int | None
    ttl: float
    limit: int = 1  # the key's holder slots: above 1, taken with acquire_slot
    slot: str | None = None  # the slot's store key, when taken with acquire_slot

    def describe(self) -> str:
        slot = "" if self.slot is None or self.slot == self.key else f" slot {self.slot!r}"
        return (
            f"{self.worker}{slot} [{self.start:.6f}, {self.end:.6f}] (acquire sent at "
            f"{self.sent:.6f}) fence={self.fence}"
        )


@dataclass(frozen=True)
class CallError:
    """An exception a worker's call to the store (or to ``check()``) raised."""

    worker: str
    call: str
    type: str  # qualified class name
    singletask: bool  # an instance of SingletaskError
    backend_error: bool  # an instance of BackendError
    cause: str | None  # class name of __cause__, if any
    context: str | None  # class name of __context__ (the error being handled when it was raised)
    message: str


@dataclass(frozen=True)
class Fault:
    """A fault the schedule injected, from ``start`` to ``end`` (monotonic)."""

    kind: str
    target: str
    start: float
    end: float
    lossy: bool = False  # the store documents that this fault can lose held locks


@dataclass(frozen=True)
class Call:
    """How long one call to the store took (for the blocking bound)."""

    worker: str
    call: str
    start: float  # monotonic
    seconds: float
    pid: int  # the worker's process, which a pause fault may have stopped meanwhile


@dataclass
class Report:
    """The checker's verdict over one run."""

    operations: int
    faults: dict[str, int]
    holds: int
    violations: list[str] = field(default_factory=list)
    documented_losses: list[str] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    longest_call: float = 0.0  # seconds, calls of paused processes left out
    slot_holds: dict[int, int] = field(default_factory=dict)  # limit: holds of such keys
    most_at_once: dict[int, int] = field(default_factory=dict)  # limit: most believed at once
    refused_full: int = 0  # acquire_slot refusals with every slot held (set by the runner)

    def summary(self, store: str, seed: int) -> str:
        faults = ", ".join(f"{kind} {n}" for kind, n in sorted(self.faults.items())) or "none"
        errors = ", ".join(f"{kind} {n}" for kind, n in sorted(self.errors.items())) or "none"
        slots = "".join(
            f", limit-{limit} holds {n} (most at once {self.most_at_once.get(limit, 0)})"
            for limit, n in sorted(self.slot_holds.items())
        )
        if self.slot_holds:
            slots += f", refused with every slot held {self.refused_full}"
        return (
            f"campaign {store} seed={seed}: operations {self.operations}, holds {self.holds}"
            f"{slots}, "
            f"faults injected {sum(self.faults.values())} ({faults}), errors seen ({errors}), "
            f"longest call {self.longest_call:.1f}s, "
            f"documented losses {len(self.documented_losses)}, "
            f"violations: {len(self.violations)}"
        )


def _excused(first: Hold, second: Hold, faults: Sequence[Fault]) -> Fault | None:
    """The lossy fault that excuses ``second`` overlapping ``first``, if any: it happened after
    ``first`` began and before ``second`` did, and ``first`` stopped believing within a lease
    after it ended."""
    for fault in faults:
        if (
            fault.lossy
            and first.start <= fault.end
            and fault.start <= second.start
            and first.end <= fault.end + first.ttl
        ):
            return fault
    return None


def _check_overlaps(
    label: str, series: Sequence[Hold], faults: Sequence[Fault], report: Report
) -> None:
    """No two believed intervals of ``series`` (sorted by start) overlap, lossy faults aside."""
    for index, hold in enumerate(series):
        for earlier in series[:index]:
            if hold.start >= earlier.end:
                continue
            excuse = _excused(earlier, hold, faults)
            text = (
                f"{label}: believed intervals overlap by "
                f"{earlier.end - hold.start:.6f}s: {earlier.describe()} and {hold.describe()}"
            )
            if excuse is None:
                report.violations.append(text)
            else:
                report.documented_losses.append(f"{text} (across {excuse.kind} of {excuse.target})")


def _check_slots(
    key: str, limit: int, series: Sequence[Hold], faults: Sequence[Fault], report: Report
) -> None:
    """The holds of a key with ``limit`` holder slots (``series`` sorted by start): at most
    ``limit`` believe at once, each slot's store key has one holder at a time, and fences grow
    in the order the store saw the acquisitions."""
    report.slot_holds[limit] = report.slot_holds.get(limit, 0) + len(series)
    if any(hold.limit != limit for hold in series):
        report.violations.append(
            f"key {key!r}: taken with different limits: {sorted({h.limit for h in series})}"
        )
    # At most `limit` at once: the most believe at once at some hold's start.
    most = report.most_at_once.get(limit, 0)
    for index, hold in enumerate(series):
        believing = [earlier for earlier in series[:index] if hold.start < earlier.end]
        most = max(most, len(believing) + 1)
        unexcused = [earlier for earlier in believing if _excused(earlier, hold, faults) is None]
        if len(believing) < limit:
            continue
        text = (
            f"key {key!r}: {len(believing) + 1} believed holders at once, over its limit of "
            f"{limit}: " + "; ".join(h.describe() for h in [*believing, hold])
        )
        if len(unexcused) >= limit:
            report.violations.append(text)
        else:
            report.documented_losses.append(f"{text} (across a lossy fault)")
    report.most_at_once[limit] = most
    # One holder per slot, as for a key of its own.
    by_slot: dict[str | None, list[Hold]] = collections.defaultdict(list)
    for hold in series:
        by_slot[hold.slot].append(hold)
    for slot, holds in sorted(by_slot.items(), key=lambda item: str(item[0])):
        _check_overlaps(f"key {key!r} slot {slot!r}", holds, faults, report)
    # Fences: a hold acquired after another's reply came (the store saw the other first) has a
    # greater fence than it. Swept in order of sending, the holds granted before each send
    # seen so far, the one with the greatest fence kept.
    for hold in series:
        if hold.fence is None:
            report.violations.append(f"key {key!r}: a hold without a fence: {hold.describe()}")
    fenced = [hold for hold in series if hold.fence is not None]
    granted = sorted(fenced, key=lambda hold: hold.start)
    seen = 0
    highest: Hold | None = None
    for hold in sorted(fenced, key=lambda hold: hold.sent):
        while seen < len(granted) and granted[seen].start < hold.sent:
            if highest is None or granted[seen].fence > highest.fence:  # type: ignore[operator]
                highest = granted[seen]
            seen += 1
        if highest is not None and not hold.fence > highest.fence:  # type: ignore[operator]
            report.violations.append(
                f"key {key!r}: fence did not increase across its slots: {highest.describe()} "
                f"was granted before {hold.describe()} was sent"
            )


def check(
    holds: Iterable[Hold],
    errors: Iterable[CallError],
    calls: Iterable[Call],
    faults: Sequence[Fault],
    *,
    operations: int,
    block_bound: float,
) -> Report:
    """Judge one run's histories; the report lists every violation, each with its evidence."""
    holds = list(holds)
    errors = list(errors)
    report = Report(
        operations=operations,
        faults=dict(collections.Counter(fault.kind for fault in faults)),
        holds=len(holds),
        errors=dict(collections.Counter(error.type for error in errors)),
    )
    by_key: dict[str, list[Hold]] = collections.defaultdict(list)
    for hold in holds:
        by_key[hold.key].append(hold)
    for key, series in sorted(by_key.items()):
        series.sort(key=lambda hold: (hold.start, hold.end))
        limit = max(hold.limit for hold in series)
        if limit > 1:
            _check_slots(key, limit, series, faults, report)
            continue
        for previous, hold in itertools.pairwise(series):
            if previous.fence is None or hold.fence is None:
                report.violations.append(
                    f"key {key!r}: a hold without a fence: {previous.describe()} / "
                    f"{hold.describe()}"
                )
            elif not hold.fence > previous.fence:
                report.violations.append(
                    f"key {key!r}: fence did not increase between successive holders: "
                    f"{previous.describe()} then {hold.describe()}"
                )
        _check_overlaps(f"key {key!r}", series, faults, report)
    for error in errors:
        if not error.singletask:
            report.violations.append(
                f"{error.worker}: {error.call} raised {error.type}, not a SingletaskError: "
                f"{error.message}"
            )
        elif error.backend_error and error.cause is None and error.context is not None:
            report.violations.append(
                f"{error.worker}: {error.call} raised {error.type} while handling "
                f"{error.context} without chaining it as its cause: {error.message}"
            )
    pauses = [fault for fault in faults if fault.kind == "pause"]
    for call in calls:
        paused = any(
            fault.target == f"pid {call.pid}"
            and fault.start <= call.start + call.seconds
            and call.start <= fault.end
            for fault in pauses
        )
        if not paused:
            report.longest_call = max(report.longest_call, call.seconds)
        if call.seconds > block_bound and not paused:
            report.violations.append(
                f"{call.worker}: {call.call} blocked {call.seconds:.1f}s, over the store's "
                f"bound of {block_bound:.1f}s"
            )
    return report
