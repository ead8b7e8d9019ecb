"""The value a skipped execution returns.

A run skipped by the ``"skip"`` policy ends in state SUCCESS with a :class:`Skipped` value, so a
caller blocked on ``AsyncResult.get()`` returns at once and can tell a skip from a run that
returned ``None``::

    value = sync_customer.delay(42).get()
    if isinstance(value, Skipped):
        print("already running as", value.holder)

:class:`Skipped` is registered with kombu's JSON serializer (and pickles as is), so it comes back
as a :class:`Skipped` in every process that has imported singletask. A process that has not sees
kombu's tagged form, ``{"__type__": "singletask.skipped", "__value__": {...}}``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kombu.utils.json import register_type

__all__ = ["Skipped"]


@dataclass(frozen=True, init=False)
class Skipped:
    """An execution did not run its body because another execution held the lock.

    Attributes:
        key: The lock key.
        holder: Task id of the execution holding the lock, when known.
        ttl: Seconds that were left on the holder's lease, when known.
        holders: With ``lock_limit`` above 1, the task id of every holder (``holder`` is the
            first); empty for a singleton task.
        reason: Why the body did not run: ``"held"`` (the lock is held: ``holder``, ``ttl``),
            ``"rate"`` (the key started too recently for its ``lock_rate``: ``retry_after``)
            ``"debounced"`` (a later send of the key superseded this one: ``holder`` is
            that send's task id), ``"replaced"`` (``lock_policy = "replace"``: a newer
            execution preempted this one, whose body stopped; ``holder`` is the newer one's
            task id) or ``"superseded"`` (``lock_coalesce = "latest"``: a later call replaced
            this pending follow-up; ``holder`` is that call's task id) or ``"limit"`` (a
            limit it names had no room for its units: ``limit``, and ``retry_after`` for a
            rate).
        retry_after: With ``reason == "rate"``, seconds until the key may start again; with
            ``reason == "limit"`` and a rate, seconds until it has room.
        limit: With ``reason == "limit"``, the limit's name (``"lock_limit"``: the key's own,
            counted in units by ``lock_cost``).
    """

    key: str
    holder: str | None = None
    ttl: float | None = None
    holders: tuple[str | None, ...] = ()
    reason: str = "held"
    retry_after: float | None = None
    limit: str | None = None

    # The __init__ the dataclass would generate, written out: a refused duplicate makes one,
    # and setting the frozen fields in the instance's dict costs a fraction of the generated
    # one's object.__setattr__ per field.
    def __init__(
        self,
        key: str,
        holder: str | None = None,
        ttl: float | None = None,
        holders: tuple[str | None, ...] = (),
        reason: str = "held",
        retry_after: float | None = None,
        limit: str | None = None,
    ) -> None:
        fields = self.__dict__
        fields["key"] = key
        fields["holder"] = holder
        fields["ttl"] = ttl
        fields["holders"] = holders
        fields["reason"] = reason
        fields["retry_after"] = retry_after
        fields["limit"] = limit

    # The __repr__ the dataclass would generate, written out without its guard against a
    # value that contains itself (no field can): Celery's tracer writes every result's repr.
    def __repr__(self) -> str:
        return (
            f"Skipped(key={self.key!r}, holder={self.holder!r}, ttl={self.ttl!r}, "
            f"holders={self.holders!r}, reason={self.reason!r}, "
            f"retry_after={self.retry_after!r}, limit={self.limit!r})"
        )

    def __str__(self) -> str:
        if self.reason == "limit":
            left = f" (room in {self.retry_after:.1f}s)" if self.retry_after else ""
            return f"skipped: limit {self.limit!r} has no room for {self.key!r}{left}"
        if self.reason == "rate":
            left = f" (next start in {self.retry_after:.1f}s)" if self.retry_after else ""
            return f"skipped: lock {self.key!r} started too recently for its lock_rate{left}"
        if self.reason == "debounced":
            return f"skipped: a later send ({self.holder}) of lock {self.key!r} superseded it"
        if self.reason == "replaced":
            return f"replaced: a newer execution ({self.holder}) of lock {self.key!r} took it over"
        if self.reason == "superseded":
            return f"skipped: a later call ({self.holder}) replaced this follow-up of {self.key!r}"
        if self.holders:
            return f"skipped: lock {self.key!r} is held by its {len(self.holders)} holders"
        who = self.holder or "another execution"
        return f"skipped: lock {self.key!r} is held by {who}"


def _encode(value: Skipped) -> dict[str, Any]:
    return asdict(value)


#: The fields of Skipped: a value sent by another version keeps the ones this one knows.
_FIELDS = frozenset(Skipped.__dataclass_fields__)


def _decode(value: dict[str, Any]) -> Skipped:
    known = {name: field for name, field in value.items() if name in _FIELDS}
    return Skipped(**{**known, "holders": tuple(value.get("holders") or ())})


register_type(Skipped, "singletask.skipped", _encode, _decode)
