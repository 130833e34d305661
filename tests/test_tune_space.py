"""`rayapp tune`'s search spaces and sweep options: read, checked against the job spec, and refused
in one line with exit 2 before anything starts. No Ray cluster."""

from __future__ import annotations

import math

import pytest
from click.testing import CliRunner
from conftest import JOBS

from rayapp.cli.app import main
from rayapp.driver.tune import TuneOptions, check_options
from rayapp.driver.tune_space import (
    ACCEPTED,
    check_params,
    param_space,
    parse_param,
    parse_params,
    trial_overrides,
)
from rayapp.spec import SpecError
from rayapp.spec.loader import build_spec, load_spec, spec_document

DIGITS = JOBS / "digits_mlp.yaml"


@pytest.mark.parametrize(
    ("text", "field", "kind", "values"),
    [
        ("train.lr=loguniform(1e-4,1e-1)", "train.lr", "loguniform", (1e-4, 1e-1)),
        ("train.lr=uniform(0.001, 0.01)", "train.lr", "uniform", (0.001, 0.01)),
        ("train.seed=randint(0,10)", "train.seed", "randint", (0, 10)),
        ("model.args.hidden=choice(32,64,128)", "model.args.hidden", "choice", (32, 64, 128)),
        ("train.strategy=grid(ddp,fsdp)", "train.strategy", "grid", ("ddp", "fsdp")),
        ("model.hidden=choice([64],[128, 128])", "model.hidden", "choice", ([64], [128, 128])),
        ("train.compile=choice(true,false)", "train.compile", "choice", (True, False)),
    ],
)
def test_spaces_are_read_as_the_values_they_spell(text, field, kind, values):
    param = parse_param(text)
    assert (param.field, param.kind, param.values) == (field, kind, values)


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("train.lr=normal(0,1)", "'normal(0,1)' is not a space"),
        ("train.lr=loguniform(0,1)", "loguniform's low 0 must be above 0"),
        ("train.lr=uniform(0.1,0.01)", "low 0.1 is not below high 0.01"),
        ("train.lr=uniform(0.1)", "takes two bounds (low, high), got 1"),
        ("train.seed=randint(0,2.5)", "bound 2.5 is not a number; randint takes whole numbers"),
        ("train.lr=uniform(a,b)", "bound 'a' is not a number"),
        ("train.lr=choice()", "choice() lists no values"),
        ("train.lr=choice(0.1,0.1)", "choice() repeats a value"),
        ("train.lr=choice([1,2)", "cannot be read"),
        ("lr=choice(0.1)", "expected FIELD=SPACE"),
        ("train.lr", "expected FIELD=SPACE"),
    ],
)
def test_a_bad_space_is_one_line_naming_it_and_what_is_accepted(text, named):
    with pytest.raises(SpecError) as caught:
        parse_param(text)
    message = str(caught.value)
    assert named in message
    assert ACCEPTED in message
    assert "\n" not in message


def test_a_field_given_twice_is_refused():
    with pytest.raises(SpecError, match="train.lr: given twice"):
        parse_params(["train.lr=choice(0.1)", "train.lr=uniform(0.1,0.2)"])


def _digits_builder():
    document = spec_document(load_spec(DIGITS))
    return lambda values: build_spec(document, values)


def test_values_the_job_cannot_take_are_refused_by_the_spec_before_anything_starts():
    build = _digits_builder()
    check_params(parse_params(["train.lr=loguniform(1e-4,1e-1)"]), build)  # a good space passes
    cases = {
        "train.lr=uniform(-1,1)": "train.lr: -1",  # the range's low end
        "train.strategy=choice(ddp,zero)": "train.strategy: 'zero'",  # one listed value
        "train.lrr=choice(0.1)": "train.lrr: unknown key",  # not a field at all
        "train.epochs=randint(0,3)": "train.epochs: 0",
    }
    for text, named in cases.items():
        with pytest.raises(SpecError) as caught:
            check_params(parse_params([text]), build)
        assert named in str(caught.value), (text, str(caught.value))
        assert str(caught.value).startswith(f"--param {text.split('=')[0]}=")


def test_spaces_become_tune_domains_and_trial_values_plain_overrides():
    from ray import tune

    params = parse_params(
        ["train.lr=loguniform(1e-4,1e-1)", "train.seed=randint(0,3)", "train.strategy=grid(ddp)"]
    )
    space = param_space(params)
    lr = space["train.lr"].sample()
    assert 1e-4 <= lr <= 1e-1
    assert {space["train.seed"].sample() for _ in range(50)} <= {0, 1, 2}
    assert space["train.strategy"] == tune.grid_search(["ddp"])
    import numpy as np

    overrides = trial_overrides({"train.lr": np.float64(0.01), "other": 1}, ["train.lr"])
    assert overrides == {"train.lr": 0.01} and type(overrides["train.lr"]) is float
    spec = build_spec(spec_document(load_spec(DIGITS)), overrides)
    assert math.isclose(spec.train.lr, 0.01)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"samples": 0}, "--samples: 0 is not accepted"),
        ({"concurrent": 0}, "--concurrent: 0 is not accepted"),
        ({"nodes_per_trial": 0}, "--nodes-per-trial: 0 is not accepted"),
        ({"mode": "best"}, "--mode: 'best' is not accepted; use max or min"),
        ({"scheduler": "pbt"}, "--scheduler: 'pbt' is not accepted; use fifo or asha"),
        ({"address": "http://127.0.0.1:8265"}, "is a Ray Jobs API address"),
    ],
)
def test_bad_sweep_options_are_named(changes, named):
    address = changes.pop("address", None)
    options = TuneOptions(**{"metric": "test_accuracy", **changes})
    spec = load_spec(DIGITS, {"cluster.address": address})
    with pytest.raises(SpecError, match=named):
        check_options(spec, parse_params(["train.lr=choice(0.1)"]), options)


def test_asha_needs_an_epoch_to_stop_after():
    spec = load_spec(DIGITS, {"train.epochs": 1})
    options = TuneOptions(metric="test_accuracy", scheduler="asha")
    with pytest.raises(SpecError, match="train.epochs is 1; ASHA stops trials between epochs"):
        check_options(spec, parse_params(["train.lr=choice(0.1)"]), options)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--param", "train.lr=loguniform(-1,1)"], "loguniform's low -1 must be above 0"),
        (["--param", "train.lr=choice(0.1,-2)"], "train.lr: -2 is not accepted"),
        ([], "--param: give at least one"),
        (["--param", "train.lr=choice(0.1)", "--epochs", "0"], "train.epochs: 0"),
    ],
)
def test_the_command_refuses_bad_input_in_one_line_with_exit_2(args, named):
    result = CliRunner().invoke(
        main,
        ["tune", str(DIGITS), "--metric", "test_accuracy", "--mode", "max", *args],
    )
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rayapp: error: ")
    assert named in lines[0]
