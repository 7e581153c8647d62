"""onnx.backend.base.Backend at module level (as onnxruntime.backend does), so ONNX's backend tests and tools
drive the engine. A prepared rep keeps its engine: repeated `run` calls neither re-lower nor re-compile."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep, Device, DeviceType

from .dtypes import onnx_type
from .engine import Engine, load


def host(value: Any) -> Any:
    """Device results as NumPy for callers that compare with NumPy (sequences stay lists, None stays None)."""
    if value is None:
        return None
    if isinstance(value, list):
        return [host(v) for v in value]
    if isinstance(value, dict):  # an ONNX map, as ONNX Runtime returns it
        return {k: np.asarray(v).item() for k, v in value.items()}
    return np.asarray(value)


class OnnxTrainRep(BackendRep):
    def __init__(self, engine: Engine):
        self.engine = engine

    def run(self, inputs: Sequence[Any] | Mapping[str, Any] | Any, **kwargs: Any) -> list[Any]:
        if isinstance(inputs, Mapping):
            feeds = dict(inputs)
        else:
            if isinstance(inputs, np.ndarray) or not isinstance(inputs, (list, tuple)):
                inputs = [inputs]
            order = [i.name for i in self.engine.required_inputs + self.engine.optional_inputs]
            feeds = dict(zip(order, inputs))
        outputs = self.engine.infer(feeds)
        return [host(outputs[name]) for name in self.engine.output_names]


class OnnxTrainBackend(Backend):
    @classmethod
    def is_compatible(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> bool:
        return cls.supports_device(device)

    @classmethod
    def prepare(cls, model: Any, device: str = "CPU", **kwargs: Any) -> OnnxTrainRep:
        return OnnxTrainRep(load(model, **kwargs))

    @classmethod
    def run_model(cls, model: Any, inputs: Any, device: str = "CPU", **kwargs: Any) -> list[Any]:
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(
        cls, node: onnx.NodeProto, inputs: Any, device: str = "CPU", outputs_info=None, **kwargs: Any
    ) -> list[Any]:
        """Run one node: a model is built around it with input types taken from `inputs`."""
        values = list(inputs.values()) if isinstance(inputs, Mapping) else list(inputs)
        names = [n for n in node.input if n]
        graph_inputs = [
            onnx.helper.make_tensor_value_info(name, onnx_type(np.asarray(v).dtype), np.shape(v))
            for name, v in zip(names, values)
        ]
        graph_outputs = [onnx.helper.make_empty_tensor_value_info(name) for name in node.output if name]
        graph = onnx.helper.make_graph([node], "run_node", graph_inputs, graph_outputs)
        opset = kwargs.pop("opset_version", onnx.defs.onnx_opset_version())
        domain = node.domain or ""
        model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid(domain, opset)])
        return cls.run_model(model, dict(zip(names, values)), device, check=False, **kwargs)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        import jax

        kind = Device(device).type
        if kind == DeviceType.CPU:
            return True
        return kind == DeviceType.CUDA and any(d.platform == "gpu" for d in jax.devices())


is_compatible = OnnxTrainBackend.is_compatible
prepare = OnnxTrainBackend.prepare
run_model = OnnxTrainBackend.run_model
run_node = OnnxTrainBackend.run_node
supports_device = OnnxTrainBackend.supports_device
