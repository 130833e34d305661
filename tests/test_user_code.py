"""Users' own code named by a job (factories, loss, optimizer, loop, script): every bad input is
caught on the driver before any cluster starts, as one line with exit code 2. No Ray here."""

from __future__ import annotations

import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from rayapp.cli import main
from rayapp.launch import working_dir


@pytest.fixture
def code(tmp_path, monkeypatch):
    """A job directory with uniquely named modules, not on this process's sys.path."""
    suffix = uuid.uuid4().hex[:8]
    names = {"models": f"models_{suffix}", "data": f"data_{suffix}"}
    (tmp_path / f"{names['models']}.py").write_text(
        textwrap.dedent("""
        from torch import nn

        def build(hidden=8):
            return nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 3))

        def broken(hidden=8):
            raise ValueError("hidden must be even")

        def not_a_model():
            return {"weights": [1, 2]}
    """)
    )
    (tmp_path / f"{names['data']}.py").write_text(
        textwrap.dedent("""
        import torch
        from torch.utils.data import TensorDataset

        def load(n=64):
            return TensorDataset(torch.randn(n, 4), torch.randint(0, 3, (n,)))

        def numbers():
            return 42
    """)
    )
    monkeypatch.setattr(
        sys, "path", list(sys.path)
    )  # what the check inserts is undone after the test
    assert str(tmp_path) not in sys.path
    return tmp_path, names


def submit(directory: Path, job: str, *flags: str):
    path = directory / "job.yaml"
    path.write_text(textwrap.dedent(job))
    return CliRunner().invoke(main, ["submit", str(path), *flags])


def assert_bad_input(result, *fragments: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    for fragment in fragments:
        assert fragment in result.output, result.output


def test_factory_name_that_is_not_defined_lists_what_is(code):
    directory, names = code
    result = submit(
        directory,
        f"""
        model: {{factory: "{names["models"]}:bild"}}
        data: {{factory: "{names["data"]}:load"}}
        train: {{loss: cross_entropy}}
    """,
    )
    assert_bad_input(
        result,
        f"model.factory: '{names['models']}:bild' not found in {names['models']}",
        "(defines: broken, build, not_a_model)",
    )


def test_module_that_does_not_exist(code):
    directory, _ = code
    result = submit(
        directory,
        """
        model: {factory: "nosuchmodule_xyz:build"}
    """,
    )
    assert_bad_input(result, "no module named 'nosuchmodule_xyz'", str(directory))


def test_factory_that_raises_names_the_error(code):
    directory, names = code
    result = submit(
        directory,
        f"""
        model: {{factory: "{names["models"]}:broken", args: {{hidden: 3}}}}
    """,
    )
    assert_bad_input(result, f"{names['models']}:broken", "raised ValueError: hidden must be even")


def test_factory_returning_the_wrong_type_names_the_type_expected(code):
    directory, names = code
    result = submit(
        directory,
        f"""
        model: {{factory: "{names["models"]}:not_a_model"}}
    """,
    )
    assert_bad_input(result, "returned dict; expected a torch.nn.Module")
    result = submit(
        directory,
        f"""
        data: {{factory: "{names["data"]}:numbers"}}
        train: {{loss: mse}}
    """,
    )
    assert_bad_input(result, "returned int; expected a map-style torch.utils.data.Dataset")


def test_args_that_the_factory_does_not_take(code):
    directory, names = code
    result = submit(
        directory,
        f"""
        model: {{factory: "{names["models"]}:build", args: {{width: 3}}}}
    """,
    )
    assert_bad_input(result, "does not take the args {'width': 3}")


@pytest.mark.parametrize(
    "job,message",
    [
        (
            'model: {factory: "m:build", args: [1, 2]}',
            "model.args: [1, 2] is not accepted; use a mapping",
        ),
        (
            'model: {factory: "m:build", kind: mlp}',
            "model.factory: 'm:build' is not accepted together with model.kind 'mlp'",
        ),
        (
            'model: {factory: "m.build"}',
            "model.factory: 'm.build' is not accepted; use an import path module:function",
        ),
        ('data: {factory: "d:load"}', "train.loss: missing; with data.factory name the loss"),
        ('train: {loop: "t:loop", script: t.py}', "train.script and train.loop: give one"),
    ],
)
def test_malformed_user_code_fields(tmp_path, job, message):
    assert_bad_input(submit(tmp_path, job), message)


def test_script_that_does_not_exist(tmp_path):
    result = CliRunner().invoke(main, ["submit", "--script", str(tmp_path / "train.py")])
    assert_bad_input(result, "train.script:", "does not exist")


def test_a_job_files_script_is_found_beside_the_job_file(tmp_path, monkeypatch):
    """train.script in a job YAML is relative to the YAML's directory, wherever rayapp runs from."""
    from rayapp.driver.submit import prepare_user_code
    from rayapp.spec.loader import load_spec

    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "train.py").write_text("print('hi')\n")
    job = tmp_path / "code" / "job.yaml"
    job.write_text("name: s\ntrain: {script: train.py, script_args: ['--epochs', '2']}\n")
    monkeypatch.chdir(tmp_path)  # not the job's directory
    spec, runtime_env = prepare_user_code(load_spec(job), str(job), lambda _: None)
    assert spec.train.script == "train.py" and spec.train.script_args == ("--epochs", "2")
    assert Path(runtime_env["working_dir"]) == tmp_path / "code"


