"""The registry as a newcomer reads it: a lowering's Python defaults say what the schema says."""

import inspect

import numpy as np
import onnx

import onnxtrain  # noqa: F401  (registers every op)
from onnxtrain.lower.registry import lookup, registered, schema_for


def decoded(value):
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, (list, tuple)):
        return [decoded(v) for v in value]
    return value


def same(python, schema) -> bool:
    python, schema = decoded(python), decoded(schema)
    if isinstance(schema, float) or (isinstance(schema, list) and schema and isinstance(schema[0], float)):
        return python is not None and np.array_equal(np.float32(python), np.float32(schema))  # float32 in protos
    if isinstance(schema, np.ndarray):
        return python is not None and np.array_equal(python, schema)
    return python == schema


def schema_default(domain: str, op_type: str, version: int, attribute: str):
    """The schema's default for `attribute`, or None where the schema has no such attribute or no default."""
    spec = schema_for(domain, op_type, version).attributes.get(attribute)
    if spec is None or spec.default_value.type == onnx.AttributeProto.UNDEFINED:
        return None
    return onnx.helper.get_attribute_value(spec.default_value)


def test_python_defaults_of_attributes_equal_the_schemas():
    """The walker passes every attribute the schema defaults, so a Python default for it is never used: it may
    only repeat the schema's, or be None where a version the same function serves has no default for it."""
    served: dict[tuple[str, str], list[tuple[str, str, int]]] = {}  # a function, adapted for old versions or not
    functions: dict[tuple[str, str], set] = {}
    for key in sorted(registered()):
        impl = lookup(*key)
        served.setdefault((impl.module, impl.fn.__name__), []).append(key)
        functions.setdefault((impl.module, impl.fn.__name__), set()).add(impl.fn)
    wrong = []
    for name, keys in served.items():
        parameters = [p for fn in functions[name] for p in inspect.signature(fn).parameters.values()]
        for parameter in parameters:
            if parameter.default is inspect.Parameter.empty:
                continue
            defaults = [schema_default(*key, parameter.name) for key in keys]
            if parameter.default is None and None in defaults:
                continue
            wrong += [(key, parameter.name, parameter.default, schema) for key, schema in zip(keys, defaults)
                      if schema is not None and not same(parameter.default, schema)]
    assert not wrong, wrong
