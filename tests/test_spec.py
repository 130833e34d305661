"""Job spec validation and the YAML loader: no Ray, no MLflow."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import JOBS

from rayapp.spec import JobSpec, SpecError
from rayapp.spec.loader import build_spec, load_spec, parse_job_yaml


@pytest.mark.parametrize("job", sorted(p.name for p in JOBS.glob("*.yaml")))
def test_shipped_jobs_load(job):
    spec = load_spec(JOBS / job, {"cluster.nodes": 2})
    assert spec.world_size == 2
    assert spec.steps_per_epoch >= 1


def test_seed_linear_is_the_articles_loop():
    spec = load_spec(JOBS / "seed_linear.yaml")
    assert (spec.model.kind, spec.data.input_size, spec.data.output_size) == ("linear", 10, 10)
    assert (spec.train.optimizer, spec.train.lr, spec.train.epochs) == ("sgd", 0.001, 10)
    assert (spec.batch_size_per_worker, spec.steps_per_epoch, spec.train.scaling) == (
        64,
        100,
        "weak",
    )


def test_precedence_defaults_then_yaml_then_flags():
    document = {"train": {"epochs": 7, "lr": 0.5}}
    spec = build_spec(document, {"train.epochs": 3, "train.lr": None})
    assert spec.train.epochs == 3  # flag beats YAML
    assert spec.train.lr == 0.5  # YAML beats default; a None flag is "not given"
    assert spec.train.seed == 0  # default


def test_spec_is_frozen():
    spec = build_spec({}, {})
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.train.epochs = 5


def test_weak_scaling_grows_data_with_world_size():
    one = build_spec({}, {"cluster.nodes": 1})
    two = build_spec({}, {"cluster.nodes": 2})
    assert two.num_train_samples == 2 * one.num_train_samples
    assert two.steps_per_epoch == one.steps_per_epoch


def test_strong_scaling_splits_a_fixed_global_batch():
    document = {
        "train": {"scaling": "strong", "global_batch_size": 256},
        "data": {"num_samples": 4096},
    }
    one = build_spec(document, {"cluster.nodes": 1})
    two = build_spec(document, {"cluster.nodes": 2})
    assert (one.batch_size_per_worker, two.batch_size_per_worker) == (256, 128)
    assert one.global_batch_size == two.global_batch_size == 256
    assert one.steps_per_epoch == two.steps_per_epoch == 16


def test_yaml_exponent_without_dot_is_a_number():
    spec = build_spec(parse_job_yaml("train:\n  lr: 1e-3\n"), {})
    assert spec.train.lr == pytest.approx(0.001)


BAD = [
    ({"cluster.nodes": 0}, "cluster.nodes: 0"),
    ({"cluster.nodes": -2}, "cluster.nodes: -2"),
    ({"cluster.workers_per_node": 0}, "cluster.workers_per_node: 0"),
    (
        {"cluster.backend": "tcp"},
        "cluster.backend: 'tcp' is not accepted; use one of: auto, nccl, gloo, mpi",
    ),
    (
        {"train.strategy": "zero3"},
        "train.strategy: 'zero3' is not accepted; use one of: ddp, fsdp, hsdp, tp, fsdp+tp, dp, mp",
    ),
    ({"train.scaling": "linear"}, "train.scaling: 'linear'"),
    ({"train.epochs": 0}, "train.epochs: 0"),
    ({"train.lr": -0.1}, "train.lr: -0.1"),
    ({"train.batch_size": 0}, "train.batch_size: 0"),
    ({"train.seed": -1}, "train.seed: -1"),
    ({"tracking.experiment": " "}, "tracking.experiment"),
]


@pytest.mark.parametrize("overrides,message", BAD)
def test_bad_values_name_the_value_and_what_is_accepted(overrides, message):
    with pytest.raises(SpecError) as caught:
        build_spec({}, overrides)
    text = str(caught.value)
    assert message in text
    assert "\n" not in text


@pytest.mark.parametrize(
    "text,message",
    [
        ("train:\n  epochs: [1\n", "not valid YAML at line"),
        ("- a\n- b\n", "must be a mapping"),
        ("trian:\n  epochs: 2\n", "'trian': unknown top-level key"),
        ("train:\n  epoch: 2\n", "train.epoch: unknown key; accepted keys are epochs"),
        ("train: 5\n", "train: 5 is not accepted"),
        ("model:\n  kind: mlp\n", "model.hidden: [] is not accepted"),
        (
            "model:\n  kind: linear\n  hidden: [3]\n",
            "model.hidden: [3] is not accepted for kind linear",
        ),
        ("data:\n  kind: digits\n", "'weak' is not accepted with data.kind digits"),
        ("train:\n  scaling: strong\n", "train.global_batch_size: missing"),
        ("train:\n  epochs: ten\n", "train.epochs: 'ten'"),
    ],
)
def test_bad_yaml_gives_one_line(text, message):
    with pytest.raises(SpecError) as caught:
        build_spec(parse_job_yaml(text), {})
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_strong_scaling_global_batch_must_divide_world():
    document = {"train": {"scaling": "strong", "global_batch_size": 100}}
    with pytest.raises(
        SpecError,
        match=(
            r"global_batch_size: 100 is not divisible by world_size 3 "
            r"\(nodes 3 \* workers_per_node 1\)"
        ),
    ):
        build_spec(document, {"cluster.nodes": 3})


def test_batch_size_under_strong_scaling_points_to_global_batch():
    document = {"train": {"scaling": "strong", "global_batch_size": 64}}
    with pytest.raises(SpecError, match="--global-batch-size"):
        build_spec(document, {"train.batch_size": 32})


def test_missing_job_file(tmp_path):
    with pytest.raises(SpecError, match="does not exist"):
        load_spec(tmp_path / "nope.yaml")


def test_job_name_defaults_to_file_stem(tmp_path):
    path = tmp_path / "my_job.yaml"
    path.write_text("train:\n  epochs: 2\n")
    assert load_spec(path).name == "my_job"
    assert isinstance(load_spec(path), JobSpec)


@pytest.mark.parametrize("strategy", ["dp", "mp"])
def test_single_process_strategies_need_one_worker(strategy):
    document = {"model": {"kind": "mlp", "hidden": [8]}}
    with pytest.raises(
        SpecError,
        match=rf"'{strategy}' runs one process on one node, not nodes 2 \* workers_per_node 1",
    ):
        build_spec(document, {"train.strategy": strategy, "cluster.nodes": 2})
    assert build_spec(document, {"train.strategy": strategy}).world_size == 1


def test_mp_needs_layers_to_split():
    with pytest.raises(SpecError, match="'mp' splits the model's layers"):
        build_spec({}, {"train.strategy": "mp"})


@pytest.mark.parametrize("nodes", ["1:2", " 1:2 "])
def test_nodes_range_is_elastic(nodes):
    spec = build_spec({}, {"cluster.nodes": nodes})
    assert (spec.cluster.min_nodes, spec.cluster.nodes, spec.cluster.elastic) == (1, 2, True)
    assert spec.cluster.nodes_label == "1:2"
    assert (spec.cluster.min_world_size, spec.cluster.world_size) == (1, 2)
    assert (
        spec.cluster.failures_allowed == 1
    )  # a lost node is a restart onto fewer, not the run's end


def test_unquoted_range_in_yaml_is_elastic_not_a_base_60_number():
    # YAML 1.1 reads 1:2 as sexagesimal 62; rayapp's loader reads it as the text it looks like
    spec = build_spec(parse_job_yaml("cluster:\n  nodes: 1:2\n"), {})
    assert (spec.cluster.min_nodes, spec.cluster.nodes) == (1, 2)


def test_min_nodes_key_and_equal_bounds():
    assert (
        build_spec(parse_job_yaml("cluster:\n  nodes: 4\n  min_nodes: 2\n"), {}).cluster.nodes_label
        == "2:4"
    )
    fixed = build_spec({}, {"cluster.nodes": "2:2"}).cluster
    assert (fixed.elastic, fixed.nodes, fixed.failures_allowed) == (False, 2, 0)


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"cluster.nodes": "2:1"}, "cluster.min_nodes: 2 is more than cluster.nodes 1"),
        ({"cluster.nodes": "0:2"}, "cluster.min_nodes: 0"),
        (
            {"cluster.nodes": "1:"},
            "cluster.nodes: '1:' is not accepted; use a whole number >= 1, or MIN:MAX",
        ),
        ({"cluster.nodes": "a:b"}, "cluster.nodes: 'a:b' is not accepted"),
        (
            {"cluster.nodes": "1:2", "cluster.min_nodes": 1},
            "gives a minimum and so does cluster.min_nodes",
        ),
        (
            {"cluster.nodes": "1:2", "cluster.resize_interval_s": 0},
            "cluster.resize_interval_s: 0 is not accepted",
        ),
        (
            {"cluster.nodes": "1:2", "train.strategy": "pp"},
            "(elastic) is not accepted with strategy pp",
        ),
    ],
)
def test_bad_node_ranges_are_one_line(overrides, message):
    with pytest.raises(SpecError) as caught:
        build_spec({}, overrides)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_an_elastic_strong_run_keeps_its_global_batch_at_every_size():
    spec = build_spec(
        {"train": {"scaling": "strong", "global_batch_size": 64}}, {"cluster.nodes": "1:2"}
    )
    assert (spec.batch_size_at(2), spec.batch_size_at(1)) == (32, 64)
    weak = build_spec({}, {"cluster.nodes": "1:2"})
    assert weak.batch_size_at(1) == weak.batch_size_at(2) == weak.train.batch_size
    with pytest.raises(SpecError) as caught:
        build_spec(
            {"train": {"scaling": "strong", "global_batch_size": 64}}, {"cluster.nodes": "1:4"}
        )
    assert "64 is not divisible by every world size an elastic run may train at (1 to 4)" in str(
        caught.value
    )
    assert "e.g. 60" in str(caught.value)
