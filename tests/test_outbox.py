"""The outbox's paced, batched writes, against a real MLflow SQLite store."""

from __future__ import annotations

import time

import pytest
from conftest import migrated_store
from mlflow.tracking import MlflowClient

from rayapp.tracking.logger import RunLogger
from rayapp.tracking.outbox import (
    MAX_METRICS_PER_WRITE,
    MAX_WRITE_GAP_S,
    Outbox,
    Record,
    leading_write,
)
from rayapp.tracking.run import EPOCH_METRICS, WRITE_COST_METRICS, open_run


@pytest.fixture
def store(tmp_path):
    uri = migrated_store(tmp_path / "mlflow.db")
    return uri, open_run(
        tracking_uri=uri, experiment="outbox", run_name="paced", params={}, tags={}
    )


def epoch_metrics(epoch: int) -> dict[str, float]:
    return {key: float(epoch * 10 + index) for index, key in enumerate(EPOCH_METRICS)}


def test_epochs_queued_during_a_write_gap_arrive_in_one_write_each_at_its_step(store, tmp_path):
    uri, run_id = store
    outbox = Outbox(uri, tmp_path / "fallback.jsonl")
    for epoch in range(20):
        outbox.put(Record("metrics", run_id, step=epoch, values=epoch_metrics(epoch)))
    assert outbox.close() is None
    # The first record may go out alone; the rest waited out the pacing gap together.
    assert outbox.stats.records == 20
    assert outbox.stats.writes <= 3
    client = MlflowClient(uri)
    for index, key in enumerate(EPOCH_METRICS):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert history == [(epoch, float(epoch * 10 + index)) for epoch in range(20)]
    # MLflow's latest value (what its run table shows) is the last epoch's, not the batch's first.
    assert client.get_run(run_id).data.metrics["loss"] == epoch_metrics(19)["loss"]


def test_write_budget_sets_how_often_the_sender_writes(store, tmp_path):
    uri, run_id = store
    writes = {}
    for budget in (1.0, 0.005):  # 1.0: write whenever something is queued; 0.005: Outbox's default
        outbox = Outbox(uri, tmp_path / f"fallback-{budget}.jsonl", write_budget=budget)
        for epoch in range(30):
            outbox.put(
                Record("metrics", run_id, step=epoch, values={f"paced_{budget}": float(epoch)})
            )
            time.sleep(0.05)
        assert outbox.close() is None
        writes[budget] = outbox.stats.writes
        assert outbox.stats.records == 30
        assert outbox.stats.wall_s > 0 and outbox.stats.cpu_s > 0
    # 1.5 s of epochs: unpaced, nearly one write each; paced, each write after the first is
    # followed by a gap 200 times as long as it took, so a few writes and the flush at close.
    assert writes[1.0] >= 10
    assert writes[0.005] * 3 <= writes[1.0], writes


def test_close_does_not_wait_out_the_pacing_gap(store, tmp_path):
    uri, run_id = store
    outbox = Outbox(uri, tmp_path / "fallback.jsonl", write_budget=1e-6)  # gap: MAX_WRITE_GAP_S
    deadline = time.monotonic() + 30
    for step in range(2):  # the first write sets no gap (it also opens the store); the second does
        outbox.put(Record("metrics", run_id, step=step, values={"loss": 1.0 / (step + 1)}))
        while outbox.stats.writes == step and time.monotonic() < deadline:
            time.sleep(0.01)
    outbox.put(Record("metrics", run_id, step=2, values={"loss": 0.25}))
    started = time.monotonic()
    assert outbox.close() is None
    assert time.monotonic() - started < MAX_WRITE_GAP_S / 2
    assert sorted(m.step for m in MlflowClient(uri).get_metric_history(run_id, "loss")) == [0, 1, 2]


def test_run_logger_logs_what_its_writes_cost_in_its_last_write(store, tmp_path):
    uri, run_id = store
    logger = RunLogger(uri, run_id, fallback_path=str(tmp_path / "fallback.jsonl"))
    for epoch in range(3):
        logger.log_epoch(epoch, epoch_metrics(epoch))
    assert logger.close(write_cost_step=2) is None
    client = MlflowClient(uri)
    logged = client.get_run(run_id).data.metrics
    assert set(WRITE_COST_METRICS) <= set(logged)
    assert [m.step for m in client.get_metric_history(run_id, "mlflow_writes")] == [2]
    # Three epochs queued at once go out in one to three writes, depending on when the sender woke;
    # the write that carries the cost is not counted in it.
    assert 1 <= logged["mlflow_writes"] <= 3
    assert 0 < logged["mlflow_write_cpu_s"] and 0 < logged["mlflow_write_s"] < 30


def test_leading_write_takes_consecutive_metrics_of_one_run_within_mlflows_limit():
    def metrics(run: str, n: int = 7) -> Record:
        return Record("metrics", run, values={f"m{i}": 1.0 for i in range(n)})

    tags = Record("tags", "a", values={"k": "v"})
    assert leading_write([metrics("a"), metrics("a"), tags, metrics("a")]) == 2
    assert leading_write([metrics("a"), metrics("b"), metrics("a")]) == 1
    assert leading_write([tags, metrics("a")]) == 1
    assert leading_write([metrics("a", 600), metrics("a", 400), metrics("a", 1)]) == 2
    assert leading_write([metrics("a", 600), metrics("a", 401)]) == 1
    assert leading_write([metrics("a", MAX_METRICS_PER_WRITE + 5)]) == 1  # never stuck
