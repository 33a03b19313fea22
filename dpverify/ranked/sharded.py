"""What the sharded checks (FSDP2, tensor parallelism) share on the parent side: the step
task sent to the ranks, and the loss-averaging trap of their data-parallel dimension.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from torch import nn

from dpverify.core.step import StepResult
from dpverify.ranked.check import RankedCheck
from dpverify.ranked.items import PieceItems
from dpverify.ranked.notes import token_trap_note, trap_note
from dpverify.ranked.rank import RankStepTask

__all__ = ["module_paths", "step_task", "trap_text"]

_Task = TypeVar("_Task", bound=RankStepTask)


def module_paths(module: nn.Module) -> str:
    """The qualified names of ``module``'s submodules, as an error lists the valid ones."""
    listed = ", ".join(repr(path) for path, _ in module.named_modules() if path)
    return listed or "(none: the module has no submodule)"


def step_task(task: type[_Task], check: RankedCheck, steps: Sequence[Any], items: PieceItems, **fields: Any) -> _Task:
    """The ranks' task of type ``task``: ``steps`` on ``check``'s batch, with the items
    ``items`` counted (token counts only; rows otherwise) and the backend's ``fields``."""
    return task(
        module=check.module,
        inputs=check.args,
        target=check.target,
        loss_fn=check.loss_fn,
        shard_sizes=check.shard_sizes,
        steps=tuple(steps),
        kwargs=check.kwargs,
        item_kind=items.kind,
        item_counts=items.counts if items.by_tokens else (),
        **fields,
    )


def trap_text(
    check: RankedCheck, items: PieceItems, naive: Sequence[Any], reference: StepResult, token_intro: str, **wording: Any,
) -> str:
    """The loss-averaging trap the plain step ``naive`` fell into: ``token_intro`` then
    ``token_trap_note`` for a mean over tokens, else ``trap_note`` with ``wording``."""
    if items.by_tokens:
        return token_intro + token_trap_note(check, items, naive, reference)
    return trap_note(check, naive, reference, **wording)

