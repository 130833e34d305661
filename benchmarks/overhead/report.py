"""The comparison as a person reads it: the verdict table, the per-pair table, and the notes below
them."""

from __future__ import annotations

from rich.table import Table

from benchmarks.overhead.common import RAY_PROCESSES, TARGET_LOG_SHARE, TARGET_RATIO, console


def verdict(ok: bool) -> str:
    return coloured("PASS" if ok else "MISS")


def coloured(verdict_text: str) -> str:
    colour = {"PASS": "green", "MISS": "red"}.get(verdict_text.split()[0], "yellow")
    return f"[{colour}]{verdict_text}[/{colour}]"


def report(figures: dict, commands: list[str]) -> None:
    f = figures
    nodes = f"{f['rayapp_nodes']} Ray node" + ("s" if f["rayapp_nodes"] > 1 else "")
    table = Table(
        title=(
            f"rayapp vs torchrun: {f['job']}, {f['world_size']} workers on "
            f"{nodes} (gloo, CPU), {f['epochs']} epochs x {f['steps_per_epoch']} "
            f"steps, steady state = median of epochs 2..{f['epochs']}"
        )
    )
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("target", justify="right")
    table.add_column("result", justify="center")
    pairs = len(f["pairs"])
    over = f" (median of {pairs} pairs)" if pairs > 1 else ""
    table.add_row(
        f"torchrun median epoch s (step loop){over}", f"{f['torchrun_epoch_s']:.4f}", "", ""
    )
    table.add_row(
        f"rayapp median epoch s (epoch_time_s){over}", f"{f['rayapp_epoch_s']:.4f}", "", ""
    )
    ratio_label = "ratio rayapp / torchrun" + (
        " (median of the pairs' ratios)" if pairs > 1 else ""
    )
    table.add_row(
        ratio_label, f"{f['ratio']:.3f}", f"<= {TARGET_RATIO:.2f}", coloured(f["ratio_verdict"])
    )
    interval = f["ratio_interval"]
    if interval is not None:
        table.add_row(
            f"  {interval['coverage']:.1%} interval for that median (order statistics, "
            "any distribution)",
            f"{interval['low']:.3f} .. {interval['high']:.3f}",
            f"<= {TARGET_RATIO:.2f}",
            "",
        )
    elif pairs > 1:
        table.add_row("  interval for that median", "needs 6+ pairs", "", "")
    table.add_row("MLflow log_epoch call s/epoch (median)", f"{f['log_call_s']:.4f}", "", "")
    table.add_row(
        f"MLflow writes per epoch, paced{over}", f"{f['log_writes_per_epoch']:.2f}", "", ""
    )
    table.add_row(f"MLflow write s/epoch, paced{over}", f"{f['log_write_s_per_epoch']:.4f}", "", "")
    table.add_row(
        "log share of rayapp's training loop (writes' wall time)",
        f"{f['log_share']:.2%}",
        f"<= {TARGET_LOG_SHARE:.0%}",
        verdict(f["log_share_pass"]),
    )
    table.add_row(
        "log share of rayapp's training loop (writes' CPU time)",
        f"{f['log_cpu_share']:.2%}",
        "",
        "[dim]info[/dim]",
    )
    table.add_section()
    table.add_row(
        f"torchrun wall s/epoch (epoch end to epoch end){over}",
        f"{f['torchrun_wall_s']:.4f}",
        "",
        "",
    )
    table.add_row(
        f"rayapp wall s/epoch incl. checkpoint+logging{over}", f"{f['rayapp_wall_s']:.4f}", "", ""
    )
    table.add_row(
        "ratio of wall s/epoch rayapp / torchrun"
        + (" (median of the pairs')" if pairs > 1 else ""),
        f"{f['wall_ratio']:.3f}",
        "none",
        "[dim]info[/dim]",
    )
    console.print(table)
    if pairs > 1:
        by_pair = Table(title="pairs (the first of each pair ran first; the order alternates)")
        for column in (
            "pair",
            "first",
            "torchrun epoch s",
            "rayapp epoch s",
            "ratio",
            "Ray's own CPU (cores)",
            "other CPU (cores)",
        ):
            by_pair.add_column(column, justify="left" if column == "first" else "right")
        for number, pair in enumerate(f["pairs"], start=1):
            others = [
                pair[f"cpu_during_{side}"]["other_processes_cores_in_steady_state"]
                for side in ("torchrun", "rayapp")
            ]
            ray_own = pair["cpu_during_rayapp"]["own_cores_in_steady_state"].get(RAY_PROCESSES)
            by_pair.add_row(
                str(number),
                pair["first"],
                f"{pair['torchrun_epoch_s']:.4f}",
                f"{pair['rayapp_epoch_s']:.4f}",
                f"{pair['ratio']:.3f}",
                "-" if ray_own is None else f"{ray_own:.2f}",
                " / ".join("-" if o is None else f"{o:.2f}" for o in others),
            )
        console.print(by_pair)
        console.print("per-epoch, wall and CPU figures below are the last pair's")

    def fmt(values):
        return "  ".join(f"{v:.3f}" for v in values)

    console.print(f"per-epoch s  torchrun step loop: {fmt(f['torchrun_epochs'])}")
    console.print(f"             rayapp epoch_time_s: {fmt(f['rayapp_epochs'])}")
    console.print(f"             rayapp wall (epoch 2 on): {fmt(f['rayapp_walls'])}")
    console.print(
        f"MLflow: rank 0's background sender wrote {f['log_writes_per_epoch']:.2f} times "
        "per epoch, paced so that each write carries every epoch queued since the last; "
        "the log share is the writes' wall time over the training loop's (total_time_s), "
        "read from the run's own mlflow_write_s, median over pairs. One epoch's metrics "
        f"in a write of their own, timed apart {len(f['log_one_epoch_writes'])} times: "
        f"median {f['log_one_epoch_write_s'] * 1e3:.1f} ms (CPU "
        f"{f['log_one_epoch_write_cpu_s'] * 1e3:.1f} ms), "
        f"{f['log_one_epoch_write_s'] / f['rayapp_epoch_s']:.2%} of an epoch, what an "
        f"unpaced sender would cost; log_epoch call median {f['log_call_s'] * 1e3:.2f} ms."
    )
    console.print(
        "rayapp's epoch_time_s stops the clock at the end of the step loop; its per-epoch "
        "checkpoint (full state dict, torch.save, ray.train.report) and MLflow write are "
        "excluded from it and show only in the wall figure: "
        f"{f['rayapp_wall_over_epoch_s']:.3f} s/epoch between the two (median over pairs)."
    )
    threads = ", ".join(
        f"rank {i}: torch {t['torch_threads']} thread(s), OMP_NUM_THREADS={t['OMP_NUM_THREADS']}"
        for i, t in enumerate(f["torchrun_threads"])
    )
    console.print(
        f"threads  torchrun: {threads}; rayapp: Ray sets OMP_NUM_THREADS to the worker's CPUs "
        f"({f['cpus_per_worker']})."
    )
    for name in ("torchrun", "rayapp"):
        cpu = f[f"cpu_during_{name}"]
        kinds = ", ".join(
            f"{kind} {g['cpu_s']:.1f} (nice {'/'.join(map(str, g['nice']))})"
            for kind, g in sorted(cpu["own_cpu_s"].items(), key=lambda item: -item[1]["cpu_s"])
        )
        steady_share = cpu["other_processes_cores_in_steady_state"]
        console.print(
            f"CPU-s  {name} run ({cpu['wall_s']:.0f}s): {kinds}; other processes on the machine "
            f"{cpu['other_processes_cpu_s']:.1f}"
            + (
                f" ({steady_share:.0%} of a core during the steady-state epochs)"
                if steady_share is not None
                else ""
            )
        )
    steady_cores = "; ".join(
        f"{name}: "
        + ", ".join(
            f"{kind} {cores:.2f}"
            for kind, cores in sorted(
                f[f"cpu_during_{name}"]["own_cores_in_steady_state"].items(),
                key=lambda item: -item[1],
            )
        )
        for name in ("torchrun", "rayapp")
    )
    console.print(f"cores  busy during the steady-state epochs, by kind of process: {steady_cores}")
    console.print(
        f"same workload: per-epoch loss differs by at most {f['max_loss_diff']:.2e} between the two"
    )
    console.print("commands:")
    for command in commands:
        console.print(f"  {command}", markup=False)
