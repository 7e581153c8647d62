"""Models exported from PyTorch run and match PyTorch's own outputs, at two batch sizes, one compile each."""

from __future__ import annotations

import io

import numpy as np
import onnx
import pytest

import onnxtrain

torch = pytest.importorskip("torch")


class LSTMTagger(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = torch.nn.LSTM(6, 12, num_layers=2, batch_first=True, bidirectional=True)
        self.head = torch.nn.Linear(24, 3)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out)


class EncoderBlock(torch.nn.Module):
    """Pre-norm multi-head self-attention + GELU feed-forward, written out (torch's fused layer does not trace)."""

    def __init__(self, d: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.ff = torch.nn.Sequential(torch.nn.Linear(d, 2 * d), torch.nn.GELU(), torch.nn.Linear(2 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attention = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1)
        x = x + self.proj((attention @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.ff(self.norm2(x))


def models():
    torch.manual_seed(0)
    return {
        "mlp": (torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)), (10,)),
        "cnn": (torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(8, 16, 3, stride=2), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
            torch.nn.Linear(16, 5)).eval(), (3, 16, 16)),
        "transformer": (EncoderBlock().eval(), (7, 32)),
        "lstm": (LSTMTagger().eval(), (9, 6)),
    }


def export(module, example) -> onnx.ModelProto:
    buffer = io.BytesIO()
    torch.onnx.export(module, (example,), buffer, dynamo=False, input_names=["X"], output_names=["Y"],
                      dynamic_axes={"X": {0: "batch"}, "Y": {0: "batch"}}, opset_version=17)
    return onnx.load_from_string(buffer.getvalue())


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer", "lstm"])
def test_pytorch_export_matches_pytorch_at_two_batch_sizes(name):
    module, shape = models()[name]
    rng = np.random.default_rng(0)
    engine = onnxtrain.load(export(module, torch.zeros(2, *shape)))
    for batch in (2, 5, 2, 5):
        x = rng.normal(size=(batch, *shape)).astype(np.float32)
        with torch.no_grad():
            expected = module(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(np.asarray(engine.infer({"X": x})["Y"]), expected, rtol=1e-3, atol=1e-4)
    assert engine.trace_count == 2  # one per batch size; repeated shapes reuse the compiled program


class GRUClassifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = torch.nn.GRU(3, 8, batch_first=True)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        out, _ = self.gru(x)
        return self.head(out[:, -1])


def test_dynamic_shapes_export_trains_like_pytorch_over_varying_batches():
    """A dynamo export with a dynamic batch (torch.export.Dim), made trainable with the default set and trained on
    batches of different sizes, as PyTorch trains the module (the last step's loss reads the weights the earlier
    steps made). The GRU's zero initial state depends on the batch size: the export makes it as Expand(0-d zero,
    shape) inside the recorded torch.zeros call, where a static export folds it into a tensor; that zero is no
    parameter (trained, it moved the initial state). The length stays fixed: torch 2.13's export specializes an
    RNN's length from the second such export in a process (from_torch warns of it), so a dynamic length would
    depend on which tests ran before in the process."""
    pytest.importorskip("onnxscript")
    torch.manual_seed(0)
    module = GRUClassifier().eval()
    trained = GRUClassifier().eval()
    trained.load_state_dict(module.state_dict())
    model = torch.onnx.export(module, (torch.zeros(2, 5, 3),), dynamo=True, verbose=False, input_names=["X"],
                              dynamic_shapes=({0: torch.export.Dim("batch")},)).model_proto
    engine = onnxtrain.load(onnxtrain.make_trainable(model, loss="cross_entropy", optimizer="sgd", learning_rate=0.5))
    optimizer = torch.optim.SGD(trained.parameters(), lr=0.5)
    rng = np.random.default_rng(0)
    for shape in [(2, 5), (3, 5), (2, 5)]:
        x = rng.normal(size=(*shape, 3)).astype(np.float32)
        y = rng.integers(0, 2, size=shape[0])
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(trained(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        optimizer.step()
        np.testing.assert_allclose(float(engine.train_step({"X": x, "target": y})["loss"]), loss.item(), rtol=1e-5)
    assert engine.trace_count == 2  # one train step compile per shape
