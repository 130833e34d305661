"""Property test of the job YAML loader: any input gives a spec or a one-line SpecError, never
anything else."""

from __future__ import annotations

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rayapp.spec import JobSpec, SpecError
from rayapp.spec.loader import build_spec, parse_job_yaml

SECTION_KEYS = {
    "model": ["kind", "hidden"],
    "data": ["kind", "features", "targets", "steps_per_epoch", "num_samples"],
    "train": [
        "epochs",
        "batch_size",
        "global_batch_size",
        "lr",
        "optimizer",
        "seed",
        "scaling",
        "strategy",
    ],
    "cluster": [
        "nodes",
        "workers_per_node",
        "backend",
        "cpus_per_worker",
        "address",
        "storage_path",
        "max_failures",
    ],
    "tracking": ["experiment", "tracking_uri"],
}

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["ddp", "fsdp", "gloo", "auto", "strong", "weak", "mlp", "linear", "digits"]),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)


@st.composite
def documents(draw):
    """Mostly well-shaped documents with wild values, sometimes unknown keys or wrong shapes."""
    document = {}
    for section, keys in SECTION_KEYS.items():
        if draw(st.booleans()):
            chosen = draw(
                st.lists(st.sampled_from(keys + ["bogus"]), unique=True, max_size=len(keys))
            )
            document[section] = {key: draw(values) for key in chosen}
    if draw(st.integers(0, 9)) == 0:
        document[draw(st.text(max_size=6))] = draw(values)
    if draw(st.booleans()):
        document["name"] = draw(values)
    return document


def check(make_spec) -> None:
    try:
        spec = make_spec()
    except SpecError as exc:
        message = str(exc)
        assert message and "\n" not in message, repr(message)
    else:
        assert isinstance(spec, JobSpec)
        assert spec.steps_per_epoch >= 1


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents())
def test_any_document_gives_spec_or_one_line_error(document):
    check(lambda: build_spec(document, {}))


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_any_text_gives_spec_or_one_line_error(text):
    check(lambda: build_spec(parse_job_yaml(text), {}))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents())
def test_round_trip_through_yaml_text(document):
    try:
        text = yaml.safe_dump(document)
    except yaml.YAMLError:
        return
    check(lambda: build_spec(parse_job_yaml(text), {}))
