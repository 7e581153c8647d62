"""ONNX element types <-> NumPy dtypes (ml_dtypes supplies bfloat16, float8, int4 and friends)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper


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
        import ml_dtypes

        ml_dtypes.finfo(dtype)
        return True
    except (ValueError, TypeError):
        return False
