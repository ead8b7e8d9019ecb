"""The contract every lock backend implements: a few atomic primitives, nothing more.

Policy (which key, which token, what to do when a lock is held, when to release) lives in
:mod:`singletask.task`. A backend only stores leases:

* a lock is a *key* with an owner *token*, a lease (seconds) and a few metadata fields;
* every operation is atomic, and release / extend only act for the owner token;
* a lease always expires: there are no permanent locks. Every record a backend writes (lock,
  fence record, follow-up slot) carries an expiry, set in the same atomic step as the write; a
  lease that is not a finite number of seconds in (0, :data:`MAX_LEASE`] is refused with
  :class:`~singletask.ConfigurationError` before anything is written (see :func:`check_lease`);
* every acquisition gets a fencing token, strictly increasing per key;
* a release can leave a completion marker that later acquisitions of the key see;
* a key can have one pending follow-up task id, claimed and cleared atomically;
* ``lock_limit``: a key can have up to N holders, one per *holder slot*; a slot is a store key
  of its own (:mod:`singletask.protocol.slots`) that shares the key's fence record, and
  :meth:`LockBackend.acquire_slot` takes a free one in one atomic step;
* ``lock_rate``: :meth:`LockBackend.acquire_slot` can also space the starts of a key by an
  interval, checked and recorded in the same atomic step (a *rate record* per key);
* ``lock_debounce``: a key can have one open *debounce window* naming its latest send
  (:meth:`LockBackend.debounce`, :meth:`LockBackend.debounce_take`), pending while its
  message is being published (:meth:`LockBackend.debounce_published`), and a send whose
  message was never published can be taken back out of it (:meth:`LockBackend.debounce_undo`);
* ``lock_policy = "replace"``: a newer execution can take a named holder's key or slot over,
  with a larger fence, in one atomic step (:meth:`LockBackend.preempt`), leaving a *preemption
  record* from which the preempted holder learns who did (:meth:`LockBackend.replaced_by`);
* named limits (``singletask_limits``, a task's ``lock_limits``): :meth:`LockBackend.take_units`
  takes units from several limits at once, all or nothing, in one atomic step, and
  :meth:`LockBackend.give_units` gives them back (a rate's: changes their number); see
  :class:`~singletask.backends.holders.Units`;
* for operators (``singletask locks / inspect / release``): the held locks can be listed by key
  prefix, in bounded pages, and a lock can be released by its holder's task id or by force; the
  store's bookkeeping (follow-ups, debounce windows, rate records) can be listed the same way.

A new backend subclasses :class:`LockBackend`, implements the abstract methods, passes
``tests/contract/test_contract.py``, and registers a URL scheme (see :mod:`singletask.backends`).
"""

from __future__ import annotations

import abc
import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

from ..exceptions import ConfigurationError, UnsupportedOperation
from ..protocol.tokens import parse_token
from .holders import MAX_LEASE as _MAX_LEASE
from .holders import (
    MAX_UNITS,
    STATE_KINDS,
    AcquireResult,
    Holder,
    StoreState,
    Turn,
    Units,
    UnitsResult,
    check_lease,
    check_taken,
    check_units,
)
from .urls import TABLE_SCHEMES

# Holder, AcquireResult, StoreState, MAX_LEASE, check_lease: from singletask.backends.holders;
# stores import them here.
__all__ = [
    "MAX_LEASE", "MAX_UNITS", "STATE_KINDS", "AcquireResult", "Holder", "LockBackend",
    "StoreState", "Turn", "Units", "UnitsResult", "check_lease", "check_taken", "check_units",
    "units_meta",
]  # fmt: skip

logger = logging.getLogger("singletask")

#: The longest lease, in seconds, any backend accepts (366 days). It is far above every lease
#: the task options allow (each at most 30 days; a queue reservation adds the message's
#: countdown, and is capped here), and far below what the stores can represent.
MAX_LEASE = _MAX_LEASE


def units_meta(meta: Mapping[str, str] | None) -> dict[str, str]:
    """What a hold of named limits keeps of a lock's metadata: its ``task_id`` and ``task``."""
    return {name: meta[name] for name in ("task_id", "task") if meta and name in meta}


