"""Model-local functions (FunctionProto): attribute references, attribute defaults, nested calls, and the
fallback that expands an op's schema function body when no direct lowering is registered."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnxtrain
from onnxtrain.errors import ModelLoadError
from onnxtrain.lower.build import Resolver, build_node
from onnxtrain.lower.walker import TraceContext, Scope, run_node

LOCAL = "local.fns"
INT, FLOAT = onnx.AttributeProto.INT, onnx.AttributeProto.FLOAT


def scaled_leaky() -> onnx.FunctionProto:
    """y = LeakyRelu(x * scale, alpha=@alpha); `scale` defaults to 2.0 through attribute_proto."""
    scale = helper.make_node("Constant", [], ["s"], value_float=0.0)
    scale.attribute[0].ref_attr_name = "scale"
    leaky = helper.make_node("LeakyRelu", ["xs"], ["y"])
    alpha = helper.make_attribute("alpha", 0.0)
    alpha.ref_attr_name = "alpha"
    leaky.attribute.append(alpha)
    function = helper.make_function(
        LOCAL, "ScaledLeaky", ["x"], ["y"],
        [scale, helper.make_node("Mul", ["x", "s"], ["xs"]), leaky],
        [helper.make_opsetid("", 17)], attributes=["alpha"],
    )
    function.attribute_proto.append(helper.make_attribute("scale", 2.0))
    return function


def twice() -> onnx.FunctionProto:
    """A function calling another one: ScaledLeaky twice, the outer alpha passed down."""
    inner = [helper.make_node("ScaledLeaky", [i], [o], domain=LOCAL) for i, o in (("x", "h"), ("h", "y"))]
    for node in inner:
        ref = helper.make_attribute("alpha", 0.0)
        ref.ref_attr_name = "alpha"
        node.attribute.append(ref)
    return helper.make_function(LOCAL, "Twice", ["x"], ["y"], inner,
                                [helper.make_opsetid("", 17), helper.make_opsetid(LOCAL, 1)], attributes=["alpha"])


def model_with(node: onnx.NodeProto, functions: Sequence[onnx.FunctionProto] = (), x_type: int = TensorProto.FLOAT,
               size: int = 5) -> onnx.ModelProto:
    """`node` reading x [size] and writing y, float [size], with `functions` (default: ScaledLeaky and Twice)."""
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", x_type, [size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [size])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(LOCAL, 1)],
                             functions=functions or [scaled_leaky(), twice()])


X = np.array([-2.0, -0.5, 0.0, 1.0, 3.0], np.float32)


def test_attribute_reference_and_default():
    node = helper.make_node("ScaledLeaky", ["x"], ["y"], domain=LOCAL, alpha=0.1)
    got = np.asarray(onnxtrain.load(model_with(node)).infer({"x": X})["y"])
    np.testing.assert_allclose(got, np.where(X * 2 > 0, X * 2, 0.1 * X * 2), rtol=1e-6)
    # (onnx's reference evaluator cannot run this function: it fails on attribute references inside it)
    node = helper.make_node("ScaledLeaky", ["x"], ["y"], domain=LOCAL, alpha=0.1, scale=3.0)
    got = np.asarray(onnxtrain.load(model_with(node)).infer({"x": X})["y"])
    np.testing.assert_allclose(got, np.where(X * 3 > 0, X * 3, 0.1 * X * 3), rtol=1e-6)


def test_caller_overrides_the_default_and_nested_calls():
    node = helper.make_node("Twice", ["x"], ["y"], domain=LOCAL, alpha=0.5)
    got = np.asarray(onnxtrain.load(model_with(node)).infer({"x": X})["y"])
    once = np.where(X * 2 > 0, X * 2, 0.5 * X * 2)
    np.testing.assert_allclose(got, np.where(once * 2 > 0, once * 2, 0.5 * once * 2), rtol=1e-6)


def test_schema_function_body_runs_an_op_without_its_lowering():
    """Celu has a function body in its schema; with the direct lowering removed the body must give the same."""
    import jax

    proto = helper.make_node("Celu", ["x"], ["y"], alpha=2.0)
    node = build_node(proto, Resolver({"": 17}, {}))
    scope = Scope({"x": X})
    run_node(dataclasses.replace(node, impl=None), scope, TraceContext(jax.random.key(0)), [node], 0)
    expected = np.maximum(0, X) + np.minimum(0, 2.0 * (np.exp(X / 2.0) - 1))
    np.testing.assert_allclose(np.asarray(scope["y"]), expected, rtol=1e-6)


def test_unsupported_op_inside_a_called_local_function_is_reported_at_load():
    from onnxtrain.errors import UnsupportedOpError

    bad = helper.make_function(LOCAL, "Bad", ["x"], ["y"], [helper.make_node("Frobnicate", ["x"], ["y"], domain="x.y")],
                               [helper.make_opsetid("x.y", 1)])
    node = helper.make_node("Bad", ["x"], ["y"], domain=LOCAL)
    model = model_with(node)
    model.functions.append(bad)
    with pytest.raises(UnsupportedOpError, match="x.y::Frobnicate"):
        onnxtrain.load(model, check=False)


def cast_to_t() -> onnx.FunctionProto:
    """y = Cast(x, to=@t): a data-type attribute set by reference."""
    cast = helper.make_node("Cast", ["x"], ["y"], name="cast")
    to = helper.make_attribute("to", 0)
    to.ref_attr_name = "t"
    cast.attribute.append(to)
    return helper.make_function(LOCAL, "CastTo", ["x"], ["y"], [cast], [helper.make_opsetid("", 17)],
                                attributes=["t"])


def passes_t_on() -> onnx.FunctionProto:
    """CastTo(x, t=@u): a call in a body passing its own caller's attribute on."""
    call = helper.make_node("CastTo", ["x"], ["y"], domain=LOCAL, name="inner")
    t = helper.make_attribute("t", 0)
    t.ref_attr_name = "u"
    call.attribute.append(t)
    return helper.make_function(LOCAL, "Outer", ["x"], ["y"], [call],
                                [helper.make_opsetid("", 17), helper.make_opsetid(LOCAL, 1)], attributes=["u"])


