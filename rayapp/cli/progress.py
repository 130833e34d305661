"""What the submitting terminal shows: status lines, one line per epoch, and where the run went."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console

from rayapp.reports.tables import wide_console
from rayapp.spec import JobSpec
from rayapp.tracking.run import run_page_url

if TYPE_CHECKING:
    from rayapp.driver.submit import SubmitResult


# Shown in their own words at the front of each epoch line; everything else a loop logs follows.
_TIMINGS = ("epoch_time_s", "samples_per_s", "comm_time_s")
# world_size: an elastic run says its size when it (re)starts; a fixed run's never changes.
_NOT_SHOWN = {
    "epoch",
    "compute_time_s",
    "data_time_s",
    "peak_mem_mb",
    "checkpoint_time_s",
    "world_size",
}
_SHORT_NAMES = {"test_accuracy": "test acc"}


class EpochPrinter:
    def __init__(self, spec: JobSpec, console: Console | None = None) -> None:
        self._spec = spec
        self._console = console or wide_console(highlight=False)

    def on_status(self, message: str) -> None:
        self._console.print(f"[dim]rayapp:[/dim] {message}")

    def on_epoch(self, metrics: dict) -> None:
        if "message" in metrics:  # a warning from rank 0, e.g. MLflow unreachable
            self._console.print(f"[yellow]rayapp: warning:[/yellow] {metrics['message']}")
            return
        if "status" in metrics:  # news from rank 0, e.g. an elastic run's new size
            self.on_status(metrics["status"])
            return
        if "output" in metrics:  # a line rank 0's script printed
            self._console.print(
                metrics["output"],
                markup=False,
                end="" if metrics["output"].endswith("\n") else "\n",
            )
            return
        self._console.print(epoch_line(metrics, self._spec.train.epochs))

    def done(self, result: SubmitResult) -> None:
        self._console.print(
            f"[green]done[/green] in {result.wall_time_s:.1f}s  "
            f"MLflow run [bold]{result.run_id}[/bold] (experiment {result.experiment!r})"
        )
        self._console.print(f"  store: {result.tracking_uri}")
        page = run_page_url(result.tracking_uri, result.run_id)
        if page:
            self._console.print(f"  view:  {page}")
            return
        self._console.print(
            f"  view:  rayapp ui --tracking-uri '{result.tracking_uri}'   or   "
            f"rayapp runs --experiment '{result.experiment}'"
        )


def epoch_line(metrics: dict, epochs: int) -> str:
    """One epoch's line: the loop's loss first, the standard timings, then whatever else the loop
    logged (a custom loop or a script may log no `loss` and no communication time), e.g.
    ``epoch 3/10  loss 0.41  time 1.20s  8,000 samples/s  comm 0.10s  test acc 0.951  val_loss 1.2``
    """
    parts = [f"epoch {metrics['epoch'] + 1:>{len(str(epochs))}}/{epochs}"]
    if "loss" in metrics:
        parts.append(f"loss {metrics['loss']:.5f}")
    if "epoch_time_s" in metrics:
        parts.append(f"time {metrics['epoch_time_s']:.2f}s")
    if metrics.get("samples_per_s"):
        parts.append(f"{metrics['samples_per_s']:,.0f} samples/s")
    comm = metrics.get("comm_time_s")
    if comm is not None and comm == comm:  # NaN: not measured (FSDP, a loop without DDP)
        parts.append(f"comm {comm:.2f}s")
    for key, value in metrics.items():
        if (
            key in _NOT_SHOWN
            or key in _TIMINGS
            or key == "loss"
            or not isinstance(value, (int, float))
        ):
            continue
        parts.append(f"{_SHORT_NAMES.get(key, key)} {_number(value)}")
    return "  ".join(parts)


def _number(value: float) -> str:
    if value != value:
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.4g}" if abs(value) < 1 else f"{value:.3f}".rstrip("0").rstrip(".")
