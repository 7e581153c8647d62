import numpy as np
import pytest

from nodes import assert_matches_reference


@pytest.mark.parametrize("op_type", ["Add", "Sub", "Mul"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.int32])
def test_binary_arithmetic_keeps_dtype_and_broadcasts(op_type, dtype):
    a = (np.arange(12).reshape(3, 4) - 5).astype(dtype)
    b = np.array([1, 2, 3, 4], dtype=dtype)
    assert_matches_reference(op_type, {"a": a, "b": b})


@pytest.mark.parametrize("op_type", ["Exp", "Tanh", "Sigmoid", "Erf", "Relu", "Sqrt"])
def test_unary_float(op_type):
    x = np.linspace(0.1, 3.0, 10).astype(np.float32)
    assert_matches_reference(op_type, {"x": x})
