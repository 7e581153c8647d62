"""`from_torch`: export a PyTorch module so that its ONNX initializers are its parameters one for one, and make it
trainable on exactly the parameters PyTorch would train. torch is imported only when called."""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import onnx

from .authoring import make_trainable
from .errors import AuthoringError


def from_torch(module: Any, example_inputs: Sequence[Any], *, input_names: Sequence[str] | None = None,
               output_names: Sequence[str] | None = None, dynamic_shapes: Any = None,
               **options: Any) -> onnx.ModelProto:
    """make_trainable(torch.onnx.export(module, example_inputs, dynamo=True, optimize=False), trainable=...) where
    the trainable names are the module's parameters that require a gradient. optimize=False keeps each parameter
    one initializer under its own name: the optimizing pass folds transposes into weights, lifts scalar constants,
    merges equal-valued initializers and unties tied ones. A tied parameter (one tensor, several names) is the
    initializer under whichever of its names the exporter kept; a parameter the forward never reads is not
    exported, and PyTorch gives it no gradient either. `options` go to make_trainable (loss, optimizer, ...)."""
    import torch

    if "trainable" in options:
        raise AuthoringError("from_torch: trainable is the module's parameters that require a gradient; call "
                             "torch.onnx.export and make_trainable yourself to choose others")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        program = torch.onnx.export(module, tuple(example_inputs), dynamo=True, optimize=False, verbose=False,
                                    input_names=input_names, output_names=output_names,
                                    dynamic_shapes=dynamic_shapes)
    model = program.model_proto
    initializers = {t.name for t in model.graph.initializer}
    names_of: dict[int, list[str]] = {}
    required: dict[int, bool] = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(parameter), []).append(name)
        required[id(parameter)] = parameter.requires_grad
    trainable = [next(n for n in names if n in initializers) for key, names in names_of.items()
                 if required[key] and any(n in initializers for n in names)]
    return make_trainable(model, trainable=trainable, **options)
