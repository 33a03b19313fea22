"""Model specs: small architectures as frozen data, built into modules deterministically.

A ``ModelSpec`` prints as a line a person can paste (``ModelSpec(kind='mlp', features=3,
hidden=4, outputs=2, depth=2, activation='tanh')``), pickles to another process, and
``spec.build(seed)`` always gives the same module. Every module maps its inputs to
``(batch, outputs)`` logits (inside a tuple, dict or namedtuple for the structured-output
kinds), or, for ``loss-head``, takes the targets and returns ``(logits, loss)``.

The exact-arithmetic kinds (``EXACT_KINDS``, also outside ``KINDS``) and the activation
``leaky_relu`` (``EXACT_ACTIVATIONS``) complete the set exact mode computes without
rounding (``dpverify.exact``): convolutions with pooling over power-of-two windows, and
concatenation.

The language-model heads (``TOKEN_KINDS``, kept out of ``KINDS`` so that what the default
strategies draw is unchanged) take ``input_ids`` and ``labels=`` and return the mean
cross-entropy over the labels that are not the ignore index; a ``TokenBatch`` is a padded
batch of them as data, and a ``TokenScenario`` puts one on devices with such a head.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dpverify.core.devices import cuda_device_count
from dpverify.core.errors import InvalidArgument
from dpverify.core.items import IGNORE_INDEX
from dpverify.core.scatter import chunk_sizes
from dpverify.core.tree import map_tensors

__all__ = [
    "ACTIVATIONS",
    "CLASSIFICATION_LOSSES",
    "EXACT_ACTIVATIONS",
    "EXACT_KINDS",
    "EXACT_SLOPE",
    "KINDS",
    "LOSSES",
    "PADDING_SIDES",
    "SHARDED_KINDS",
    "TOKEN_KINDS",
    "BuiltScenario",
    "DeviceList",
    "LanguageModelHead",
    "LossSpec",
    "ModelSpec",
    "Output",
    "Scenario",
    "TokenBatch",
    "TokenMean",
    "TokenScenario",
    "primary_output",
    "tied_sequential",
]

#: Architecture kinds, simplest first: hypothesis shrinks toward the front.
KINDS: tuple[str, ...] = (
    "linear",
    "mlp",
    "residual",
    "layernorm",
    "conv1d",
    "conv2d",
    "embedding",
    "tied-embedding",
    "gru",
    "lstm",
    "attention",
    "kwargs",
    "tuple-output",
    "dict-output",
    "namedtuple-output",
    "buffer-counter",
    "attribute-counter",
    "batchnorm",
    "dropout",
    "loss-head",
)
#: Language-model heads (``LanguageModelHead``), plain and causal (shifted by one like Hugging
#: Face's causal LM heads). Not in ``KINDS``: ``model_specs()`` and ``scenarios()`` draw them
#: only when asked, and ``token_scenarios()`` draws them with padded token batches.
TOKEN_KINDS: tuple[str, ...] = ("lm-head", "causal-lm-head")
#: Models the sharded checks need as they are: ``sequential`` is a bare ``nn.Sequential`` of
#: ``depth + 1`` Linear layers with activations between them (``0``, ``2``, ... are the
#: Linear layers), whose top-level children a pipeline splits into stages and whose Linear
#: pairs a tensor-parallel plan shards colwise then rowwise. ``tied-sequential`` is the
#: pipelines' language model in miniature, an ``nn.Sequential`` of as many children whose
#: first is an embedding and whose last, the output projection, shares its weight
#: (``TiedSequential``): a pipeline puts the two copies on the first and the last stage.
#: Not in ``KINDS``, so that what the default strategies draw is unchanged.
SHARDED_KINDS: tuple[str, ...] = ("sequential", "tied-sequential")
#: Models of exact mode's set (``dpverify.exact``) that ``KINDS`` has no equal of:
#: ``conv-pool`` is a Conv2d (3x3, padding 1) on 4x4 inputs, an activation, pooling over
#: 2x2 windows (``pooling``: max, mean, or sum) and a Linear head; ``concat`` concatenates
#: each hidden layer's activation to its input (a densely connected MLP of ``depth``
#: layers) before a Linear head. Not in ``KINDS``, so that what the default strategies draw
#: is unchanged; ``dpverify.strategies.exact_scenarios`` draws them.
EXACT_KINDS: tuple[str, ...] = ("conv-pool", "concat")
_ALL_KINDS = KINDS + TOKEN_KINDS + SHARDED_KINDS + EXACT_KINDS
#: Where a ``TokenBatch`` pads its rows.
PADDING_SIDES: tuple[str, ...] = ("right", "left")
ACTIVATIONS: tuple[str, ...] = ("relu", "tanh", "gelu", "sigmoid", "silu")
#: The activations exact mode computes without rounding: ReLU, and LeakyReLU with the
#: dyadic slope ``EXACT_SLOPE`` (``leaky_relu``, not in ``ACTIVATIONS`` so that what the
#: default strategies draw is unchanged).
EXACT_ACTIVATIONS: tuple[str, ...] = ("relu", "leaky_relu")
#: ``leaky_relu``'s negative slope: a power of two, so that its products round nothing.
EXACT_SLOPE = 2.0**-3
POOLINGS: tuple[str, ...] = ("mean", "sum", "max")

_SEQUENCE = 5  # time steps / tokens / spatial size of generated inputs
_EXACT_SIDE = 4  # the spatial size of ``conv-pool``'s inputs: 2x2 windows tile it
_VOCAB = 11
_LM_VOCAB = 64  # the language-model heads' vocabulary; id 0 pads, real tokens are 1 .. 63
_PAD_ID = 0

#: The namedtuple that ``namedtuple-output`` models return.
Output = namedtuple("Output", ["logits", "features"])


_ACTIVATION_TYPES: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU, "sigmoid": nn.Sigmoid, "silu": nn.SiLU,
    "leaky_relu": lambda: nn.LeakyReLU(EXACT_SLOPE),
}


def _activation(name: str) -> nn.Module:
    return _ACTIVATION_TYPES[name]()


class MLP(nn.Module):
    def __init__(self, features: int, hidden: int, outputs: int, depth: int, activation: str) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), _activation(activation)]
            width = hidden
        layers.append(nn.Linear(width, outputs))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.layers(x)
        return out


class Residual(nn.Module):
    def __init__(self, features: int, hidden: int, outputs: int, depth: int, activation: str) -> None:
        super().__init__()
        self.stem = nn.Linear(features, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, hidden), _activation(activation)) for _ in range(depth)
        )
        self.head = nn.Linear(hidden, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = h + block(h)
        out: torch.Tensor = self.head(h)
        return out


class Normed(nn.Module):
    """Linear, a normalisation layer, activation, dropout (optional), Linear."""

    def __init__(self, features: int, hidden: int, outputs: int, activation: str, norm: str, p: float) -> None:
        super().__init__()
        self.inp = nn.Linear(features, hidden)
        self.norm = nn.LayerNorm(hidden) if norm == "layer" else nn.BatchNorm1d(hidden) if norm == "batch" else nn.Identity()
        self.act = _activation(activation)
        self.drop = nn.Dropout(p) if p > 0 else nn.Identity()
        self.out = nn.Linear(hidden, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(self.drop(self.act(self.norm(self.inp(x)))))
        return out


class Conv(nn.Module):
    def __init__(self, dims: int, channels: int, hidden: int, outputs: int, activation: str) -> None:
        super().__init__()
        conv = nn.Conv1d if dims == 1 else nn.Conv2d
        self.conv = conv(channels, hidden, kernel_size=3, padding=1)
        self.act = _activation(activation)
        self.head = nn.Linear(hidden, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.conv(x)).flatten(2).mean(dim=2)
        out: torch.Tensor = self.head(h)
        return out


class ConvPool(nn.Module):
    """Conv2d (3x3, padding 1), activation, pooling over 2x2 windows, Linear head."""

    def __init__(self, channels: int, hidden: int, outputs: int, activation: str, pooling: str) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, hidden, kernel_size=3, padding=1)
        self.act = _activation(activation)
        # a sum over each window is an average whose divisor is 1
        self.pool = nn.MaxPool2d(2) if pooling == "max" else nn.AvgPool2d(2, divisor_override=1 if pooling == "sum" else None)
        self.head = nn.Linear(hidden * (_EXACT_SIDE // 2) ** 2, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.pool(self.act(self.conv(x))).flatten(1))
        return out


class Concat(nn.Module):
    """A densely connected MLP: each of ``depth`` layers appends its activation to its
    input (``torch.cat``), then a Linear head reads them all."""

    def __init__(self, features: int, hidden: int, outputs: int, depth: int, activation: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(features + i * hidden, hidden) for i in range(depth))
        self.act = _activation(activation)
        self.head = nn.Linear(features + depth * hidden, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.cat([x, self.act(layer(x))], dim=-1)
        out: torch.Tensor = self.head(x)
        return out


class Pooled(nn.Module):
    """Embedding table, pooling over tokens, Linear head."""

    def __init__(self, hidden: int, outputs: int, pooling: str) -> None:
        super().__init__()
        self.embedding = nn.Embedding(_VOCAB, hidden)
        self.head = nn.Linear(hidden, outputs)
        self.pooling = pooling

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        e = self.embedding(tokens)
        h = e.mean(1) if self.pooling == "mean" else e.sum(1) if self.pooling == "sum" else e.amax(1)
        out: torch.Tensor = self.head(h)
        return out


class Tied(nn.Module):
    """The output layer is the embedding table, shared (tied weights)."""

    def __init__(self, hidden: int, activation: str) -> None:
        super().__init__()
        self.embedding = nn.Embedding(_VOCAB, hidden)
        self.mix = nn.Linear(hidden, hidden)
        self.act = _activation(activation)
        self.decoder = nn.Linear(hidden, _VOCAB, bias=False)
        self.decoder.weight = self.embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.decoder(self.act(self.mix(self.embedding(tokens).mean(1))))
        return out


class TokenMean(nn.Module):
    """The mean over the token dimension (dim 1) of a ``(batch, tokens, hidden)`` tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(1)


