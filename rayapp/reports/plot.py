"""The scaling plot: measured vs ideal throughput, and efficiency, against world size; below them,
where the time of a steady epoch goes (compute, comm, data, other) for each run, so a run that
does not scale shows why beside how much; and at the bottom, where each run's whole wall time
went (goodput: start-up, compute, comm, data, checkpoints, restarts, other).

Figures are built on matplotlib's Agg canvas directly, not through pyplot: no display is needed,
and no global figure state is left behind in a long-lived process (the bench driver).
"""

from __future__ import annotations

import math
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from rayapp.reports.run_summary import RunSummary

SCALING_TITLES = ("Throughput", "Scaling efficiency")
BREAKDOWN_TITLE = "Where the time goes (median steady epoch)"
PART_STYLES = {  # part of RunSummary.time_parts -> legend label, colour
    "compute": ("compute (fwd + bwd + step, comm taken out)", "#4C72B0"),
    "comm": ("comm (all-reduce)", "#DD8452"),
    "data": ("data (waiting for batches)", "#55A868"),
    "other": ("other (untimed: sync, logging, ...)", "#B0B0B0"),
}
GOODPUT_TITLE = "Where the run's wall time goes (goodput = compute share)"
GOODPUT_STYLES = {  # goodput part (rayapp.tracking.goodput.PARTS) -> legend label, colour
    "goodput_startup_s": ("start-up (cluster, workers, first step)", "#8172B3"),
    "goodput_compute_s": ("compute", "#4C72B0"),
    "goodput_comm_s": ("comm (all-reduce)", "#DD8452"),
    "goodput_data_s": ("data", "#55A868"),
    "goodput_checkpoint_s": ("checkpoint (blocking part)", "#937860"),
    "goodput_restart_lost_s": ("restart (work lost + restart)", "#C44E52"),
    "goodput_other_s": ("other (evaluation, logging, teardown, ...)", "#B0B0B0"),
}


def _new_figure(width: float, height: float) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    figure = Figure(figsize=(width, height), layout="constrained")  # fits the legend below the bars
    FigureCanvasAgg(figure)  # renders PNGs without a display
    return figure


def _groups(summaries: list[RunSummary]) -> dict[tuple[str, ...], list[RunSummary]]:
    groups: dict[tuple[str, ...], list[RunSummary]] = {}
    for summary in summaries:
        groups.setdefault(summary.group, []).append(summary)
    return {group: sorted(runs, key=lambda s: s.world_size) for group, runs in groups.items()}


def _group_label(group: tuple[str, ...]) -> str:
    return f"{group[0]} ({', '.join(part for part in group[1:] if part)})"


def draw_scaling(throughput_axis: Axes, efficiency_axis: Axes, summaries: list[RunSummary]) -> None:
    """Throughput (measured, and the ideal from each group's smallest run) and efficiency by world
    size."""
    for group, runs in _groups(summaries).items():
        label = _group_label(group)
        workers = [s.world_size for s in runs]
        base = runs[0]
        ideal = [base.samples_per_s * w / base.world_size for w in workers]
        (line,) = throughput_axis.plot(
            workers, [s.samples_per_s for s in runs], "o-", label=f"{label} measured"
        )
        throughput_axis.plot(
            workers, ideal, "--", color=line.get_color(), alpha=0.6, label=f"{label} ideal"
        )
        efficiency_axis.plot(
            workers, [100 * s.efficiency for s in runs], "o-", color=line.get_color(), label=label
        )
    throughput_axis.set(
        title=SCALING_TITLES[0], xlabel="workers (world size)", ylabel="samples / s"
    )
    efficiency_axis.set(
        title=SCALING_TITLES[1], xlabel="workers (world size)", ylabel="% of ideal", ylim=(0, 110)
    )
    efficiency_axis.axhline(100, color="grey", linewidth=0.8, linestyle=":")
    all_workers = sorted({s.world_size for s in summaries})
    for axis in (throughput_axis, efficiency_axis):
        axis.set_xticks(all_workers)
        axis.grid(alpha=0.3)
    throughput_axis.legend(fontsize=7)


