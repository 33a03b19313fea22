"""Modules that make a parallel step legitimately differ from the single-device step."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

from dpverify.core.text import name_list, plural

__all__ = ["ONE_ROW_BATCHNORM", "DivergenceSource", "SourceGroup", "divergence_sources", "group_sources"]

#: torch's error when BatchNorm in train mode gets a chunk of one row.
ONE_ROW_BATCHNORM = "Expected more than 1 value per channel when training"


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
        return SourceGroup((self.module,), "", self.kind, self.reason, self.fix).describe()


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


def divergence_sources(module: nn.Module, *, replayed: Collection[str] = ()) -> tuple[DivergenceSource, ...]:
    """Every submodule whose train-mode output depends on the batch split or on randomness,
    but the ``replayed`` ones: Dropout layers whose masks the reference replayed from the
    ranks (``dpverify.ranked.randomness``), which make no difference any more."""
    found = (_classify(name, sub) for name, sub in module.named_modules() if name not in replayed)
    return tuple(source for source in found if source is not None)


@dataclass(frozen=True)
class SourceGroup:
    """Divergence sources that share one explanation: modules of one class, with the same
    reason and fix (a MobileNet's 34 BatchNorm2d layers are one group).

    Attributes:
        modules: the modules' dotted names, in model order (``""`` for the root).
        module_type: their class, e.g. ``"BatchNorm2d"``.
        kind: ``"batch statistics"`` or ``"randomness"``.
        reason: what these modules do differently under DataParallel.
        fix: how to get an exact comparison.
    """

    modules: tuple[str, ...]
    module_type: str
    kind: str
    reason: str
    fix: str

    def names(self, width: int | None = None, *, most: int | None = None) -> str:
        """The modules, quoted: all of them in full by default; ``width`` shortens each in
        the middle, and ``most`` keeps the first and last few of a long list."""
        named = [m for m in self.modules if m]
        longest = max(map(len, named), default=0)
        text = name_list(named, width or longest, most=most or len(named)) if named else ""
        if len(named) < len(self.modules):
            text = f"the root module and {text}" if text else "the root module"
        return text

    def describe(self, names: str | None = None) -> str:
        """The explanation, once, for every module of the group (``names``: the modules as
        they should read, by default ``self.names()``)."""
        count = f", {plural(len(self.modules), 'module')}" if len(self.modules) > 1 else ""
        return f"{names or self.names()} ({self.kind}{count}): {self.reason} Fix: {self.fix}"

    def cause(self) -> str:
        """The group in a few words: ``'norm' (batch statistics)`` or ``4 BatchNorm1d
        modules (batch statistics)``."""
        who = self.names() if len(self.modules) == 1 else plural(len(self.modules), f"{self.module_type} module")
        return f"{who} ({self.kind})"


def group_sources(module: nn.Module, sources: Sequence[DivergenceSource] | None = None) -> tuple[SourceGroup, ...]:
    """``module``'s divergence sources (by default all of them), one group per shared
    explanation, in the order the groups first occur."""
    groups: dict[tuple[str, str, str, str], list[str]] = {}
    for source in divergence_sources(module) if sources is None else sources:
        key = (type(module.get_submodule(source.module)).__name__, source.kind, source.reason, source.fix)
        groups.setdefault(key, []).append(source.module)
    return tuple(SourceGroup(tuple(names), *key) for key, names in groups.items())
