"""The operators, one module per op group. Importing this package imports every module in it, so a new file
registers itself."""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
