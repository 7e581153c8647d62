"""The test model zoo: small configurations of the architectures people export from PyTorch (hidden 32-64, one or
two layers, sequence 8-16, batch 2), each with example inputs, the loss it trains on and a target for it.

HF models are built from configs with random weights (nothing downloads). Every parameter is then moved by seeded
noise, as training moves weights: LayerNorm scales leave 1 and biases leave 0, so no two parameters (and no
parameter and lifted constant) hold the same values, which the tests rely on to map ONNX initializers back to
parameters by value (TorchScript's exporter renames and transposes some)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only: never reach for the hub

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

BATCH = 2
SEQ = 8
VOCAB = 64
PAD = 0  # the padding token of the models that pad (their embeddings' padding_idx)


@dataclass(frozen=True)
class ZooModel:
    """`build()` returns the module in eval mode with perturbed parameters; `inputs` are its forward arguments;
    `loss` is make_trainable's loss on the first output and `target` draws that loss's target."""

    build: Callable[[], nn.Module]
    inputs: Callable[[np.random.Generator], tuple[np.ndarray, ...]]
    loss: str
    target: Callable[[np.random.Generator, tuple[int, ...]], np.ndarray]

    def module(self) -> nn.Module:
        """The same module at every call: HF initialises from torch's global generator."""
        torch.manual_seed(0)
        return self.build()


def perturbed(module: nn.Module, seed: int = 0) -> nn.Module:
    """Every trained parameter plus seeded N(0, 0.02) noise (zero biases and unit LayerNorm scales included), and
    BatchNorm running statistics away from 0 and 1, as a trained network's are; a frozen parameter
    (requires_grad off: Whisper's sinusoidal positions) stays as the model made it, as training leaves it."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad:
                p.add_(0.02 * torch.randn(p.shape, generator=generator))
        for m in module.modules():
            # every BatchNorm (1d, 2d, 3d) that keeps running statistics: fresh ones (0 and 1) would be merged by
            # exporters into one initializer per value, and their use would not show
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
                m.running_mean.uniform_(-0.5, 0.5, generator=generator)
                m.running_var.uniform_(0.5, 2.0, generator=generator)
    return module.eval()


class Logits(nn.Module):
    """A HF model's `logits` (or `last_hidden_state`) alone, so the export has one tensor output; the forward
    arguments are passed by keyword (`names`), since HF's positional order puts caches between them."""

    def __init__(self, model: nn.Module, names: tuple[str, ...], field: str = "logits"):
        super().__init__()
        self.model, self.names, self.field = model, names, field

    def forward(self, *inputs):
        return getattr(self.model(**dict(zip(self.names, inputs))), self.field)


class ResidualBlock(nn.Module):
    def __init__(self, channels: int, stride: int):
        super().__init__()
        out = channels * stride
        self.conv1 = nn.Conv2d(channels, out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out)
        self.conv2 = nn.Conv2d(out, out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out)
        self.shortcut = nn.Sequential() if stride == 1 else nn.Sequential(
            nn.Conv2d(channels, out, 1, stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, classes: int = 5):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.blocks = nn.Sequential(ResidualBlock(8, 1), ResidualBlock(8, 2))
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, squeezed: int):
        super().__init__()
        self.reduce, self.expand = nn.Conv2d(channels, squeezed, 1), nn.Conv2d(squeezed, channels, 1)

    def forward(self, x):
        scale = nn.functional.adaptive_avg_pool2d(x, 1)
        return x * nn.functional.hardsigmoid(self.expand(torch.relu(self.reduce(scale))))


