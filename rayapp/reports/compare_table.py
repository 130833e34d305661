"""The scaling comparison as a table: its columns, their titles and formats, and the table,
markdown, CSV and JSON forms of a list of :class:`RunSummary`."""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import asdict, dataclass
from typing import Any

from rayapp.reports.run_summary import RunSummary


@dataclass(frozen=True)
class Column:
    name: str
    """The RunSummary field (or property) shown, and the CSV header."""
    title: str
    fmt: str
    """How the table writes one value; ``{}`` columns are text, aligned left."""
    unit: float = 1.0
    """The table shows value / unit (bytes as MiB); CSV and JSON keep the value as logged."""


MIB = float(2**20)

COLUMNS = [
    Column("job", "job", "{}"),
    Column("nodes", "nodes", "{}"),
    Column("world_size", "world", "{}"),
    Column("backend", "backend", "{}"),
    Column("strategy", "strategy", "{}"),
    Column("scaling", "scaling", "{}"),
    Column("epoch_time_s", "epoch s", "{:.3f}"),
    Column("ideal_epoch_s", "ideal s", "{:.3f}"),
    Column("article_epoch_s", "article s", "{:.3f}"),
    Column("samples_per_s", "samples/s", "{:,.0f}"),
    Column("speedup", "speedup", "{:.2f}x"),
    Column("efficiency", "efficiency", "{:.0%}"),
    Column("comm_share", "comm share", "{:.0%}"),
    Column("peak_mem_mb", "peak MB", "{:,.0f}"),
    Column("param_bytes_per_rank", "param MB/rank", "{:,.2f}", MIB),
    Column("comm_bytes_per_step", "comm MB/step", "{:,.2f}", MIB),
    Column("tflops_per_s", "TFLOP/s", "{:.3g}"),
    Column("mfu", "MFU", "{:.1%}"),
    Column("goodput", "goodput", "{:.0%}"),
    Column("straggler", "slowest rank", "{}"),
    Column("slow_link", "slowest link", "{}"),
    Column("startup_cluster_s", "cluster up s", "{:.1f}"),
    Column("startup_workers_s", "workers up s", "{:.1f}"),
    Column("time_to_first_step_s", "first step s", "{:.1f}"),
    Column("cpu_percent_by_node", "cpu % per node", "{:.0f}"),
    Column("run_id", "run", "{:.12}"),
]
CSV_ONLY = [
    "run_wall_s",
    "compute_s",
    "comm_s",
    "data_s",
    "other_s",
    "peak_tflops",
    "peak_source",
    "step_time_spread",
    "slowest_rank",
    "slowest_node",
    "link_spread",
    "slowest_link_node",
]
"""The time breakdown's numbers: in CSV and JSON for whoever plots them again; the table has the
plot."""


def _cell(value: Any, fmt: str, unit: float = 1.0) -> str:
    if isinstance(value, dict):  # per node, side by side: "127.0.0.2: 87, 127.0.0.3: 85"
        return ", ".join(f"{node}: {_cell(number, fmt)}" for node, number in value.items()) or "-"
    if isinstance(value, float) and math.isnan(value):
        return "-"
    return fmt.format(value / unit if unit != 1.0 else value)


def _shown(summary: RunSummary, name: str) -> Any:
    """A column's value; sizes as their labels (an elastic run's ``1:2``)."""
    return {"nodes": summary.nodes_label, "world_size": summary.world_label}.get(
        name, getattr(summary, name)
    )


def _csv_value(value: Any) -> Any:
    # One cell per run, as the table writes it but a decimal finer; other values as they are.
    return _cell(value, "{:.1f}") if isinstance(value, dict) else value


def render(summaries: list[RunSummary], fmt: str) -> str:
    """fmt: table (rich), markdown, csv or json."""
    if fmt == "json":
        return json.dumps([asdict(s) for s in summaries], indent=2, default=str)
    if fmt == "csv":
        buffer = io.StringIO()
        names = [column.name for column in COLUMNS] + CSV_ONLY
        writer = csv.DictWriter(buffer, fieldnames=names)
        writer.writeheader()
        for summary in summaries:
            writer.writerow({name: _csv_value(_shown(summary, name)) for name in names})
        return buffer.getvalue()
    rows = [[_cell(_shown(s, c.name), c.fmt, c.unit) for c in COLUMNS] for s in summaries]
    headers = [column.title for column in COLUMNS]
    if fmt == "markdown":
        lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines) + "\n"
    from rich.console import Console
    from rich.table import Table

    caption = CAPTION + (ELASTIC_CAPTION if any(s.elastic for s in summaries) else "")
    table = Table(title="Scaling comparison (medians, first epoch excluded)", caption=caption)
    for column in COLUMNS:
        text = column.fmt == "{}" or column.name in (
            "run_id",
            "cpu_percent_by_node",
            "straggler",
            "slow_link",
        )
        table.add_column(column.title, justify="left" if text else "right")
    for row in rows:
        table.add_row(*row)
    # As wide as the table wants (at least 220): squeezed, rich would cut run ids and wrap the
    # per-node cells; whoever reads it in a narrower terminal can scroll or pick --format markdown.
    natural = Console(width=1000).measure(table).maximum
    console = Console(record=True, width=max(220, natural))
    with console.capture() as capture:
        console.print(table)
    return capture.get()


CAPTION = (
    "ideal: perfect scaling for the run's mode (strong: time / N, weak: flat). "
    "article: the article's expectation, time halving per doubling. "
    "efficiency = throughput_N / (N/N_min x throughput_min). "
    "cluster up s: submission to cluster up; workers up s: cluster up to every worker started; "
    "first step s: submission to the first step done. "
    "cpu % per node: the node's machine over the run, mean (100 = all its cores busy). "
    "MFU: TFLOP/s over the ranks' peak (GPU datasheet, else a measured matmul; see peak_source). "
    "goodput: the share of the run's wall time (submission to end) spent computing; the plot "
    "shows the rest (start-up, comm, data, checkpoints, restarts, other). "
    "slowest rank: its median step time (batch request to gradients ready) over the median "
    "rank's, and its node. "
    "slowest link (3 nodes or more): the node whose link took longest to bring it 1 MiB from its "
    "faster neighbour, timed at each epoch's end, over the median node's. "
    "param MB/rank: the parameters rank 0 holds; comm MB/step: what one step's collectives moved "
    "on rank 0, counted from the collectives (MB = 2^20 bytes; CSV and JSON keep the bytes)."
)
ELASTIC_CAPTION = (
    " nodes MIN:MAX: an elastic run, "
    "compared with none of fixed size (its world size per epoch is in MLflow)."
)