def draw_time_breakdown(axis: Axes, summaries: list[RunSummary]) -> None:
    """One stacked bar per run, grouped as in the scaling panels, smallest world size first, with
    the ideal epoch time marked: the part that grows with the world size is what stops scaling."""
    groups = _groups(summaries)
    positions, labels, ordered, x = [], [], [], 0.0
    for group, runs in groups.items():
        for summary in runs:
            positions.append(x)
            ordered.append(summary)
            plural = "s" if summary.nodes_label != "1" else ""
            label = f"world {summary.world_label}\n{summary.nodes_label} node{plural}"
            labels.append(label if len(groups) == 1 else f"{group[0]}, {group[2]}\n{label}")
            x += 1.0
        x += 0.5  # a gap between groups, so bars are compared within one
    ideals = [s.ideal_epoch_s for s in ordered if math.isfinite(s.ideal_epoch_s)]
    top = max(
        [s.epoch_time_s for s in ordered]
        + [sum(s.time_parts.values()) for s in ordered]
        + ideals
        + [0.0]
    )
    bottoms = [0.0] * len(ordered)
    for part, (label, colour) in PART_STYLES.items():
        heights = [summary.time_parts[part] for summary in ordered]
        axis.bar(
            positions,
            heights,
            width=0.6,
            bottom=bottoms,
            color=colour,
            label=label,
            edgecolor="white",
        )
        for position, summary, bottom, height in zip(
            positions, ordered, bottoms, heights, strict=True
        ):
            # The share of the epoch, printed only where the segment is tall enough to hold it.
            if top > 0 and height / top >= 0.06 and summary.epoch_time_s > 0:
                axis.text(
                    position,
                    bottom + height / 2,
                    f"{height / summary.epoch_time_s:.0%}",
                    ha="center",
                    va="center",
                    fontsize=7,
                )
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    ideal_label = "ideal epoch time (perfect scaling)"
    for position, summary, height in zip(positions, ordered, bottoms, strict=True):
        if math.isnan(summary.compute_s) and math.isnan(summary.data_s):
            note = "\nsteps not timed"  # a run from before the step timers, or a script's own loop
        else:
            note = (
                "" if math.isfinite(summary.comm_s) else "\ncomm not measured"
            )  # FSDP: inside compute
        # Above the bar and its ideal mark, whichever is higher, so neither hides the figure.
        label_at = max(
            height, summary.ideal_epoch_s if math.isfinite(summary.ideal_epoch_s) else 0.0
        )
        axis.annotate(
            f"{summary.epoch_time_s:.3g} s{note}",
            (position, label_at),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=7,
        )
        if math.isfinite(summary.ideal_epoch_s):
            axis.hlines(
                summary.ideal_epoch_s,
                position - 0.38,
                position + 0.38,
                colors="black",
                linestyles="--",
                linewidth=1.2,
                label=ideal_label,
            )
            ideal_label = "_nolegend_"  # one legend entry for all the marks
    axis.set_xticks(positions, labels, fontsize=8)
    axis.set_ylim(0, top * 1.18 if top > 0 else 1.0)  # room for the labels above the bars
    axis.set(title=BREAKDOWN_TITLE, ylabel="seconds per epoch")
    axis.grid(axis="y", alpha=0.3)
    # Below the bars, not beside them: the panel keeps the full width of the figure.
    axis.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, frameon=False)


def draw_goodput(axis: Axes, summaries: list[RunSummary]) -> None:
    """One stacked bar per run, in the order of the epoch breakdown: its wall time's parts, and
    its goodput above it. A run without them (failed, or from before they were logged) gets an
    empty slot saying so."""
    ordered = [summary for runs in _groups(summaries).values() for summary in runs]
    positions = list(range(len(ordered)))
    bottoms = [0.0] * len(ordered)
    for part, (label, colour) in GOODPUT_STYLES.items():
        # other can be slightly negative (parts measured on different ranks): drawn as nothing
        heights = [max(summary.goodput_parts.get(part, 0.0), 0.0) for summary in ordered]
        axis.bar(positions, heights, width=0.6, bottom=bottoms, color=colour, label=label)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    for position, summary, height in zip(positions, ordered, bottoms, strict=True):
        text = (
            f"{summary.run_wall_s:.3g} s, goodput {summary.goodput:.0%}"
            if summary.goodput_parts and math.isfinite(summary.goodput)
            else "not measured"
        )
        axis.annotate(
            text,
            (position, height),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=7,
        )
    labels = [f"{s.job}\nworld {s.world_label}, {s.run_id[:8]}" for s in ordered]
    axis.set_xticks(positions, labels, fontsize=8)
    axis.set_ylim(0, max(bottoms + [0.0]) * 1.18 or 1.0)
    axis.set(title=GOODPUT_TITLE, ylabel="seconds (submission to end)")
    axis.grid(axis="y", alpha=0.3)
    axis.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=4, frameon=False)


def scaling_figure(summaries: list[RunSummary]) -> Figure:
    """Throughput and efficiency side by side; the time breakdown across the width below them,
    and below that the goodput bars."""
    figure = _new_figure(11, 12.4)
    grid = figure.add_gridspec(3, 2, height_ratios=(1, 1.1, 1.1))
    draw_scaling(figure.add_subplot(grid[0, 0]), figure.add_subplot(grid[0, 1]), summaries)
    draw_time_breakdown(figure.add_subplot(grid[1, :]), summaries)
    draw_goodput(figure.add_subplot(grid[2, :]), summaries)
    return figure


def time_breakdown_figure(summaries: list[RunSummary]) -> Figure:
    """The time breakdown alone, wider as the runs grow in number."""
    figure = _new_figure(max(8.0, 3.5 + 0.9 * len(summaries)), 4.6)
    draw_time_breakdown(figure.add_subplot(), summaries)
    return figure


def _save(figure: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    return path


def scaling_plot(summaries: list[RunSummary], path: str | Path) -> Path:
    """Save :func:`scaling_figure` as a PNG at path (what `compare --plot` and `bench` write)."""
    return _save(scaling_figure(summaries), path)


def time_breakdown_plot(summaries: list[RunSummary], path: str | Path) -> Path:
    """Save :func:`time_breakdown_figure` as a PNG at path (bench's time_breakdown.png)."""
    return _save(time_breakdown_figure(summaries), path)
