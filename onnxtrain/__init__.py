"""onnxtrain: train and run ONNX models by lowering them to JAX, so XLA compiles them."""

from . import errors
from .authoring import make_trainable
from .engine import Engine, export_params, jax_function, load
from .host_memory import retain_freed_memory
from .loop import History, array_batches, fit
from .parameters import ParameterizationWarning, parameter_names
from .pytorch import from_torch, to_torch

__all__ = [
    "Engine", "History", "array_batches", "errors", "export_params", "fit", "jax_function", "load", "make_trainable",
    "ParameterizationWarning", "from_torch", "parameter_names", "retain_freed_memory", "to_torch",
]
__version__ = "0.1.0"