def tied_sequential(hidden: int, depth: int, activation: str) -> nn.Sequential:
    """``nn.Sequential(Embedding, TokenMean, (Linear, activation) * (depth - 1), Linear)``,
    ``2 * depth + 1`` children like ``sequential``, the last Linear's weight the
    embedding's (tied): token ids in, one logit per vocabulary entry out."""
    embedding = nn.Embedding(_VOCAB, hidden)
    layers: list[nn.Module] = [embedding, TokenMean()]
    for _ in range(depth - 1):
        layers += [nn.Linear(hidden, hidden), _activation(activation)]
    head = nn.Linear(hidden, _VOCAB, bias=False)
    head.weight = embedding.weight
    return nn.Sequential(*layers, head)


class Recurrent(nn.Module):
    def __init__(self, cell: str, features: int, hidden: int, outputs: int, depth: int) -> None:
        super().__init__()
        rnn = nn.GRU if cell == "gru" else nn.LSTM
        self.rnn = rnn(features, hidden, num_layers=depth, batch_first=True)
        self.head = nn.Linear(hidden, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq, _ = self.rnn(x)
        out: torch.Tensor = self.head(seq[:, -1])
        return out


class Attention(nn.Module):
    def __init__(self, features: int, hidden: int, outputs: int) -> None:
        super().__init__()
        self.inp = nn.Linear(features, 2 * hidden)
        self.attention = nn.MultiheadAttention(2 * hidden, num_heads=2, batch_first=True)
        self.head = nn.Linear(2 * hidden, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        attended, _ = self.attention(h, h, h, need_weights=False)
        out: torch.Tensor = self.head(attended.mean(1))
        return out


class Scaled(nn.Module):
    """``forward(x, *, scale)``: a keyword tensor argument, scattered like the inputs."""

    def __init__(self, features: int, outputs: int) -> None:
        super().__init__()
        self.linear = nn.Linear(features, outputs)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(x) * scale
        return out


class Structured(nn.Module):
    """Returns the logits with its hidden features, as a tuple, a dict or a namedtuple."""

    def __init__(self, features: int, hidden: int, outputs: int, activation: str, form: str) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, hidden), _activation(activation))
        self.head = nn.Linear(hidden, outputs)
        self.form = form

    def forward(self, x: torch.Tensor) -> Any:
        features = self.body(x)
        logits = self.head(features)
        if self.form == "tuple":
            return logits, features
        if self.form == "dict":
            return {"logits": logits, "features": features}
        return Output(logits, features)


