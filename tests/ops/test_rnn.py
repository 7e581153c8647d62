"""RNN / GRU / LSTM against a plain NumPy recurrence written here (one batch entry, one direction, one time step
at a time), covering what ReferenceEvaluator ignores: sequence_lens, clip, activations with alpha/beta,
linear_before_reset, input_forget, peepholes, layout, old opsets, dtypes and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator

from onnxtrain.dtypes import onnx_type
from onnxtrain.lower.build import build_graph, model_resolver
from onnxtrain.lower.walker import TraceContext, run_graph
from onnxtrain.lower.target import targeting
from onnxtrain.placement import Placement
from nodes import run_outputs as run

GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
DEFAULT_ACTIVATIONS = {"RNN": ["tanh"], "GRU": ["sigmoid", "tanh"], "LSTM": ["sigmoid", "tanh", "tanh"]}
# name -> (f(x, alpha, beta), default alpha, default beta); None marks a parameter the function does not take
ACT = {
    "sigmoid": (lambda x, a, b: 1 / (1 + np.exp(-x)), None, None),
    "tanh": (lambda x, a, b: np.tanh(x), None, None),
    "relu": (lambda x, a, b: np.maximum(x, 0), None, None),
    "affine": (lambda x, a, b: a * x + b, 1.0, 0.0),
    "leakyrelu": (lambda x, a, b: np.where(x >= 0, x, a * x), 0.01, None),
    "thresholdedrelu": (lambda x, a, b: np.where(x >= a, x, 0), 1.0, None),
    "scaledtanh": (lambda x, a, b: a * np.tanh(b * x), 1.0, 1.0),
    "hardsigmoid": (lambda x, a, b: np.clip(a * x + b, 0, 1), 0.2, 0.5),
    "elu": (lambda x, a, b: np.where(x >= 0, x, a * (np.exp(x) - 1)), 1.0, None),
    "softsign": (lambda x, a, b: x / (1 + np.abs(x)), None, None),
    "softplus": (lambda x, a, b: np.log1p(np.exp(x)), None, None),
}


def activation_list(names, alphas, betas):
    """Callables for `names`; alpha/beta values go, in order, to the functions that take them."""
    alphas, betas, out = list(alphas), list(betas), []
    for name in names:
        fn, a, b = ACT[name.lower()]
        a = alphas.pop(0) if a is not None and alphas else a
        b = betas.pop(0) if b is not None and betas else b
        out.append(lambda x, fn=fn, a=a, b=b: fn(x, a, b))
    return out


def cell(op, x, h, c, W, R, B, P, acts, clip, linear_before_reset, input_forget):
    H = h.shape[0]
    cut = (lambda v: v) if clip is None else (lambda v: np.clip(v, -clip, clip))
    Wb, Rb = B[: len(B) // 2], B[len(B) // 2:]
    if op == "RNN":
        return acts[0](cut(W @ x + R @ h + Wb + Rb)), c
    if op == "GRU":
        f, g = acts
        z = f(cut(W[:H] @ x + R[:H] @ h + Wb[:H] + Rb[:H]))
        r = f(cut(W[H:2 * H] @ x + R[H:2 * H] @ h + Wb[H:2 * H] + Rb[H:2 * H]))
        if linear_before_reset:
            candidate = g(cut(W[2 * H:] @ x + Wb[2 * H:] + r * (R[2 * H:] @ h + Rb[2 * H:])))
        else:
            candidate = g(cut(W[2 * H:] @ x + R[2 * H:] @ (r * h) + Wb[2 * H:] + Rb[2 * H:]))
        return (1 - z) * candidate + z * h, c
    f, g, act_h = acts
    pre = W @ x + R @ h + Wb + Rb
    i_, o_, f_, c_ = (pre[k * H:(k + 1) * H] for k in range(4))
    i = f(cut(i_ + P[:H] * c))
    forget = 1 - i if input_forget else f(cut(f_ + P[2 * H:] * c))
    c = forget * c + i * g(cut(c_))
    o = f(cut(o_ + P[H:2 * H] * c))
    return o * act_h(c), c


def numpy_recurrence(op, X, W, R, B=None, lens=None, h0=None, c0=None, P=None, *, direction="forward", layout=0,
                     clip=None, activations=None, alpha=(), beta=(), linear_before_reset=0, input_forget=0):
    if layout:
        X = X.transpose(1, 0, 2)
        h0 = None if h0 is None else h0.transpose(1, 0, 2)
        c0 = None if c0 is None else c0.transpose(1, 0, 2)
    T, batch, _ = X.shape
    D, H = W.shape[0], R.shape[-1]
    k = len(DEFAULT_ACTIVATIONS[op])
    names = activations or DEFAULT_ACTIVATIONS[op] * D
    acts = activation_list(names, alpha, beta)
    B = np.zeros((D, 2 * GATES[op] * H)) if B is None else B
    P = np.zeros((D, 3 * H)) if P is None else P
    Y, Yh, Yc = np.zeros((T, D, batch, H)), np.zeros((D, batch, H)), np.zeros((D, batch, H))
    for d in range(D):
        backwards = direction == "reverse" or d == 1
        for b in range(batch):
            n = T if lens is None else int(lens[b])
            h = np.zeros(H) if h0 is None else h0[d, b].astype(np.float64)
            c = np.zeros(H) if c0 is None else c0[d, b].astype(np.float64)
            for t in (range(n - 1, -1, -1) if backwards else range(n)):
                h, c = cell(op, X[t, b], h, c, W[d], R[d], B[d], P[d], acts[d * k:(d + 1) * k], clip,
                            linear_before_reset, input_forget)
                Y[t, d, b] = h
            Yh[d, b], Yc[d, b] = h, c
    if layout:
        return Y.transpose(2, 0, 1, 3), Yh.transpose(1, 0, 2), Yc.transpose(1, 0, 2)
    return Y, Yh, Yc


INPUT_NAMES = ["X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"]


def problem(op, D=1, T=5, batch=3, I=2, H=3, layout=0, lens=False, initial=False, peepholes=False,
            dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    G = GATES[op]
    x_shape = (batch, T, I) if layout else (T, batch, I)
    s_shape = (batch, D, H) if layout else (D, batch, H)
    feeds = {"X": rng.standard_normal(x_shape), "W": rng.standard_normal((D, G * H, I)) * 0.7,
             "R": rng.standard_normal((D, G * H, H)) * 0.7, "B": rng.standard_normal((D, 2 * G * H)) * 0.5}
    if lens:
        feeds["sequence_lens"] = np.array([T, 2, 1, 4][:batch], np.int32)
    if initial:
        feeds["initial_h"] = rng.standard_normal(s_shape)
        if op == "LSTM":
            feeds["initial_c"] = rng.standard_normal(s_shape)
    if peepholes:
        feeds["P"] = rng.standard_normal((D, 3 * H))
    return {k: v if v.dtype == np.int32 else v.astype(dtype) for k, v in feeds.items()}


def rnn_model(op, feeds, opset=22, n_outputs=None, **attrs):
    names = [n if n in feeds else "" for n in INPUT_NAMES[: 1 + max(INPUT_NAMES.index(k) for k in feeds)]]
    n_outputs = n_outputs or (3 if op == "LSTM" else 2)
    outputs = ["Y", "Y_h", "Y_c"][:n_outputs]
    node = helper.make_node(op, names, outputs, hidden_size=feeds["R"].shape[-1], **attrs)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(k, onnx_type(v.dtype), v.shape) for k, v in feeds.items()],
        [helper.make_value_info(o, helper.TypeProto()) for o in outputs],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def expected(op, feeds, **attrs):
    f64 = {k: v.astype(np.float64) if v.dtype != np.int32 else v for k, v in feeds.items()}
    return numpy_recurrence(
        op, f64["X"], f64["W"], f64["R"], f64.get("B"), f64.get("sequence_lens"), f64.get("initial_h"),
        f64.get("initial_c"), f64.get("P"), **attrs,
    )


def assert_close(ours, theirs, dtype=np.float32, rtol=1e-5, atol=1e-5):
    for a, b in zip(ours, theirs):
        assert a.dtype == dtype and a.shape == b.shape, (a.dtype, a.shape, b.shape)
        np.testing.assert_allclose(a.astype(np.float64), b, rtol=rtol, atol=atol)


NUMPY_ATTRS = {"clip", "activations", "alpha", "beta", "direction", "layout", "linear_before_reset",
               "input_forget"}


def onnx_attrs(attrs):
    renamed = {"alpha": "activation_alpha", "beta": "activation_beta"}
    return {renamed.get(k, k): v for k, v in attrs.items()}


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
@pytest.mark.parametrize(("direction", "layout"), [("forward", 0), ("reverse", 1), ("bidirectional", 0),
                                                   ("bidirectional", 1)])
@pytest.mark.parametrize("platform", ["cpu", "gpu"])  # one scanned input per gate, or one split in the step
def test_directions_layouts_sequence_lens_and_initial_states(op, direction, layout, platform, monkeypatch):
    monkeypatch.setattr(Placement, "platform", property(lambda self: platform))
    D = 2 if direction == "bidirectional" else 1
    feeds = problem(op, D, layout=layout, lens=True, initial=True, peepholes=op == "LSTM")
    attrs = {"direction": direction, "layout": layout}
    assert_close(run(rnn_model(op, feeds, **attrs), feeds), expected(op, feeds, **attrs))


@pytest.mark.parametrize(
    ("op", "attrs"),
    [
        ("RNN", {"clip": 0.4}),
        ("RNN", {"activations": ["LeakyRelu"], "alpha": [0.3]}),
        ("RNN", {"direction": "bidirectional", "activations": ["Affine", "ScaledTanh"], "alpha": [0.5, 0.8],
                 "beta": [0.1, 1.5]}),
        ("GRU", {"linear_before_reset": 1}),
        ("GRU", {"clip": 0.3, "linear_before_reset": 1}),
        ("GRU", {"activations": ["HardSigmoid", "Softsign"], "alpha": [0.3], "beta": [0.4]}),
        ("GRU", {"direction": "bidirectional", "activations": ["Sigmoid", "Tanh", "HardSigmoid", "Elu"]}),
        ("LSTM", {"input_forget": 1}),
        ("LSTM", {"clip": 0.25}),
        ("LSTM", {"activations": ["HardSigmoid", "ThresholdedRelu", "Softplus"], "alpha": [0.3, 0.1]}),
        ("LSTM", {"direction": "bidirectional", "activations": ["Sigmoid", "Relu", "Tanh"]}),  # one list, both ways
    ],
)
def test_cell_options(op, attrs):
    D = 2 if attrs.get("direction") == "bidirectional" else 1
    feeds = problem(op, D, lens=True, initial=True, peepholes=op == "LSTM", seed=1)
    ours = run(rnn_model(op, feeds, **onnx_attrs(attrs)), feeds)
    if attrs.get("activations") and D == 2 and len(attrs["activations"]) == len(DEFAULT_ACTIVATIONS[op]):
        attrs = {**attrs, "activations": attrs["activations"] * 2}
    assert_close(ours, expected(op, feeds, **attrs))


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
def test_defaults_match_reference_evaluator(op):
    feeds = problem(op, 1, initial=True)
    model = rnn_model(op, feeds)
    theirs = ReferenceEvaluator(model).run(None, feeds)
    assert_close(run(model, feeds), [np.asarray(t, np.float64) for t in theirs])


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
@pytest.mark.parametrize("op", ["GRU", "LSTM"])
def test_dtypes_are_kept(op, dtype):
    feeds = problem(op, 2, lens=True, initial=True, dtype=dtype)
    tolerance = 1e-10 if dtype == np.float64 else 2e-2
    assert_close(run(rnn_model(op, feeds, direction="bidirectional"), feeds),
                 expected(op, feeds, direction="bidirectional"), dtype=dtype, rtol=tolerance, atol=tolerance)


def test_only_final_state_requested():
    feeds = problem("LSTM", 1, lens=True)
    node = helper.make_node("LSTM", ["X", "W", "R", "B", "sequence_lens"], ["", "Y_h"], hidden_size=3)
    inputs = [helper.make_tensor_value_info(k, onnx_type(v.dtype), v.shape) for k, v in feeds.items()]
    graph = helper.make_graph([node], "g", inputs, [helper.make_value_info("Y_h", helper.TypeProto())])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)])
    assert_close(run(model, feeds), expected("LSTM", feeds)[1:2])


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
def test_an_empty_sequence_returns_the_initial_states(op):
    feeds = problem(op, 2, T=0, batch=2, initial=True)
    ours = run(rnn_model(op, feeds, direction="bidirectional"), feeds)
    assert ours[0].shape == (0, 2, 2, 3)
    assert_close(ours[1:], expected(op, feeds, direction="bidirectional")[1:len(ours)])


@pytest.mark.parametrize(("op", "opset"), [("RNN", 1), ("GRU", 1), ("GRU", 3), ("LSTM", 1), ("LSTM", 7)])
def test_old_opsets(op, opset):
    feeds = problem(op, 1, lens=True, initial=True)
    attrs = {"output_sequence": 1} if opset == 1 or (op == "GRU" and opset == 3) else {}
    if op == "GRU" and opset > 1:
        attrs["linear_before_reset"] = 1
    assert_close(run(rnn_model(op, feeds, opset=opset, **attrs), feeds),
                 expected(op, feeds, linear_before_reset=attrs.get("linear_before_reset", 0)))


# ---- gradients ------------------------------------------------------------------------------------------------


def traced_outputs(model, feeds):
    """The node's outputs as a JAX function of the feeds, any of them replaced by keyword."""
    graph = build_graph(model.graph, model_resolver(model))

    def outputs(**changed):
        return run_graph(graph, [changed.get(n, v) for n, v in feeds.items()], TraceContext(jax.random.key(0)))

    return outputs


