"""The job spec: frozen dataclasses validated by pydantic, their registries, and the loader that
builds them from defaults < job YAML < command-line flags. Imports nothing else of rayapp."""

from rayapp.spec.catalog import DATASETS, LOSSES, MODELS, OPTIMIZERS, STRATEGIES
from rayapp.spec.cluster import BACKENDS, ClusterSpec
from rayapp.spec.errors import SpecError
from rayapp.spec.job import (
    SCALINGS,
    DataSpec,
    JobSpec,
    ModelSpec,
    TrackingSpec,
    TrainSpec,
)

__all__ = [
    "BACKENDS",
    "SCALINGS",
    "DATASETS",
    "LOSSES",
    "MODELS",
    "OPTIMIZERS",
    "STRATEGIES",
    "SpecError",
    "JobSpec",
    "ModelSpec",
    "DataSpec",
    "TrainSpec",
    "ClusterSpec",
    "TrackingSpec",
]
