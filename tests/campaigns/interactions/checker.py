"""The ledger of an interaction run, and the checker that accounts for every send.

The runner writes down every send attempt (:class:`Send`: the task id it chose or got, or the
exception its caller got, its args, configuration, time and producer), reads every body's start
and end from the probe (:class:`Body`), every task id's stored outcome (:class:`Outcome`), what
the lock store still holds once the fleet is idle (:class:`Residue`), and the faults it injected
(:class:`Fault`). :func:`check` then asserts the ledger promise of docs/guarantees.rst ("Every
send accounted for") and the exclusion, fence and rate promises, rule by rule:

* ``accounted``: every send has exactly one outcome its caller can see. A send the caller got an
  ``AsyncResult`` for resolves (a final state, or a body that raised ``Ignore``, or before
  Celery 5.7 ``Reject(requeue=False)``, whose result Celery leaves PENDING), whether it was its
  own message or one it joined; a send whose publish
  failed ran nothing, is named by no store record, and no other send joined it or was
  superseded by it. Only a send in flight when its producer was killed has no outcome
  (documented: a producer killed between its store write and its publish), and a message that
  waits for a key such a send's reservation still held when the outcomes were read (a
  follow-up, a retry) has none yet: the record holds the key until it expires,
  ``lock_queue_ttl`` after the send, longer than the quiet bound.
* ``joined-ended``: a send deduplicated onto another joined one that had not yet ended.
* ``once``: no attempt of a message (task id, retries) completes its body twice.
* ``retry-runs``: a body that called ``self.retry()`` has its retried attempt run, unless a
  later send of its window superseded the retry (``docs/lifecycle.rst``: the latest arguments
  run instead; ``superseded`` checks that they do), or, with ``lock_policy = "replace"``, the
  retried attempt found a newer execution holding the key and stood aside as
  ``Skipped(reason="replaced")`` (a retried attempt never preempts; ``replaced`` checks the
  holder it names), or ``lock_replace_terminate`` revoked its task id (REVOKED: Celery
  discards every later message of a revoked id), or the retried attempt met the lock store
  unreachable through its whole ``lock_backend_retry_max`` budget (FAILURE
  ``BackendUnavailable``, documented in docs/configuration.rst), or found a named limit
  without room through its whole ``lock_retry_max`` (``TaskLocked`` naming the limit:
  docs/sharing-limits.rst, "No room"), or was refused ``lock_retry_max`` times in any mix of
  its key held, its key's rate and a limit without room (the workers record each refusal:
  ``TaskLocked`` or ``RateLimited``, its lock retries spent).
* ``superseded``: a ``Skipped(reason="debounced")`` (``lock_debounce``) or
  ``Skipped(reason="superseded")`` (a coalescing follow-up of ``lock_coalesce = "latest"``)
  names a later send that was published and whose body ran (or that met a visible refusal of
  its own), never a send whose publish failed: a message that starts while a later send's
  publish is going on waits for it to be published or taken back (docs/limits.rst, "While a
  send is being published"). A chain of such skips is judged at its last link.
* ``last-runs``: of a debounced burst, or of a burst of ``lock_coalesce = "latest"``, the last
  send actually published runs its body (or meets a visible refusal: held, rate,
  ``TaskLocked``), never superseded by nothing.
* ``replaced`` (``lock_policy = "replace"``): a ``Skipped(reason="replaced")`` names a newer
  execution whose body ran, with a larger fence than this execution's body if it ran; and a
  preempted body (singleton key) that returned while the execution that preempted it still
  held the key ends as ``Skipped(reason="replaced")`` naming that execution, or with
  ``lock_replace_terminate`` as REVOKED (docs/guarantees.rst, "Latest wins"; docs/policies.rst:
  the revoke's SIGTERM can reach it just after the body returned).
* ``holder-alive``: a refusal as "held" names holders that had not ended (a lease whose release
  a store fault lost is excused for one lease).
* ``exclusion``: never more than ``lock_limit`` bodies of a key at once (with ``lock_cost``, as
  many as their units fit in it), a body whose lease ran out while its renewals failed (it
  ends ``lost``) not counted once a newer one took its key (docs/guarantees.rst, "Lease
  loss"). With ``lock_policy =
  "replace"``, exclusion is by fence: a body that starts while every slot is held by a running
  body preempted the one with the smallest fence (the oldest), which must be smaller than its
  own; that preempted body holds nothing from then on and may run on beside its successor until
  it learns it (within one renewal interval, ``lock_ttl / 3``; the campaign's bodies never call
  ``self.lock.check()``, so until their end, which is the documented "for as long as it does
  not check"). A body over the limit that cannot have preempted (no smaller fence) is a
  violation.
* ``fences``: a body's fence is larger than that of every holder of its key that started
  before it (before its acquire was sent: the units of its named limits are taken between its
  acquire and its start).
* ``rate``: no two starts of a rated key closer than its interval, by the lock store's clock
  (docs/limits.rst): two bodies whose starts are closer are no violation if their fences, which
  carry the store's clock at the acquire, are an interval apart (:func:`spaced_by_the_store`).
* ``limit-held`` (named limits, docs/sharing-limits.rst): never more units of a limit's
  concurrency held at once than its size, on each lock store (its configurations share the
  limit): at each body's start, the units of the bodies that had started and not recorded
  their end (a body records its start after its units are taken and its end before they are
  given back).
* ``limit-rate``: never more units of a limit's rate started in a window of its period than it
  allows, by the store's clock: the bodies whose acquires were sent less than a period before
  a body started, and that started no later, took their units in one window; they add up to
  at most the rate (each start counted at the least it may have counted then: its estimate,
  or a charge that may have been written before; an attempt's start once).
* ``limit-refusal``: a ``Skipped(reason="limit")`` or a ``TaskLocked`` naming a limit names one
  its task takes (``"lock_limit"`` with ``lock_cost``) and is its policy's (a Skipped for
  "skip", a TaskLocked for "raise" or for lock retries spent; a retried attempt of the body is
  never skipped for want of room).
* ``idle``: once the fleet is idle the store holds no live lock, reservation, open debounce
  window, pending follow-up claim, rate record of a key or hold of a named limit's
  concurrency (records naming a send whose producer was killed in flight excepted, until they
  expire, and the claim of a follow-up still waiting behind such a record; units come back on
  every ending, and a hold that a fault of the workers' store link left, or a killed
  process's, is excused for one lease).
* ``turn-order`` and ``tickets-end`` (fair turns, docs/fair-turns.rst): a waiting execution
  is passed over no more than the keys waiting ahead of it allow, and every ticket ends
  (turns_rules.py says how each is judged).
* ``failures``: a FAILURE carries an exception its send's ending or configuration explains.

Every violation names the seed, the configuration, the key, the sends involved and the rule.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from celery import VERSION as CELERY_VERSION

from singletask.conf.limits import LimitSpec, check_spec

from .space import FIXED, LIMITS, Config
from .turns_rules import Refusal, Ticket, tickets_end, turn_order

__all__ = [
    "Body",
    "Charge",
    "Fault",
    "History",
    "Outcome",
    "Report",
    "Residue",
    "Send",
    "check",
    "unstored_endings",
]

#: Seconds by which a body taken over between its acquire and its own start (``"replace"``) may
#: start after the body of the execution that took it over (a few milliseconds go from an
#: acquire to its body; the rest is a loaded machine's slack).
TAKEN_BEFORE_START = 0.05

#: Exceptions a caller gets from a publish that failed.
PUBLISH_ERRORS = frozenset({"OperationalError", "EncodeError"})
#: Exceptions a caller gets at send by its task's policy (``lock_scope`` "queue", "raise").
POLICY_ERRORS = frozenset({"TaskLocked", "RateLimited"})
#: States after which nothing more happens to a task id.
FINAL = frozenset({"SUCCESS", "FAILURE", "REVOKED"})
#: How a body's end is recorded when it ran to an end of its own.
COMPLETED = frozenset({"return", "raise", "retry", "ignore", "reject", "soft"})
#: Seconds of clock and scheduling slack between what different processes record.
SLACK = 1.0
#: Two starts this close are in no order the probe can tell.
TIE = 0.05
#: Seconds a named rate's window may be longer than its period as a store keeps it (Redis
#: rounds it up to the millisecond) or its starts' times rounded: a start this close to the
#: edge of a window is not counted in it.
RATE_EDGE = 0.002

#: The exceptions a FAILURE may carry, by the body's ending (any ending: the policy's).
EXPECTED_FAILURES: dict[str, frozenset[str]] = {
    "raise": frozenset({"RuntimeError"}),
    "soft": frozenset({"SoftTimeLimitExceeded"}),
    "hard": frozenset({"TimeLimitExceeded"}),
    "kill": frozenset({"WorkerLostError"}),
    "reject": frozenset({"Reject"}),
    "*": frozenset({"TaskLocked", "RateLimited", "BackendUnavailable", "BackendTimeout"}),
}
#: What a FAILURE may carry besides, with ``lock_replace_terminate`` (a revoke with terminate
#: ends the preempted execution's pool process).
TERMINATED = frozenset({"WorkerLostError", "Terminated", "TaskRevokedError"})
#: ``Skipped.reason`` of a send that a later send of its window superseded.
SUPERSEDED = frozenset({"debounced", "superseded"})
#: Whether the installed Celery stores a FAILURE for a body that raised ``Reject(requeue=False)``:
#: from 5.7 (celery/celery#10369) it does; before, it stores nothing, and the result stays
#: PENDING as an ``Ignore``'s does (docs/quickstart.rst lists the difference).
REJECT_STORED = (CELERY_VERSION.major, CELERY_VERSION.minor) >= (5, 7)


def unstored_endings(rejects_stored: bool = REJECT_STORED) -> frozenset[str]:
    """The endings of a body (``Body.how``) after which Celery stores no result: ``Ignore``,
    and ``Reject(requeue=False)`` on a Celery that does not store it (``REJECT_STORED``)."""
    return frozenset({"ignore"} if rejects_stored else {"ignore", "reject"})


@dataclass
class Send:
    """One send attempt, as its producer saw it."""

    seq: int
    producer: str
    config: str
    key: str
    method: str  # delay, apply_async, send_task, group
    ending: str
    t_before: float  # time.time() just before the call
    task_id: str | None = None  # the id the send chose (None: delay, which picks its own)
    returned: str | None = None  # the AsyncResult's id the caller got
    error: str | None = None  # the class name of the exception the caller got
    t_after: float | None = None  # None: no reply (the producer was killed meanwhile)
    countdown: float | None = None
    fault: str | None = None  # the hand-off fault the send met (broker-down, encode, ...)
    own: str | None = None  # the id of the message it published, when it published one

    def describe(self) -> str:
        what = self.returned if self.error is None else f"raised {self.error}"
        if self.t_after is None and self.error is None:
            what = "no reply (producer killed)"
        fault = f" fault={self.fault}" if self.fault else ""
        ident = self.own or self.task_id
        return f"send#{self.seq}({self.method} by {self.producer}{fault} id={ident} -> {what})"


@dataclass
class Charge:
    """A body's call of ``self.lock.charge(name, units)``: the times just before and just after
    it, and the exception it raised (the store may have written it all the same)."""

    name: str
    units: int
    before: float
    after: float
    error: str | None = None


@dataclass
class Body:
    """One body, from the probe: its start and, if it got there, its end.

    ``acquired`` is when its execution sent the request that acquired its key (no store step of
    it is earlier: its units are taken after it); ``units``, what it took of each named limit
    (recorded after they were taken, as its start is; its end is recorded before they are given
    back); ``charges``, its calls of ``self.lock.charge``; ``lost``, whether its lease was lost
    (preempted, or run out) by its end."""

    task_id: str
    retries: int
    seq: int
    key: str
    config: str
    pid: int
    fence: int | None
    start: float
    end: float | None = None
    how: str | None = None  # return, raise, retry, ignore, reject, soft, hard, unwound
    ending: str = "return"
    redelivered: bool = False
    acquired: float | None = None
    units: dict[str, int] = field(default_factory=dict)
    charges: list[Charge] = field(default_factory=list)
    lost: bool = False

    @property
    def token(self) -> tuple[str, int]:
        """Its attempt (task id, retries): its owner token in the stores, one per attempt (a
        redelivered copy takes with the same one)."""
        return (self.task_id, self.retries)

    def describe(self) -> str:
        end = "no end" if self.end is None else f"{self.end:.3f} {self.how}"
        return (
            f"body({self.task_id[:8]}#{self.retries} send#{self.seq} pid={self.pid} "
            f"fence={self.fence} [{self.start:.3f}, {end}])"
        )

    def until(self) -> float:
        """When the body stopped acting: its end, or (killed: no end) its start."""
        if self.end is not None:
            return self.end
        return self.start + (1.5 if self.ending == "hard" else 0.01)


def spaced_by_the_store(earlier: Body, later: Body, interval: float) -> bool:
    """Whether the lock store's clock spaced the acquisitions of two bodies by ``interval`` at
    least, as docs/limits.rst promises ("by the lock store's clock"). A body's fence is
    ``max(last + 1, the store's clock in microseconds)`` at its acquire (docs/guarantees.rst,
    "Fencing tokens"), so a fence gap of ``interval`` or more can only be the clock's: the
    bodies' own start times also count the requests between the acquire and the body (a
    coalescing follow-up's claim cleared, a redelivered copy's twin check), which a stalled
    link can hold back."""
    if earlier.fence is None or later.fence is None:
        return False
    return later.fence - earlier.fence >= int(interval * 1_000_000) - 1


def _passed_on(dead: Body, later: Body) -> bool:
    """Whether ``dead``, a body that killed its own process (it has no end), had its lock passed
    on to ``later``: a larger fence, which the store gives only once the worker saw the process
    gone (or its lease ran out). A dead process acts no more, however soon that was."""
    return (
        dead.end is None
        and dead.ending == "kill"
        and dead.fence is not None
        and later.fence is not None
        and later.fence > dead.fence
    )


def _lease_ran_out(lost: Body, later: Body) -> bool:
    """Whether ``lost``, a body that ended with its lease lost (renewals that failed while the
    store was unreachable, until the lease passed), had its key taken by ``later`` after that:
    a larger fence, which the store gives only once the lease is over. docs/guarantees.rst,
    "Lease loss": the body is not interrupted, and runs on beside the newer one until it
    checks or ends."""
    return (
        lost.lost
        and lost.fence is not None
        and later.fence is not None
        and later.fence > lost.fence
    )


def _windowed(config: Config) -> bool:
    """Whether only the latest send of a burst runs: ``lock_debounce``, or ``lock_coalesce =
    "latest"``."""
    return config.options["lock_debounce"] is not None or (
        config.options.get("lock_coalesce") == "latest"
    )


@dataclass
class Outcome:
    """What the result store holds for a task id."""

    state: str
    kind: str | None = None  # "skipped", "value", "exception"
    reason: str | None = None  # Skipped.reason
    holder: str | None = None
    holders: tuple[str, ...] = ()
    exception: str | None = None  # the exception's class name
    date_done: float | None = None  # time.time() when it was stored
    limit: str | None = None  # the limit without room (Skipped(reason="limit"), TaskLocked)

    def describe(self) -> str:
        limit = f", limit={self.limit}" if self.limit is not None else ""
        if self.kind == "skipped":
            return f"Skipped(reason={self.reason}, holder={self.holder}{limit})"
        if self.kind == "exception":
            return f"{self.state}({self.exception}, holder={self.holder}{limit})"
        return self.state


@dataclass
class Residue:
    """A record the lock store still holds once the fleet is idle."""

    key: str
    kind: str  # lock, reservation, window, claim, rate, limit hold
    task_id: str | None
    detail: str
    store: str | None = None  # the lock store that holds it, when the reader says


@dataclass
class Fault:
    kind: str
    start: float
    end: float
    side: str = "send"  # "send": a producer's hand-off; "run": the worker's store link
    stores: tuple[str, ...] = ()  # the stores whose link it met (none named: every store)

    def hits(self, store: str | None) -> bool:
        return not self.stores or store is None or store in self.stores


@dataclass
class History:
    seed: int
    configs: dict[str, Config]
    sends: list[Send]
    bodies: list[Body]
    outcomes: dict[str, Outcome]
    residues: list[Residue]
    faults: list[Fault] = field(default_factory=list)
    observed: float | None = None  # time.time() when the outcomes were read (None: not known)
    rejects_stored: bool = REJECT_STORED  # the workers' Celery stores a Reject's FAILURE
    refusals: list[Refusal] = field(default_factory=list)  # what the workers refused
    tickets: list[Ticket] = field(default_factory=list)  # in the idle stores' lines


@dataclass
class Report:
    seed: int
    sends: int = 0
    configs: list[str] = field(default_factory=list)
    methods: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=dict)
    bodies: int = 0
    documented: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)

    def summary(self) -> str:
        def counts(d: Mapping[str, int]) -> str:
            return ", ".join(f"{k} {n}" for k, n in sorted(d.items())) or "none"

        return (
            f"interactions seed={self.seed}: {self.sends} sends ({counts(self.methods)}), "
            f"{len(self.configs)} combinations, {self.bodies} bodies, outcomes: "
            f"{counts(self.outcomes)}; faults injected: {counts(self.faults)}; documented "
            f"exceptions {len(self.documented)}; violations {len(self.violations)}"
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class _Judge:
    def __init__(self, history: History) -> None:
        self.h = history
        self.report = Report(history.seed, configs=[c.describe() for c in history.configs.values()])
        self.by_seq = {s.seq: s for s in history.sends}
        self._assign_own_ids()
        self.by_id: dict[str, Send] = {s.own: s for s in history.sends if s.own}
        self.killed = {
            s.task_id: s
            for s in history.sends
            if s.t_after is None and s.error is None and s.task_id
        }
        self.failed = {
            s.task_id: s for s in history.sends if s.error in PUBLISH_ERRORS and s.task_id
        }
        # A failed publish whose undo met the lock store unreachable: documented (a WARNING
        # says what stays, until it expires), like a producer killed between the two steps.
        for tid in [t for t, s in self.failed.items() if s.fault and "store-down" in s.fault]:
            self.killed[tid] = self.failed.pop(tid)
        self.bodies: dict[str, list[Body]] = collections.defaultdict(list)
        for body in history.bodies:
            self.bodies[body.task_id].append(body)

    def _assign_own_ids(self) -> None:
        chosen = {s.task_id for s in self.h.sends if s.task_id}
        for send in self.h.sends:
            if send.error is not None or send.t_after is None:
                continue
            if send.task_id is not None:
                send.own = send.task_id if send.returned == send.task_id else None
        taken = {s.own for s in self.h.sends if s.own}
        # A body runs the arguments of the send that published its message: of two ``delay``
        # sends that got the same id (one published, the other joined it), the one whose
        # ``seq`` the body ran is its own, whichever replied first.
        ran: dict[str, set[int]] = collections.defaultdict(set)
        for body in self.h.bodies:
            ran[body.task_id].add(body.seq)
        for send in sorted(self.h.sends, key=lambda s: s.t_after or 0.0):
            fresh = send.returned not in chosen and send.returned not in taken
            seqs = ran.get(send.returned or "")
            if seqs and send.seq not in seqs:
                continue  # its id's body ran another send's arguments: it joined that send
            if send.task_id is None and send.returned and send.error is None and fresh:
                send.own = send.returned
                taken.add(send.returned)

    # -- helpers -----------------------------------------------------------------------

    def where(self, send: Send | None, key: str | None = None, config: str | None = None) -> str:
        config = send.config if send is not None else config
        key = send.key if send is not None else key
        described = self.h.configs[config].describe() if config in self.h.configs else config
        return f"seed={self.h.seed} {described} key={key!r}"

    def violation(self, rule: str, where: str, sends: Iterable[Send], detail: str) -> None:
        involved = " ".join(s.describe() for s in sends)
        self.report.violations.append(f"{where}: rule {rule}: {detail}; sends: {involved}")

    def outcome(self, task_id: str) -> Outcome:
        return self.h.outcomes.get(task_id) or Outcome("PENDING")

    def ended_at(self, task_id: str) -> float | None:
        """When ``task_id`` had ended for good, or None while it may still run."""
        outcome = self.outcome(task_id)
        ends = [b.until() for b in self.bodies.get(task_id, ())]
        if outcome.state in FINAL:
            return max([outcome.date_done or 0.0, *ends])
        last = max(self.bodies.get(task_id, ()), key=lambda b: (b.retries, b.start), default=None)
        if last is not None and last.how in self.unstored:
            return last.end
        return None

    @property
    def unstored(self) -> frozenset[str]:
        """The endings of a body whose result Celery leaves PENDING (it stores nothing)."""
        return unstored_endings(self.h.rejects_stored)

    def behind_killed(self, send: Send) -> str | None:
        """A send of the same configuration and key, killed in flight, whose reservation may
        still hold the key when the outcomes were read (``lock_queue_ttl`` after it, plus its
        countdown), or None: a message that waits for that key (a follow-up, a policy retry)
        waits until the record expires, which may be past the quiet bound (docs/guarantees.rst
        bounds such a record by ``lock_queue_ttl``)."""
        config = self.h.configs.get(send.config)
        if config is None:
            return None
        lease = float(config.options.get("lock_queue_ttl", FIXED["lock_queue_ttl"]))
        for tid, killed in self.killed.items():
            if killed.config != send.config or killed.key != send.key:
                continue
            expires = killed.t_before + lease + (killed.countdown or 0.0)
            if self.h.observed is None or expires > self.h.observed - SLACK:
                return tid
        return None

    def visible(self, task_id: str) -> bool:
        return self.ended_at(task_id) is not None

    def ran(self, task_id: str) -> bool:
        return bool(self.bodies.get(task_id))

    def store_fault_near(self, moment: float, lease: float, store: str | None = None) -> bool:
        return any(
            f.side == "run" and f.hits(store) and f.start - SLACK <= moment <= f.end + lease + SLACK
            for f in self.h.faults
        )

    def sends_of(self, task_id: str | None) -> list[Send]:
        if task_id is None:
            return []
        found = [s for s in self.h.sends if task_id in (s.own, s.task_id, s.returned)]
        return sorted(found, key=lambda s: (s.own != task_id and s.task_id != task_id, s.seq))

    # -- the rules ---------------------------------------------------------------------

    def accounted(self) -> None:
        for send in self.h.sends:
            here = self.where(send)
            if send.error in PUBLISH_ERRORS:
                self._unpublished(send, here)
                continue
            if send.error in POLICY_ERRORS:
                continue
            if send.error is not None:
                self.violation("accounted", here, [send], f"unexpected {send.error} at send")
                continue
            if send.t_after is None:
                self.report.documented.append(f"{here}: {send.describe()} in flight at the kill")
                continue
            target = send.returned
            assert target is not None
            if target in self.failed:
                failed, joined = self.failed[target], self.outcome(target)
                if joined.state == "FAILURE" and joined.exception == failed.error:
                    continue  # joined while the publish failed: its error is the joined result
                self.violation(
                    "accounted", here, [send, failed],
                    f"joined {target}, a send whose publish failed, and its result is "
                    f"{joined.describe()}, not that publish's error",
                )  # fmt: skip
                continue
            if target in self.killed:
                self.report.documented.append(f"{here}: {send.describe()} joined a killed send")
                continue
            if not self.visible(target) and (blocker := self.behind_killed(send)) is not None:
                self.report.documented.append(
                    f"{here}: {target} still waits behind the record of {blocker}, killed in "
                    "flight, which holds its key until it expires"
                )
            elif not self.visible(target):
                outcome = self.outcome(target)
                ran = ", ".join(b.describe() for b in self.bodies.get(target, ())) or "no body"
                self.violation(
                    "accounted", here, [send, *self.sends_of(target)][:4],
                    f"its AsyncResult {target} is still {outcome.state} past the bound ({ran})",
                )  # fmt: skip
            if send.own is None:
                self._joined(send, target, here)

    def _unpublished(self, send: Send, here: str) -> None:
        tid = send.task_id
        if tid is None:
            return
        if self.ran(tid):
            self.violation("accounted", here, [send], "its publish failed, yet a body ran for it")
        for residue in self.h.residues:
            if residue.task_id == tid:
                self.violation(
                    "accounted", here, [send],
                    f"its publish failed, yet the store still holds a {residue.kind} naming it "
                    f"({residue.detail})",
                )  # fmt: skip

    def _joined(self, send: Send, target: str, here: str) -> None:
        ended = self.ended_at(target)
        if ended is not None and ended < send.t_before - SLACK:
            config = self.h.configs.get(send.config)
            lease = float(config.task_options()["lock_ttl"]) if config else FIXED["lock_ttl"]
            store = config.store if config else None
            if send.t_before <= ended + lease + SLACK and self.store_fault_near(ended, 0, store):
                # docs/guarantees.rst: the lock store unreachable at the release (a fault of
                # the workers' link as the target ended): its key stays until its lease ends
                self.report.documented.append(
                    f"{here}: {send.describe()} joined {target}, whose release a store fault "
                    "lost, within its lease"
                )
                return
            self.violation(
                "joined-ended", here, [send, *self.sends_of(target)][:3],
                f"deduplicated onto {target}, which had ended {send.t_before - ended:.2f}s "
                f"before the send ({self.outcome(target).describe()})",
            )  # fmt: skip

    def once(self) -> None:
        done: dict[tuple[str, int], list[Body]] = collections.defaultdict(list)
        for body in self.h.bodies:
            if body.how in COMPLETED:
                done[(body.task_id, body.retries)].append(body)
        for (task_id, retries), bodies in done.items():
            if len(bodies) > 1:
                send = self.by_seq.get(bodies[0].seq)
                here = self.where(send, bodies[0].key, bodies[0].config)
                self.violation(
                    "once", here, [send] if send else [],
                    f"attempt {retries} of {task_id} completed {len(bodies)} times: "
                    + ", ".join(b.describe() for b in bodies),
                )  # fmt: skip

    def retry_runs(self) -> None:
        for body in self.h.bodies:
            if body.how != "retry":
                continue
            later = [b for b in self.bodies[body.task_id] if b.retries == body.retries + 1]
            if later:
                continue
            outcome = self.outcome(body.task_id)
            if outcome.kind == "skipped" and outcome.reason in SUPERSEDED:
                continue  # superseded by a later send of its window: the `superseded` rule
            if outcome.kind == "skipped" and outcome.reason == "replaced":
                continue  # stood aside for a newer execution: the `replaced` rule
            if outcome.state == "REVOKED" and self._terminates(body.config):
                continue  # revoked by the execution that replaced it
            send = self.by_seq.get(body.seq)
            if outcome.exception == "TaskLocked" and outcome.limit is not None:
                # docs/sharing-limits.rst, "No room": the retried attempt that finds no room
                # retries whatever the policy, spending lock_retry_max as any lock retry; a
                # named limit kept full by the others for that long spends it (`limit-refusal`
                # checks the limit it names)
                self.report.documented.append(
                    f"{self.where(send, body.key, body.config)}: the retry of {body.task_id} "
                    f"spent its lock retries waiting for room in limit {outcome.limit!r}"
                )
                continue
            # (one budget covers the task id, its attempts all: docs/policies.rst)
            refused = sum(1 for r in self.h.refusals if r.task_id == body.task_id)
            if outcome.exception in POLICY_ERRORS and refused >= int(FIXED["lock_retry_max"]):
                # docs/policies.rst, lock_retry_max: refused that many times (its key
                # held, its key's rate, a limit without room, in any mix: the workers recorded
                # each refusal), the retried attempt spent its lock retries and failed so
                self.report.documented.append(
                    f"{self.where(send, body.key, body.config)}: the retry of {body.task_id} "
                    f"was refused {refused} times, its lock retries spent "
                    f"({outcome.describe()})"
                )
                continue
            if outcome.state == "FAILURE" and outcome.exception == "BackendUnavailable":
                # docs/configuration.rst, lock_backend_retry_max: the retried attempt met the
                # lock store unreachable through its whole store-error budget, and failed so
                self.report.documented.append(
                    f"{self.where(send, body.key, body.config)}: the retry of {body.task_id} "
                    "met the lock store unreachable through its store-error budget"
                )
                continue
            self.violation(
                "retry-runs", self.where(send, body.key, body.config), [send] if send else [],
                f"{body.describe()} called self.retry(), and its attempt {body.retries + 1} never "
                f"ran: it ended {self.outcome(body.task_id).describe()}",
            )  # fmt: skip

    def _killed_within_lease(self, task_id: str | None) -> bool:
        """Whether a body of ``task_id`` was killed (it has no end: SIGKILL, a hard time limit)
        less than one lease before the idle store was read: nothing releases for a killed pool
        process whose message is delivered again (``reject_on_worker_lost``), and its lock stays
        until its lease ends unless a later execution takes it over (docs/lifecycle.rst)."""
        killed = [b for b in self.bodies.get(task_id or "", ()) if b.end is None]
        if not killed or self.h.observed is None:
            return False
        config = self.h.configs.get(killed[0].config)
        lease = float(config.task_options()["lock_ttl"]) if config else FIXED["lock_ttl"]
        return any(self.h.observed - b.start < lease + SLACK for b in killed)

    def superseded(self) -> None:
        for task_id, outcome in self.h.outcomes.items():
            if outcome.kind != "skipped" or outcome.reason not in SUPERSEDED:
                continue
            chain = [task_id]
            holder = outcome.holder
            while holder is not None and holder not in chain:
                chain.append(holder)
                next_ = self.outcome(holder)
                if next_.kind == "skipped" and next_.reason in SUPERSEDED and not self.ran(holder):
                    holder = next_.holder
                    continue
                break
            last = chain[-1]
            send = next(iter(self.sends_of(task_id)), None)
            here = self.where(send) if send else f"seed={self.h.seed} task {task_id}"
            involved = [s for tid in chain for s in self.sends_of(tid)][:5]
            if last in self.killed:
                self.report.documented.append(f"{here}: superseded by {last}, killed in flight")
            elif last in self.failed:
                self.violation(
                    "superseded", here, involved,
                    f"{task_id} was superseded by {last}, a send whose publish failed: the "
                    f"burst's latest published send does not run",
                )  # fmt: skip
            elif last == task_id or holder is None:
                self.violation("superseded", here, involved, f"{task_id} superseded by nothing")
            elif not self.ran(last) and self.outcome(last).kind in (None, "skipped"):
                final = self.outcome(last)
                if final.kind == "skipped" and final.reason not in SUPERSEDED:
                    continue  # a visible refusal of the latest send
                self.violation(
                    "superseded", here, involved,
                    f"{task_id} was superseded by {last}, which never ran ({final.describe()})",
                )  # fmt: skip

    def last_runs(self) -> None:
        bursts: dict[tuple[str, str], list[Send]] = collections.defaultdict(list)
        for send in self.h.sends:
            config = self.h.configs.get(send.config)
            if config is None or not _windowed(config):
                continue
            if send.method in ("delay", "apply_async") and send.own and send.fault is None:
                bursts[(send.config, send.key)].append(send)
        for (_config, _key), sends in bursts.items():
            latest_start = max(s.t_before for s in sends)
            last = [s for s in sends if (s.t_after or 0.0) >= latest_start]
            if any(self._ran_or_refused(s.own) for s in last if s.own):
                continue
            holders = [self.outcome(s.own).holder for s in last if s.own]
            if any(h in self.by_id and self._ran_or_refused(h) for h in holders if h):
                continue  # a later send (made during a store fault, say) wrote the window
            if any(s.own in self.killed for s in last):
                continue
            later_kill = [s for s in self.killed.values() if s.key == _key and s.config == _config]
            if later_kill:
                self.report.documented.append(f"{self.where(last[0])}: latest burst after a kill")
                continue
            self.violation(
                "last-runs", self.where(last[0]), last,
                "the last published send of the burst did not run: "
                + ", ".join(f"{s.own} {self.outcome(s.own).describe()}" for s in last if s.own),
            )  # fmt: skip

    def _ran_or_refused(self, task_id: str) -> bool:
        if self.ran(task_id):
            return True
        outcome = self.outcome(task_id)
        if outcome.state not in FINAL:
            return False
        return not (outcome.kind == "skipped" and outcome.reason in SUPERSEDED)

    def holder_alive(self) -> None:
        for task_id, outcome in self.h.outcomes.items():
            refused_held = (outcome.kind == "skipped" and outcome.reason == "held") or (
                outcome.exception == "TaskLocked"
            )
            if not refused_held or outcome.date_done is None:
                continue
            holders = [h for h in (outcome.holders or (outcome.holder,)) if h]
            for holder in holders:
                if holder == task_id:
                    continue
                ended = self.ended_at(holder)
                if ended is None or outcome.date_done <= ended + SLACK:
                    continue
                send = next(iter(self.sends_of(task_id)), None)
                config = self.h.configs.get(send.config) if send else None
                lease = float(config.task_options()["lock_ttl"]) if config else 5.0
                if self.store_fault_near(ended, lease, config.store if config else None):
                    self.report.documented.append(f"{holder}: release lost to a store fault")
                    continue
                here = self.where(send) if send else f"seed={self.h.seed} task {task_id}"
                self.violation(
                    "holder-alive", here, [*([send] if send else []), *self.sends_of(holder)][:4],
                    f"{task_id} was refused as held by {holder}, which had ended "
                    f"{outcome.date_done - ended:.2f}s before ({self.outcome(holder).describe()})",
                )  # fmt: skip

    def exclusion_fences_rate(self) -> None:
        by_key: dict[tuple[str, str], list[Body]] = collections.defaultdict(list)
        for body in self.h.bodies:
            by_key[(body.config, body.key)].append(body)
        for (config_name, key), bodies in by_key.items():
            config = self.h.configs.get(config_name)
            if config is None:
                continue
            here = self.where(None, key, config_name)
            bodies.sort(key=lambda b: b.start)
            replace = config.options.get("lock_policy") == "replace"
            preempted = self._exclusion(here, config.key_units, bodies, replace)
            if replace and config.options["lock_limit"] == 1:
                self._ended_replaced(here, bodies, preempted)
            self._fences(here, bodies)
            if config.rate_interval is not None:
                self._rate(here, config.rate_interval, bodies)

    def _sends(self, bodies: Sequence[Body]) -> list[Send]:
        return [self.by_seq[b.seq] for b in bodies if b.seq in self.by_seq][:4]

    def _exclusion(
        self, here: str, limit: int, bodies: Sequence[Body], replace: bool = False
    ) -> dict[int, Body]:
        """The rule; returns, with ``replace``, each preempted body (by ``id``) -> the body that
        preempted it."""
        preempted: dict[int, Body] = {}
        for body in bodies:
            along = [
                b for b in bodies
                if b.start <= body.start < b.until() and b is not body and not _passed_on(b, body)
                and id(b) not in preempted and not _lease_ran_out(b, body)
            ]  # fmt: skip
            counted = 1  # this body, unless it was itself taken over before it started
            while replace and along and len(along) + counted > limit:
                victim = min(along, key=lambda b: -1 if b.fence is None else b.fence)
                if victim.fence is not None and (body.fence is None or victim.fence >= body.fence):
                    if (
                        body.fence is not None and victim.fence > body.fence
                        and body.start - victim.start <= TAKEN_BEFORE_START
                    ):  # fmt: skip
                        # This body is older than every body running along: it was taken over
                        # between its acquire and its start, and starts anyway, to learn it at
                        # its renewer's next renewal (docs/guarantees.rst, "Latest wins").
                        preempted[id(body)] = victim
                        counted = 0
                    break  # else it cannot have preempted that body: an overlap
                preempted[id(victim)] = body
                along.remove(victim)
            if len(along) + counted > limit:
                self.violation(
                    "exclusion", here, self._sends([*along, body]),
                    f"{len(along) + 1} bodies at once, over the limit of {limit}: "
                    + ", ".join(b.describe() for b in [*along, body]),
                )  # fmt: skip
        return preempted

    def _ended_replaced(
        self, here: str, bodies: Sequence[Body], preempted: dict[int, Body]
    ) -> None:
        """A preempted body that returned while its successor still held the key (no body
        started after the successor's before that return) ends as replaced, naming it."""
        for body in bodies:
            successor = preempted.get(id(body))
            if successor is None or body.how != "return" or body.end is None:
                continue
            if successor.until() <= body.end + TIE or successor.end is None:
                continue  # it had ended (or died): the key no longer says who replaced it
            if any(successor.start < b.start <= body.end + TIE for b in bodies):
                continue  # preempted in turn: the key names a later successor
            outcome = self.outcome(body.task_id)
            if outcome.kind == "skipped" and outcome.reason == "replaced":
                continue
            if outcome.state == "REVOKED" and self._terminates(body.config):
                continue  # lock_replace_terminate: revoked, its SIGTERM just after the return
            between = next(
                iter(self._revoked_unseen(body.config, body.key, body.start, body.end)), None
            )
            if between is not None:
                self.report.documented.append(
                    f"{here}: {body.describe()} was preempted by {between}, itself preempted "
                    "and revoked before its body started: the key names a later holder"
                )
                continue
            self.violation(
                "replaced", here, self._sends([body, successor]),
                f"{body.describe()} was preempted by {successor.describe()}, which still held "
                f"the key when it returned, yet it ended {outcome.describe()}",
            )  # fmt: skip

    def replaced(self) -> None:
        for task_id, outcome in self.h.outcomes.items():
            if outcome.kind != "skipped" or outcome.reason != "replaced":
                continue
            send = next(iter(self.sends_of(task_id)), None)
            here = self.where(send) if send else f"seed={self.h.seed} task {task_id}"
            newer = self.bodies.get(outcome.holder or "", [])
            own = self.bodies.get(task_id, [])
            fences = [b.fence for b in own if b.fence is not None]
            if newer and (not fences or any((b.fence or 0) > max(fences) for b in newer)):
                continue
            holder = outcome.holder or ""
            if not newer and send and holder in self._revoked_unseen(send.config, send.key):
                self.report.documented.append(
                    f"{here}: {task_id} ended replaced by {holder}, itself preempted and "
                    "revoked before its body started"
                )
                continue
            self.violation(
                "replaced", here, [*([send] if send else []), *self.sends_of(outcome.holder)][:4],
                f"{task_id} ended replaced by {outcome.holder}, "
                + ("whose body never ran" if not newer else "whose fence is not larger"),
            )  # fmt: skip

    def _terminates(self, config_name: str) -> bool:
        config = self.h.configs.get(config_name)
        return bool(config and config.options.get("lock_replace_terminate"))

    def _revoked_unseen(
        self, config: str, key: str, start: float | None = None, end: float | None = None
    ) -> list[str]:
        """With ``lock_replace_terminate``: the sends of ``key`` that ended REVOKED without a
        body (between ``start`` and ``end`` when given). Such an execution took the key over
        and was itself preempted, and terminated, before its body started (docs/policies.rst):
        the probe never saw it hold the key, and the key named a later holder once it ended."""
        found: list[str] = []
        for send in self.h.sends if self._terminates(config) else ():
            tid = send.own
            if send.config != config or send.key != key or not tid or self.bodies.get(tid):
                continue
            outcome = self.outcome(tid)
            done = outcome.date_done
            if outcome.state != "REVOKED" or done is None:
                continue
            if start is None or end is None or start - SLACK <= done <= end + SLACK:
                found.append(tid)
        return found

    def _fences(self, here: str, bodies: Sequence[Body]) -> None:
        for i, body in enumerate(bodies):
            if body.fence is None:
                continue
            # Its acquire was sent at `acquired`: a holder whose body had started before then
            # had acquired before it. (Its start may come long after its acquire: the units of
            # its named limits are taken in between, over a link that a fault may stall.)
            acquired = body.start if body.acquired is None else min(body.acquired, body.start)
            for earlier in bodies[:i]:
                if earlier.fence is None or earlier.start >= acquired - TIE:
                    continue
                if earlier.fence >= body.fence:
                    self.violation(
                        "fences", here, self._sends([earlier, body]),
                        f"{body.describe()} started after {earlier.describe()} with a fence "
                        "not larger",
                    )  # fmt: skip

    def _rate(self, here: str, interval: float, bodies: Sequence[Body]) -> None:
        for earlier, later in itertools.pairwise(bodies):
            gap = later.start - earlier.start
            if gap < interval - TIE and not spaced_by_the_store(earlier, later, interval):
                self.violation(
                    "rate", here, self._sends([earlier, later]),
                    f"two starts {gap:.3f}s apart, closer than the rate's interval "
                    f"{interval:.3f}s: {earlier.describe()}, {later.describe()}",
                )  # fmt: skip

    # -- named limits (docs/sharing-limits.rst, "What is guaranteed") ------------------

    def named_limits(self) -> None:
        """``limit-held`` and ``limit-rate``, for each named limit of each lock store (the
        configurations of a store share its limits; each store keeps its own)."""
        by_limit: dict[tuple[str, str], list[Body]] = collections.defaultdict(list)
        for body in self.h.bodies:
            config = self.h.configs.get(body.config)
            for name in body.units if config is not None else ():
                by_limit[(config.store, name)].append(body)
        for (store, name), bodies in sorted(by_limit.items()):
            if name not in LIMITS:
                continue
            spec = check_spec(LIMITS[name], name)
            bodies.sort(key=lambda b: b.start)
            here = f"seed={self.h.seed} limit {name!r} {LIMITS[name]} store={store}"
            if spec.concurrency is not None:
                self._limit_held(here, name, spec.concurrency, bodies)
            if spec.rate_size is not None:
                self._limit_rate(here, name, spec, bodies)

    def _limit_held(self, here: str, name: str, size: int, bodies: Sequence[Body]) -> None:
        """Never more units of a concurrency held at once than its size. A body's start is
        recorded after its units were taken and its end before they are given back, on the
        clock every process of the host reads: at the instant a body starts, every body that
        had started and not yet recorded its end holds its units. A body with no end (its
        process killed) is counted at its own start only (its units come back once the worker
        sees the process gone, or with the lease); a redelivered copy holds its attempt's units
        (the store counts one hold per attempt)."""
        for i, body in enumerate(bodies):
            along = [
                b for b in bodies[:i + 1]
                if b is not body and b.token != body.token and b.end is not None
                and b.start <= body.start <= b.end
            ]  # fmt: skip
            held = body.units[name] + sum(b.units[name] for b in along)
            if held <= size:
                continue
            bodies_at = [*along, body]
            if any(b.lost for b in bodies_at):
                self.report.documented.append(
                    f"{here}: {held} units held at {body.start:.3f} by bodies one of which had "
                    "lost its lease (its units may have expired in the store)"
                )
                continue
            self.violation(
                "limit-held", here, self._sends(bodies_at),
                f"{held} units held at once at {body.start:.3f}, over the size {size}: "
                + ", ".join(self._unit_body(b, name) for b in bodies_at),
            )  # fmt: skip

    def _limit_rate(self, here: str, name: str, spec: LimitSpec, bodies: Sequence[Body]) -> None:
        """Never more units started in a window of a rate's period than its size, by the
        store's clock, counting each start's estimate until it is charged and its charged
        units after (docs/sharing-limits.rst). The store checks it at each take: the starts in
        the period before it, at what they count at that moment, plus the take's own units.

        The store's clock is the host's (every store of the campaign runs on it), and a start's
        time is its take's, which falls between its body's ``acquired`` (its acquire was sent
        before the take) and its recorded start. So for every body L, the starts of the bodies
        that started no later than L and whose acquire was sent less than a period (less
        ``RATE_EDGE``) before L started all lie in one window that ends at the last take among
        them, which saw all the others: their units may not add up to more than the size.
        Judged conservatively, so that a correct run cannot fail: each start counts at most what
        the last take may have seen (its estimate, or the smallest charge that may have been
        written before it: a charge sent before L started); an attempt's starts count once,
        from its first body (a redelivered copy's take finds its attempt's start counted and
        adds none); a start the ledger has no body for (a take whose reply was lost) counts
        nothing. A charge that raises a start's units after a later take counted it is no
        violation: that take was judged by what it saw."""
        size, period = int(spec.rate_size or 0), float(spec.period or 0.0)
        first: dict[tuple[str, int], Body] = {}
        charges: dict[tuple[str, int], list[Charge]] = collections.defaultdict(list)
        for body in bodies:
            first.setdefault(body.token, body)
            charges[body.token] += [c for c in body.charges if c.name == name]
        for last in bodies:
            window = [
                b for b in first.values()
                if b.start <= last.start and b.acquired is not None
                and b.acquired > last.start - period + RATE_EDGE
            ]  # fmt: skip
            if not window:
                continue
            seen = max(b.acquired or 0.0 for b in window)  # the last take was no earlier
            counted = sum(
                self._rate_units(b.units[name], charges[b.token], seen, last.start) for b in window
            )
            if counted <= size:
                continue
            window.sort(key=lambda b: b.start)
            span = last.start - min(b.acquired or 0.0 for b in window)
            self.violation(
                "limit-rate", here, self._sends(window),
                f"{counted} units started within {span:.3f}s (from the first acquire sent to "
                f"the last start), over the rate {spec.rate}: "
                + ", ".join(self._unit_body(b, name) for b in window),
            )  # fmt: skip

    @staticmethod
    def _rate_units(estimate: int, charges: Sequence[Charge], seen: float, until: float) -> int:
        """The fewest units a start may have counted at a take made between ``seen`` and
        ``until``: its ``estimate``, or one of its ``charges`` (its attempt's bodies' calls)
        written before that take (one that returned before ``seen`` surely was; one sent
        before ``until`` may have been)."""
        value, maybe = estimate, []
        for charge in sorted(charges, key=lambda c: c.before):
            if charge.error is None and charge.after < seen:
                value, maybe = charge.units, []  # written before the take: it replaces the rest
            elif charge.before < until:
                maybe.append(charge.units)
        return min([value, *maybe])

    @staticmethod
    def _unit_body(body: Body, name: str) -> str:
        charged = ",".join(f"{c.units}@{c.before:.3f}" for c in body.charges if c.name == name)
        acquired = "?" if body.acquired is None else f"{body.acquired:.3f}"
        return (
            f"{body.config}:{body.key} {body.describe()} {body.units[name]}u acquired {acquired}"
            + (f" charged {charged}" if charged else "")
        )

    def limit_refusals(self) -> None:
        """A refusal for want of room (``Skipped(reason="limit")``, ``TaskLocked`` with a
        ``limit``) names a limit its configuration takes (of ``lock_limits``; ``"lock_limit"``,
        the key's own, with ``lock_cost``), and is its policy's: a Skipped for "skip", a
        TaskLocked for "raise" (or "retry", its lock retries spent). The retried attempt of a
        body that called ``self.retry()`` retries whatever the policy: it is never skipped for
        want of room, and ends TaskLocked once its lock retries are spent."""
        for task_id, outcome in self.h.outcomes.items():
            skipped = outcome.kind == "skipped" and outcome.reason == "limit"
            locked = outcome.exception == "TaskLocked" and outcome.limit is not None
            if not (skipped or locked):
                continue
            send = next(iter(self.sends_of(task_id)), None)
            config = self.h.configs.get(send.config) if send is not None else None
            if send is None or config is None:
                continue
            names = set(config.costs(1)) | (
                {"lock_limit"} if config.options.get("lock_cost") else set()
            )
            policy = config.options["lock_policy"]
            retried = any(b.how == "retry" for b in self.bodies.get(task_id, ()))
            wrong = []
            if outcome.limit not in names:
                wrong.append(f"names limit {outcome.limit!r}, which its task does not take "
                             f"(it takes {sorted(names) or 'none'})")  # fmt: skip
            if skipped and retried:
                wrong.append("is a Skipped of the retry its body asked for (it must retry)")
            elif skipped and policy != "skip":
                wrong.append(f"is a Skipped, and the policy is {policy!r}")
            if locked and policy not in ("raise", "retry") and not retried:
                wrong.append(f"is a TaskLocked, and the policy is {policy!r}")
            if wrong:
                self.violation(
                    "limit-refusal", self.where(send), [send],
                    f"{task_id} ended {outcome.describe()}, which " + "; ".join(wrong),
                )  # fmt: skip

    def _run_fault_within_lease(self, store: str | None) -> bool:
        """Whether the workers' link to ``store`` met a fault less than one lease (``lock_ttl``)
        before the idle store was read."""
        if self.h.observed is None:
            return True
        lease = float(FIXED["lock_ttl"])
        return any(
            f.side == "run" and f.hits(store) and f.end + lease + SLACK >= self.h.observed
            for f in self.h.faults
        )

    def idle(self) -> None:
        for residue in self.h.residues:
            if residue.task_id in self.killed:
                self.report.documented.append(f"{residue.key}: {residue.kind} of a killed send")
                continue
            if residue.task_id in self.failed:
                continue  # reported by the accounted rule, naming the failed send
            if residue.kind in ("lock", "limit hold") and self._killed_within_lease(
                residue.task_id
            ):
                self.report.documented.append(
                    f"{residue.key}: {residue.kind} of {residue.task_id}, whose pool process was "
                    "killed less than one lease before the idle store was read"
                )
                continue
            if residue.kind == "limit hold" and self._run_fault_within_lease(residue.store):
                # docs/sharing-limits.rst: a hold the store could not drop (a give that failed),
                # or a take whose reply a fault lost, ends with its lease (lock_ttl)
                self.report.documented.append(
                    f"{residue.key}: limit hold of {residue.task_id}, less than one lease after "
                    "a fault of the workers' link to its store"
                )
                continue
            waiting = [
                s for s in self.sends_of(residue.task_id)
                if residue.task_id and not self.visible(residue.task_id) and self.behind_killed(s)
            ]  # fmt: skip
            if waiting:
                self.report.documented.append(
                    f"{residue.key}: {residue.kind} of {residue.task_id}, which waits behind "
                    "a killed send's record"
                )
                continue
            config = next((c for c in self.h.configs.values() if f"{c.name}:" in residue.key), None)
            sends = [s for s in self.sends_of(residue.task_id)][:3]
            where = (
                self.where(sends[0])
                if sends
                else self.where(None, residue.key, config.name if config else "?")
            )
            self.violation(
                "idle", where, sends,
                f"the idle store still holds a {residue.kind} of {residue.task_id} "
                f"({residue.detail}); its send ended "
                f"{self.outcome(residue.task_id or '').describe()}",
            )  # fmt: skip

    def failures(self) -> None:
        for task_id, outcome in self.h.outcomes.items():
            if outcome.state != "FAILURE":
                continue
            send = next(iter(self.sends_of(task_id)), None)
            if (
                send is not None
                and send.error in PUBLISH_ERRORS
                and send.error == outcome.exception
            ):
                continue  # its publish's error, stored for the calls that joined it (scopes)
            ending = send.ending if send else "*"
            allowed = EXPECTED_FAILURES["*"] | EXPECTED_FAILURES.get(ending, frozenset())
            if send is not None and self._terminates(send.config):
                allowed |= TERMINATED
            if outcome.exception in allowed:
                continue
            here = self.where(send) if send else f"seed={self.h.seed} task {task_id}"
            self.violation(
                "failures", here, [send] if send else [],
                f"{task_id} failed with {outcome.exception}, which its ending {ending!r} "
                "does not explain",
            )  # fmt: skip

    def figures(self) -> None:
        r = self.report
        r.sends = len(self.h.sends)
        r.bodies = len(self.h.bodies)
        r.methods = dict(collections.Counter(s.method for s in self.h.sends))
        kinds = collections.Counter()
        for send in self.h.sends:
            if send.error is not None:
                kinds[f"raised {send.error}"] += 1
            elif send.t_after is None:
                kinds["killed in flight"] += 1
            elif send.own is None:
                kinds["joined"] += 1
            elif self.ran(send.own):
                o = self.outcome(send.own)
                kinds["ran, then replaced" if o.reason == "replaced" else "ran"] += 1
            else:
                o = self.outcome(send.own)
                kinds[f"skipped {o.reason}" if o.kind == "skipped" else o.exception or o.state] += 1
        r.outcomes = dict(kinds)
        faults = collections.Counter(f.kind for f in self.h.faults)
        faults.update(s.fault for s in self.h.sends if s.fault)
        r.faults = dict(faults)


def check(history: History) -> Report:
    """Judge one run's history; the report lists every violation."""
    judge = _Judge(history)
    judge.accounted()
    judge.once()
    judge.retry_runs()
    judge.superseded()
    judge.replaced()
    judge.last_runs()
    judge.holder_alive()
    judge.exclusion_fences_rate()
    judge.named_limits()
    judge.limit_refusals()
    judge.idle()
    turn_order(judge, history.refusals)
    tickets_end(judge, history.tickets)
    judge.failures()
    judge.figures()
    return judge.report