class InvertedResidual(nn.Module):
    """MobileNetV3's block: 1x1 expand, depthwise 3x3, squeeze-excite, 1x1 project, hard-swish."""

    def __init__(self, channels: int, expanded: int):
        super().__init__()
        self.expand = nn.Sequential(nn.Conv2d(channels, expanded, 1, bias=False), nn.BatchNorm2d(expanded),
                                    nn.Hardswish())
        self.depthwise = nn.Sequential(nn.Conv2d(expanded, expanded, 3, 1, 1, groups=expanded, bias=False),
                                       nn.BatchNorm2d(expanded), nn.Hardswish())
        self.se = SqueezeExcite(expanded, 8)
        self.project = nn.Sequential(nn.Conv2d(expanded, channels, 1, bias=False), nn.BatchNorm2d(channels))

    def forward(self, x):
        return x + self.project(self.se(self.depthwise(self.expand(x))))


class MobileNetV3(nn.Module):
    def __init__(self, classes: int = 5):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.Hardswish())
        self.block = InvertedResidual(16, 32)
        self.head = nn.Sequential(nn.Linear(16, 32), nn.Hardswish(), nn.Linear(32, classes))

    def forward(self, x):
        return self.head(self.block(self.stem(x)).mean((2, 3)))


class LSTMClassifier(nn.Module):
    def __init__(self, classes: int = 5):
        super().__init__()
        self.lstm = nn.LSTM(12, 32, batch_first=True)
        self.head = nn.Linear(32, classes)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


class GRUClassifier(nn.Module):
    """Two stacked GRU layers, InstanceNorm1d over the hidden features, a head on the last step."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.gru = nn.GRU(12, 16, num_layers=2, batch_first=True)
        self.norm = nn.InstanceNorm1d(16, affine=True)
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        out, _ = self.gru(x)
        return self.head(self.norm(out.transpose(1, 2))[:, :, -1])


class WeightNormed(nn.Module):
    """A linear layer under weight_norm's parametrization (weight = g * v / |v|, g and v the parameters)."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.linear = nn.utils.parametrizations.weight_norm(nn.Linear(12, 16))
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        return self.head(torch.tanh(self.linear(x)).mean(1))


class TorchTransformer(nn.Module):
    """PyTorch's own nn.TransformerEncoder (scaled_dot_product_attention inside) over an embedding with a padding
    row, fed padded sequences: PyTorch never trains that row."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32, padding_idx=PAD)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, classes)

    def forward(self, ids):
        return self.head(self.encoder(self.embed(ids)).mean(dim=1))


class TextCNN(nn.Module):
    """Conv1d and a depthwise Conv1d over padded token embeddings, max-pooled over time."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16, padding_idx=PAD)
        self.conv = nn.Conv1d(16, 24, 3, padding=1)
        self.depthwise = nn.Conv1d(24, 24, 3, padding=1, groups=24)
        self.head = nn.Linear(24, classes)

    def forward(self, ids):
        h = torch.relu(self.conv(self.embed(ids).transpose(1, 2)))
        return self.head(nn.functional.adaptive_max_pool1d(nn.functional.gelu(self.depthwise(h)), 1).squeeze(-1))


class UNet(nn.Module):
    """A small U-Net: GroupNorm and SiLU, a strided convolution down, a transposed convolution and a bilinear
    upsampling back, the skip concatenated, a PixelShuffle head under LeakyReLU."""

    def __init__(self):
        super().__init__()
        self.inc = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.SiLU())
        self.down = nn.Sequential(nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.GroupNorm(4, 16), nn.SiLU())
        self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.upsample = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.mix = nn.Conv2d(32, 8, 3, padding=1)
        self.shuffle = nn.Sequential(nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.PixelShuffle(2))
        self.out = nn.Conv2d(2, 2, 1)

    def forward(self, x):
        a = self.inc(x)
        b = self.down(a)
        h = self.mix(torch.cat([a, self.up(b), self.upsample(b)], dim=1))
        return self.out(nn.functional.leaky_relu(self.shuffle(h), 0.1))


