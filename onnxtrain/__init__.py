"""onnxtrain: train and run ONNX models by lowering them to JAX, so XLA compiles them."""

from . import errors
from .engine import Engine, load

__all__ = ["Engine", "errors", "load"]
__version__ = "0.1.0"
