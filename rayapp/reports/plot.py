"""The scaling plot: measured vs ideal throughput, and efficiency, against world size."""

from __future__ import annotations

from pathlib import Path

from rayapp.reports.compare import RunSummary


def scaling_plot(summaries: list[RunSummary], path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    path = Path(path)
    figure, (throughput_axis, efficiency_axis) = plt.subplots(1, 2, figsize=(11, 4.2))
    groups: dict[tuple, list[RunSummary]] = {}
    for summary in summaries:
        groups.setdefault(summary.group, []).append(summary)
    for group, runs in groups.items():
        runs = sorted(runs, key=lambda s: s.world_size)
        label = f"{group[0]} ({group[1]}, {group[2]}, {group[3]})"
        workers = [s.world_size for s in runs]
        base = runs[0]
        ideal = [base.samples_per_s * w / base.world_size for w in workers]
        (line,) = throughput_axis.plot(workers, [s.samples_per_s for s in runs], "o-", label=f"{label} measured")
        throughput_axis.plot(workers, ideal, "--", color=line.get_color(), alpha=0.6, label=f"{label} ideal")
        efficiency_axis.plot(workers, [100 * s.efficiency for s in runs], "o-", color=line.get_color(), label=label)
    throughput_axis.set(title="Throughput", xlabel="workers (world size)", ylabel="samples / s")
    efficiency_axis.set(title="Scaling efficiency", xlabel="workers (world size)", ylabel="% of ideal", ylim=(0, 110))
    efficiency_axis.axhline(100, color="grey", linewidth=0.8, linestyle=":")
    all_workers = sorted({s.world_size for s in summaries})
    for axis in (throughput_axis, efficiency_axis):
        axis.set_xticks(all_workers)
        axis.grid(alpha=0.3)
    throughput_axis.legend(fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