class DenseNet(nn.Module):
    """Pre-activation BatchNorm-ReLU-Conv layers, each fed the concatenation of all earlier maps: BatchNorm with no
    Conv before it, which the default exports keep (its scale and shift train)."""

    def __init__(self, channels: int = 8, growth: int = 4, layers: int = 3, classes: int = 5):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.BatchNorm2d(channels + i * growth), nn.ReLU(),
                          nn.Conv2d(channels + i * growth, growth, 3, padding=1, bias=False)) for i in range(layers))
        self.transition = nn.Sequential(nn.BatchNorm2d(channels + layers * growth), nn.ReLU(),
                                        nn.Conv2d(channels + layers * growth, 8, 1), nn.AvgPool2d(2))
        self.head = nn.Linear(8, classes)

    def forward(self, x):
        features = [self.stem(x)]
        for layer in self.layers:
            features.append(layer(torch.cat(features, 1)))
        return self.head(self.transition(torch.cat(features, 1)).mean((2, 3)))


class VisionOps(nn.Module):
    """A spatial transformer's warp (affine_grid, whose base grid the dynamo exporter folds, and grid_sample),
    sub-pixel up- and downsampling, nearest and bicubic resizing, a ceil_mode max pool."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.loc = nn.Sequential(nn.Conv2d(3, 4, 3, 2, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                                 nn.Linear(16, 6))
        self.identity = nn.Parameter(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0]))
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Tanh(), nn.Conv2d(8, 3 * 4, 3, padding=1))
        self.mix = nn.Conv2d(3 * 4 + 3 * 3, 8, 3, padding=1)
        self.head = nn.Linear(8, classes)

    def forward(self, x):  # x [B, 3, 8, 8]
        theta = (self.identity + 0.1 * self.loc(x)).view(-1, 2, 3)
        warped = F.grid_sample(x, F.affine_grid(theta, list(x.shape), align_corners=False), align_corners=False)
        big = F.pixel_shuffle(self.body(warped), 2)  # [B, 3, 16, 16]
        small = F.pixel_unshuffle(big, 2)  # [B, 12, 8, 8]
        resized = [F.interpolate(warped, scale_factor=2, mode="nearest"),
                   F.interpolate(small[:, :3], size=(16, 16), mode="bicubic", align_corners=False),
                   F.interpolate(small[:, 3:6], size=(16, 16), mode="bicubic", align_corners=True)]
        h = torch.tanh(self.mix(torch.cat([big.repeat(1, 4, 1, 1), *resized], 1)))
        return self.head(F.max_pool2d(h, 3, 2, 1, ceil_mode=True).amax((2, 3)))


class Attention(nn.Module):
    """nn.MultiheadAttention (batch_first) with a key_padding_mask of the padding tokens, its head-averaged weights
    used too: it makes a float mask of zeros_like, which the dynamo exporter folds into an initializer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 5)

    def forward(self, ids):
        h = self.embed(ids)
        out, weights = self.attn(h, h, h, key_padding_mask=ids == PAD)
        return self.head(out.mean(1)) + weights.mean(1)[:, :5]