def test_inside_a_ray_job_the_code_that_came_with_it_is_not_uploaded_again(tmp_path, monkeypatch):
    """A `rayapp submit --address` job's driver runs in the working_dir the job brought; a second
    working_dir given to ray.init there makes Ray refuse to merge the two runtime_envs."""
    import json

    from rayapp.driver.submit import prepare_user_code
    from rayapp.spec.loader import load_spec

    (tmp_path / "train.py").write_text("print('hi')\n")
    job = tmp_path / "job.yaml"
    job.write_text("name: s\ntrain: {script: train.py}\n")
    shown: list[str] = []
    job_config = {"runtime_env": {"working_dir": "gcs://_ray_pkg_0123.zip"}, "metadata": {}}
    monkeypatch.setenv(working_dir.JOB_CONFIG_ENV, json.dumps(job_config))
    spec, runtime_env = prepare_user_code(load_spec(job), str(job), shown.append)
    assert runtime_env is None and spec.train.script == "train.py"
    assert shown == [f"your code came with the Ray job, in {tmp_path}"]
    # A job that brought no working_dir (code a driver uploads itself) still uploads it.
    monkeypatch.setenv(working_dir.JOB_CONFIG_ENV, json.dumps({"runtime_env": {}}))
    uploaded = prepare_user_code(load_spec(job), str(job), shown.append)[1]
    assert Path(uploaded["working_dir"]) == tmp_path


def test_large_files_are_left_out_of_the_upload_and_named(tmp_path):
    (tmp_path / "train.py").write_text("print('hi')\n")
    with open(tmp_path / "weights.bin", "wb") as handle:  # sparse: takes no disk
        handle.truncate(working_dir.LARGE_FILE_BYTES + 1)
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "x.pyc").write_bytes(b"0" * 100)
    planned = working_dir.plan(tmp_path)
    assert planned.large_files == [("weights.bin", working_dir.LARGE_FILE_BYTES + 1)]
    assert "/weights.bin" in planned.excludes and "__pycache__" in planned.excludes
    assert planned.total_bytes == len("print('hi')\n")


def test_working_dir_over_rays_upload_limit_fails_before_anything_starts(tmp_path, monkeypatch):
    # Ray's real limit is hundreds of MiB; the check is the same against a smaller one.
    monkeypatch.setattr(working_dir, "ray_upload_limit_bytes", lambda: 1000)
    (tmp_path / "train.py").write_text("x = 1\n" * 300)
    result = CliRunner().invoke(main, ["submit", "--script", str(tmp_path / "train.py")])
    assert_bad_input(result, "over Ray's limit", "--working-dir")
