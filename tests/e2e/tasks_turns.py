"""Tasks of tests/e2e/test_fair_turns.py: tenants sharing one small limit, on a real worker.

``sync`` is a tenant's job: its lock key is the tenant (``lock_key``, with up to
:data:`PER_TENANT` of a tenant's syncs at once, so the key never holds a tenant back), and it
takes one unit of the test's turns limit (``"{e2e}-turns:<label>"``, a concurrency of 2:
tests/e2e/app.py ``e2e_limits``). A sync that finds the limit full retries until it has room
(``lock_policy="retry"``): with fair turns, it waits in the limit's line as its tenant's turn.
Its body records its start and end, with its tenant, under the test's label, and each
refusal is recorded there too (``lock_conflict``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from singletask import SingletonTask
from singletask.signals import lock_conflict

from .probe import probe
from .tasks_shared import register_where_units

PREFIX = "e2e.turns."

#: The limit's name (a template over the call's ``label``), and its size.
LIMIT = "{e2e}-turns:{label}"
SIZE = 2

#: Syncs of one tenant that may run at once as far as its key goes: more than any test sends,
#: so that only the shared limit holds a tenant back.
PER_TENANT = 50

#: Seconds between a refused sync's lock retries.
COUNTDOWN = 0.5

#: Lease of the units and keys here: far above any body.
TTL = 30


def weight(args: Sequence[Any], kwargs: Mapping[str, Any]) -> float:
    """A tenant's share of the turns: the call's ``weight`` keyword (1 when none)."""
    return float(kwargs.get("weight", 1))


def sync(
    self: SingletonTask, label: str, tenant: str, pause: float = 0.2, weight: float = 1
) -> str:
    """One sync of ``tenant``: records its start and end under ``label``, and sleeps ``pause``."""
    with probe().running(label, self.request.id, units=1, tenant=tenant, task=self.name):
        time.sleep(pause)
    return tenant


#: The tasks of this module.
TASKS: list[tuple[Any, dict[str, Any]]] = [
    (sync, {"name": PREFIX + "sync", "lock_limits": [LIMIT], "lock_key": "{label}:{tenant}",
            "lock_limit": PER_TENANT, "lock_weight": weight, "lock_policy": "retry",
            "lock_retry_countdown": COUNTDOWN, "lock_retry_max": 1000}),
]  # fmt: skip


@lock_conflict.connect(weak=False)
def _refused(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
    """A sync refused (its tenant waits in the limit's line from then on), recorded under the
    test's label as a ``refused`` event with its tenant."""
    if getattr(sender, "name", None) != PREFIX + "sync":
        return
    args = sender.request.args or ()
    if len(args) >= 2:
        probe().mark(str(args[0]), "refused", task_id, tenant=str(args[1]))


register_where_units(TASKS, TTL)