class Scans(nn.Module):
    """cumsum over learned values, topk / sort / argmax + gather picking values (values differentiable), and
    sigmoid(decay) of a parameter, which the dynamo exporter folds into a tensor of its own."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(12, 16)
        self.decay = nn.Parameter(torch.full((SEQ, 16), 0.9))
        self.head = nn.Linear(16 * 3 + 4 + SEQ, 5)

    def forward(self, x):
        h = self.a(x)
        c = torch.cumsum(h, dim=1)
        p = torch.cumsum(torch.sigmoid(self.decay) * torch.tanh(h), dim=1).flip(1)
        top, _ = torch.topk(h.mean(1), 4, dim=-1)
        ordered, _ = torch.sort(h[:, -1], dim=-1, descending=True)
        picked = torch.gather(c, -1, torch.argmax(h, dim=-1, keepdim=True)).squeeze(-1)
        return self.head(torch.cat([c.mean(1), p.sum(1), ordered, top, picked], -1))


class Scatter(nn.Module):
    """scatter_add into torch.zeros (folded into an initializer by the dynamo exporter), scatter_reduce amax,
    index_select, argsort + gather, the indices buffers."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(12, 16)
        self.register_buffer("route", torch.tensor([0, 2, 1, 0, 3, 2, 1, 3]))
        self.register_buffer("pick", torch.tensor([5, 1, 7, 2]))
        self.head = nn.Linear(16 * 3 + SEQ, 5)

    def forward(self, x):
        h = self.a(x)  # [B, S, 16]
        index = self.route.view(1, SEQ, 1).expand(h.shape[0], SEQ, 16)
        pooled = torch.zeros(h.shape[0], 4, 16).scatter_add(1, index, h)
        largest = torch.full((h.shape[0], 4, 16), -1.0).scatter_reduce(1, index, h * 2, "amax")
        chosen = torch.index_select(h, 1, self.pick)
        gathered = torch.gather(h[:, :, 1], 1, torch.argsort(h[:, :, 0], dim=1))
        return self.head(torch.cat([pooled.mean(1), largest.amax(1), chosen.mean(1), gathered], -1))


class Norms(nn.Module):
    """LayerNorm without affine parameters (its ones and zeros folded by the dynamo exporter), RMSNorm, Bilinear,
    F.normalize, clamp with parameter bounds, where, logsumexp, var / std (both corrections), amax / amin, norm."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(12, 16)
        self.ln = nn.LayerNorm(16, elementwise_affine=False)
        self.rms = nn.RMSNorm(16, eps=1e-5)
        self.bilinear = nn.Bilinear(16, 16, 8)
        self.low = nn.Parameter(torch.full((16,), -0.5))
        self.high = nn.Parameter(torch.full((16,), 0.2))
        self.head = nn.Linear(8 + 16 * 2 + 8, 5)

    def forward(self, x):
        h = self.a(x)
        r = self.rms(h)
        b = self.bilinear(self.ln(h), r).mean(1)
        w = torch.where(h > 0.3, F.normalize(h, dim=-1), torch.clamp(h, self.low, self.high)).mean(1)
        stats = torch.stack([torch.logsumexp(h, dim=(1, 2)), h.var(dim=(1, 2)), h.var(dim=(1, 2), unbiased=False),
                             h.std(dim=(1, 2)), h.std(dim=(1, 2), correction=0), h.amax(dim=(1, 2)),
                             h.amin(dim=(1, 2)), torch.norm(h, dim=(1, 2))], -1)
        return self.head(torch.cat([b, w, r.amax(1), torch.tanh(0.1 * stats)], -1))


class Generator(nn.Module):
    """A DCGAN generator: the noise projected by Linear + BatchNorm1d, then ConvTranspose2d + BatchNorm2d + ReLU
    up to the image under Tanh. The default dynamo export folds both BatchNorms, into the Gemm and into the
    ConvTranspose (the TorchScript export keeps them)."""

    def __init__(self, noise: int = 8):
        super().__init__()
        self.project = nn.Sequential(nn.Linear(noise, 8 * 4 * 4, bias=False), nn.BatchNorm1d(8 * 4 * 4), nn.ReLU())
        self.up = nn.Sequential(nn.ConvTranspose2d(8, 4, 4, 2, 1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                                nn.ConvTranspose2d(4, 3, 3, 1, 1), nn.Tanh())

    def forward(self, z):
        return self.up(self.project(z).view(-1, 8, 4, 4))


class LoopModule(nn.Module):
    """A recurrence scripted with a Python for loop over a fixed count. TorchScript's exporter unrolls the fixed
    count (four Gemm, Add, Tanh); a fed count stays an ONNX Loop (tests/test_remat.py trains one)."""

    def __init__(self, steps: int = 4):
        super().__init__()
        self.steps = steps
        self.cell = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = x
        for _ in range(self.steps):
            h = torch.tanh(self.cell(h) + x)
        return self.head(h)


def scripted_loop() -> nn.Module:
    return torch.jit.script(perturbed(LoopModule()))


def bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=32, num_labels=3, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    return perturbed(Logits(BertForSequenceClassification(config), ("input_ids", "attention_mask")))


def gpt2(tied: bool = True) -> nn.Module:
    """With its attention mask fed: without one, transformers' packed-sequence check calls aten::diff, which
    TorchScript's exporter cannot export."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
                        tie_word_embeddings=tied)
    return perturbed(Logits(GPT2LMHeadModel(config), ("input_ids", "attention_mask")))


