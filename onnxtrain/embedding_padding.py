"""Padding rows of embedding tables: the rows PyTorch's `nn.Embedding(padding_idx=p)` never trains.

PyTorch's embedding backward gives row p no gradient ("the entries at padding_idx do not contribute to the
gradient"), while the ONNX export is a plain Gather, whose gradient adds every lookup's, padding tokens' included:
trained as the graph says, a batch with padding moves row p where PyTorch leaves it (and a language model's
padding vector drifts). make_trainable therefore zeroes those rows of the table's gradient
(optimizers.zero_parts), right after the Gradient node and before clipping, decay and the optimizer, which is where
PyTorch's zero sits: weight decay still moves the row, as torch.optim's does.

The rows come from `padding_idx={table: row}`, or, by default, from the dynamo exporter's provenance of each
Gather (`pkg.torch.onnx.fx_node`, which spells out `aten.embedding(weight, indices, padding_idx)`); the TorchScript
exporter keeps none, so its exports need the option. Only a table that nothing but such lookups reads is masked:
a table tied to an output projection also takes that projection's gradient in row p, which PyTorch keeps, and
the ONNX Gradient gives only the sum, so such a table is left as ONNX computes it, with a warning.
"""

from __future__ import annotations

import re
import warnings
from typing import Iterator, Mapping

import onnx

from .errors import AuthoringError
from .optimizers import is_integer
from .parameters import ParameterizationWarning, recorded_call, uses

# aten.embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False); -1: no padding row
EMBEDDING_CALL = re.compile(r"aten\.embedding\.default\]\(args = \(%[\w.]+, %[\w.]+, (-?\d+)(, True)?")


def embedding_lookups(graph: onnx.GraphProto) -> Iterator[tuple[str, re.Match]]:
    """(table, the recorded aten.embedding call) of each Gather the dynamo exporter made from an embedding."""
    for node in graph.node:
        call = EMBEDDING_CALL.search(recorded_call(node)) if node.op_type == "Gather" else None
        if call:
            yield node.input[0], call


def exported_padding_rows(graph: onnx.GraphProto) -> dict[str, int]:
    """{table: padding row} of the Gathers the dynamo exporter made from an embedding with a padding_idx."""
    return {table: int(call.group(1)) for table, call in embedding_lookups(graph) if int(call.group(1)) >= 0}


def frequency_scaled(graph: onnx.GraphProto) -> list[str]:
    """Tables the dynamo exporter records as looked up with scale_grad_by_freq=True."""
    return [table for table, call in embedding_lookups(graph) if call.group(2)]


def padding_rows(model: onnx.ModelProto, params: list[str], padding_idx: Mapping[str, int] | None,
                 shapes: Mapping[str, tuple[int, ...]]) -> dict[str, int]:
    """The padding row of each trained table to mask: `padding_idx` as given (checked), or the exporter's. Warns
    about a trained table PyTorch scales the gradient of by the lookups' frequencies in the batch
    (scale_grad_by_freq), which ONNX's Gather has no notion of either, and which is not reproduced."""
    scaled = [table for table in frequency_scaled(model.graph) if table in params]
    if scaled:
        warnings.warn(ParameterizationWarning(
            f"{', '.join(scaled)}: looked up with scale_grad_by_freq=True, whose gradient PyTorch divides by each "
            f"index's count in the batch; the ONNX Gradient sums the lookups' gradients unscaled, so these train "
            f"differently (construct the embedding without scale_grad_by_freq to train as PyTorch would)"),
            stacklevel=3)
    if padding_idx is None:
        found = exported_padding_rows(model.graph)
        return {table: row for table, row in found.items() if table in params and masked_alone(model, table)}
    if not isinstance(padding_idx, Mapping):
        raise AuthoringError(f"padding_idx is a mapping {{embedding table: padding row}}, not "
                             f"{type(padding_idx).__name__}")
    rows = {}
    for table, row in padding_idx.items():
        if table not in params:
            raise AuthoringError(f"padding_idx: {table!r} is not a trained parameter")
        size = shapes[table][0] if shapes[table] else 0
        if not is_integer(row) or not -size <= row < size:
            raise AuthoringError(f"padding_idx: row {row!r} of {table!r} is not an integer in [{-size}, {size})")
        if masked_alone(model, table):
            rows[table] = int(row) % size
    return rows


def masked_alone(model: onnx.ModelProto, table: str) -> bool:
    """Whether only lookups (Gathers along the first axis, in the main graph) read `table`; warns otherwise."""
    lookups = [node for node in model.graph.node if node.op_type == "Gather" and node.input[0] == table
               and all(a.i == 0 for a in node.attribute if a.name == "axis")]
    used = uses(model.graph)[table]
    if len(used) == len(lookups):
        return True
    others = sorted({op for op, index in used if (op, index) != ("Gather", 0)}) or ["a Gather along another axis"]
    warnings.warn(ParameterizationWarning(
        f"{table!r} has a padding row (PyTorch's padding_idx) but is also read by {', '.join(others)}: PyTorch "
        f"keeps that reader's gradient in the row and the ONNX Gradient gives only the sum, so the row trains as "
        f"the graph says"), stacklevel=4)
    return False
