"""Modules that make a parallel step legitimately differ from the single-device step."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

__all__ = ["DivergenceSource", "divergence_sources"]


@dataclass(frozen=True)
class DivergenceSource:
    """A module whose train-mode behaviour depends on the batch split or on random draws.

    Attributes:
        module: dotted name of the module (``""`` for the root).
        kind: ``"batch statistics"`` or ``"randomness"``.
        reason: what the module does differently under DataParallel.
        fix: how to get an exact comparison.
    """

    module: str
    kind: str
    reason: str
    fix: str

    def describe(self) -> str:
        name = repr(self.module) if self.module else "the root module"
        return f"{name} ({self.kind}): {self.reason} Fix: {self.fix}"


def _classify(name: str, module: nn.Module) -> DivergenceSource | None:
    if not module.training:
        return None
    kind = type(module).__name__
    if isinstance(module, _BatchNorm):
        return DivergenceSource(
            name,
            "batch statistics",
            f"{kind} in train mode normalises each replica's chunk with that chunk's own mean "
            "and variance, not the whole batch's; a chunk of one row raises "
            "'Expected more than 1 value per channel when training'.",
            "compare in eval mode (module.eval()), or use SyncBatchNorm under "
            "DistributedDataParallel.",
        )
    p = getattr(module, "p", None) if isinstance(module, _DropoutNd) else getattr(module, "dropout", None)
    if isinstance(module, (_DropoutNd, nn.MultiheadAttention, nn.RNNBase)) and isinstance(p, float) and p > 0:
        if isinstance(module, nn.RNNBase) and module.num_layers < 2:
            return None  # torch applies RNN dropout between layers only
        return DivergenceSource(
            name,
            "randomness",
            f"{kind} draws its own mask on each replica (p={p}), so masks differ from the "
            "single-device mask.",
            "compare in eval mode, or with dropout p=0.",
        )
    return None


def divergence_sources(module: nn.Module) -> tuple[DivergenceSource, ...]:
    """Every submodule whose train-mode output depends on the batch split or on randomness."""
    found = (_classify(name, sub) for name, sub in module.named_modules())
    return tuple(source for source in found if source is not None)
