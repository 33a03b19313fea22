"""User code for ``tests/test_cli_loss.py``: the command line's ``--loss MODULE:FN``,
``--output-key`` and ``--ddp-kwargs``, loaded as ``cli_loss_code:NAME`` from the tests
directory, written as a user would write it.

* ``token_lm`` and ``token_batches``: a token-level language model (embedding, linear head)
  returning ``(B, T, V)`` logits, and batches of ``(ids, labels)`` with labels padded with
  -100; ``token_ce`` is its loss, cross-entropy over the tokens that are not padding.
* ``dict_model``: a forward returning ``{"pred": ..., "aux": ...}``.
* ``unused_parameter``: a model with a parameter its forward never uses, which DDP refuses
  unless ``find_unused_parameters=True``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 13
LENGTH = 7


class TokenLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(torch.tanh(self.embed(ids)))
        return logits


def token_lm() -> nn.Module:
    return TokenLM()


def token_batches(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, labels)``: row r keeps 2 + r % 5 tokens, the rest of its labels are -100."""
    g = torch.Generator().manual_seed(batch_size)
    ids = torch.randint(1, VOCAB, (batch_size, LENGTH), generator=g)
    labels = ids.roll(-1, dims=1)
    for row in range(batch_size):
        labels[row, 2 + row % 5:] = -100
    return ids, labels


def token_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def raising_loss(output: Any, target: Any) -> torch.Tensor:
    raise ValueError("this loss is broken")


NOT_CALLABLE = 3


class DictModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 6)
        self.pred = nn.Linear(6, 3)
        self.aux = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.tanh(self.body(x))
        return {"pred": self.pred(h), "aux": self.aux(h)}


def dict_model() -> nn.Module:
    return DictModel()


def dict_batches(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(batch_size)
    return torch.randn(batch_size, 4, generator=g), torch.randn(batch_size, 3, generator=g)


class UnusedParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 2)
        self.unused = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.used(x)
        return out


def unused_parameter() -> nn.Module:
    return UnusedParameter()


class ReducingParallel(nn.DataParallel):  # type: ignore[type-arg]
    """DataParallel that averages its replicas' losses itself: one value comes back."""

    def gather(self, outputs: Any, output_device: Any) -> Any:
        prediction, losses = super().gather(outputs, output_device)
        return prediction, losses.mean()


def per_row_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A loss without reduction: one value per row, not the scalar a step needs."""
    return F.mse_loss(output, target, reduction="none").mean(dim=1)


class Pair(nn.Module):
    """forward returns ``(features, prediction)``: the prediction is the second element."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 6)
        self.pred = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.body(x))
        return h, self.pred(h)


def pair() -> nn.Module:
    return Pair()


def smoothed_ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy with label smoothing: a classification loss of the user's own."""
    return F.cross_entropy(logits, target, label_smoothing=0.1)


def huber(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A regression loss of the user's own: Huber with a small delta."""
    return F.huber_loss(output, target, delta=0.5)


#: The calls of ``counted_mse``: evidence that ``fuzz --loss`` really uses the user's loss.
CALLS: list[int] = []


def counted_mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    CALLS.append(1)
    return F.mse_loss(output, target)
