"""Turn ``results.json`` into tables and the Markdown report; publish.py lays them out for the
docs page, plot.py draws them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from bench.harness.app import LOCK_SIDE, LOCK_TTL

Table = tuple[str, list[str], list[list[str]]]  # title, header, rows

DASH = "\u2013"  # en dash, for ranges
TIMES = "\u00d7"  # multiplication sign, for command counts
NA = DASH  # an empty cell


def label(results: dict[str, Any], variant: str) -> str:
    version = results["environment"]["versions"].get(variant, "")
    names = {
        "plain": "plain Task",
        "singletask": "singletask",
        "singletask-queue": "singletask, lock_scope='queue'",
        "singletask-acks-late": "singletask, acks_late (completion marker kept)",
        "celery-heimdall-nb": "celery-heimdall, non-blocking",
        "only-one": "only_one (redis-py Lock)",
        "cookbook": "cookbook add/delete",
    }
    name = names.get(variant, variant)
    return f"{name} {version}".strip()


def _num(value: float | None, digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return NA
    return f"{value:,.{digits}f}"


def _spread(stats: dict[str, Any] | None, digits: int = 0, scale: float = 1.0) -> str:
    """``median (p25 to p75)``, or ``median (min to max)`` for fewer than 4 values."""
    if not stats or stats.get("median") is None:
        return NA
    median = stats["median"] * scale
    if stats["n"] == 1:
        return _num(median, digits)
    low, high = ("p25", "p75") if stats["n"] >= 4 else ("min", "max")
    return (
        f"{_num(median, digits)} ({_num(stats[low] * scale, digits)}{DASH}"
        f"{_num(stats[high] * scale, digits)})"
    )


def _commands(counts: dict[str, float]) -> str:
    parts = []
    for name, per in counts.items():
        shown = f"{per:.2f}".rstrip("0").rstrip(".")
        parts.append(f"{name.upper()}{TIMES}{shown}" if shown != "1" else name.upper())
    return ", ".join(parts) or "none"


def _left(row: dict[str, Any]) -> str:
    keys, size = row["keys_left_per_released_lock"], row["bytes_left_per_released_lock"]
    if keys < 0.005 and abs(size) < 20:  # within the noise of used_memory
        return "nothing"
    return f"{_num(keys, 1)} keys, {_num(size)} B"


def _ttl(variant: str) -> str:
    ttl = LOCK_TTL.get(variant)
    if variant == "plain":
        return NA
    if ttl is None:
        return "never expires"
    if variant.startswith("singletask"):
        return f"{ttl:.0f} s lease, renewed"
    return f"{ttl:.0f} s"


def tables(results: dict[str, Any]) -> list[Table]:
    out: list[Table] = []
    variants = results["variants"]
    overhead = results.get("overhead")
    if overhead:
        rows = []
        data = overhead["variants"]
        references = {
            "plain+2PING": "reference: plain Task sending two PINGs in its body",
            "PING": "reference: one bare PING, in a loop",
            "SET+DEL": "reference: SET NX EX then DEL, in a loop",
            "singletask-scripts": "breakdown: singletask's acquire and release scripts alone",
            "singletask-memory": "breakdown: singletask task, in-memory backend (no Redis)",
        }
        for variant in [*variants, *references]:
            row = data.get(variant)
            if row is None:
                continue
            rows.append(
                [
                    references.get(variant) or label(results, variant),
                    LOCK_SIDE.get(variant, NA),
                    _spread(row["us_per_execution"]),
                    _spread(row["added_us"]) if variant != "plain" and row["added_us"]["n"] else NA,
                    _num(row["round_trips"], 2),
                    _commands(row["client_commands"]["sent"]),
                    _commands(row["client_commands"]["in_scripts"]),
                ]
            )
        out.append(
            (
                "Lock overhead per execution (empty task, in process)",
                [
                    "variant",
                    "lock taken at",
                    "µs per execution",
                    "added µs over plain",
                    "round trips",
                    "commands sent",
                    "commands run in scripts",
                ],
                rows,
            )
        )
    throughput = results.get("throughput")
    if throughput:
        rows = []
        for variant in variants:
            row = throughput["variants"].get(variant)
            if row is None:
                continue
            done = "" if row["all_complete"] else " (capped)"
            rows.append(
                [
                    label(results, variant),
                    _spread(row["tasks_per_second"]) + done,
                    _spread(row["vs_plain"], 0, 100.0) + " %"
                    if row["vs_plain"]["median"] is not None
                    else NA,
                    _spread(row["task_us"]),
                    _spread(row["publish_us"]),
                ]
            )
        out.append(
            (
                f"Throughput of a prefork worker (-c {throughput['concurrency']}, "
                f"{throughput['messages']} tasks per round, {throughput['rounds']} rounds)",
                [
                    "variant",
                    "tasks/s",
                    "of plain",
                    "µs per task in the pool process",
                    "µs to publish one",
                ],
                rows,
            )
        )
    contention = results.get("contention")
    if contention:
        rows = []
        reject = contention.get("reject", {})
        overlap = contention.get("overlap", {})
        for variant in variants:
            r = reject.get(variant, {})
            o = overlap.get(variant, {})
            delay, send = o.get("delay", {}), o.get("send_task", {})

            def runs(part: dict[str, Any]) -> str:
                if not part:
                    return NA
                bodies, published = part["bodies_run"]["median"], part["published"]["median"]
                return f"{part['max_overlap']} ({_num(bodies)} of {_num(published)})"

            rows.append(
                [
                    label(results, variant),
                    _spread(r.get("us_per_duplicate")) if r else NA,
                    _num(r.get("round_trips"), 2) if r else NA,
                    ", ".join(r.get("raised", [])) or ("returns" if r else NA),
                    runs(delay),
                    runs(send),
                ]
            )
        duplicates = contention.get("duplicates")
        out.append(
            (
                f"Duplicates of one key ({duplicates} sent at once to "
                f"{contention.get('concurrency')} worker processes)",
                [
                    "variant",
                    "µs to turn a duplicate away",
                    "round trips",
                    "duplicate raises",
                    "max overlap via delay() (bodies run of published)",
                    "max overlap via send_task() (bodies run of published)",
                ],
                rows,
            )
        )
    recovery = results.get("recovery")
    if recovery:
        rows = []
        window = recovery["window"]
        for variant in variants:
            row = recovery["variants"].get(variant)
            if row is None:
                continue

            def cell(fault: dict[str, Any]) -> str:
                if fault["never"]:
                    return f"never within {window:.0f} s"
                return _spread(fault["seconds"], 2) + " s"

            rows.append(
                [
                    label(results, variant),
                    _ttl(variant),
                    cell(row["sigkill"]),
                    cell(row["time-limit"]),
                    cell(row["revoke"]),
                ]
            )
        out.append(
            (
                "Recovery: seconds until the key runs again after its holder dies",
                [
                    "variant",
                    "lock lifetime",
                    "pool process SIGKILLed",
                    f"hard time limit ({recovery['time_limit']:.0f} s)",
                    "revoke(terminate=True)",
                ],
                rows,
            )
        )
    scale = results.get("scale")
    if scale:
        rows = []
        for variant in [*variants, "singletask-acks-late"]:
            row = scale["variants"].get(variant)
            if row is None:
                continue
            rows.append(
                [
                    label(results, variant),
                    _num(row["bytes_per_held_lock"]),
                    _num(row["keys_per_held_lock"], 1),
                    _spread(row["cycles_per_second_while_held"]),
                    _spread(row["cycles_per_second_empty"]),
                    _spread(row["while_held_vs_empty"], 0, 100.0) + " %",
                    _left(row),
                ]
            )
        out.append(
            (
                f"Scale: {scale['holds']:,} locks held at once",
                [
                    "variant",
                    "bytes per held lock",
                    "keys per held lock",
                    "acquire+release /s while held",
                    "same, empty database",
                    "ratio",
                    "left per released lock",
                ],
                rows,
            )
        )
    return out


def summary_lines(results: dict[str, Any]) -> list[str]:
    """The target checks, as sentences."""
    lines = []
    overhead = (results.get("overhead") or {}).get("variants", {})
    if "singletask" in overhead and "PING" in overhead:
        st, ping = overhead["singletask"], overhead["PING"]
        lines.append(
            f"singletask: {st['round_trips']:.2f} round trips per execution (target 2); "
            f"it adds {_spread(st['added_us'])} µs to a plain task, "
            f"{_spread(st['added_vs_two_pings'], 2)} times two bare PINGs "
            f"({_num(2 * ping['us_per_execution']['median'])} µs; target at most 1.10 times)."
        )
        if "plain+2PING" in overhead:
            body = overhead["plain+2PING"]
            lines.append(
                f"Two PINGs sent from a task body add {_spread(body['added_us'])} µs to a plain "
                f"task, {_spread(body['added_vs_two_pings'], 2)} times two bare PINGs; "
                f"singletask adds {_spread(st['added_vs_two_pings_in_a_body'], 2)} times "
                "what they add."
            )
        if "singletask-scripts" in overhead:
            scripts = overhead["singletask-scripts"]
            lines.append(
                "singletask's acquire and release scripts alone, in a loop: "
                f"{_spread(scripts['us_per_execution'])} µs, "
                f"{_spread(scripts['added_vs_two_pings'], 2)} times two bare PINGs."
            )
        if "singletask-memory" in overhead:
            memory = overhead["singletask-memory"]
            lines.append(
                "singletask's bookkeeping in the worker process (its task on the in-memory "
                f"backend): {_spread(memory['added_us'])} µs per execution."
            )
    throughput = (results.get("throughput") or {}).get("variants", {})
    if "singletask" in throughput:
        vs = throughput["singletask"]["vs_plain"]
        lines.append(
            f"singletask worker throughput: {_spread(vs, 0, 100.0)} % of plain (target ≥ 90 %)."
        )
    overlap = ((results.get("contention") or {}).get("overlap") or {}).get("singletask")
    if overlap:
        lines.append(
            "singletask max overlap of one key: "
            f"{overlap['delay']['max_overlap']} via delay(), "
            f"{overlap['send_task']['max_overlap']} via send_task() (target 1)."
        )
    return lines


def _md_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |"]
    lines.append("|" + "|".join("---" for _ in header) + "|")
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def environment_lines(results: dict[str, Any]) -> list[str]:
    env = results["environment"]
    load = env["load_before"]
    return [
        f"Run {env['started']} ({'quick' if results['quick'] else 'full'} configuration), "
        f"{env['cpus']} CPUs, {env['memory_gib']:.0f} GiB; load average when it started "
        f"{load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1 / 5 / 15 min), when it ended "
        f"{env['load_after'][0]:.2f}.",
        f"Python {env['python']}, Celery {env['celery']}, kombu {env['kombu']}, "
        f"redis-py {env['redis_py']}, Redis server {env['redis_server']} on loopback.",
    ]


def markdown(results: dict[str, Any]) -> str:
    parts = ["# singletask benchmark results", ""]
    parts += [f"- {line}" for line in environment_lines(results)]
    parts += [f"- {line}" for line in summary_lines(results)]
    parts.append("")
    for title, header, rows in tables(results):
        parts.append(_md_table(title, header, rows))
    parts.append(
        f"Cells show the median over rounds, with the interquartile range (p25{DASH}p75) in "
        f"parentheses, or the full range (min{DASH}max) when there are fewer than four rounds."
    )
    return "\n".join(parts) + "\n"
