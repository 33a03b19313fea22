"""What the sharded checks (FSDP2, tensor parallelism) share on the parent side: the steps
sent to the ranks, and the loss-averaging trap of their data-parallel dimension.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from dpverify.core.step import StepResult
from dpverify.ranked.check import RankedCheck
from dpverify.ranked.items import PieceItems
from dpverify.ranked.notes import token_trap_note, trap_note
from dpverify.ranked.rank import RankStepTask

__all__ = ["module_paths", "send_steps", "trap_text"]


def module_paths(module: nn.Module) -> str:
    """The qualified names of ``module``'s submodules, as an error lists the valid ones."""
    listed = ", ".join(repr(path) for path, _ in module.named_modules() if path)
    return listed or "(none: the module has no submodule)"


def send_steps(
    check: RankedCheck, step: Any, plain: Any, weighted: Any, run: Callable[..., Any], title: str, task: type[RankStepTask],
    **fields: Any,
) -> tuple[PieceItems, Any, list[Any], list[Any] | None]:
    """Sends ``check``'s batch to ``run`` on the ranks as a ``task`` (with the backend's
    ``fields``) of the step verified: ``step``, else ``weighted`` when the ranks hold
    different numbers of items (the loss-averaging trap), else ``plain``; on such shards
    the plain step runs beside it, for contrast.

    Returns:
        The items counted, the verified step, each rank's result of it, and each rank's
        result of the plain step (None on even shards).
    """
    counted = check.count_items()
    trap = counted.unequal_ranks
    chosen = step or (weighted if trap else plain)
    sent = task(**check.step_fields((chosen, plain) if trap else (chosen,), counted if counted.by_tokens else None), **fields)
    results = check.send(run, sent, title)
    return counted, chosen, [steps[0] for steps in results], [steps[1] for steps in results] if trap else None


def trap_text(
    check: RankedCheck, items: PieceItems, naive: Sequence[Any], reference: StepResult, token_intro: str, **wording: Any,
) -> str:
    """The loss-averaging trap the plain step ``naive`` fell into: ``token_intro`` then
    ``token_trap_note`` for a mean over tokens, else ``trap_note`` with ``wording``."""
    if items.by_tokens:
        return token_intro + token_trap_note(check, items, naive, reference)
    return trap_note(check, naive, reference, **wording)

