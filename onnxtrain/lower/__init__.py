"""ONNX -> JAX lowering. Importing this package registers every op module in it (one file per op group)."""

import importlib
import pkgutil

_INFRASTRUCTURE = {"graph", "registry", "values", "target"}

for _module in pkgutil.iter_modules(__path__):
    if _module.name not in _INFRASTRUCTURE:
        importlib.import_module(f"{__name__}.{_module.name}")
