"""Small built-in models that the quick verification and the tests run on."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BUILTIN_MODELS", "BuiltinCase", "LossHead", "builtin_case"]


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


@dataclass(frozen=True)
class BuiltinCase:
    """One built-in model with a batch, ready to check.

    ``target`` and ``loss_fn`` are None for ``LossHead``-style models, whose forward
    receives the targets among ``inputs`` and returns the loss.
    """

    name: str
    module: nn.Module
    inputs: tuple[Any, ...]
    target: torch.Tensor | None
    loss_fn: Callable[[Any, Any], torch.Tensor] | None


def _mlp(g: torch.Generator, batch: int) -> BuiltinCase:
    module = nn.Sequential(nn.Linear(5, 16), nn.GELU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
    return BuiltinCase("mlp", module, (torch.randn(batch, 5, generator=g),), torch.randn(batch, 2, generator=g), F.mse_loss)


def _conv(g: torch.Generator, batch: int) -> BuiltinCase:
    x = torch.randn(batch, 2, 6, 6, generator=g)
    y = torch.randint(0, 3, (batch,), generator=g)
    return BuiltinCase("conv", ConvNet(), (x,), y, F.cross_entropy)


def _embedding(g: torch.Generator, batch: int) -> BuiltinCase:
    tokens = torch.randint(0, 20, (batch, 7), generator=g)
    y = torch.randint(0, 3, (batch,), generator=g)
    return BuiltinCase("embedding", EmbeddingPool(), (tokens,), y, F.cross_entropy)


def _loss_head(g: torch.Generator, batch: int) -> BuiltinCase:
    x = torch.randn(batch, 3, generator=g)
    y = torch.randn(batch, generator=g)
    return BuiltinCase("loss-in-forward", LossHead(), (x, y), None, None)


BUILTIN_MODELS: dict[str, Callable[[torch.Generator, int], BuiltinCase]] = {
    "mlp": _mlp,
    "conv": _conv,
    "embedding": _embedding,
    "loss-in-forward": _loss_head,
}


def builtin_case(name: str, *, batch: int, seed: int = 0) -> BuiltinCase:
    """Builds the named built-in model and a batch of ``batch`` rows, deterministically."""
    if name not in BUILTIN_MODELS:
        raise KeyError(f"unknown built-in model {name!r}; choose from {sorted(BUILTIN_MODELS)}")
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # module initialisation, without touching the caller's RNG
        return BUILTIN_MODELS[name](generator, batch)