@pytest.mark.parametrize("op, attrs, peepholes", [
    ("RNN", {}, False), ("GRU", {}, False), ("GRU", {"linear_before_reset": 1}, False), ("LSTM", {}, True),
    ("LSTM", {"input_forget": 1}, False),
])
@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_gradient_matches_finite_differences(op, attrs, peepholes, platform):
    """Every differentiable input of a bidirectional layer with sequence lengths and initial states."""
    feeds = problem(op, 2, T=3, batch=2, H=2, lens=True, initial=True, peepholes=peepholes, dtype=np.float64,
                    seed=3)
    outputs_of = traced_outputs(rnn_model(op, feeds, direction="bidirectional", **attrs), feeds)
    wrt = [n for n in feeds if n != "sequence_lens"]
    y_shape = expected(op, feeds, direction="bidirectional", **attrs)[0].shape
    weights = np.random.default_rng(7).standard_normal(y_shape)

    def loss(*values):
        outputs = outputs_of(**dict(zip(wrt, values)))
        return jnp.sum(outputs[0] * weights) + sum(jnp.sum(o) for o in outputs[1:])

    with jax.enable_x64(True), targeting(platform):
        grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(wrt)))))(*[feeds[n] for n in wrt])
        jaxpr = jax.make_jaxpr(loss)(*[feeds[n] for n in wrt])
    assert "scan" in str(jaxpr)

    def numpy_loss(**changed):
        Y, *states = expected(op, {**feeds, **changed}, direction="bidirectional", **attrs)
        return np.sum(Y * weights) + sum(np.sum(s) for s in states[: 2 if op == "LSTM" else 1])

    for name, grad in zip(wrt, grads):
        numeric = np.zeros_like(feeds[name])
        for index in np.ndindex(numeric.shape):
            step = np.zeros_like(numeric)
            step[index] = 1e-6
            up, down = numpy_loss(**{name: feeds[name] + step}), numpy_loss(**{name: feeds[name] - step})
            numeric[index] = (up - down) / 2e-6
        np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