def cast_model(node: onnx.NodeProto) -> onnx.ModelProto:
    return model_with(node, [cast_to_t(), passes_t_on()], TensorProto.INT32, 3)


def test_a_data_type_a_call_gives_its_body_is_checked_at_load():
    node = helper.make_node("CastTo", ["x"], ["y"], domain=LOCAL, name="call", t=99)
    with pytest.raises(ModelLoadError, match=r"^attribute 'to' of node 'cast' of function 'CastTo' called by node "
                                             r"'call' \(it refers to the function's attribute 't'\) is 99, "
                                             r"which is not a TensorProto data type$"):
        onnxtrain.load(cast_model(node), check=False)
    node = helper.make_node("Outer", ["x"], ["y"], domain=LOCAL, name="call", u=99)  # passed on through a call
    with pytest.raises(ModelLoadError, match=r"^attribute 'to' of node 'cast' of function 'CastTo' called by node "
                                             r"'inner' of function 'Outer' called by node 'call' \(it refers to "
                                             r"the function's attribute 't'\) is 99"):
        onnxtrain.load(cast_model(node), check=False)
    x = np.array([-3, 0, 7], np.int32)
    for node in (helper.make_node("CastTo", ["x"], ["y"], domain=LOCAL, t=TensorProto.FLOAT),
                 helper.make_node("Outer", ["x"], ["y"], domain=LOCAL, u=TensorProto.FLOAT)):
        got = onnxtrain.load(cast_model(node)).infer({"x": x})["y"]
        assert got.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(got), x.astype(np.float32))


@pytest.mark.parametrize("call", ["CastTo", "Outer"])
def test_a_required_attribute_a_call_leaves_unset_is_refused_at_load(call):
    """Cast's `to` <- t, and neither the call nor the function's defaults give t (directly, or through Outer's u):
    refused at load, naming the body's node and the reference. It had loaded and failed at the first infer."""
    node = helper.make_node(call, ["x"], ["y"], domain=LOCAL, name="call")
    within = "node 'call'" if call == "CastTo" else "node 'inner' of function 'Outer' called by node 'call'"
    with pytest.raises(ModelLoadError, match=rf"^attribute 'to' of node 'cast' of function 'CastTo' called by "
                                             rf"{within} \(it refers to the function's attribute 't'\) is required "
                                             r"by Cast-13, but the call does not set it and the function has no "
                                             r"default for it$"):
        onnxtrain.load(cast_model(node), check=False)


