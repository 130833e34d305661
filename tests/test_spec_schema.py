"""The job spec's JSON Schema (`rayapp schema`), the flags made from its fields, and a property
test: a job document with one value its field does not accept, an unknown key, or a section that
is not a mapping, always gives a one-line SpecError naming that key, never another exception.
No Ray, no MLflow."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, get_args

import jsonschema
import pytest
from click.testing import CliRunner
from conftest import JOBS, REPO
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rayapp.cli import main
from rayapp.spec import BACKENDS, DATASETS, LOSSES, MODELS, OPTIMIZERS, STRATEGIES, SpecError
from rayapp.spec.catalog import DataKind, LossName, ModelKind, OptimizerName, StrategyName
from rayapp.spec.loader import build_spec, job_schema, load_spec, read_job_yaml, spec_document
from rayapp.spec.messages import field_schema
from rayapp.spec.overrides import BY_FLAG, OVERRIDES

SCHEMA = job_schema()
SHIPPED = sorted([*JOBS.glob("*.yaml"), *(REPO / "examples").glob("*/job*.yaml")])


def section_schema(section: str) -> dict[str, Any]:
    return SCHEMA["$defs"][SCHEMA["properties"][section]["$ref"].rsplit("/", 1)[-1]]


SECTIONS = [key for key, value in SCHEMA["properties"].items() if "$ref" in value]
FIELDS = (
    [
        (f"{section}.{key}", schema)
        for section in SECTIONS
        for key, schema in section_schema(section)["properties"].items()
        if key != "pipeline"
    ]
    + [
        (f"train.pipeline.{key}", schema)
        for key, schema in SCHEMA["$defs"]["PipelineSpec"]["properties"].items()
    ]
    + [("name", SCHEMA["properties"]["name"]), ("description", SCHEMA["properties"]["description"])]
)


def follows_schema(value: Any, schema: dict[str, Any]) -> bool:
    return jsonschema.Draft202012Validator({**schema, "$defs": SCHEMA["$defs"]}).is_valid(value)


def one_line(message: str) -> bool:
    return bool(message) and "\n" not in message


def with_value(document: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of `document` with ``train.pipeline.stages`` (say) set to `value`."""
    head, _, rest = path.partition(".")
    inner = document.get(head)
    return {**document, head: with_value(inner or {}, rest, value) if rest else value}


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["ddp", "pp", "gloo", "strong", "mlp", "digits", "m:f", " ", "1:2", "2:1"]),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)


@st.composite
def bad_field(draw: st.DrawFn) -> tuple[str, Any]:
    """A field and a value its JSON Schema rejects. A number written as text is left out: the
    spec reads it as the number (YAML 1.1 leaves ``1e-3`` as text), where a schema says number."""
    path, schema = draw(st.sampled_from(FIELDS))
    value = draw(values)
    assume(not follows_schema(value, schema))
    assume(not (isinstance(value, str) and "number" in json.dumps(schema)))
    return path, value


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(bad_field(), st.sampled_from(SHIPPED))
def test_a_value_its_field_does_not_accept_is_one_line_naming_the_field(bad, job):
    path, value = bad
    document = with_value(read_job_yaml(job), path, value)
    with pytest.raises(SpecError) as caught:
        build_spec(document)
    message = str(caught.value)
    assert one_line(message) and message.startswith(path), (message, path, value)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(SECTIONS), st.text(min_size=1, max_size=10))
def test_an_unknown_key_is_one_line_naming_it_and_the_accepted_keys(section, key):
    cls_fields = section_schema(section)["properties"]
    assume(key not in cls_fields and key != "async_save")  # async_save: the field behind `async`
    with pytest.raises(SpecError) as caught:
        build_spec({section: {key: 1}})
    message = str(caught.value)
    assert one_line(message)
    shown = key if key.isprintable() and key.strip() == key else repr(key)  # one line
    assert message.startswith(f"{section}.{shown}: unknown key; accepted keys are ")
    assert all(name in message for name in cls_fields)


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(SECTIONS), values.filter(lambda value: value and not isinstance(value, dict))
)
def test_a_section_that_is_no_mapping_is_one_line_naming_it(section, value):
    with pytest.raises(SpecError) as caught:
        build_spec({section: value})
    message = str(caught.value)
    assert one_line(message) and message.startswith(f"{section}: ")
    assert "is not accepted; use a mapping of " in message


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.text(max_size=10), st.integers()), values)
def test_an_unknown_top_level_key_is_one_line_naming_it(key, value):
    assume(key not in SCHEMA["properties"])
    with pytest.raises(SpecError) as caught:
        build_spec({key: value})
    message = str(caught.value)
    assert one_line(message) and message.startswith(f"{key!r}: unknown top-level key")


@pytest.mark.parametrize("job", SHIPPED, ids=lambda path: str(path.relative_to(REPO)))
def test_shipped_jobs_follow_the_schema_and_read_back_as_the_same_spec(job):
    document = read_job_yaml(job)
    assert follows_schema(document, SCHEMA)
    spec = load_spec(job, {"cluster.nodes": 2})
    written = spec_document(spec)
    assert follows_schema(written, SCHEMA)
    assert build_spec(json.loads(json.dumps(written))) == spec


