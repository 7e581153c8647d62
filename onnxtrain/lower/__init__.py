"""ONNX -> JAX lowering. The modules here are the machinery (registry, walker, values, layout, target and the
helpers several op groups share); `ops/` holds the operators, one module per op group. Importing this package
registers every op."""

from . import ops  # noqa: F401  (registers every op)