class BufferCounter(nn.Module):
    """Counts the rows it has seen in a buffer, updated in place in ``forward``."""

    rows_seen: torch.Tensor

    def __init__(self, features: int, outputs: int) -> None:
        super().__init__()
        self.linear = nn.Linear(features, outputs)
        self.register_buffer("rows_seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rows_seen.add_(x.shape[0])
        out: torch.Tensor = self.linear(x)
        return out


class AttributeCounter(nn.Module):
    """Counts its calls in a Python attribute set in ``forward``."""

    def __init__(self, features: int, outputs: int) -> None:
        super().__init__()
        self.linear = nn.Linear(features, outputs)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        out: torch.Tensor = self.linear(x)
        return out


class LossHead(nn.Module):
    """``forward(x, y)`` returns ``(logits, loss)``, the loss being its chunk's mean."""

    def __init__(self, features: int, hidden: int, outputs: int, activation: str) -> None:
        super().__init__()
        self.body = MLP(features, hidden, outputs, 1, activation)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.body(x)
        return logits, F.mse_loss(logits, y)


class LanguageModelHead(nn.Module):
    """Embedding, activation, Linear to the vocabulary, and the mean cross-entropy.

    ``forward(input_ids, *, labels=None)`` returns the logits without labels, else the mean
    loss over the labels that are not ``ignore_index`` (``nn.CrossEntropyLoss`` inside, so
    the ignore index can be read off the module). ``causal``: token t predicts label t + 1
    (logits ``[:, :-1]`` against labels ``[:, 1:]``, as Hugging Face's causal LM heads do),
    so a row's first label is never counted.
    """

    def __init__(self, hidden: int, activation: str, causal: bool, ignore_index: int = IGNORE_INDEX, vocab: int = _LM_VOCAB) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, hidden)
        self.act = _activation(activation)
        self.head = nn.Linear(hidden, vocab)
        self.loss = nn.CrossEntropyLoss(ignore_index=ignore_index)
        self.causal = causal
        self.vocab = vocab

    def forward(self, input_ids: torch.Tensor, *, labels: torch.Tensor | None = None) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.act(self.embedding(input_ids)))
        if labels is None:
            return logits
        if self.causal:
            logits, labels = logits[:, :-1], labels[:, 1:]
        loss: torch.Tensor = self.loss(logits.reshape(-1, self.vocab), labels.reshape(-1))
        return loss


