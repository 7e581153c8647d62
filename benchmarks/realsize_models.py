"""Real-size models for benchmarks/realsize.py: Hugging Face models built from their default configs (random
weights, nothing downloaded) and ResNet-18 / MobileNetV3-small written in plain PyTorch (PyPI's torchvision does
not load beside the CPU build of torch this project tests with).

Each model is a `Case`: a module returning class logits [batch, classes] (a language model's last position, so
every peer trains the same cross-entropy on integer labels), or a language model's logits at every position
[batch, positions, vocabulary] with a next-token label per position, and a function making its named inputs. Dropout is
off (probability 0) so a train step computes the same function in every peer; BatchNorm modules stay in eval
mode (PyTorch's `eval()`, the statistics an eval-mode ONNX export carries), i.e. fine-tuning with frozen
statistics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn


@dataclass(frozen=True)
class Case:
    module: Callable[[], nn.Module]  # builds the module with seeded random weights
    inputs: Callable[[int, np.random.Generator], dict[str, np.ndarray]]  # batch -> named inputs, in call order
    classes: int
    positions: int = 0  # a language model's: its logits [batch, positions, classes], one label per position
    timed: bool = True  # in realsize.py's default set (agreement.py's holds every case)

    def labels(self, batch: int, rng: np.random.Generator) -> np.ndarray:
        """A class per example, or per position of a language model, whose last two are -100 (a padded batch's
        label, as Hugging Face's collators write it), which both peers' cross-entropy ignores."""
        if not self.positions:
            return rng.integers(0, self.classes, batch).astype(np.int64)
        labels = rng.integers(0, self.classes, (batch, self.positions)).astype(np.int64)
        labels[:, -2:] = -100
        return labels


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """PyTorch's cross-entropy over the last axis, as make_trainable's `class_axis=-1` (torch wants the classes
    on axis 1: a language model's [batch, positions, vocabulary] is moved; [batch, classes] stays)."""
    return nn.functional.cross_entropy(logits.movedim(-1, 1), labels)


class LastPosition(nn.Module):
    """A language model's logits at the last position: [batch, vocabulary]."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.model(*args).logits[:, -1]


class Logits(nn.Module):
    """A Hugging Face classifier's logits tensor instead of its output dataclass."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.model(*args).logits


def token_inputs(vocabulary: int, **sequences: int) -> Callable[[int, np.random.Generator], dict]:
    """Random token ids for each named input, of its own sequence length."""
    return lambda batch, rng: {name: rng.integers(0, vocabulary, (batch, length)).astype(np.int64)
                               for name, length in sequences.items()}


def image_inputs(batch: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"image": rng.normal(size=(batch, 3, 224, 224)).astype(np.float32)}


def bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return Logits(BertForSequenceClassification(config))


def gpt2_lm_head() -> nn.Module:
    """GPT-2 124M with its language-model head, tied to the token embedding as GPT2LMHeadModel ties it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def gpt2() -> nn.Module:
    return LastPosition(gpt2_lm_head())


def gpt2_lm() -> nn.Module:
    return Logits(gpt2_lm_head())


def t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    # t5-small's shape: d_model 512, 6 + 6 layers, 8 heads, d_ff 2048, vocabulary 32128
    # eager attention: the dynamo exporter fails on the SDPA form's reshape of a permuted view (torch 2.13)
    config = T5Config(d_model=512, d_ff=2048, num_layers=6, num_heads=8, dropout_rate=0.0,
                      attn_implementation="eager")

    class Seq2Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = T5ForConditionalGeneration(config)

        def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=input_ids, decoder_input_ids=decoder_input_ids).logits[:, -1]

    return Seq2Seq()


def conv_bn(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(*conv_bn(cin, cout, 3, stride), nn.ReLU(), *conv_bn(cout, cout, 3))
        self.skip = nn.Sequential(*conv_bn(cin, cout, 1, stride)) if stride != 1 or cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


def resnet18() -> nn.Module:
    layers: list[nn.Module] = [*conv_bn(3, 64, 7, 2), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
        cin = cout
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 1000))


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, squeezed: int):
        super().__init__()
        self.gate = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(channels, squeezed, 1), nn.ReLU(),
                                  nn.Conv2d(squeezed, channels, 1), nn.Hardsigmoid())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gate(x)


def make_divisible(value: float) -> int:
    return max(8, int(value + 4) // 8 * 8)


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, kernel: int, expanded: int, cout: int, se: bool, hardswish: bool, stride: int):
        super().__init__()
        act = nn.Hardswish if hardswish else nn.ReLU
        layers: list[nn.Module] = [] if expanded == cin else [*conv_bn(cin, expanded, 1), act()]
        layers += [*conv_bn(expanded, expanded, kernel, stride, groups=expanded), act()]
        if se:
            layers.append(SqueezeExcite(expanded, make_divisible(expanded / 4)))
        layers += conv_bn(expanded, cout, 1)
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x) if self.residual else self.body(x)


# MobileNetV3-small (Howard et al. 2019, table 2): kernel, expanded, out, squeeze-excite, hard-swish, stride
MOBILENET_V3_SMALL = [
    (3, 16, 16, True, False, 2), (3, 72, 24, False, False, 2), (3, 88, 24, False, False, 1),
    (5, 96, 40, True, True, 2), (5, 240, 40, True, True, 1), (5, 240, 40, True, True, 1),
    (5, 120, 48, True, True, 1), (5, 144, 48, True, True, 1), (5, 288, 96, True, True, 2),
    (5, 576, 96, True, True, 1), (5, 576, 96, True, True, 1),
]


def mobilenet_v3_small() -> nn.Module:
    layers: list[nn.Module] = [*conv_bn(3, 16, 3, 2), nn.Hardswish()]
    cin = 16
    for kernel, expanded, cout, se, hardswish, stride in MOBILENET_V3_SMALL:
        layers.append(InvertedResidual(cin, kernel, expanded, cout, se, hardswish, stride))
        cin = cout
    layers += [*conv_bn(cin, 576, 1), nn.Hardswish(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
               nn.Linear(576, 1024), nn.Hardswish(), nn.Linear(1024, 1000)]
    return nn.Sequential(*layers)


CASES: dict[str, Case] = {
    "bert-base": Case(bert, token_inputs(30522, input_ids=128), 2),
    "gpt2": Case(gpt2, token_inputs(50257, input_ids=128), 50257),
    "t5-small": Case(t5, token_inputs(32128, input_ids=128, decoder_input_ids=32), 32128),
    "resnet18": Case(resnet18, image_inputs, 1000),
    "mobilenetv3-small": Case(mobilenet_v3_small, image_inputs, 1000),
    # trained as a language model: next-token loss at all 128 positions through the tied head
    "gpt2-lm": Case(gpt2_lm, token_inputs(50257, input_ids=128), 50257, positions=128, timed=False),
}


def build(name: str) -> nn.Module:
    """The module of case `name` with the same random weights in every process, in eval mode."""
    torch.manual_seed(0)
    return CASES[name].module().eval()