def hugging_face(config: str, model: str, names: tuple[str, ...], **settings) -> nn.Module:
    """transformers' `model` class from its `config` class with `settings`, perturbed, its logits alone."""
    import transformers

    return perturbed(Logits(getattr(transformers, model)(getattr(transformers, config)(**settings)), names))


DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=32, use_cache=False, attention_dropout=0.0, bos_token_id=0, eos_token_id=0,
               pad_token_id=0, attn_implementation="eager")
ENCODER = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
               num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def llama() -> nn.Module:
    """A Llama-style decoder, the layout of most language models now: RMSNorm, rotary positions, a SiLU-gated
    feed-forward, grouped-query attention (2 key/value heads for 4 query heads), an untied head."""
    return hugging_face("LlamaConfig", "LlamaForCausalLM", ("input_ids", "attention_mask"), **DECODER,
                        num_key_value_heads=2)


def qwen2() -> nn.Module:
    """Llama's layout with biases on the query, key and value products."""
    return hugging_face("Qwen2Config", "Qwen2ForCausalLM", ("input_ids", "attention_mask"), **DECODER,
                        num_key_value_heads=2)


def gemma() -> nn.Module:
    """Multi-query attention (one key/value head), embeddings scaled by sqrt(width), a GELU-gated feed-forward,
    RMSNorm with a (1 + weight) scale, and the head tied to the embedding."""
    return hugging_face("GemmaConfig", "GemmaForCausalLM", ("input_ids", "attention_mask"), **DECODER,
                        num_key_value_heads=1, head_dim=8)


def roberta() -> nn.Module:
    """BERT with positions counted from the padding index, derived from the token ids: a padding token's position is
    the padding row of the position embedding, which PyTorch does not train either."""
    return hugging_face("RobertaConfig", "RobertaForSequenceClassification", ("input_ids", "attention_mask"), **ENCODER,
                        max_position_embeddings=40, pad_token_id=1)


def albert() -> nn.Module:
    """One layer's weights shared by every layer, and a factorized embedding (16 wide, projected to 32)."""
    return hugging_face("AlbertConfig", "AlbertForSequenceClassification", ("input_ids",), **ENCODER,
                        embedding_size=16, max_position_embeddings=32, classifier_dropout_prob=0.0)


def distilbert() -> nn.Module:
    return hugging_face("DistilBertConfig", "DistilBertForSequenceClassification", ("input_ids",),
                        vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=32,
                        num_labels=3, dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0)


def mobilebert() -> nn.Module:
    """Bottlenecks around each layer's attention, stacked feed-forwards, NoNorm (an elementwise scale and shift in
    place of LayerNorm), and a trigram input: each token's embedding beside its neighbours', Pad with 0.0 at the
    ends (the dynamo export reads that 0.0 as its masks' Where operand too: a setting, not a parameter)."""
    return hugging_face("MobileBertConfig", "MobileBertForSequenceClassification", ("input_ids", "attention_mask"),
                        **ENCODER, embedding_size=16, intra_bottleneck_size=16, true_hidden_size=16,
                        num_feedforward_networks=2, max_position_embeddings=32)


