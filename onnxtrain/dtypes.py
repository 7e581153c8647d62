"""ONNX element types <-> NumPy dtypes (ml_dtypes supplies bfloat16, float8, int4 and friends)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
from onnx import helper


# XLA has no 6-bit float type: such arrays are computed with NumPy and never enter or leave a jitted function.
HOST_ONLY_DTYPES = frozenset({np.dtype(ml_dtypes.float6_e2m3fn), np.dtype(ml_dtypes.float6_e3m2fn)})

# The ONNX element types a model trains in (parameters, losses): the 8-, 6- and 4-bit floats are storage types.
TRAINING_FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
                                  onnx.TensorProto.BFLOAT16})
# The 16-bit training types, which torch computes in float32 (its "opmath" type) and rounds back to, element by
# element: optimizer updates, a broadcast operand's gradient sum (optimizers.py, lower/ops/training.py,
# lower/ops/elementwise.py); as ONNX element types and as the dtypes that hold them
HALF_FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16})
HALF_FLOAT_DTYPES = frozenset(np.dtype(helper.tensor_dtype_to_np_dtype(t)) for t in HALF_FLOAT_TYPES)


def host_only(value) -> bool:
    """Strings and 6-bit floats live on the host only (NumPy), never in an XLA program; so does a sequence (list)
    holding any of them, or maps (object arrays holding dicts)."""
    if isinstance(value, list):
        return any(host_only(v) for v in value)
    return isinstance(value, np.ndarray) and (value.dtype.kind in "OUS" or value.dtype in HOST_ONLY_DTYPES)


def np_dtype(elem_type: int) -> np.dtype:
    """The NumPy dtype that holds ONNX element type `elem_type` (strings are object arrays)."""
    if elem_type == onnx.TensorProto.STRING:
        return np.dtype(object)
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))


def onnx_type(dtype: np.dtype) -> int:
    """The ONNX element type of a NumPy dtype."""
    dtype = np.dtype(dtype)
    if dtype == object or dtype.kind in "US":
        return onnx.TensorProto.STRING
    return helper.np_dtype_to_tensor_dtype(dtype)


def type_name(elem_type: int) -> str:
    return onnx.TensorProto.DataType.Name(elem_type).lower()


def is_float(dtype: np.dtype) -> bool:
    """True for every floating or complex dtype, including the ml_dtypes ones NumPy calls kind 'V'."""
    dtype = np.dtype(dtype)
    if dtype.kind in "fc":
        return True
    try:
        ml_dtypes.finfo(dtype)
        return True
    except (ValueError, TypeError):
        return False
