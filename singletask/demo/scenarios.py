"""The demo's scenarios: what the write-ups singletask grew from asked for, as task calls.

Each scenario sends calls at planned moments and says what should be seen. The durations scale
with one number, the time a run works (``--quick`` shortens it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["PARTNER_RATE", "PARTNER_WORK", "REPLACE_TTL", "Call", "Scenario", "scenarios"]

#: The rate scenario's lock_rate: 4 starts a second, one every 0.25 s. It is fixed, not scaled
#: with ``work``: the worker defines the task before it could know whether the demo is quick.
PARTNER_RATE = "4/s"
#: Seconds a call of the rate scenario works: longer than the rate's interval, so that calls
#: overlap (up to its lock_limit of 3) while their starts stay spaced.
PARTNER_WORK = 0.4

#: The replace scenario's lock_ttl: renewed every 0.3 s, so a replaced rebuild stops within
#: about 0.3 s of the newer one's start. Fixed, like the rate, for the same reason.
REPLACE_TTL = 0.9

NEWS = "https://example.org/news.rss"
BLOG = "https://example.org/blog.rss"


@dataclass(frozen=True)
class Call:
    """One task call of a scenario.

    Attributes:
        at: When to send it, in seconds after the scenario starts.
        task: The task name.
        args: Its positional arguments.
        label: One character that stands for the call's lock key on the timeline.
        text: How the call reads, e.g. ``sync_customer(2)``.
    """

    at: float
    task: str
    args: tuple[Any, ...]
    label: str
    text: str


@dataclass(frozen=True)
class Scenario:
    """A scenario: its calls, and the words around them."""

    name: str
    title: str
    setup: str
    expect: str
    policy: str
    task: str
    calls: tuple[Call, ...]
    #: Roughly how long it takes, in seconds (the timeline's initial span).
    span: float


def scenarios(work: float) -> list[Scenario]:
    """The eight scenarios, for runs that work ``work`` seconds each."""
    period = round(work * 2 / 3, 2)
    tick = round(period * 2.5, 2)
    return [
        Scenario(
            name="burst",
            title="A burst of duplicates of a global singleton",
            setup="8 x nightly_report() sent at once; one lock for the task, lock_policy skip",
            expect="one runs; the 7 duplicates find the lock held and return Skipped at once",
            policy="skip",
            task="demo.nightly_report",
            calls=tuple(
                Call(0.0, "demo.nightly_report", (work,), "N", "nightly_report()") for _ in range(8)
            ),
            span=work * 1.3,
        ),
        Scenario(
            name="customers",
            title="One lock per customer",
            setup="sync_customer(1), (2), (3), then (1), (2), (3) again, all at once; "
            "lock_args=('customer_id',), lock_policy skip",
            expect="the three customers sync side by side; the second call for each customer "
            "is skipped, so no customer is ever synced twice at once",
            policy="skip",
            task="demo.sync_customer",
            calls=tuple(
                Call(0.0, "demo.sync_customer", (n, work), str(n), f"sync_customer({n})")
                for n in (1, 2, 3, 1, 2, 3)
            ),
            span=work * 1.3,
        ),
        Scenario(
            name="retry",
            title="The retry policy serialises the runs",
            setup="3 x send_invoices(7) sent at once; lock_args=('customer_id',), "
            "lock_policy retry, lock_retry_countdown 0.3 s",
            expect="the duplicates are sent again every ~0.3 s until the lock is free: "
            "all three run, one after another, and none is lost",
            policy="retry",
            task="demo.send_invoices",
            calls=tuple(
                Call(0.0, "demo.send_invoices", (7, work), "7", "send_invoices(7)")
                for _ in range(3)
            ),
            span=work * 3.4,
        ),
        Scenario(
            name="raise",
            title="The raise policy reports the holder",
            setup="import_feed(news) at once, then import_feed(news) and import_feed(blog) "
            f"{work / 3:.1f} s later; lock_key 'feed:{{url}}', lock_policy raise",
            expect="the second import of the news feed fails with TaskLocked naming the import "
            "that holds its lock; the blog feed imports alongside",
            policy="raise",
            task="demo.import_feed",
            calls=(
                Call(0.0, "demo.import_feed", (NEWS, work), "n", "import_feed(news)"),
                Call(work / 3, "demo.import_feed", (NEWS, work), "n", "import_feed(news)"),
                Call(work / 3, "demo.import_feed", (BLOG, work), "b", "import_feed(blog)"),
            ),
            span=work * 1.5,
        ),
        Scenario(
            name="periodic",
            title="A periodic task that outlasts its period",
            setup=f"refresh_dashboard() sent every {period} s, as beat would; each run takes "
            f"{tick} s; one lock for the task, lock_policy skip",
            expect="the ticks that come while a run is still going are skipped: runs never "
            "overlap and never pile up",
            policy="skip",
            task="demo.refresh_dashboard",
            calls=tuple(
                Call(n * period, "demo.refresh_dashboard", (tick,), "D", "refresh_dashboard()")
                for n in range(6)
            ),
            span=period * 5 + tick,
        ),
        Scenario(
            name="replace",
            title="The latest rebuild wins",
            setup=f"rebuild_index('products') v1, then v2 {work / 3:.1f} s later and v3 "
            f"{work / 3:.1f} s after that; lock_args=('index',), lock_policy replace, lock_ttl "
            f"{REPLACE_TTL} s; the body calls self.lock.check() as it works",
            expect="each newer rebuild takes the lock over at once; the one it replaces stops "
            f"at its next check, within {REPLACE_TTL / 3:.1f} s (a third of its lock_ttl), and "
            "returns a Skipped naming the newer one; only v3 runs to its end",
            policy="replace",
            task="demo.rebuild_index",
            calls=tuple(
                Call(
                    n * work / 3,
                    "demo.rebuild_index",
                    ("products", n + 1, work),
                    "I",
                    f"rebuild_index(v{n + 1})",
                )
                for n in range(3)
            ),
            span=work * 5 / 3 + 0.5,
        ),
        Scenario(
            name="limit",
            title="A limit of two runs per customer",
            setup="5 x export_report(1) and export_report(2), all at once; "
            "lock_args=('customer_id',), lock_limit 2, lock_policy retry, "
            "lock_retry_countdown 0.3 s",
            expect="customer 1 exports two at a time, never three: the others are sent again "
            "until one of the two holder slots is free, and all five run; customer 2 exports "
            "alongside, as its key has slots of its own",
            policy="retry",
            task="demo.export_report",
            calls=tuple(
                Call(0.0, "demo.export_report", (n, work), str(n), f"export_report({n})")
                for n in (1, 1, 2, 1, 1, 1)
            ),
            span=work * 3.6,
        ),
        Scenario(
            name="rate",
            title="A rate spaces the starts",
            setup=f"6 x call_partner('acme') sent at once; lock_args=('partner',), lock_rate "
            f"'{PARTNER_RATE}' (a start every 0.25 s), lock_limit 3, lock_policy retry; each "
            f"call takes {PARTNER_WORK} s",
            expect="the calls start one by one, 0.25 s apart or more, never closer, and overlap "
            "as they go: each call over the rate is sent again when its turn comes, and none is "
            "lost",
            policy="retry",
            task="demo.call_partner",
            calls=tuple(
                Call(0.0, "demo.call_partner", ("acme", PARTNER_WORK), "P", "call_partner('acme')")
                for _ in range(6)
            ),
            span=2.0,
        ),
    ]
