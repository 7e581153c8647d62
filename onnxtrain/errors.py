"""Every failure a user can cause is one of these, raised as early as possible and naming the culprit."""

from __future__ import annotations


class OnnxTrainError(Exception):
    """Base class of every error onnxtrain raises on purpose."""


class ModelLoadError(OnnxTrainError):
    """The file or bytes are not a valid ONNX model (truncated, not protobuf, rejected by onnx.checker)."""


class ExternalDataError(ModelLoadError):
    """An external-data reference is malformed, missing, outside the model's folder, or in a model without one."""


class UnsupportedOpError(OnnxTrainError):
    """The model uses operators this engine does not implement; lists all of them at once."""

    def __init__(self, missing: list[tuple[str, str, int]]):
        self.missing = sorted(set(missing))
        # opset -1: the model imports no version of the node's domain (build.py), so no operator of it can bind
        lines = [f"  {domain or 'ai.onnx'}::{op_type} "
                 + (f"(opset {opset})" if opset >= 0 else "(its domain is not in the model's opset_import)")
                 for domain, op_type, opset in self.missing]
        if any(domain == "org.pytorch.aten" for domain, _, _ in self.missing):
            lines.append("org.pytorch.aten's are PyTorch's own operators, which torch.onnx.export(..., "
                         "operator_export_type=ONNX_ATEN_FALLBACK) writes where it has no ONNX form for them: export "
                         "with the default operator_export_type (torch's error names an opset that has the operator), "
                         "or with dynamo=True")
        super().__init__("unsupported operators:\n" + "\n".join(lines))


class FeedError(OnnxTrainError):
    """A feed is missing, unknown, or has the wrong dtype, rank or shape."""


class BindingError(OnnxTrainError):
    """A TrainingInfoProto binding breaks a rule of the ONNX IR spec."""


class StateError(OnnxTrainError):
    """An assignment to a state variable changes its shape or dtype, or names an unknown variable."""


class NodeError(OnnxTrainError):
    """A node cannot be lowered with the values it receives (bad attribute, incompatible shapes...)."""


class ValueTooLargeError(NodeError):
    """A node's result would be larger than what must hold it: this host's memory for a value built on the host (a
    constant: ConstantOfShape, Range, any node whose inputs are all known at compile time, computed at load), any
    device's for a traced one. Raised before it is allocated; at load where its inputs are constants."""

    def __init__(self, description: str, node: str | None = None):
        self.description = description
        self.node = node
        super().__init__(f"{node}: {description}" if node else description)


class StaticValueRequired(NodeError):
    """An input that XLA needs at compile time (a shape, an axis list, a count) is only known at run time."""

    def __init__(self, what: str, value_name: str | None = None, node: str | None = None, reason: str = ""):
        self.what = what
        self.value_name = value_name
        self.node = node
        self.reason = reason
        where = f" of node {node}" if node else ""
        named = f" (value {value_name!r})" if value_name else ""
        why = f"; {reason}" if reason else ""
        super().__init__(
            f"input {what!r}{where}{named} must be known at compile time (a constant, an initializer, "
            f"or computed from shapes), but it depends on run-time data{why}"
        )


class AuthoringError(OnnxTrainError):
    """make_trainable's options do not fit the model (loss vs. output, trainable names, learning rate)."""


class ExportError(OnnxTrainError):
    """The trained model cannot be written."""


class CheckpointError(ExportError):
    """fit's last checkpoint could not be written (the disk full, an I/O error), after every earlier failed one was
    warned of and trained past; the engine holds the trained state. `written`: the step count of the last checkpoint
    this fit call wrote, which the file still holds (None: it wrote none, the file is as before the call);
    `reason`: the failed write, its path and the system's reason."""

    def __init__(self, message: str, written: int | None, reason: str):
        super().__init__(message)
        self.written = written
        self.reason = reason


class StepError(OnnxTrainError):
    """A train step or infer failed while it ran (out of device memory, a runtime XLA error), or before it ran, JAX
    unable to lower or compile its program; the state is as before it unless the message says otherwise, and JAX's
    error is the __cause__."""


class DivergenceError(OnnxTrainError):
    """Training diverged: the loss (or a state variable) became NaN or infinite."""


class OptionError(OnnxTrainError):
    """An option of load / Engine or the command line has a value it does not accept (named with the allowed ones)."""