def _unsupported(message: str) -> Iterator[StoreState]:
    """An iteration that raises UnsupportedOperation(``message``) at its first step."""
    raise UnsupportedOperation(message)
    yield  # pragma: no cover - makes this a generator


class LockBackend(abc.ABC):
    """Abstract base of lock stores. All durations are float seconds."""

    #: The longest lease this store accepts (at most :data:`MAX_LEASE`); longer ones are refused
    #: with ConfigurationError. Reservations are capped at it.
    max_lease: float = MAX_LEASE

    #: True for a store that lives in this process's memory, where a second instance built from
    #: the same URL is another, empty store. For any other store a second instance reaches the
    #: same locks: under gevent or eventlet the lease renewer builds one for its own OS thread.
    in_process: ClassVar[bool] = False

    #: Whether the store implements :meth:`acquire_slot` (tasks with ``lock_limit`` above 1).
    supports_limit: ClassVar[bool] = False

    #: Whether :meth:`acquire_slot` takes an ``interval`` (tasks with ``lock_rate``).
    supports_rate: ClassVar[bool] = False

    #: Whether the store implements :meth:`debounce` (tasks with ``lock_debounce``).
    supports_debounce: ClassVar[bool] = False

    #: Whether the store implements :meth:`preempt` (``lock_policy = "replace"``). Never for a
    #: store whose fences can go back (memcached): only its older fence makes a preempted
    #: holder harmless.
    supports_replace: ClassVar[bool] = False

    #: Whether the store implements :meth:`take_units` and :meth:`give_units` (named limits,
    #: ``lock_limits``).
    supports_units: ClassVar[bool] = False
    #: True when the store keeps the limits' waiting lines of fair turns. A take whose
    #: :class:`Units` carry a ``turn`` then waits in line when refused; a store without them
    #: takes as though no turn were given (singletask gives none there).
    supports_turns: ClassVar[bool] = False

    @classmethod
    @abc.abstractmethod
    def from_url(cls, url: str, **options: Any) -> LockBackend:
        """Build a backend from its URL.

        Raises:
            ConfigurationError: The URL or an option is invalid.
        """

    @classmethod
    def check_table_option(cls, url: str, table: str, where: str) -> str:
        """Return ``table`` if the store at ``url`` takes it as its ``table`` option (the setting
        ``singletask_backend_table``), checked without connecting to anything.

        The default refuses it: the store keeps no table. A store that keeps its locks in a
        table (the SQL stores) overrides this.

        Raises:
            ConfigurationError: The store has no table, or ``table`` is not a usable name; the
                message starts with ``where``.
        """
        scheme = url.split("://", 1)[0].lower()
        raise ConfigurationError(
            f"{where}: the lock store {scheme}:// has no table; the setting applies to "
            f"{', '.join(f'{s}://' for s in sorted(TABLE_SCHEMES))} only"
        )

    @classmethod
    def check_url(cls, url: str) -> None:
        """Check ``url`` without connecting to anything; :meth:`from_url` checks the same.

        Lets the configuration refuse a bad URL before the first backend is built. The default
        checks nothing; built-in backends check every part and query option.

        Raises:
            ConfigurationError: The URL is invalid; the message masks its password.
        """
        return None

    @classmethod
    def check_units_keys(cls, keys: Sequence[str], where: str) -> None:
        """Refuse, without connecting to anything, limit store keys that one :meth:`take_units`
        of this store could not take together (a Redis Cluster keeps them in one hash slot).
        Called when a task naming limits is bound. The default refuses nothing.

        Raises:
            ConfigurationError: They cannot be taken together; the message starts with
                ``where`` and says how to name them.
        """
        return None

    @abc.abstractmethod
    def acquire(
        self,
        key: str,
        token: str,
        ttl: float,
        *,
        meta: Mapping[str, str] | None = None,
        takeover_prefix: str | None = None,
        units: Sequence[Units] = (),
    ) -> AcquireResult:
        """Take ``key`` for ``token`` with a lease of ``ttl`` seconds, in one atomic step.

        It succeeds when the key is free (or its lease ran out), when it is already held by
        ``token`` itself (so a retried call is harmless), or when the current holder's token
        starts with ``takeover_prefix``. On success the metadata is replaced by ``meta``, the
        lease restarts, and the result carries a fencing token and the key's last completion
        marker. Otherwise nothing changes and the result names the holder.

        Fencing tokens of one key strictly increase: a new acquisition gets more than every
        token issued before for that key, even after the lock expired; re-acquiring by the same
        token keeps its token.

        With ``units`` (named limits, stores with :attr:`supports_units`; singletask passes it
        only when it has units to take), the key is taken only with them, as
        :meth:`take_units` takes them (``meta``'s ``task_id`` and ``task`` kept with each
        hold): a held key is refused as without; a key free but a limit without room changes
        nothing and returns ``AcquireResult(False, limit=..., used=..., retry_after=...)``.
        The built-in stores do it in one atomic step where the key and the limits are in one
        place (not across Redis Cluster slots); elsewhere ``_take_units_after`` does it in
        two.

        Raises:
            BackendError: The store failed.
        """

    def _take_units_after(
        self,
        result: AcquireResult,
        key: str,
        token: str,
        ttl: float,
        units: Sequence[Units],
        meta: Mapping[str, str] | None,
        takeover_prefix: str | None = None,
    ) -> AcquireResult:
        """The units of an acquire that took ``key`` (``result``), in a second step: taken
        (the result as it is), or refused, the key given back again (a duplicate may meet it
        held in between: not one atomic step). For a store that cannot take both at once.

        An acquire that took over a body retry's reservation of the key itself
        (``takeover_prefix``, an attempt after the first; not a holder slot) puts the
        reservation back instead of freeing the key: the retried attempt is refused for want
        of room and comes back for it."""
        if not units or not result.acquired:
            return result
        taken_key = result.key or key
        if taken_key != key or not _retry_reservation(takeover_prefix):
            takeover_prefix = None
        try:
            taken = self.take_units(token, ttl, units, meta=units_meta(meta))
        except BaseException:
            with contextlib.suppress(Exception):
                self._give_key_back(taken_key, token, ttl, meta, takeover_prefix)
            raise
        if taken.taken:
            return result
        self._give_key_back(taken_key, token, ttl, meta, takeover_prefix)
        return AcquireResult(False, retry_after=taken.retry_after, limit=taken.limit,
                             used=taken.used)  # fmt: skip

    def _give_key_back(
        self,
        key: str,
        token: str,
        ttl: float,
        meta: Mapping[str, str] | None,
        reservation: str | None,
    ) -> None:
        """Undo an acquire whose units were refused: the reservation it took over back in
        place (held by ``reservation`` for ``ttl``), or the key released."""
        if reservation is not None:
            back = self.acquire(key, reservation, ttl, meta=meta, takeover_prefix=token)
            if back.acquired:
                return
        self.release(key, token)

    def _give_units_before(self, token: str, units: Sequence[Units]) -> None:
        """The units of a release, given back before its key, in a step of their own (for a
        store that cannot do both at once): the concurrency units of ``units``."""
        held = [item for item in units if item.period is None]
        if held:
            self.give_units(token, held)

    def acquire_slot(
        self,
        key: str,
        limit: int,
        token: str,
        ttl: float,
        *,
        meta: Mapping[str, str] | None = None,
        takeover_prefix: str | None = None,
        interval: float | None = None,
        units: Sequence[Units] = (),
    ) -> AcquireResult:
        """Take one of the ``limit`` holder slots of ``key`` for ``token``, in one atomic step.

        The slots are the store keys ``slots.slot_keys(key, limit)`` (slot 0 is ``key``). Like
        :meth:`acquire` for the first slot that qualifies, in this order: a slot ``token``
        holds already (its fence is kept); else a slot whose holder's token starts with
        ``takeover_prefix``; else the lowest free slot (free, or its lease ran out). The result
        names the slot taken in :attr:`AcquireResult.key`; its fence is greater than every
        fence issued before for ``key`` or any of its slots, and ``completed`` is the key's
        marker. When every slot is held, nothing changes and the result lists every holder in
        :attr:`AcquireResult.holders`.

        With ``interval`` (seconds, stores with :attr:`supports_rate`), starts of the key are
        spaced by at least that much of the store's clock: a slot taken by a new token (free,
        or taken over) is a *start*, allowed only when ``interval`` has passed since the key's
        last start; it records its own time in the key's rate record, which expires
        ``interval`` seconds later. A start that is not allowed changes nothing and returns
        ``AcquireResult(False, retry_after=<seconds until one is>)``. A holder re-acquiring
        its own slot is no start; a key with every slot held is refused as without
        ``interval``, and records nothing. ``units``: as for :meth:`acquire`.

        Raises:
            UnsupportedOperation: The store has no holder slots (:attr:`supports_limit`).
            BackendError: The store failed.
        """
        raise UnsupportedOperation(f"{self!r} cannot keep more than one holder per lock key")

    def preempt(
        self,
        key: str,
        limit: int,
        token: str,
        ttl: float,
        victim: str,
        *,
        meta: Mapping[str, str] | None = None,
    ) -> AcquireResult:
        """Take ``key`` (``limit`` 1), or the holder slot the owner token ``victim`` holds (or a
        slot free now), for ``token``: :meth:`acquire` or :meth:`acquire_slot` with
        ``takeover_prefix=victim`` (no token of singletask's is the start of another), so its
        fence is greater than the victim's and the victim's next :meth:`extend` and
        :meth:`release` return False. If ``victim`` holds nothing and no slot is free, nothing
        changes and the result names the holders. ``meta`` names the victim's token
        (``replaces``) and the preemptor's task id (``task_id``).

        **One atomic step, record included**: when the key or slot taken was the victim's, the
        same step leaves a *preemption record* that :meth:`replaced_by` reads for ``ttl``
        seconds, whenever the new holder ends, so the victim, whose renewal fails the moment
        this returns, always learns who preempted it (the built-in stores: one Lua script, one
        transaction, one hold of the mutex). The default, for a store that sets
        :attr:`supports_replace` without overriding this, is the takeover alone: its record is
        the new holder's own metadata (``replaces``), written with it, which the default
        :meth:`replaced_by` reads while that holder holds.

        Raises:
            UnsupportedOperation: The store cannot preempt (:attr:`supports_replace`).
            BackendError: The store failed.
        """
        if not self.supports_replace:
            raise UnsupportedOperation(f"{self!r} cannot preempt a holder (lock_policy 'replace')")
        if limit == 1:
            return self.acquire(key, token, ttl, meta=meta, takeover_prefix=victim)
        return self.acquire_slot(key, limit, token, ttl, meta=meta, takeover_prefix=victim)

    def replaced_by(self, key: str, token: str) -> str | None:
        """The task id of the execution that took ``key`` (a key or slot) over from the owner
        token ``token`` (``""`` for one without a task id), or None when the store has no record
        of it (another loss, or the record ran out). The record is readable from the moment
        :meth:`preempt` returns. The default reads :meth:`holder`: it names only a preemptor
        that still holds the key; the built-in stores read their record first.

        Raises:
            BackendError: The store failed.
        """
        holder = self.holder(key)
        if holder is None or holder.meta.get("replaces") != token:
            return None
        return holder.task_id or ""

    def debounce(
        self, key: str, task_id: str, ttl: float, *, pending: float = 0.0
    ) -> tuple[str | None, float, str | None]:
        """Make ``task_id`` the latest send of the debounce window of ``key``, in one step.

        Opens the window if none is open (no record, a record that ran out, or a closed one).
        The window's record lasts ``ttl`` seconds from this call, or longer if an earlier
        send's call asked for longer: a send never shortens it, so an earlier send with a
        longer countdown of its own still finds the window (naming its successor) when it
        starts.
        With ``pending`` (seconds, > 0) the new latest send is *pending* for that long: its
        message is being published. It stops being pending when :meth:`debounce_published`
        says its message was published, or when it is taken back (:meth:`debounce_undo`);
        still pending after ``pending`` seconds, it is treated as taken back by
        :meth:`debounce_take` (its producer died before it could publish or take it back).
        Without, it is published at once. The pending deadline of the send it superseded is
        kept with it, for :meth:`debounce_undo` to put back.
        Returns the previous latest send (None when this call opened the window), the seconds
        since the window was opened, by the store's clock (0 when this call opened it), and,
        when this call opened the window over a closed one (its record not run out), the send
        that closed it, else None: what :meth:`debounce_undo` puts back.

        Raises:
            UnsupportedOperation: The store has no debounce windows (:attr:`supports_debounce`).
            BackendError: The store failed.
        """
        raise UnsupportedOperation(f"{self!r} cannot keep debounce windows")

    def debounce_published(self, key: str, task_id: str) -> bool:
        """The message of ``task_id``, a pending latest send (:meth:`debounce`), was published:
        if the open window of ``key`` still names it as its latest send, it is pending no
        more (even past its pending deadline). One atomic step. Returns whether the window
        changed.

        Raises:
            UnsupportedOperation: The store has no debounce windows (:attr:`supports_debounce`).
            BackendError: The store failed.
        """
        raise UnsupportedOperation(f"{self!r} cannot keep debounce windows")

    def debounce_take(
        self, key: str, task_id: str, *, overdue: bool = False
    ) -> tuple[str | None, float]:
        """If ``task_id`` is the latest send of the open window of ``key``, close the window
        and return ``(task_id, 0.0)``. If the latest is another send that is pending (its
        message being published), change nothing and return it with the seconds it stays
        pending at most: the caller waits for it to be published or taken back, then asks
        again. If that send is still pending past its deadline, or with ``overdue`` (the
        caller can wait no longer: its time limit is near) still pending at all, it is
        treated as taken back: the window is closed naming ``task_id``, as if ``task_id``
        were the latest, and ``(task_id, 0.0)`` returned. Else return the window's latest
        send and ``0.0`` and change nothing; ``(None, 0.0)`` when the key has no window
        record. One atomic step.

        A closed window keeps its record, naming the send that closed it, until the record
        expires: an earlier send that starts late (after the run of the latest began) still
        learns that it was superseded, and the send that closed it (its message sent again)
        gets its own id back. A :meth:`debounce` on a closed window opens a new one.

        Raises:
            UnsupportedOperation: The store has no debounce windows (:attr:`supports_debounce`).
            BackendError: The store failed.
        """
        raise UnsupportedOperation(f"{self!r} cannot keep debounce windows")

    def debounce_undo(
        self, key: str, task_id: str, previous: str | None, *, closed: str | None = None
    ) -> bool:
        """Take back the :meth:`debounce` of ``task_id``, whose message was never published,
        in one atomic step; ``previous`` and ``closed`` are what that call returned as the
        previous latest send and as the send that closed the window it replaced.

        Only if the open window of ``key`` still names ``task_id`` as its latest send: with
        ``previous``, ``previous`` is the latest again (the window keeps when it opened, the
        expiry ``task_id``'s call gave its record, and ``previous``'s pending deadline if it
        was pending when ``task_id``'s call superseded it); without (``task_id``'s call opened
        the window), the window is removed, as if it had never been opened, or, with
        ``closed`` (it was opened over a closed window), the closed window is back: closed,
        naming ``closed``, its record keeping the expiry ``task_id``'s call gave it. Otherwise
        (a later send superseded ``task_id``, the window was closed or ran out) nothing
        changes. Returns whether the window changed. Called only when a publish fails, never
        on the way of a send that is published.

        Raises:
            UnsupportedOperation: The store has no debounce windows (:attr:`supports_debounce`).
            BackendError: The store failed.
        """
        raise UnsupportedOperation(f"{self!r} cannot keep debounce windows")

    def take_units(
        self,
        token: str,
        ttl: float,
        units: Sequence[Units],
        *,
        meta: Mapping[str, str] | None = None,
    ) -> UnitsResult:
        """Take ``units`` for ``token`` from every limit named, all or nothing, in one atomic
        step, by the store's clock.

        Each limit has room when:

        * concurrency: the units held by other tokens (holds whose lease has not run out) plus
          those asked are at most its size;
        * rate: ``token`` has a start in its window already (a retried call: nothing more is
          counted), or the units of the starts in the last ``period`` seconds plus those asked
          are at most its size.

        When every limit has room, each records the take: a concurrency limit holds the units
        for ``token`` for ``ttl`` seconds (a hold ``token`` had is replaced: taking again is
        how a holder renews its lease); a rate records a start of the units now, counted for
        ``period`` seconds. ``meta`` (``task_id``, ``task``) is kept with each, for operators.
        Otherwise nothing changes, and the result names the first limit without room, its
        units in use and, for a rate, when it has room. A limit's record expires when its last
        hold or start stops counting; every record has an expiry.

        Raises:
            ConfigurationError: ``ttl``, a ``period``, a ``size`` or ``units`` is out of range
                (:func:`check_lease`, :func:`check_units`), or ``units`` is more than ``size``;
                before anything is written.
            UnsupportedOperation: The store keeps no limits (:attr:`supports_units`).
            BackendError: The store failed.
        """
        raise UnsupportedOperation(f"{self!r} cannot keep named limits")

    def give_units(self, token: str, units: Sequence[Units]) -> list[bool]:
        """Give back what ``token`` took from each limit named, in one atomic step.

        A concurrency limit drops ``token``'s hold (its ``units`` are not read). A rate keeps
        ``token``'s start where it is and sets its units to ``units`` (the real cost, known
        after the start; 0 removes the start); a start that stopped counting is left alone.
        Returns, per limit in order, whether ``token`` had a hold or a counted start there.

        Raises:
            ConfigurationError: A ``units`` or ``size`` is out of range (0 allowed for a rate).
            UnsupportedOperation: The store keeps no limits (:attr:`supports_units`).
            BackendError: The store failed.
        """
        raise UnsupportedOperation(f"{self!r} cannot keep named limits")

    @abc.abstractmethod
    def release(
        self, key: str, token: str, *, completed: str | None = None, units: Sequence[Units] = ()
    ) -> bool:
        """Delete ``key`` if ``token`` holds it. Returns whether it did.

        With ``completed``, a successful release also records that marker for the key, in the
        same atomic step; the next acquisitions report it in :attr:`AcquireResult.completed`.
        With ``units`` (stores with :attr:`supports_units`), ``token``'s holds of their
        concurrency limits are given back first, whether it still held the key or not (rates
        are left alone: spent), as :meth:`give_units` does: in the same atomic step where the
        store can (as :meth:`acquire`), else just before (``_give_units_before``).

        Raises:
            BackendError: The store failed.
        """

    @abc.abstractmethod
    def extend(self, key: str, token: str, ttl: float) -> bool:
        """Set the lease of ``key`` to ``ttl`` seconds from now if ``token`` holds it.

        Returns whether it did. Shortening a lease is allowed.

        Raises:
            BackendError: The store failed.
        """

    def extend_many(self, leases: Sequence[tuple[str, str, float]]) -> list[bool]:
        """:meth:`extend` each ``(key, token, ttl)``; backends override it to use one round trip.

        Returns one result per lease, in order. When one lease is out of range, none is changed.

        Raises:
            ConfigurationError: A lease is out of range (see :func:`check_lease`).
            BackendError: The store failed.
        """
        for _, _, ttl in leases:
            check_lease(ttl, "extend")  # all of them, before any lease changes
        return [self.extend(key, token, ttl) for key, token, ttl in leases]

    @abc.abstractmethod
    def claim_next(self, key: str, task_id: str, ttl: float) -> str:
        """Make ``task_id`` the key's pending follow-up unless one is pending; return the one.

        A key has at most one pending follow-up (coalescing: one run plus one follow-up). The
        claim lasts ``ttl`` seconds unless :meth:`clear_next` ends it first. Returns ``task_id``
        when the caller's claim took, else the task id that was already pending.

        Raises:
            BackendError: The store failed.
        """

    @abc.abstractmethod
    def clear_next(self, key: str, task_id: str) -> bool:
        """End ``task_id``'s pending follow-up claim on ``key``; returns whether it was pending.

        One atomic step, and only for ``task_id``: a claim of another task id is left as it is.
        (A follow-up whose message could not be published takes its claim back with it.)

        Raises:
            BackendError: The store failed.
        """

    @abc.abstractmethod
    def holder(self, key: str) -> Holder | None:
        """Return who holds ``key`` (with all metadata), or None when it is free.

        Raises:
            BackendError: The store failed.
        """

    # -- operator primitives (not on the execution path) --------------------------------------

    @abc.abstractmethod
    def iter_locks(self, prefix: str, *, page_size: int = 500) -> Iterator[tuple[str, Holder]]:
        """Yield ``(key, holder)`` for every lock or reservation currently held whose key starts
        with ``prefix``, reading the store in pages of at most ``page_size`` keys (bounded memory,
        streamed: never load the whole keyspace; Redis uses SCAN MATCH COUNT, never KEYS). Only live
        (unexpired) locks are yielded, each with the same Holder ``holder(key)`` returns (token,
        task_id, ttl, meta, fence). The holder slots of a key under ``prefix`` are yielded too,
        each under its own store key (``{<key>}:slot:<i>``, see :mod:`singletask.protocol.slots`). A
        lock acquired or released during the iteration may or may not
        appear. Bookkeeping keys of the store (fence records, follow-up slots) are never yielded.

        Raises:
            UnsupportedOperation: the store cannot list its keys (memcached).
            BackendError: the store failed.
        """

    def iter_state(self, prefix: str, *, page_size: int = 500) -> Iterator[StoreState]:
        """Yield the live bookkeeping records of the lock keys that start with ``prefix``: a
        pending follow-up claim (:meth:`claim_next`), a debounce window, open or closed
        (:meth:`debounce`), a rate record (``acquire_slot`` with ``interval``), a limit's
        record whose key starts with ``prefix`` (:meth:`take_units`); see
        :class:`~singletask.backends.holders.StoreState`. Paged and bounded as :meth:`iter_locks`,
        whose prefix rules it shares; read-only: it creates, renews and deletes nothing (a store
        whose table or file is missing yields nothing). Never on the execution path. A record
        that runs out or changes during the iteration may or may not appear.

        Raises:
            UnsupportedOperation: the store cannot list its keys (memcached, the Django cache).
            BackendError: the store failed.
        """
        yield from _unsupported(f"{self!r} cannot list its bookkeeping records")

    @abc.abstractmethod
    def release_held_by(self, key: str, task_id: str) -> Holder | None:
        """Delete ``key`` only if its holder's metadata ``task_id`` equals ``task_id``, in one
        atomic step. Returns the Holder removed, or None (nothing changed) when the key is free or
        held by another task id. The key keeps what a release leaves (its fence record, where the
        store keeps one), so the next acquisition still gets a larger fencing token; the removed
        holder's next extend()/release() returns False, which the renewer reports as a lost
        lease.

        Raises:
            BackendError: the store failed.
        """

    @abc.abstractmethod
    def force_release(self, key: str) -> Holder | None:
        """Delete ``key`` whoever holds it, in one atomic step; return the Holder removed, or None
        when it was free. Same fence and lease-loss semantics as release_held_by.

        Raises:
            BackendError: the store failed.
        """

    def close(self) -> None:  # noqa: B027 - optional hook, most backends have nothing to close
        """Release the backend's resources (connections). The backend may be used again after."""

    def __enter__(self) -> LockBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _retry_reservation(token: str | None) -> bool:
    """Whether ``token`` is the reservation a body retry leaves for its next attempt (an
    attempt after the first: a send's reservation, for the first, may never have been made)."""
    parsed = parse_token(token) if token is not None and token.endswith(":reserved") else None
    return parsed is not None and parsed[1] >= 1
