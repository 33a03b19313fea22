"""Small built-in models that the quick verification and the tests run on."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BUILTIN_MODELS", "VERIFY_MODELS", "BuiltinCase", "LossHead", "builtin_case"]


class ConvNet(nn.Module):
    """Conv2d, ReLU, global average pool, Linear: a batch-independent conv net."""

    def __init__(self, channels: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, channels, kernel_size=3, padding=1)
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(F.relu(self.conv(x)).mean(dim=(2, 3)))
        return logits


class EmbeddingPool(nn.Module):
    """Embedding table, mean pooling over tokens, Linear head."""

    def __init__(self, vocab: int = 20, dim: int = 6, classes: int = 3) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.embedding(tokens).mean(dim=1))
        return logits


class LossHead(nn.Module):
    """``forward(x, y)`` returns ``(prediction, loss)``: the loss is its chunk's mean."""

    def __init__(self, features: int = 3) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        prediction = self.body(x).squeeze(-1)
        return prediction, F.mse_loss(prediction, y)


class Buffered(nn.Module):
    """Normalises its input with buffers read in forward (a fixed shift and scale, as a
    preprocessing layer keeps them), then Linear, Tanh, Linear: every replica needs the
    module's buffers, not only the first."""

    shift: torch.Tensor
    scale: torch.Tensor

    def __init__(self, features: int = 4, classes: int = 2) -> None:
        super().__init__()
        self.register_buffer("shift", torch.linspace(-1.0, 1.0, features))
        self.register_buffer("scale", torch.linspace(0.5, 2.0, features))
        self.body = nn.Sequential(nn.Linear(features, 8), nn.Tanh(), nn.Linear(8, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body((x - self.shift) * self.scale)
        return out


class Gated(nn.Module):
    """``forward(x, *, gate=None)``: a keyword argument with a value per row scales each
    row's hidden layer; without it the rows are not gated (a wrapper that drops keyword
    arguments changes the output, silently)."""

    def __init__(self, features: int = 4, classes: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(features, 8)
        self.out = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor, *, gate: torch.Tensor | None = None) -> torch.Tensor:
        hidden = torch.tanh(self.inp(x))
        if gate is not None:
            hidden = hidden * gate
        out: torch.Tensor = self.out(hidden)
        return out


class DictHead(nn.Module):
    """Returns ``{"logits": ..., "features": ...}``, as Hugging Face models return a dict."""

    def __init__(self, features: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(features, 8)
        self.out = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = torch.tanh(self.inp(x))
        return {"logits": self.out(hidden), "features": hidden}


class TupleHead(DictHead):
    """Returns ``(prediction, features)``, as recurrent layers return ``(output, state)``."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        out = super().forward(x)
        return out["logits"], out["features"]


class TimeMajor(nn.Module):
    """Reads ``(time, batch, features)``, the batch along dim 1, and returns each step's
    running mean over the steps before it: a split along time, not batch, changes it."""

    def __init__(self, features: int = 4, classes: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(features, 6)
        self.out = nn.Linear(6, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.inp(x))
        steps = torch.arange(1, x.shape[0] + 1, dtype=hidden.dtype, device=hidden.device).reshape(-1, 1, 1)
        out: torch.Tensor = self.out(hidden.cumsum(0) / steps)
        return out


def dict_logits_cross_entropy(output: Mapping[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a dict output's ``logits``."""
    return F.cross_entropy(output["logits"], target)


def first_output_cross_entropy(output: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a tuple output's first element."""
    return F.cross_entropy(output[0], target)


@dataclass(frozen=True)
class BuiltinCase:
    """One built-in model with a batch, ready to check.

    ``target`` and ``loss_fn`` are None for ``LossHead``-style models, whose forward
    receives the targets among ``inputs`` and returns the loss.

    Attributes:
        kwargs: keyword arguments of the forward, split with the batch.
        dim: the dimension the batch is split along.
        covers: what a DataParallel wrapper can get wrong that this model exercises, in
            words (``verify`` prints what its run covered).
    """

    name: str
    module: nn.Module
    inputs: tuple[Any, ...]
    target: torch.Tensor | None
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    dim: int = 0
    covers: tuple[str, ...] = ()


def _mlp(g: torch.Generator, batch: int) -> BuiltinCase:
    module = nn.Sequential(nn.Linear(5, 16), nn.GELU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
    return BuiltinCase("mlp", module, (torch.randn(batch, 5, generator=g),), torch.randn(batch, 2, generator=g), F.mse_loss, covers=("tensor output",))


def _conv(g: torch.Generator, batch: int) -> BuiltinCase:
    x = torch.randn(batch, 2, 6, 6, generator=g)
    y = torch.randint(0, 3, (batch,), generator=g)
    return BuiltinCase("conv", ConvNet(), (x,), y, F.cross_entropy, covers=("4-D inputs",))


def _embedding(g: torch.Generator, batch: int) -> BuiltinCase:
    tokens = torch.randint(0, 20, (batch, 7), generator=g)
    y = torch.randint(0, 3, (batch,), generator=g)
    return BuiltinCase("embedding", EmbeddingPool(), (tokens,), y, F.cross_entropy, covers=("integer inputs",))


def _loss_head(g: torch.Generator, batch: int) -> BuiltinCase:
    x = torch.randn(batch, 3, generator=g)
    y = torch.randn(batch, generator=g)
    return BuiltinCase("loss-in-forward", LossHead(), (x, y), None, None, covers=("loss computed in forward", "tuple output"))


def _buffered(g: torch.Generator, batch: int) -> BuiltinCase:
    x = torch.randn(batch, 4, generator=g)
    return BuiltinCase("buffered", Buffered(), (x,), torch.randn(batch, 2, generator=g), F.mse_loss, covers=("buffers read in forward",))


def _keywords(g: torch.Generator, batch: int) -> BuiltinCase:
    x = torch.randn(batch, 4, generator=g)
    gate = torch.rand(batch, 1, generator=g) + 0.5
    return BuiltinCase(
        "keywords", Gated(), (x,), torch.randn(batch, 2, generator=g), F.mse_loss, kwargs={"gate": gate},
        covers=("keyword arguments",),
    )


def _dict_output(g: torch.Generator, batch: int) -> BuiltinCase:
    x = torch.randn(batch, 4, generator=g)
    y = torch.randint(0, 3, (batch,), generator=g)
    return BuiltinCase("dict-output", DictHead(), (x,), y, dict_logits_cross_entropy, covers=("dict output",))


def _tuple_output(g: torch.Generator, batch: int) -> BuiltinCase:
    x = torch.randn(batch, 4, generator=g)
    y = torch.randint(0, 3, (batch,), generator=g)
    return BuiltinCase("tuple-output", TupleHead(), (x,), y, first_output_cross_entropy, covers=("tuple output",))


def _time_major(g: torch.Generator, batch: int) -> BuiltinCase:
    x = torch.randn(5, batch, 4, generator=g)
    y = torch.randn(5, batch, 2, generator=g)
    return BuiltinCase("time-major", TimeMajor(), (x,), y, F.mse_loss, dim=1, covers=("split along dim=1",))


#: The built-in models ``check --model`` and ``explain --model`` offer.
BUILTIN_MODELS: dict[str, Callable[[torch.Generator, int], BuiltinCase]] = {
    "mlp": _mlp,
    "conv": _conv,
    "embedding": _embedding,
    "loss-in-forward": _loss_head,
}

#: The models ``verify`` runs a wrapper on: the built-in ones, and one for each thing a
#: wrapper can get wrong that they leave out (buffers, keyword arguments, dict and tuple
#: outputs, a split along dim 1).
VERIFY_MODELS: dict[str, Callable[[torch.Generator, int], BuiltinCase]] = {
    **BUILTIN_MODELS,
    "buffered": _buffered,
    "keywords": _keywords,
    "dict-output": _dict_output,
    "tuple-output": _tuple_output,
    "time-major": _time_major,
}


def builtin_case(name: str, *, batch: int, seed: int = 0) -> BuiltinCase:
    """Builds the named built-in model (one of ``VERIFY_MODELS``) and a batch of ``batch``
    rows, deterministically."""
    if name not in VERIFY_MODELS:
        raise KeyError(f"unknown built-in model {name!r}; choose from {sorted(VERIFY_MODELS)}")
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # module initialisation, without touching the caller's RNG
        return VERIFY_MODELS[name](generator, batch)
