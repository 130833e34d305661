"""What the submitting terminal shows: status lines, one line per epoch, and where the run went."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console

from rayapp.spec import JobSpec

if TYPE_CHECKING:
    from rayapp.driver.submit import SubmitResult


class EpochPrinter:
    def __init__(self, spec: JobSpec, console: Console | None = None) -> None:
        self._spec = spec
        self._console = console or Console(highlight=False)

    def on_status(self, message: str) -> None:
        self._console.print(f"[dim]rayapp:[/dim] {message}")

    def on_epoch(self, metrics: dict) -> None:
        if "message" in metrics:  # a warning from rank 0, e.g. MLflow unreachable
            self._console.print(f"[yellow]rayapp: warning:[/yellow] {metrics['message']}")
            return
        epochs = self._spec.train.epochs
        line = (
            f"epoch {metrics['epoch'] + 1:>{len(str(epochs))}}/{epochs}  "
            f"loss {metrics['loss']:.5f}  "
            f"time {metrics['epoch_time_s']:.2f}s  "
            f"{metrics['samples_per_s']:,.0f} samples/s"
        )
        comm = metrics["comm_time_s"]
        line += "  comm -" if comm != comm else f"  comm {comm:.2f}s"  # NaN: not measured (FSDP)
        if "test_accuracy" in metrics:
            line += f"  test acc {metrics['test_accuracy']:.3f}"
        self._console.print(line)

    def done(self, result: "SubmitResult") -> None:
        self._console.print(
            f"[green]done[/green] in {result.wall_time_s:.1f}s  "
            f"MLflow run [bold]{result.run_id}[/bold] (experiment {result.experiment!r})"
        )
        self._console.print(f"  store: {result.tracking_uri}")
        self._console.print(f"  view:  rayapp ui --tracking-uri '{result.tracking_uri}'   or   rayapp runs --experiment '{result.experiment}'")