def test_second_derivatives_match_finite_differences_of_the_gradient(op):
    """A gradient of a gradient (ONNX's Gradient composes) through the recurrence product's own derivative rule."""
    feeds = problem(op, 2, T=3, batch=2, H=2, lens=True, initial=True, dtype=np.float64, seed=5)
    outputs_of = traced_outputs(rnn_model(op, feeds, direction="bidirectional"), feeds)

    def loss(R, X):
        return jnp.sum(outputs_of(R=R, X=X)[0] ** 3)

    with jax.enable_x64(True):
        gradient_size = jax.jit(lambda R: jnp.sum(jax.grad(loss, argnums=1)(R, feeds["X"]) ** 2))
        second = jax.grad(gradient_size)(feeds["R"])
        numeric = np.zeros_like(feeds["R"])
        for index in np.ndindex(numeric.shape):
            step = np.zeros_like(numeric)
            step[index] = 1e-6
            numeric[index] = (gradient_size(feeds["R"] + step) - gradient_size(feeds["R"] - step)) / 2e-6
    np.testing.assert_allclose(second, numeric, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
def test_forward_mode_matches_finite_differences(op):
    feeds = problem(op, 1, T=3, batch=2, H=2, dtype=np.float64, seed=2)
    outputs_of = traced_outputs(rnn_model(op, feeds), feeds)

    def loss(R):
        return jnp.sum(outputs_of(R=R)[0] ** 2)

    direction = np.random.default_rng(4).standard_normal(feeds["R"].shape)
    with jax.enable_x64(True):
        _, tangent = jax.jvp(loss, (feeds["R"],), (direction,))
        numeric = (loss(feeds["R"] + 1e-6 * direction) - loss(feeds["R"] - 1e-6 * direction)) / 2e-6
    np.testing.assert_allclose(tangent, numeric, rtol=1e-6)