def convnext() -> nn.Module:
    """7x7 depthwise convolutions, LayerNorm over channels-last activations, a per-channel layer scale."""
    return hugging_face("ConvNextConfig", "ConvNextForImageClassification", ("pixel_values",), num_channels=3,
                        hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=3, drop_path_rate=0.0)


def t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1,
                      num_heads=4, relative_attention_num_buckets=8, dropout_rate=0.0, use_cache=False,
                      decoder_start_token_id=0)
    names = ("input_ids", "attention_mask", "decoder_input_ids")
    return perturbed(Logits(T5ForConditionalGeneration(config), names))


def vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=4, intermediate_size=64, num_labels=3, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0)
    return perturbed(Logits(ViTForImageClassification(config), ("pixel_values",)))


def whisper_encoder() -> nn.Module:
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    config = WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, d_model=32, encoder_layers=2,
                           encoder_attention_heads=4, encoder_ffn_dim=64, max_source_positions=SEQ, dropout=0.0,
                           attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, bos_token_id=0,
                           eos_token_id=0, decoder_start_token_id=0)
    return perturbed(Logits(WhisperEncoder(config), ("input_features",), "last_hidden_state"))


IDS_MASK = ("input_ids", "attention_mask")


def deberta_v2() -> nn.Module:
    """Disentangled relative attention (content-to-position and position-to-content scores gathered by relative
    distance, 8 buckets) over absolute positions; the dynamo export folds the position projections repeated per
    sequence."""
    return hugging_face("DebertaV2Config", "DebertaV2ForSequenceClassification", IDS_MASK, **ENCODER,
                        max_position_embeddings=32, relative_attention=True, position_buckets=8,
                        pos_att_type=["p2c", "c2p"], pad_token_id=0, pooler_dropout=0.0, pooler_hidden_size=32,
                        attn_implementation="eager")


def bart() -> nn.Module:
    """An encoder-decoder the dynamo exporter exports (T5 fails there): one embedding shared by the encoder, the
    decoder and the head (padding row 1), learned positions offset by 2, and final_logits_bias, a buffer."""
    return hugging_face("BartConfig", "BartForConditionalGeneration", IDS_MASK + ("decoder_input_ids",),
                        vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
                        use_cache=False, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                        attn_implementation="eager", dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)


def bloom() -> nn.Module:
    """ALiBi position biases (per-head slopes, which the dynamo exporter folds, times the attention mask's running
    count), LayerNorm after the embedding, the head tied to it."""
    return hugging_face("BloomConfig", "BloomForCausalLM", IDS_MASK, vocab_size=VOCAB, hidden_size=32, n_layer=2,
                        n_head=4, hidden_dropout=0.0, attention_dropout=0.0, use_cache=False, pad_token_id=0,
                        bos_token_id=0, eos_token_id=0, attn_implementation="eager")


def qwen2_moe() -> nn.Module:
    """A sparse mixture of experts: router softmax and top-2 of 4 experts, a Gather of the 3-D expert weights by
    the routed ids (its gradient a scatter-add into the experts), batched products, a shared expert behind a
    sigmoid gate. experts_implementation="batched_mm": transformers' default grouped_mm has no ONNX function in the
    dynamo exporter, and "eager" loops over the experts hit (a guard torch.export cannot make; TorchScript traces
    a NonZero of run-time size)."""
    return hugging_face("Qwen2MoeConfig", "Qwen2MoeForCausalLM", IDS_MASK, **DECODER, num_key_value_heads=2,
                        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                        shared_expert_intermediate_size=32, decoder_sparse_step=1, norm_topk_prob=False,
                        output_router_logits=False, mlp_only_layers=[], experts_implementation="batched_mm")