def _seed_initialisation(seed: int) -> None:
    """Seeds the generator a module's initialisation draws from. On the CPU (the default
    device) that is the CPU generator alone: ``torch.manual_seed`` would also queue a seed for
    every accelerator backend, recording a stack trace for each (a few milliseconds a model,
    a third of a fuzz example's model build) and reseeding the caller's accelerator
    generators, which ``fork_rng(devices=[])`` does not restore. Same weights either way."""
    if torch.get_default_device().type == "cpu":
        torch.default_generator.manual_seed(seed)
    else:
        torch.manual_seed(seed)


@dataclass(frozen=True)
class ModelSpec:
    """A small architecture, as data.

    Attributes:
        kind: one of ``KINDS`` (or ``TOKEN_KINDS``: a ``LanguageModelHead`` of width
            ``hidden`` and ``activation``, the other fields unused; or ``SHARDED_KINDS``,
            or ``EXACT_KINDS``).
        features: input features (channels for convolutions).
        hidden: hidden width.
        outputs: output width (``tied-embedding`` and ``tied-sequential`` output the
            vocabulary instead).
        depth: hidden layers, residual blocks or recurrent layers.
        activation: one of ``ACTIVATIONS`` or ``EXACT_ACTIVATIONS``.
        pooling: token pooling of ``embedding``, window pooling of ``conv-pool``: mean,
            sum or max.
        train: train mode (``batchnorm`` and ``dropout`` depend on it).
        p: dropout probability of ``dropout``.
    """

    kind: str = "linear"
    features: int = 3
    hidden: int = 4
    outputs: int = 2
    depth: int = 1
    activation: str = "relu"
    pooling: str = "mean"
    train: bool = True
    p: float = 0.5

    def __post_init__(self) -> None:
        if self.kind not in _ALL_KINDS:
            raise InvalidArgument(f"kind={self.kind!r} is not one of {_ALL_KINDS}")
        if self.activation not in _ACTIVATION_TYPES:
            raise InvalidArgument(f"activation={self.activation!r} is not one of {tuple(_ACTIVATION_TYPES)}")
        if self.pooling not in POOLINGS:
            raise InvalidArgument(f"pooling={self.pooling!r} is not one of {POOLINGS}")
        for name in ("features", "hidden", "outputs", "depth"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"{name}={getattr(self, name)} must be at least 1")

    @property
    def batch_independent(self) -> bool:
        """Each row's output depends on that row alone (not BatchNorm in train mode)."""
        return not (self.kind == "batchnorm" and self.train)

    @property
    def deterministic(self) -> bool:
        """No random draws in forward (not dropout in train mode)."""
        return not (self.kind == "dropout" and self.train and self.p > 0)

    @property
    def exact(self) -> bool:
        """DataParallel must reproduce the single-device step exactly (up to rounding)."""
        return self.batch_independent and self.deterministic and not self.returns_loss

    @property
    def returns_loss(self) -> bool:
        return self.kind == "loss-head" or self.kind in TOKEN_KINDS

    @property
    def causal(self) -> bool:
        """A causal language-model head: its loss skips each row's first label."""
        return self.kind == "causal-lm-head"

    @property
    def output_dim(self) -> int:
        if self.kind in TOKEN_KINDS:
            return _LM_VOCAB
        return _VOCAB if self.kind in ("tied-embedding", "tied-sequential") else self.outputs

    def build(self, seed: int = 0, *, ignore_index: int = IGNORE_INDEX) -> nn.Module:
        """The module, its weights drawn from ``seed`` (the caller's RNG is left alone).

        ``ignore_index``: the label a language-model head's loss ignores (its
        ``nn.CrossEntropyLoss(ignore_index=...)``); other kinds have no use for it.
        """
        with torch.random.fork_rng(devices=[]):
            _seed_initialisation(seed)
            module = self._module(ignore_index)
        return module.train(self.train)

    def _module(self, ignore_index: int = IGNORE_INDEX) -> nn.Module:
        k, f, h, o, act = self.kind, self.features, self.hidden, self.outputs, self.activation
        if k in TOKEN_KINDS:
            return LanguageModelHead(h, act, causal=self.causal, ignore_index=ignore_index)
        if k == "linear":
            return nn.Linear(f, o)
        if k == "mlp":
            return MLP(f, h, o, self.depth, act)
        if k == "sequential":
            return MLP(f, h, o, self.depth, act).layers
        if k == "tied-sequential":
            return tied_sequential(h, self.depth, act)
        if k == "residual":
            return Residual(f, h, o, self.depth, act)
        if k in ("layernorm", "batchnorm", "dropout"):
            norm = {"layernorm": "layer", "batchnorm": "batch"}.get(k, "none")
            return Normed(f, h, o, act, norm, self.p if k == "dropout" else 0.0)
        if k in ("conv1d", "conv2d"):
            return Conv(1 if k == "conv1d" else 2, f, h, o, act)
        if k == "embedding":
            return Pooled(h, o, self.pooling)
        if k == "conv-pool":
            return ConvPool(f, h, o, act, self.pooling)
        if k == "concat":
            return Concat(f, h, o, self.depth, act)
        if k == "tied-embedding":
            return Tied(h, act)
        if k in ("gru", "lstm"):
            return Recurrent(k, f, h, o, self.depth)
        if k == "attention":
            return Attention(f, h, o)
        if k == "kwargs":
            return Scaled(f, o)
        if k.endswith("-output"):
            return Structured(f, h, o, act, k.removesuffix("-output"))
        if k == "buffer-counter":
            return BufferCounter(f, o)
        if k == "attribute-counter":
            return AttributeCounter(f, o)
        return LossHead(f, h, o, act)

    def inputs(self, batch: int, seed: int = 0, target: torch.Tensor | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Positional and keyword forward arguments for ``batch`` rows, drawn from ``seed``.

        ``loss-head`` models receive ``target`` (float, ``(batch, outputs)``) as their
        second argument. Language-model heads are called by keyword, ``input_ids`` and
        ``labels``: ``TokenBatch.sample(batch, causal, seed)``, right-padded, each row
        holding at least one counted token.
        """
        g = torch.Generator().manual_seed(seed)
        k = self.kind
        if k in TOKEN_KINDS:
            return (), TokenBatch.sample(batch, self.causal, seed).build()
        if k in ("embedding", "tied-embedding", "tied-sequential"):
            return (torch.randint(0, _VOCAB, (batch, _SEQUENCE), generator=g),), {}
        if k == "conv1d":
            return (torch.randn(batch, self.features, _SEQUENCE, generator=g),), {}
        if k == "conv2d":
            return (torch.randn(batch, self.features, _SEQUENCE, _SEQUENCE, generator=g),), {}
        if k == "conv-pool":
            return (torch.randn(batch, self.features, _EXACT_SIDE, _EXACT_SIDE, generator=g),), {}
        if k in ("gru", "lstm", "attention"):
            return (torch.randn(batch, _SEQUENCE, self.features, generator=g),), {}
        x = torch.randn(batch, self.features, generator=g)
        if k == "kwargs":
            return (x,), {"scale": torch.rand(batch, 1, generator=g) + 0.5}
        if k == "loss-head":
            y = target if target is not None else torch.randn(batch, self.outputs, generator=g)
            return (x, y), {}
        return (x,), {}


def primary_output(output: Any) -> torch.Tensor:
    """The logits inside a spec model's output (tuple, dict or namedtuple kinds)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        logits: torch.Tensor = output["logits"]
        return logits
    first: torch.Tensor = output[0]
    return first


#: Loss functions, simplest first.
LOSSES: tuple[str, ...] = ("mse", "l1", "smooth_l1", "cross_entropy", "nll", "bce_with_logits")
CLASSIFICATION_LOSSES = ("cross_entropy", "nll")
_LOSS_FUNCTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "mse": F.mse_loss, "l1": F.l1_loss, "smooth_l1": F.smooth_l1_loss, "cross_entropy": F.cross_entropy,
    "bce_with_logits": F.binary_cross_entropy_with_logits,
}


