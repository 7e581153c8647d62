"""Signal ops: what conformance leaves out (traced signals under jit, dft_length padding and truncation, opset 17's
axis attribute, half and double precision, gradients, windows' types and symmetric forms, errors). References are
NumPy's FFT and windows, or onnx's ReferenceEvaluator."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from nodes import assert_matches_reference, node_model, run_both
from onnxtrain.dtypes import onnx_type
from onnxtrain.lower.ops import signal
from nodes import run_with_engine as run

T = TensorProto
# Windows and MelWeightMatrix take their sizes as graph inputs here: the engine compiles them in, and says so.
pytestmark = pytest.mark.filterwarnings("ignore:.*compiled in as constants:UserWarning")


def as_onnx(z):
    """A NumPy complex array as ONNX's [..., 2] real tensor."""
    return np.stack([z.real, z.imag], axis=-1)


def as_complex(x):
    return x[..., 0] + 1j * x[..., 1] if x.shape[-1] == 2 else x[..., 0]


RNG = np.random.default_rng(0)
SIGNAL = RNG.standard_normal((2, 6, 3, 2))  # [batch, signal, signal, complex]


# ---- DFT -----------------------------------------------------------------------------------------------------


def dft_model(x, length, axis, opset=None, **attrs):
    """One DFT node with x a graph input, and dft_length and axis (when given) initializers: static values."""
    constants = {"length": None if length is None else np.array(length, np.int64), "axis": np.array(axis, np.int64)}
    node = helper.make_node("DFT", ["x"] + [n if v is not None else "" for n, v in constants.items()], ["y"], **attrs)
    graph = helper.make_graph(
        [node],
        "dft",
        [helper.make_tensor_value_info("x", onnx_type(x.dtype), x.shape)],
        [helper.make_empty_tensor_value_info("y")],
        initializer=[numpy_helper.from_array(v, n) for n, v in constants.items() if v is not None],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset or 20)])


