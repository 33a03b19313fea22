"""Models with Hugging Face-like parameter names (``bert.encoder.layer.0.attention.self.key.weight``),
for the tests of name shortening: imported by ``dpverify check``/``explain`` as
``hf_like_models:plain`` or ``hf_like_models:with_norm`` (the tests directory is on sys.path)."""

from __future__ import annotations

import torch
from torch import nn


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.key = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.key(x)


class Attention(nn.Module):
    def __init__(self, norm: bool) -> None:
        super().__init__()
        self.self = SelfAttention()
        self.batch_norm = nn.BatchNorm1d(4) if norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.self(x)
        return torch.tanh(self.batch_norm(x)) if self.batch_norm is not None else x


class Layer(nn.Module):
    def __init__(self, norm: bool) -> None:
        super().__init__()
        self.attention = Attention(norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention(x)


class Encoder(nn.Module):
    def __init__(self, norm: bool) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer(norm) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x)
        return x


class Bert(nn.Module):
    def __init__(self, norm: bool) -> None:
        super().__init__()
        self.encoder = Encoder(norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)


class Model(nn.Module):
    def __init__(self, norm: bool = False) -> None:
        super().__init__()
        self.bert = Bert(norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bert(x)


def plain() -> nn.Module:
    """Three layers of a key projection: six long, nearly equal parameter names."""
    return Model(norm=False)


def with_norm() -> nn.Module:
    """The same with a BatchNorm in every layer: one explanation for three modules."""
    return Model(norm=True)
