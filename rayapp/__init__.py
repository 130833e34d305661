"""rayapp: PyTorch distributed training on Ray clusters, tracked in MLflow, measured for scaling."""

__version__ = "0.1.0"
