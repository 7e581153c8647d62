"""ONNX's node suite and the model suites shipped in the onnx wheel, through onnxtrain.backend."""

from __future__ import annotations

import warnings

import pytest

from conformance import all_case_names, run_case
from known_failures import KNOWN_FAILURES


def params():
    for name in all_case_names():
        marks = ()
        if name in KNOWN_FAILURES:
            marks = (pytest.mark.xfail(reason=KNOWN_FAILURES[name], strict=True),)
        yield pytest.param(name, id=name, marks=marks)


@pytest.mark.parametrize("name", list(params()))
def test_case(name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_case(name)
