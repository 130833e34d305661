"""The trained model as an MLflow Model, logged into the job's run as ``model``.

``mlflow.pyfunc.load_model("runs:/RUN_ID/model")`` loads it and ``mlflow models serve -m
runs:/RUN_ID/model`` serves it. It carries a signature and an input example, both taken from the
job's own data (a few rows of the test set, else the training set), so the serving endpoint
knows the input's shape and dtype. The model is rebuilt on CPU from the job's spec and the full
state dict every strategy gathers at the end (FSDP's shards, the pipeline's stages), so what is
logged is the plain, unwrapped ``nn.Module``.

It is saved with cloudpickle (MLflow's ``pickle`` format): a fraction of a second against the
seconds ``torch.export`` (``pt2``) takes on these small models. A model built by the job's own
``model.factory`` from modules in the job's directory (the worker's working directory) has those
modules pickled by value, so loading needs torch and mlflow only, not the job's files.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from rayapp.spec import JobSpec
from rayapp.train.config import WorkerConfig

if TYPE_CHECKING:
    from mlflow.models.model import ModelInfo

MODEL_NAME = "model"
"""The name the model is logged under: ``runs:/RUN_ID/model``."""
EXAMPLE_ROWS = 5


def exports_model(spec: JobSpec) -> bool:
    """Whether rayapp knows how to rebuild the job's model from its spec: its built-in loop (a
    registered model or a model.factory); not a loop or script of the user's own, which train a
    model rayapp did not build."""
    return not spec.train.loop and not spec.train.script


def input_example(dataset: Dataset, rows: int = EXAMPLE_ROWS) -> np.ndarray:
    """The inputs of the first `rows` samples of `dataset` (each sample ``(inputs, target)``),
    stacked into one array."""
    count = min(rows, len(dataset))  # type: ignore[arg-type]
    if count == 0:
        raise ValueError("the data set is empty: no input example to log the model with")
    samples = [dataset[index] for index in range(count)]
    inputs = [sample[0] if isinstance(sample, (tuple, list)) else sample for sample in samples]
    if not all(isinstance(row, torch.Tensor) for row in inputs):
        raise TypeError(
            f"the data set's inputs are {type(inputs[0]).__name__}, not tensors: "
            "no input example to log the model with"
        )
    return torch.stack(inputs).numpy()


def example_from_data(spec: JobSpec) -> np.ndarray:
    """An input example from the job's data: the test set's first rows, else the training set's."""
    from rayapp.train.data import build_datasets

    datasets = build_datasets(spec)
    return input_example(datasets.test if datasets.test is not None else datasets.train)


def rebuild_model(spec: JobSpec, model_state: dict) -> nn.Module:
    """The job's model on CPU in eval mode with the trained weights (`model_state`: the full,
    unwrapped state dict :func:`rayapp.train.checkpoint.full_model_state` gathers)."""
    from rayapp.train.models import build_model

    model = build_model(spec)
    model.load_state_dict(model_state)
    return model.eval()


def log_trained_model(
    spec: JobSpec,
    model_state: dict,
    *,
    tracking_uri: str,
    run_id: str,
    example: np.ndarray | None = None,
    step: int = 0,
) -> ModelInfo:
    """Log the model `spec` builds, with `model_state`'s weights, to run `run_id` as the MLflow
    Model ``model``, and register a version of it under ``tracking.register_model`` when the job
    names one. `example` (model inputs) defaults to a few rows of the job's data; the run's
    metrics at `step` (its last epoch) are copied onto the logged model. Raises on any failure;
    the caller decides whether that fails anything."""
    import mlflow
    import mlflow.pytorch
    from mlflow.models import infer_signature

    model = rebuild_model(spec, model_state)
    example = example_from_data(spec) if example is None else example
    with torch.no_grad():
        output = model(torch.as_tensor(example))
    signature = infer_signature(example, output.numpy())

    mlflow.set_tracking_uri(tracking_uri)
    client = mlflow.MlflowClient(tracking_uri)
    # MLflow 3 files a logged model under the active experiment and finds it through
    # runs:/RUN_ID/model only in the run's own experiment.
    mlflow.set_experiment(experiment_id=client.get_run(run_id).info.experiment_id)
    with _pickled_by_value(_job_modules(spec, model)):
        return mlflow.pytorch.log_model(
            model,
            name=MODEL_NAME,
            run_id=run_id,
            step=step,
            signature=signature,
            input_example=example,
            serialization_format="pickle",
            # Named rather than inferred: inference loads the model in a subprocess (seconds).
            pip_requirements=_requirements(),
            registered_model_name=spec.tracking.register_model,
        )


def _requirements() -> list[str]:
    import mlflow

    torch_version = torch.__version__.split("+")[0]  # "2.13.0+cpu": the local part is no pin
    return [f"torch=={torch_version}", f"mlflow=={mlflow.__version__}", "cloudpickle"]


def _job_modules(spec: JobSpec, model: nn.Module) -> list[ModuleType]:
    """The modules of the job's own directory that define the model: model.factory's and those
    of the model's classes. Installed packages stay pickled by reference."""
    if spec.model.factory is None:
        return []
    names = {spec.model.factory.partition(":")[0]}
    names.update(type(layer).__module__ for layer in model.modules())
    modules = [sys.modules.get(name) or importlib.import_module(name) for name in sorted(names)]
    return [module for module in modules if _in_job_dir(module)]


def _in_job_dir(module: ModuleType) -> bool:
    if not getattr(module, "__file__", None):
        return False
    path = Path(str(module.__file__)).resolve()
    installed = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
    return path.is_relative_to(Path.cwd().resolve()) and not any(
        path.is_relative_to(Path(directory).resolve()) for directory in installed
    )


@contextlib.contextmanager
def _pickled_by_value(modules: list[ModuleType]) -> Iterator[None]:
    """cloudpickle pickles `modules` by value while the model is saved."""
    import cloudpickle

    for module in modules:
        cloudpickle.register_pickle_by_value(module)
    try:
        yield
    finally:
        for module in modules:
            cloudpickle.unregister_pickle_by_value(module)


def log_trained_model_or_warn(config: WorkerConfig, model_state: dict, *, step: int) -> None:
    """:func:`log_trained_model` at the end of a finished run, on rank 0: a model that cannot be
    logged is said in one line at the submitting terminal and fails nothing (the weights are in
    the run's state_dict artifact and its checkpoints anyway)."""
    spec = config.spec
    try:
        info = log_trained_model(
            spec, model_state, tracking_uri=config.tracking_uri, run_id=config.run_id, step=step
        )
    except Exception as exc:
        reason = " ".join(str(exc).split())[:300] or repr(exc)  # one line, however it was said
        config.tell(f"the trained model was not logged as an MLflow Model: {reason}")
        return
    if spec.tracking.register_model:
        config.say(
            f"model registered: {spec.tracking.register_model} version "
            f"{info.registered_model_version} (runs:/{config.run_id}/{MODEL_NAME})"
        )