def mamba() -> nn.Module:
    """Mamba's slow path (no fused kernels): a depthwise causal Conv1d read as weight.squeeze(1).unsqueeze(1),
    softplus'd time steps, A = -exp(A_log), the selective scan unrolled over the sequence from a torch.zeros state
    per layer (one initializer for both layers in the dynamo export), RMSNorm, the head tied to the embedding.
    Time steps in [0.3, 0.9]: from the default [0.001, 0.1] the dt_proj biases move less than a float32 ulp in
    five steps, which test_zoo cannot tell from a constant."""
    return hugging_face("MambaConfig", "MambaForCausalLM", ("input_ids",), vocab_size=VOCAB, hidden_size=16,
                        state_size=4, num_hidden_layers=2, expand=2, conv_kernel=4, time_step_rank=4,
                        time_step_min=0.3, time_step_max=0.9, use_cache=False, use_mambapy=False, pad_token_id=0,
                        bos_token_id=0, eos_token_id=0)


def clip() -> nn.Module:
    """A text and a vision tower in one graph: the text pooled at argmax(input_ids), both L2-normalized, logits
    exp(logit_scale) * text @ image.T (the dynamo exporter folds the exp)."""
    import transformers

    text = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                max_position_embeddings=SEQ, projection_dim=8, bos_token_id=0, eos_token_id=2, pad_token_id=1)
    vision = dict(image_size=16, patch_size=4, num_channels=3, hidden_size=16, intermediate_size=32,
                  num_hidden_layers=1, num_attention_heads=2, projection_dim=8)
    config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=8)
    return perturbed(Logits(transformers.CLIPModel(config), ("input_ids", "pixel_values"), "logits_per_image"))


def tokens(rng: np.random.Generator) -> np.ndarray:
    return rng.integers(1, VOCAB, size=(BATCH, SEQ)).astype(np.int64)


def padded(pad: int = PAD, with_mask: bool = False) -> Callable[[np.random.Generator], tuple[np.ndarray, ...]]:
    """Token ids whose two sequences end in 2 and 3 `pad` tokens (no other token is `pad`), and with_mask their
    attention mask (0 at the padding)."""
    def inputs(rng: np.random.Generator) -> tuple[np.ndarray, ...]:
        ids = rng.integers(2, VOCAB, size=(BATCH, SEQ)).astype(np.int64)
        attention = np.ones((BATCH, SEQ), np.int64)
        for row, count in enumerate((2, 3)):
            ids[row, -count:], attention[row, -count:] = pad, 0
        return (ids, attention) if with_mask else (ids,)

    return inputs


def mask() -> np.ndarray:
    return np.ones((BATCH, SEQ), np.int64)


