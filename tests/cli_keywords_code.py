"""User code for tests/test_cli_keywords.py: a keyword-only token model whose forward
computes its own loss when given labels, as Hugging Face models do, and ``--inputs``
functions in each form that returns keyword arguments."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 11


class TokenModel(nn.Module):
    """forward(*, input_ids, labels=None): logits, or ``{"loss", "logits"}`` given labels."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 6)
        self.head = nn.Linear(6, VOCAB)

    def forward(self, *, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        logits = self.head(torch.tanh(self.embed(input_ids)))
        if labels is None:
            return logits.mean(dim=1)
        return {"loss": F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)), "logits": logits}


def token_model() -> nn.Module:
    return TokenModel()


def _ids(batch_size: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch_size, 5), generator=torch.Generator().manual_seed(batch_size))


def padded_labels(batch_size: int) -> dict[str, torch.Tensor]:
    """A dict of keyword arguments: ``labels`` padded with -100 (rows keep 1 to 5 tokens)."""
    ids = _ids(batch_size)
    labels = ids.clone()
    for row in range(batch_size):
        labels[row, 1 + row % 5:] = -100
    return {"input_ids": ids, "labels": labels}


def unpadded_labels(batch_size: int) -> dict[str, torch.Tensor]:
    ids = _ids(batch_size)
    return {"input_ids": ids, "labels": ids.clone()}


def ids_and_target(batch_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``(kwargs, target)``: the loss is computed outside, against a float target."""
    return {"input_ids": _ids(batch_size)}, torch.randn(batch_size, VOCAB, generator=torch.Generator().manual_seed(7))


def args_and_kwargs(batch_size: int) -> tuple[tuple[()], dict[str, torch.Tensor]]:
    return (), unpadded_labels(batch_size)


def a_string(batch_size: int) -> str:
    return "batch"


class PositionalTokenModel(TokenModel):
    """forward(input_ids, labels): the token-mean loss, with labels by position."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:  # type: ignore[override]
        return super().forward(input_ids=input_ids, labels=labels)["loss"]


def positional_token_model() -> nn.Module:
    return PositionalTokenModel()


def positional_padded(batch_size: int) -> tuple[tuple[torch.Tensor, torch.Tensor], None]:
    batch = padded_labels(batch_size)
    return (batch["input_ids"], batch["labels"]), None