@dataclass(frozen=True)
class LossSpec:
    """A loss function and its reduction; callable as ``loss(output, target)``.

    ``output`` may be any spec model's output (the logits are taken out of tuples, dicts
    and namedtuples).
    """

    name: str = "mse"
    reduction: str = "mean"

    def __post_init__(self) -> None:
        if self.name not in LOSSES:
            raise InvalidArgument(f"name={self.name!r} is not one of {LOSSES}")
        if self.reduction not in ("mean", "sum"):
            raise InvalidArgument(f"reduction={self.reduction!r} must be 'mean' or 'sum'")

    def __call__(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        logits = primary_output(output)
        if self.name == "nll":
            return F.nll_loss(F.log_softmax(logits, dim=-1), target, reduction=self.reduction)
        return _LOSS_FUNCTIONS[self.name](logits, target, reduction=self.reduction)

    def target(self, batch: int, outputs: int, seed: int = 0) -> torch.Tensor:
        """A target batch for ``(batch, outputs)`` logits, drawn from ``seed``."""
        g = torch.Generator().manual_seed(seed + 1)
        if self.name in CLASSIFICATION_LOSSES:
            return torch.randint(0, outputs, (batch,), generator=g)
        if self.name == "bce_with_logits":
            return torch.randint(0, 2, (batch, outputs), generator=g).float()
        return torch.randn(batch, outputs, generator=g)


@dataclass(frozen=True)
class DeviceList:
    """DataParallel's ``device_ids`` and ``output_device`` (None: ``device_ids[0]``)."""

    device_ids: tuple[int, ...] = (0, 1)
    output_device: int | None = None

    @property
    def real(self) -> bool:
        """Whether these are visible CUDA devices (else virtual ids)."""
        return cuda_device_count() > max(self.device_ids)


@dataclass(frozen=True)
class BuiltScenario:
    """A scenario made concrete: pass these to the assertion helpers."""

    module: nn.Module
    inputs: tuple[Any, ...]
    kwargs: dict[str, Any]
    target: torch.Tensor
    loss_fn: LossSpec
    device_ids: list[int]
    output_device: int | None


@dataclass(frozen=True)
class Scenario:
    """One data-parallel step to check: a model, a batch, devices, a loss, a dtype, a seed."""

    model: ModelSpec = field(default_factory=ModelSpec)
    batch_size: int = 2
    devices: DeviceList = field(default_factory=DeviceList)
    loss: LossSpec = field(default_factory=LossSpec)
    dtype: torch.dtype = torch.float32
    seed: int = 0

    @property
    def chunk_sizes(self) -> list[int]:
        return chunk_sizes(self.batch_size, len(self.devices.device_ids))

    def build(self) -> BuiltScenario:
        """The module (in ``dtype``), inputs, keyword inputs and target, deterministically.

        A language-model head's target is its ``labels`` (also among the keyword inputs).
        """
        target = self.loss.target(self.batch_size, self.model.output_dim, self.seed)
        if self.model.returns_loss:
            target = torch.randn(self.batch_size, self.model.outputs, generator=torch.Generator().manual_seed(self.seed + 2))
        args, kwargs = self.model.inputs(self.batch_size, self.seed, target=target)
        if self.model.kind in TOKEN_KINDS:
            target = kwargs["labels"]
        module = self.model.build(self.seed).to(self.dtype)

        def cast(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.to(self.dtype) if tensor.is_floating_point() else tensor

        inputs, kwargs, target = map_tensors((tuple(args), kwargs, target), cast)
        return BuiltScenario(
            module=module,
            inputs=inputs,
            kwargs=kwargs,
            target=target,
            loss_fn=self.loss,
            device_ids=list(self.devices.device_ids),
            output_device=self.devices.output_device,
        )


@dataclass(frozen=True)
class TokenBatch:
    """A padded batch of token ids and their labels, as data.

    ``build()`` gives ``{"input_ids": ..., "labels": ...}``, both ``(rows, seq_len)`` int64:
    real tokens are ids from 1 to 63 (never the ignore index), drawn from ``seed`` without
    repeating while the batch has at most 62 positions (so that two chunks' mean losses agree
    only by coincidence); padding is id 0 in ``input_ids`` and ``ignore_index`` in ``labels``.
    The labels are the ids themselves (a causal head shifts them).

    Attributes:
        lengths: real tokens in each row, one entry per row (0: a row of padding only).
        seq_len: every row's padded length.
        padding_side: ``"right"`` (real tokens first) or ``"left"`` (padding first).
        ignore_index: the label of every padding position (-100 is torch's and Hugging
            Face's default).
        seed: the token ids are drawn from it.
    """

    lengths: tuple[int, ...] = (1,)
    seq_len: int = 1
    padding_side: str = "right"
    ignore_index: int = IGNORE_INDEX
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len < 1:
            raise InvalidArgument(f"seq_len={self.seq_len!r} must be an int >= 1")
        if not isinstance(self.lengths, tuple) or not self.lengths or any(
            isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= self.seq_len for n in self.lengths
        ):
            raise InvalidArgument(f"lengths={self.lengths!r} must be a non-empty tuple of ints from 0 to seq_len={self.seq_len}")
        if self.padding_side not in PADDING_SIDES:
            raise InvalidArgument(f"padding_side={self.padding_side!r} is not one of {PADDING_SIDES}")
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
            raise InvalidArgument(f"ignore_index={self.ignore_index!r} must be an int")

    @property
    def rows(self) -> int:
        return len(self.lengths)

    def mask(self) -> torch.Tensor:
        """``(rows, seq_len)`` bool: True at the real tokens."""
        positions = torch.arange(self.seq_len).expand(self.rows, self.seq_len)
        lengths = torch.tensor(self.lengths).unsqueeze(1)
        if self.padding_side == "right":
            return positions < lengths
        return positions >= self.seq_len - lengths

    def counted(self, causal: bool = False) -> tuple[int, ...]:
        """The tokens a mean loss counts in each row: its labels that are not the ignore
        index, after the shift for a causal head (which never counts a row's first label)."""
        mask = self.mask()
        return tuple(int(n) for n in (mask[:, 1:] if causal else mask).sum(dim=1))

    def chunk_counts(self, n_devices: int, causal: bool = False) -> list[int]:
        """The tokens a mean loss counts in each chunk DataParallel gives ``n_devices``
        devices (torch.chunk's rule; can be fewer chunks than devices)."""
        per_row, counts, start = self.counted(causal), [], 0
        for size in chunk_sizes(self.rows, n_devices):
            counts.append(sum(per_row[start:start + size]))
            start += size
        return counts

    def build(self) -> dict[str, torch.Tensor]:
        """``input_ids`` and ``labels``, deterministically from ``seed``."""
        g = torch.Generator().manual_seed(self.seed)
        real = torch.tensor([i for i in range(1, _LM_VOCAB) if i != self.ignore_index])
        positions = self.rows * self.seq_len
        if positions <= len(real):
            picked = torch.randperm(len(real), generator=g)[:positions]
        else:
            picked = torch.randint(0, len(real), (positions,), generator=g)
        ids = real[picked].reshape(self.rows, self.seq_len)
        mask = self.mask()
        return {
            "input_ids": ids.masked_fill(~mask, _PAD_ID),
            "labels": ids.masked_fill(~mask, self.ignore_index),
        }

    @classmethod
    def sample(cls, rows: int, causal: bool = False, seed: int = 0) -> TokenBatch:
        """``rows`` right-padded rows of 5 positions, each with at least one counted token
        (two real tokens for a causal head), their lengths drawn from ``seed``."""
        g = torch.Generator().manual_seed(seed + 3)
        lengths = torch.randint(2 if causal else 1, _SEQUENCE + 1, (rows,), generator=g)
        return cls(tuple(int(n) for n in lengths), _SEQUENCE, seed=seed)


@dataclass(frozen=True)
class TokenScenario:
    """One DataParallel step of a language-model head on a padded token batch.

    Attributes:
        model: a ``ModelSpec`` of one of ``TOKEN_KINDS``.
        batch: the padded ``TokenBatch``; the head's loss ignores its ``ignore_index``.
        devices: DataParallel's devices.
        dtype: the module's floating dtype.
        seed: the module's weights are drawn from it.
    """

    model: ModelSpec = field(default_factory=lambda: ModelSpec("lm-head"))
    batch: TokenBatch = field(default_factory=TokenBatch)
    devices: DeviceList = field(default_factory=DeviceList)
    dtype: torch.dtype = torch.float32
    seed: int = 0

    def __post_init__(self) -> None:
        if self.model.kind not in TOKEN_KINDS:
            raise InvalidArgument(f"model kind={self.model.kind!r} is not one of {TOKEN_KINDS}")

    @property
    def causal(self) -> bool:
        return self.model.causal

    @property
    def chunk_sizes(self) -> list[int]:
        return chunk_sizes(self.batch.rows, len(self.devices.device_ids))

    @property
    def token_counts(self) -> list[int]:
        """The tokens each replica's mean loss counts (``TokenBatch.chunk_counts``)."""
        return self.batch.chunk_counts(len(self.devices.device_ids), self.causal)

    def build(self) -> BuiltScenario:
        """The head (in ``dtype``, ignoring the batch's ``ignore_index``), no positional
        inputs, the keyword inputs ``input_ids`` and ``labels``, and the labels as target.
        ``loss_fn`` is a cross-entropy ``LossSpec`` for the record only: the head computes
        its loss in forward (call it as ``module(**kwargs)``)."""
        module = self.model.build(self.seed, ignore_index=self.batch.ignore_index).to(self.dtype)
        kwargs = self.batch.build()
        return BuiltScenario(
            module=module,
            inputs=(),
            kwargs=kwargs,
            target=kwargs["labels"],
            loss_fn=LossSpec("cross_entropy"),
            device_ids=list(self.devices.device_ids),
            output_device=self.devices.output_device,
        )
