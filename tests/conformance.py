"""ONNX's own conformance suites, run through onnxtrain.backend and compared as onnx's runner compares."""

from __future__ import annotations

import functools
import glob
import os
import warnings

import onnx
from onnx import numpy_helper
from onnx.backend.test.loader import load_model_tests
from onnx.backend.test.runner import Runner

import onnxtrain.backend as backend

MODEL_SUITES = ("simple", "pytorch-converted", "pytorch-operator")
# ONNX's nine real architectures with constant weights, shipped in the wheel under data/light; onnx's loader calls
# that suite "real" and its runner generates their inputs
LIGHT_SUITE = "real"


@functools.cache
def node_cases() -> dict[str, object]:
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {case.name: case for case in collect_testcases()}


@functools.cache
def model_cases() -> dict[str, object]:
    cases = {f"{suite}/{case.name}": case for suite in MODEL_SUITES for case in load_model_tests(kind=suite)}
    cases.update({f"light/{case.name}": case for case in load_model_tests(kind=LIGHT_SUITE)})
    return cases


def light_path(case) -> str:
    """A light case's model file: its url is relative to the folder holding the onnx package."""
    return os.path.join(os.path.dirname(os.path.dirname(onnx.__file__)), case.url)


def light_data_set(case) -> tuple[list, list]:
    """As onnx's runner makes it: each non-initializer input filled by Runner.generate_dummy_data (not random),
    the expected outputs from the files shipped beside the model."""
    model = onnx.load(light_path(case))
    initialized = {i.name for i in model.graph.initializer}
    inputs = [Runner.generate_dummy_data(i, seed=0, name=case.model_name, random=False)
              for i in model.graph.input if i.name not in initialized]
    prefix = os.path.splitext(light_path(case))[0]
    outputs = [read_value(f"{prefix}_output_{i}.pb", o.type) for i, o in enumerate(model.graph.output)]
    return inputs, outputs


def all_case_names() -> list[str]:
    return sorted(node_cases()) + sorted(model_cases())


def read_value(path: str, type_proto: onnx.TypeProto):
    data = open(path, "rb").read()
    if type_proto.HasField("sequence_type"):
        proto = onnx.SequenceProto()
        proto.ParseFromString(data)
        return numpy_helper.to_list(proto)
    if type_proto.HasField("optional_type"):
        proto = onnx.OptionalProto()
        proto.ParseFromString(data)
        return numpy_helper.to_optional(proto)
    proto = onnx.TensorProto()
    proto.ParseFromString(data)
    return numpy_helper.to_array(proto)


def data_sets(case) -> list[tuple[list, list]]:
    if case.data_sets is not None:
        normalize = lambda v: numpy_helper.to_array(v) if isinstance(v, onnx.TensorProto) else v  # noqa: E731
        return [([normalize(v) for v in i], [normalize(v) for v in o]) for i, o in case.data_sets]
    if case.model_dir is None:
        return [light_data_set(case)]
    model = onnx.load(os.path.join(case.model_dir, "model.onnx"))
    sets = []
    for folder in sorted(glob.glob(os.path.join(case.model_dir, "test_data_set*"))):
        n_in = len(glob.glob(os.path.join(folder, "input_*.pb")))
        n_out = len(glob.glob(os.path.join(folder, "output_*.pb")))
        inputs = [read_value(os.path.join(folder, f"input_{i}.pb"), model.graph.input[i].type) for i in range(n_in)]
        outputs = [
            read_value(os.path.join(folder, f"output_{i}.pb"), model.graph.output[i].type) for i in range(n_out)
        ]
        sets.append((inputs, outputs))
    return sets


def case_model(case) -> onnx.ModelProto:
    if case.model is not None:
        return case.model
    if case.model_dir is None:
        return onnx.load(light_path(case))
    return onnx.load(os.path.join(case.model_dir, "model.onnx"))


def run_case(name: str) -> None:
    """Raise if onnxtrain disagrees with the case's expected outputs (dtype, shape, rtol/atol)."""
    case = node_cases().get(name) or model_cases()[name]
    rep = backend.prepare(case_model(case))
    for inputs, expected in data_sets(case):
        outputs = rep.run(inputs)
        assert len(outputs) == len(expected), f"{len(outputs)} outputs, expected {len(expected)}"
        for want, got in zip(expected, outputs):
            # one output at a time, wrapped, so ONNX's comparison also handles sequences of 0-d tensors
            if isinstance(want, list):
                assert isinstance(got, list) and len(got) == len(want), f"sequence {got!r}, expected {want!r}"
                pairs = list(zip(want, got))
            else:
                pairs = [(want, got)]
            for w, g in pairs:
                Runner.assert_similar_outputs([w], [g], rtol=case.rtol, atol=case.atol, model_dir=name)


def main() -> None:
    """Print the pass count and each failure's first line; used to keep known_failures.py honest."""
    import sys
    import traceback

    pattern = sys.argv[1] if len(sys.argv) > 1 else ""
    passed, failed = 0, {}
    for name in all_case_names():
        if pattern not in name:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                run_case(name)
            passed += 1
        except Exception as exc:  # noqa: BLE001 - a report of every kind of failure
            line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
            failed[name] = f"{type(exc).__name__}: {line}"
            if os.environ.get("CONFORMANCE_TRACEBACK"):
                traceback.print_exc()
    for name, why in sorted(failed.items()):
        print(f"FAIL {name}: {why}")
    node_total = sum(1 for n in node_cases() if pattern in n)
    node_passed = node_total - sum(1 for n in failed if n in node_cases())
    print(f"node suite: {node_passed}/{node_total} passed; all suites: {passed} passed, {len(failed)} failed")


if __name__ == "__main__":
    main()
