"""Draw ``results.json`` as one figure, a panel per measurement (``plot.png``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.report.report import DASH, label

#: Font sizes of the plot, in points. The figure is drawn 10 inches wide and shown about 7.5
#: inches wide on the docs' page, so these read like the page's own small print.
PLOT_FONT = {"font.size": 13, "axes.titlesize": 15, "axes.labelsize": 13, "legend.fontsize": 12}


def draw(results: dict[str, Any], path: Path) -> bool:
    """Draw one panel per measurement, one under the other, into ``path``; False when matplotlib
    is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.layout_engine import ConstrainedLayoutEngine
    except ImportError:
        return False
    variants = results["variants"]
    names = {v: label(results, v) for v in variants}

    def bars(ax: Any, items: list[tuple[str, dict[str, Any] | None]], scale: float = 1.0) -> None:
        shown = [(n, s) for n, s in items if s and s.get("median") is not None]
        y = list(range(len(shown)))
        medians = [s["median"] * scale for _, s in shown]
        low = [
            max(0.0, (s["median"] - s["p25" if s["n"] >= 4 else "min"]) * scale) for _, s in shown
        ]
        high = [
            max(0.0, (s["p75" if s["n"] >= 4 else "max"] - s["median"]) * scale) for _, s in shown
        ]
        colors = ["tab:green" if n.startswith("singletask") else "tab:gray" for n, _ in shown]
        ax.barh(y, medians, xerr=[low, high], color=colors, capsize=3)
        ax.set_yticks(y, [n for n, _ in shown])
        ax.invert_yaxis()

    def legend_above(ax: Any, title: str) -> None:
        """The panel's title, and its legend in one row between the title and the bars."""
        ax.set_title(title, pad=30)
        ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=3, frameon=False)

    # Each panel: (number of bars, drawing function); only the measurements that were run.
    panels: list[tuple[int, Any]] = []
    overhead = (results.get("overhead") or {}).get("variants", {})
    if overhead:

        def draw_overhead(ax: Any) -> None:
            bars(
                ax,
                [(names[v], overhead[v]["us_per_execution"]) for v in variants if v in overhead],
            )
            ax.set_xscale("log")
            ax.set_xlabel(f"µs per execution (log scale), median and p25{DASH}p75")
            title = "1. Empty task, in process"
            if "plain" in overhead and "PING" in overhead:
                ref = (
                    overhead["plain"]["us_per_execution"]["median"]
                    + 2 * (overhead["PING"]["us_per_execution"]["median"])
                )
                ax.axvline(ref, color="tab:red", linestyle="--", label="plain + two PINGs")
                legend_above(ax, title)
            else:
                ax.set_title(title)

        panels.append((sum(v in overhead for v in variants), draw_overhead))
    throughput = (results.get("throughput") or {}).get("variants", {})
    if throughput:

        def draw_throughput(ax: Any) -> None:
            shown = [(names[v], throughput[v]["vs_plain"]) for v in variants if v in throughput]
            bars(ax, shown, 100.0)
            ax.axvline(90, color="tab:red", linestyle="--", label="90 % of plain")
            ax.set_xlabel("worker throughput, % of the plain task (same round)")
            legend_above(ax, "2. Distinct keys through a prefork worker")

        panels.append((sum(v in throughput for v in variants), draw_throughput))
    contention = results.get("contention") or {}
    reject = contention.get("reject") or {}
    if reject:

        def draw_reject(ax: Any) -> None:
            bars(
                ax,
                [(names[v], reject[v].get("us_per_duplicate")) for v in variants if v in reject],
            )
            ax.set_xscale("log")
            ax.set_xlabel("µs to turn a duplicate away while the key is held (log scale)")
            ax.set_title("3. Duplicates: cost of a rejection, in process")

        panels.append((sum(v in reject for v in variants), draw_reject))
    overlap = contention.get("overlap") or {}
    if overlap:

        def draw_overlap(ax: Any) -> None:
            shown = [v for v in variants if v in overlap]
            for index, via in enumerate(("delay", "send_task")):
                ax.barh(
                    [i + index * 0.4 for i in range(len(shown))],
                    [overlap[v][via]["max_overlap"] or 0 for v in shown],
                    height=0.4,
                    label=f"sent with {via}()",
                )
            ax.set_yticks([i + 0.2 for i in range(len(shown))], [names[v] for v in shown])
            ax.invert_yaxis()
            ax.axvline(1, color="tab:red", linestyle="--")
            ax.set_xlabel(
                f"most bodies of one key at once ({contention.get('duplicates')} duplicates, "
                f"-c {contention.get('concurrency')})"
            )
            legend_above(ax, "3. Duplicates: observed overlap on a real worker")

        panels.append((sum(v in overlap for v in variants), draw_overlap))
    recovery = (results.get("recovery") or {}).get("variants", {})
    if recovery:

        def draw_recovery(ax: Any) -> None:
            window = results["recovery"]["window"]
            faults = [
                ("sigkill", "SIGKILL"),
                ("time-limit", "hard time limit"),
                ("revoke", "revoke"),
            ]
            shown = [v for v in variants if v in recovery]
            height = 0.8 / len(faults)
            for index, (fault, title) in enumerate(faults):
                values, hatches = [], []
                for v in shown:
                    cell = recovery[v][fault]
                    never = cell["never"] or cell["seconds"]["median"] is None
                    values.append(window if never else max(cell["seconds"]["median"], 0.01))
                    hatches.append("//" if never else "")
                y = [i + index * height for i in range(len(shown))]
                drawn = ax.barh(y, values, height=height, label=title)
                for patch, hatch in zip(drawn, hatches, strict=True):
                    patch.set_hatch(hatch)
            ax.set_yticks([i + height for i in range(len(shown))], [names[v] for v in shown])
            ax.invert_yaxis()
            ax.set_xscale("log")
            ax.set_xlabel(
                "seconds until the key runs again (log scale; under 0.01 s drawn at 0.01)\n"
                f"hatched: not within {window:.0f} s"
            )
            legend_above(ax, "4. Recovery after the holder dies")

        panels.append((int(sum(v in recovery for v in variants) * 1.5), draw_recovery))
    scale = (results.get("scale") or {}).get("variants", {})
    if scale:

        def draw_scale(ax: Any) -> None:
            shown = [v for v in variants if v in scale]
            values = [scale[v]["bytes_per_held_lock"] for v in shown]
            ax.barh(
                range(len(shown)),
                values,
                color=["tab:green" if v.startswith("singletask") else "tab:gray" for v in shown],
            )
            ax.set_yticks(range(len(shown)), [names[v] for v in shown])
            ax.invert_yaxis()
            ax.set_xlabel(f"Redis bytes per held lock ({results['scale']['holds']:,} held)")
            ax.set_title("5. Memory per held lock")

        panels.append((sum(v in scale for v in variants), draw_scale))
    if not panels:
        return False
    # About 0.4 inch per bar and 1.6 inches for a panel's title, axis and label.
    heights = [0.4 * max(count, 1) + 1.6 for count, _ in panels]
    with plt.rc_context(PLOT_FONT):
        fig, axes = plt.subplots(
            len(panels),
            1,
            figsize=(10, sum(heights) + 0.6),
            gridspec_kw={"height_ratios": heights},
            squeeze=False,
            layout=ConstrainedLayoutEngine(h_pad=0.3),
        )
        for (_, draw), row in zip(panels, axes, strict=True):
            draw(row[0])
        fig.suptitle(
            "singletask vs alternatives, one run on one machine "
            f"({results['environment']['cpus']} CPUs; {'quick' if results['quick'] else 'full'})"
        )
        fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
