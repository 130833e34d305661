"""Scaling comparison of MLflow runs: which runs to compare, and each one's speedup, efficiency and
ideal times against its group's baseline.

Runs are grouped by what makes them comparable (job, scaling, strategy, backend); within a
group, the run with the smallest world size is the baseline. Each run's own figures come from
:mod:`rayapp.reports.run_summary`; :mod:`rayapp.reports.compare_table` renders them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace

from rayapp.errors import RayappError
from rayapp.reports.run_summary import RunSummary, summarize_run


def with_scaling(summaries: Iterable[RunSummary]) -> list[RunSummary]:
    """Fill speedup, efficiency and ideal times against each group's smallest run."""
    summaries = list(summaries)
    baselines: dict[tuple[str, str, str, str, str], RunSummary] = {}
    for summary in sorted(summaries, key=lambda s: (s.world_size, s.epoch_time_s)):
        baselines.setdefault(summary.group, summary)
    result = []
    for summary in summaries:
        base = baselines[summary.group]
        if summary.elastic:  # no fixed size to scale from: the figures stand alone
            result.append(replace(summary, speedup=math.nan, efficiency=math.nan))
            continue
        workers_ratio = summary.world_size / base.world_size
        speedup = summary.samples_per_s / base.samples_per_s
        article = base.epoch_time_s / workers_ratio
        ideal = article if summary.scaling == "strong" else base.epoch_time_s
        result.append(
            replace(
                summary,
                speedup=speedup,
                efficiency=speedup / workers_ratio,
                ideal_epoch_s=ideal,
                article_epoch_s=article,
            )
        )
    return sorted(result, key=lambda s: (s.group, s.world_size))


def load_summaries(
    tracking_uri: str,
    *,
    experiment: str | None = None,
    run_ids: Iterable[str] = (),
    parent_run_id: str | None = None,
) -> list[RunSummary]:
    """Runs named by id, or the finished rayapp runs of an experiment (children of parent_run_id if
    given)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    run_ids = list(run_ids)
    if run_ids:
        runs = []
        for run_id in run_ids:
            try:
                runs.append(client.get_run(run_id))
            except MlflowException:
                raise RayappError(f"run {run_id!r} does not exist in {tracking_uri}") from None
    else:
        found = client.get_experiment_by_name(experiment or "rayapp")
        if found is None:
            raise RayappError(f"experiment {experiment!r} does not exist in {tracking_uri}")
        query = "attributes.status = 'FINISHED' and params.world_size != ''"
        if parent_run_id:
            query += f" and tags.mlflow.parentRunId = '{parent_run_id}'"
        runs = client.search_runs([found.experiment_id], filter_string=query, max_results=1000)
        if not runs:
            raise RayappError(f"experiment {experiment!r} has no finished rayapp runs to compare")
    return with_scaling(summarize_run(client, run) for run in runs)