def unpadded_pairs(rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """An encoder-decoder's inputs without its padding token 1 (a tied table's padding row also takes the head's
    gradient, which only PyTorch keeps apart), an attention mask with padding, decoder tokens."""
    ids = lambda: rng.integers(2, VOCAB, size=(BATCH, SEQ)).astype(np.int64)  # noqa: E731
    return ids(), padded(1, with_mask=True)(rng)[1], ids()


def text_and_image(rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    return tokens(rng), rng.normal(size=(BATCH, 3, 16, 16)).astype(np.float32)


def normal(*shape: int) -> Callable[[np.random.Generator], tuple[np.ndarray, ...]]:
    return lambda rng: (rng.normal(size=(BATCH, *shape)).astype(np.float32),)


def classes(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Class indices for logits of `shape` [B, C]."""
    return rng.integers(0, shape[1], size=shape[:1]).astype(np.int64)


def lm_labels(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Next-token labels [B, S] for logits [B, S, V]; the last two positions are padding (-100, ignored)."""
    labels = rng.integers(0, shape[-1], size=shape[:2]).astype(np.int64)
    labels[:, -2:] = -100
    return labels


def regression(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.normal(size=shape).astype(np.float32)


ZOO: dict[str, ZooModel] = {
    "resnet": ZooModel(lambda: perturbed(ResNet()), normal(3, 16, 16), "cross_entropy", classes),
    "mobilenetv3": ZooModel(lambda: perturbed(MobileNetV3()), normal(3, 16, 16), "cross_entropy", classes),
    "bert": ZooModel(bert, padded(with_mask=True), "cross_entropy", classes),
    "gpt2": ZooModel(gpt2, lambda rng: (tokens(rng), mask()), "mse", regression),
    "llama": ZooModel(llama, lambda rng: (tokens(rng), mask()), "mse", regression),
    "qwen2": ZooModel(qwen2, lambda rng: (tokens(rng), mask()), "mse", regression),
    "gemma": ZooModel(gemma, lambda rng: (tokens(rng), mask()), "mse", regression),
    "roberta": ZooModel(roberta, padded(1, with_mask=True), "cross_entropy", classes),
    "albert": ZooModel(albert, lambda rng: (tokens(rng),), "cross_entropy", classes),
    "distilbert": ZooModel(distilbert, lambda rng: (tokens(rng),), "cross_entropy", classes),
    "mobilebert": ZooModel(mobilebert, padded(with_mask=True), "cross_entropy", classes),
    "convnext": ZooModel(convnext, normal(3, 16, 16), "cross_entropy", classes),
    "t5": ZooModel(t5, lambda rng: (tokens(rng), mask(), tokens(rng)), "mse", regression),
    "vit": ZooModel(vit, normal(3, 16, 16), "cross_entropy", classes),
    "whisper_encoder": ZooModel(whisper_encoder, normal(8, 2 * SEQ), "mse", regression),
    "lstm": ZooModel(lambda: perturbed(LSTMClassifier()), normal(SEQ, 12), "cross_entropy", classes),
    "gru": ZooModel(lambda: perturbed(GRUClassifier()), normal(SEQ, 12), "cross_entropy", classes),
    "weight_norm": ZooModel(lambda: perturbed(WeightNormed()), normal(SEQ, 12), "cross_entropy", classes),
    "torch_transformer": ZooModel(lambda: perturbed(TorchTransformer()), padded(), "cross_entropy", classes),
    "textcnn": ZooModel(lambda: perturbed(TextCNN()), padded(), "cross_entropy", classes),
    "unet": ZooModel(lambda: perturbed(UNet()), normal(3, 16, 16), "mse", regression),
    "deberta_v2": ZooModel(deberta_v2, padded(with_mask=True), "cross_entropy", classes),
    "bart": ZooModel(bart, unpadded_pairs, "mse", regression),
    "bloom": ZooModel(bloom, lambda rng: (tokens(rng), mask()), "mse", regression),
    "clip": ZooModel(clip, text_and_image, "cross_entropy", classes),
    "densenet": ZooModel(lambda: perturbed(DenseNet()), normal(3, 16, 16), "cross_entropy", classes),
    "vision_ops": ZooModel(lambda: perturbed(VisionOps()), normal(3, 8, 8), "cross_entropy", classes),
    "attention": ZooModel(lambda: perturbed(Attention()), padded(), "cross_entropy", classes),
    "scans": ZooModel(lambda: perturbed(Scans()), normal(SEQ, 12), "cross_entropy", classes),
    "scatter": ZooModel(lambda: perturbed(Scatter()), normal(SEQ, 12), "mse", regression),
    "norms": ZooModel(lambda: perturbed(Norms()), normal(SEQ, 12), "mse", regression),
    "script_loop": ZooModel(scripted_loop, normal(16), "mse", regression),
    "qwen2_moe": ZooModel(qwen2_moe, lambda rng: (tokens(rng), mask()), "mse", regression),
    "mamba": ZooModel(mamba, lambda rng: (tokens(rng),), "mse", regression),
    "dcgan": ZooModel(lambda: perturbed(Generator()), normal(8), "mse", regression),
}

# GPT-2 trained as a language model; untied embeddings keep the tied-weight question (see ZOO's gpt2) out
LANGUAGE_MODEL = ZooModel(lambda: gpt2(tied=False), lambda rng: (tokens(rng), mask()), "cross_entropy", lm_labels)