def test_schema_says_what_validation_accepts():
    train = section_schema("train")["properties"]
    assert train["epochs"] == {
        "default": 10,
        "description": "Epochs to train.",
        "minimum": 1,
        "title": "Epochs",
        "type": "integer",
    }
    assert section_schema("cluster")["properties"]["backend"]["enum"] == list(BACKENDS)
    assert section_schema("checkpoint")["properties"]["async"]["type"] == "boolean"
    assert all(schema["additionalProperties"] is False for schema in SCHEMA["$defs"].values())
    assert follows_schema({"cluster": {"nodes": "1:2"}, "train": {"lr": 1e-3}}, SCHEMA)
    assert not follows_schema({"cluster": {"nodes": "two"}}, SCHEMA)
    assert not follows_schema({"train": {"optimizer": "rmsprop"}}, SCHEMA)
    assert follows_schema({"train": {"optimizer": "torch.optim:RMSprop"}}, SCHEMA)


def test_rayapp_schema_prints_it():
    result = CliRunner().invoke(main, ["schema"])
    assert result.exit_code == 0
    assert json.loads(result.output) == SCHEMA


@pytest.mark.parametrize(
    "registry,names",
    [
        (MODELS, ModelKind),
        (DATASETS, DataKind),
        (LOSSES, LossName),
        (OPTIMIZERS, OptimizerName),
        (STRATEGIES, StrategyName),
    ],
)
def test_every_accepted_name_has_a_builder(registry, names):
    assert registry.names() == get_args(names)


def test_flags_take_type_choices_and_help_from_their_field():
    for row in OVERRIDES:
        assert row.help == field_schema(SCHEMA, row.field)["description"]
    assert BY_FLAG["--backend"].choices == BACKENDS
    assert (BY_FLAG["--epochs"].type, BY_FLAG["--lr"].type) == (int, float)
    assert (BY_FLAG["--compile"].type, BY_FLAG["--nodes"].type) == (bool, int)
    assert BY_FLAG["--experiment"].type is str and not BY_FLAG["--experiment"].choices
    help_text = CliRunner().invoke(main, ["submit", "-h"]).output
    assert "--backend [auto|nccl|gloo|mpi]" in help_text
    assert "--nodes N|MIN:MAX" in help_text


@pytest.mark.parametrize(
    "args,message",
    [
        (["--epochs", "ten"], "train.epochs: 'ten' is not accepted; use a whole number >= 1"),
        (["--lr", "fast"], "train.lr: 'fast' is not accepted; use a number > 0"),
        (["--lr", "nan"], "train.lr: nan is not accepted; use a number > 0"),
        (["--nodes", "1:x"], "cluster.nodes: '1:x' is not accepted; use a whole number >= 1, or"),
    ],
)
def test_a_flag_value_of_the_wrong_type_is_the_specs_one_line(args, message):
    result = CliRunner().invoke(main, ["submit", str(JOBS / "seed_linear.yaml"), *args])
    assert result.exit_code == 2
    assert message in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_a_section_rebuilt_with_a_bad_value_names_its_full_key():
    spec = build_spec({}, {})
    with pytest.raises(SpecError, match=r"^cluster\.nodes: 0 is not accepted; use a whole number"):
        dataclasses.replace(spec.cluster, nodes=0)
    pp = build_spec(
        {"model": {"kind": "mlp", "hidden": [8]}}, {"train.strategy": "pp", "cluster.nodes": 2}
    )
    with pytest.raises(SpecError, match=r"^train\.pipeline\.stages: 1 is not accepted"):
        dataclasses.replace(pp.train.pipeline, stages=1)
    with pytest.raises(SpecError, match=r"^train\.pipeline\.stages: 2 .* with world_size 3"):
        dataclasses.replace(pp, cluster=dataclasses.replace(pp.cluster, nodes=3))
    with pytest.raises(
        SpecError, match=r"^checkpoint\.async: true is not accepted with format full"
    ):
        dataclasses.replace(spec.checkpoint, async_save=True, format="full")


def test_overrides_never_change_the_callers_document():
    document = {"train": {"epochs": 3, "pipeline": {"stages": 2}}, "cluster": {"nodes": 2}}
    before = json.dumps(document, sort_keys=True)
    build_spec(document, {"train.epochs": 4, "train.strategy": "ddp"})
    with pytest.raises(SpecError):
        build_spec(document, {"train.pipeline.microbatches": 0})
    assert json.dumps(document, sort_keys=True) == before


def test_numbers_in_yaml_and_flags_are_read_alike():
    spec = build_spec({"train": {"lr": "2e-3", "grad_clip": 1}}, {})
    assert (spec.train.lr, spec.train.grad_clip) == (pytest.approx(0.002), 1.0)
    assert isinstance(spec.train.grad_clip, float) and math.isfinite(spec.train.lr)
    with pytest.raises(SpecError, match=r"^train\.epochs: True is not accepted"):
        build_spec({"train": {"epochs": True}}, {})
    with pytest.raises(
        SpecError, match=r"^checkpoint\.async: 'yes' is not accepted; use true or false"
    ):
        build_spec({"checkpoint": {"async": "yes"}}, {})


def test_the_schema_file_an_editor_reads_is_json(tmp_path: Path):
    path = tmp_path / "rayapp-job.schema.json"
    path.write_text(CliRunner().invoke(main, ["schema"]).output)
    jsonschema.Draft202012Validator.check_schema(json.loads(path.read_text()))
