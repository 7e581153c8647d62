"""Float constants enter a compiled program as arguments, not as literals compiled into it.

A float tensor that a graph computes from constants alone (a `Constant` node, a `ConstantOfShape` of a constant
shape, arithmetic on those) is static while tracing, like every value known at trace time, and a traced op that
read it used to compile it into the executable. Two reasons not to: XLA-CPU in jaxlib 0.10.2 miscompiles
a convolution whose filter is a splat constant when its result is reduced (a Conv over `ConstantOfShape`
weights then GlobalAveragePool returned NaN or garbage: docs/known-upstream-bugs.md), and a weight compiled in
makes the executable, and its persistent-cache entry, as large as the weight. So such values are computed once
at load (`folding.load_time_constants`), placed on the devices like the float initializers, passed to each program as
one more argument, and a traced op receives the argument instead of the literal (`with_hoisted`). The value
stays static in the walker's scope: ops that read it at trace time (shape arithmetic, `static()`) see NumPy
as before.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator, Mapping

import numpy as np

from ..dtypes import is_float
from ..ir import Node
from .values import Value

# Fewer elements stay literals: scalars, Resize scales/roi and the like, which ops read at trace time and XLA
# folds best as literals. The smallest filter seen to trigger the XLA-CPU bug above has 64 elements.
MIN_ELEMENTS = 17

_HOISTED: ContextVar[Mapping[str, Any]] = ContextVar("onnxtrain_hoisted_constants", default={})


def hoistable(value: Value) -> bool:
    return (isinstance(value, np.ndarray) and is_float(value.dtype) and value.size >= MIN_ELEMENTS)


@contextmanager
def hoisting(arguments: Mapping[str, Any]) -> Iterator[None]:
    """While a program traces: `arguments` (value name -> the program's traced argument) replace the literals."""
    token = _HOISTED.set(arguments)
    try:
        yield
    finally:
        _HOISTED.reset(token)


def with_hoisted(node: "Node", args: list[Value]) -> list[Value]:
    """`args` of a traced call with each hoisted constant replaced by the program's argument holding it (the same
    list when there is none)."""
    arguments = _HOISTED.get()
    if not arguments:
        return args
    replaced = list(args)
    for i, (name, value) in enumerate(zip(node.inputs, args)):
        argument = arguments.get(name)
        # the shape/dtype check guards a subgraph or function body that reuses an outer name
        if argument is not None and hoistable(value) and argument.shape == value.shape and argument.dtype == value.dtype:
            replaced[i] = argument
    return replaced if any(a is not b for a, b in zip(replaced, args)) else args