@pytest.mark.parametrize(
    ("inverse", "onesided", "length", "channels"),
    [(0, 0, None, 2), (0, 1, 9, 1), (1, 0, 4, 2), (1, 1, 7, 2), (0, 0, 8, 1), (1, 1, None, 2)],
)
def test_dft_traced_signal_compiles_once(inverse, onesided, length, channels):
    x = SIGNAL[..., :channels]
    engine = onnxtrain.load(dft_model(x, length, 1, inverse=inverse, onesided=onesided), check=False)
    for scale in (1.0, -3.5):
        got = np.asarray(engine.infer({"x": x * scale})["y"])
        z = as_complex(x * scale)
        if inverse and onesided:
            want = np.fft.irfft(z, n=length or 2 * (x.shape[1] - 1), axis=1)[..., None]
        elif inverse:
            want = as_onnx(np.fft.ifft(z, n=length, axis=1))
        else:
            want = np.fft.fft(z, n=length, axis=1)
            want = as_onnx(want[:, : (length or x.shape[1]) // 2 + 1] if onesided else want)
        assert got.dtype == np.float64 and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert engine.trace_count == 1


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_dft_keeps_low_precision_types(dtype):
    x = SIGNAL[0, :, :, :1].astype(dtype)  # [signal, signal, 1]: axis 0 is a signal axis in opset 20
    (got,), _ = run(dft_model(x, None, 0, onesided=1), {"x": x})
    want = as_onnx(np.fft.rfft(x[..., 0].astype(np.float64), axis=0))
    assert got.dtype == dtype
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("opset", [17, 19])
def test_dft_opset17_axis_attribute_counts_the_batch(opset):
    x = SIGNAL[..., :1].astype(np.float32)
    for attrs, axis in (({}, 1), ({"axis": 2}, 2), ({"axis": -2}, 2)):
        (got,), _ = run(node_model("DFT", {"x": x}, opset=opset, **attrs), {"x": x})
        want = as_onnx(np.fft.fft(x[..., 0].astype(np.float64), axis=axis))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_dft_opset17_dft_length_and_reference():
    x = SIGNAL.astype(np.float32)
    inputs = {"x": x, "length": np.array(4, np.int32)}
    ours, theirs = run_both(node_model("DFT", inputs, opset=17, inverse=1), inputs)
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-5, atol=1e-6)


def test_dft_gradient_is_the_transposed_transform():
    x = SIGNAL[0, :, 0, :1]  # [6, 1] real
    weights = RNG.standard_normal((6, 2))
    with jax.enable_x64(True):
        got = jax.grad(lambda v: jnp.sum(signal.dft(v, None, 0, False, False) * weights))(x)
    # DFT as a real linear map: column j is the transform of the j-th unit signal
    matrix = np.stack([as_onnx(np.fft.fft(np.eye(6)[j])) for j in range(6)], axis=-1)  # [6, 2, 6]
    np.testing.assert_allclose(np.asarray(got)[:, 0], np.einsum("kcj,kc->j", matrix, weights), rtol=1e-10)


def test_dft_on_the_complex_axis_is_an_error():
    x = np.zeros((2, 4, 2), np.float32)
    with pytest.raises(ValueError, match="last of the 3 axes holds real/imaginary parts"):
        signal.dft(x, None, -1, False, False)
    with pytest.raises(ValueError, match="last axis must be 1 \\(real\\) or 2 \\(complex\\)"):
        signal.dft(np.zeros((2, 4, 3), np.float32), None, 1, False, False)


# ---- STFT ----------------------------------------------------------------------------------------------------


def stft_reference(x, step, window, length, onesided):
    z = as_complex(x)
    frames = (z.shape[1] - length) // step + 1
    framed = np.stack([z[:, f * step : f * step + length] for f in range(frames)], axis=1)
    spectrum = np.fft.fft(framed * (1 if window is None else window), axis=-1)
    return as_onnx(spectrum[..., : length // 2 + 1] if onesided else spectrum)


@pytest.mark.parametrize(("channels", "onesided", "with_window"), [(1, 1, True), (1, 0, False), (2, 0, True)])
def test_stft_traced_signal_and_window(channels, onesided, with_window):
    x = RNG.standard_normal((2, 20, channels)).astype(np.float32)
    window = np.hanning(7).astype(np.float32)
    feeds = {"x": x, "step": np.array(3, np.int64)}
    if with_window:
        feeds["window"] = window
    feeds["length"] = np.array(7, np.int64)
    model = node_model("STFT", feeds, onesided=onesided)
    if not with_window:
        model.graph.node[0].input[:] = ["x", "step", "", "length"]
    with pytest.warns(UserWarning, match="compiled in as constants"):  # step and length shape the output
        (got,), engine = run(model, feeds)
    want = stft_reference(x.astype(np.float64), 3, window if with_window else None, 7, onesided)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    got = np.asarray(engine.infer({**feeds, "x": -x})["out0"])
    np.testing.assert_allclose(got, -want, rtol=1e-4, atol=1e-5)


def test_stft_frame_length_from_window_matches_reference():
    x = RNG.standard_normal((1, 16, 1))
    inputs = {"x": x, "step": np.array(4, np.int32), "window": np.hamming(8)}
    assert_matches_reference("STFT", inputs, rtol=1e-10, atol=1e-10)


def test_stft_window_length_mismatch_is_an_error():
    x = np.zeros((1, 16, 1), np.float32)
    with pytest.raises(ValueError, match="window must be a vector of frame_length 8"):
        signal.stft(x, np.array(2), np.ones(6, np.float32), np.array(8))
    with pytest.raises(ValueError, match="do not fit a signal of length 16"):
        signal.stft(x, np.array(2), None, np.array(17))


# ---- windows -------------------------------------------------------------------------------------------------

def onnx_hamming(n):
    """ONNX's Hamming window weighs 25/46 and 21/46, not NumPy's rounded 0.54 and 0.46."""
    return 25 / 46 - 21 / 46 * np.cos(2 * np.pi * np.arange(n) / (n - 1))


NUMPY_WINDOWS = {"HannWindow": np.hanning, "HammingWindow": onnx_hamming, "BlackmanWindow": np.blackman}


@pytest.mark.parametrize("op_type", sorted(NUMPY_WINDOWS))
@pytest.mark.parametrize("periodic", [0, 1])
def test_windows_against_numpy(op_type, periodic):
    size = np.array(9, np.int32)
    (got,), _ = run(node_model(op_type, {"size": size}, periodic=periodic, output_datatype=T.DOUBLE), {"size": size})
    want = NUMPY_WINDOWS[op_type](10)[:9] if periodic else NUMPY_WINDOWS[op_type](9)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize(("datatype", "dtype"), [(T.FLOAT16, np.float16), (T.BFLOAT16, ml_dtypes.bfloat16),
                                                 (T.INT32, np.int32), (T.UINT8, np.uint8)])  # fmt: skip
def test_window_output_datatypes(datatype, dtype):
    inputs = {"size": np.array(6, np.int64)}
    (got,), _ = run(node_model("HannWindow", inputs, output_datatype=datatype), inputs)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, np.hanning(7)[:6].astype(dtype))


def test_symmetric_window_of_one_point_is_one():
    inputs = {"size": np.array(1, np.int64)}
    (got,), _ = run(node_model("BlackmanWindow", inputs, periodic=0), inputs)
    np.testing.assert_array_equal(got, [1.0])
    (got,), _ = run(node_model("HammingWindow", {"size": np.array(0, np.int64)}), {"size": np.array(0, np.int64)})
    assert got.shape == (0,) and got.dtype == np.float32


# ---- MelWeightMatrix -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bins", "length", "rate", "low", "high", "datatype"),
    [
        (8, 64, 8000, 0.0, 4000.0, T.FLOAT),
        (5, 31, 16000, 100.0, 7000.0, T.DOUBLE),
        (20, 512, 22050, 20.0, 11025.0, T.FLOAT16),
    ],
)
def test_mel_weight_matrix_against_reference(bins, length, rate, low, high, datatype):
    inputs = {
        "bins": np.array(bins, np.int64), "length": np.array(length, np.int64), "rate": np.array(rate, np.int64),
        "low": np.array(low, np.float32), "high": np.array(high, np.float32),
    }  # fmt: skip
    ours, theirs = run_both(node_model("MelWeightMatrix", inputs, output_datatype=datatype), inputs)
    assert ours[0].dtype == theirs[0].dtype and ours[0].shape == (length // 2 + 1, bins)
    np.testing.assert_allclose(ours[0].astype(np.float64), theirs[0].astype(np.float64), rtol=1e-3, atol=1e-6)


def test_mel_weight_matrix_traced_edges_compile_once():
    inputs = {
        "bins": np.array(4, np.int32), "length": np.array(32, np.int32), "rate": np.array(8000, np.int32),
        "low": np.array(0.0, np.float64), "high": np.array(4000.0, np.float64),
    }  # fmt: skip
    with pytest.warns(UserWarning, match="compiled in as constants"):  # the integers shape the output
        (first,), engine = run(node_model("MelWeightMatrix", inputs), inputs)
    traces = engine.trace_count
    edges = {**inputs, "low": np.array(300.0), "high": np.array(3000.0)}
    second = np.asarray(engine.infer(edges)["out0"])
    _, (want,) = run_both(node_model("MelWeightMatrix", edges), edges)
    np.testing.assert_allclose(second, want, atol=1e-6)
    assert engine.trace_count == traces and not np.array_equal(first, second)