def referring(name: str, ref: str, kind: int) -> onnx.AttributeProto:
    """A reference with no value field set: onnx.checker refuses one with a value in a subgraph."""
    return onnx.AttributeProto(name=name, ref_attr_name=ref, type=kind)


def with_refs(node: onnx.NodeProto, *refs: onnx.AttributeProto) -> onnx.NodeProto:
    node.attribute.extend(refs)
    return node


def cast_leaky(x: str, y: str, suffix: str) -> list[onnx.NodeProto]:
    """y = LeakyRelu(Cast(x, to=@t), alpha=@alpha)."""
    cast = with_refs(helper.make_node("Cast", [x], [f"c{suffix}"], name=f"cast{suffix}"), referring("to", "t", INT))
    return [cast,
            with_refs(helper.make_node("LeakyRelu", [f"c{suffix}"], [y]), referring("alpha", "alpha", FLOAT))]


def branches() -> onnx.FunctionProto:
    """Branches(x, c) = If(c): a Loop of 3 steps v <- LeakyRelu(v, alpha=@alpha) - Cast(i, to=@t) from
    v = Cast(x, to=@t) (the Loop's body a subgraph of a subgraph); else LeakyRelu(Cast(x, to=@t), alpha=@alpha)."""
    f32 = TensorProto.FLOAT
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond"], ["cond_out"]),
         with_refs(helper.make_node("LeakyRelu", ["v"], ["leaky"]), referring("alpha", "alpha", FLOAT)),
         with_refs(helper.make_node("Cast", ["i"], ["fi"], name="cast_i"), referring("to", "t", INT)),
         helper.make_node("Sub", ["leaky", "fi"], ["v_out"])],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
                 helper.make_tensor_value_info("v", f32, None)],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_out", f32, None)],
    )
    steps = helper.make_node("Constant", [], ["m"], value=helper.make_tensor("m", TensorProto.INT64, [], [3]))
    loop = helper.make_node("Loop", ["m", "", "v0"], ["looped"], body=body)
    then = helper.make_graph([steps, with_refs(helper.make_node("Cast", ["x"], ["v0"], name="cast_x"),
                                               referring("to", "t", INT)), loop],
                             "then", [], [helper.make_tensor_value_info("looped", f32, None)])
    other = helper.make_graph(cast_leaky("x", "leaked", "_else"), "else", [],
                              [helper.make_tensor_value_info("leaked", f32, None)])
    branch = helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)
    return helper.make_function(LOCAL, "Branches", ["x", "c"], ["y"], [branch], [helper.make_opsetid("", 17)],
                                attributes=["t", "alpha"])


def branches_model(**attributes) -> onnx.ModelProto:
    node = helper.make_node("Branches", ["x", "c"], ["y"], domain=LOCAL, name="call", **attributes)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.INT32, [4]),
                                            helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(LOCAL, 1)],
                             functions=[branches()])


def test_references_in_a_function_bodys_subgraphs_take_the_calls_values():
    """onnx.proto allows a reference (ref_attr_name) in a subgraph of a function body, at any depth: an If's
    branches and a Loop's body inside one take the call's `to` and `alpha` (they had been dropped: a TypeError)."""
    x = np.array([-6, -1, 0, 5], np.int32)
    engine = onnxtrain.load(branches_model(t=TensorProto.FLOAT, alpha=0.25))
    leaky = lambda v: np.where(v > 0, v, np.float32(0.25) * v)  # noqa: E731
    expected = x.astype(np.float32)
    for i in range(3):
        expected = leaky(expected) - np.float32(i)
    for c, want in ((True, expected), (False, leaky(x.astype(np.float32)))):
        got = engine.infer({"x": x, "c": np.array(c)})["y"]
        assert got.dtype == np.float32
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


def test_a_bad_data_type_a_call_gives_a_subgraph_of_its_body_is_refused_at_load():
    with pytest.raises(ModelLoadError, match=r"^attribute 'to' of node 'cast_else' of function 'Branches' called by "
                                             r"node 'call' \(it refers to the function's attribute 't'\) is 99, "
                                             r"which is not a TensorProto data type$"):
        onnxtrain.load(branches_model(t=99, alpha=0.25), check=False)
