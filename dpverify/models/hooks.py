"""Correct code of a user's training step, as the training scenarios run it.

Module-level functions, so that they pickle by reference to the rank processes; a
scenario binds their arguments with ``functools.partial`` (``TrainingScenario.hook``,
``TrainingScenario.step``), which pickles too and prints as ``global_clip(max_norm=1.0)``
in a check's report.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["accumulation_step", "global_clip"]


def global_clip(ctx: Any, *, max_norm: float) -> None:
    """Clips the gradients to a global norm of ``max_norm``: an ``after_backward`` hook.

    ``torch.nn.utils.clip_grad_norm_`` over every parameter of the rank's module is the
    global clip under DDP (each rank holds the averaged, whole gradient) and under FSDP2
    (the gradients are sharded DTensors: their norm is reduced over the shards by DTensor,
    torch/nn/utils/clip_grad.py), and in the single-device reference.
    """
    torch.nn.utils.clip_grad_norm_(ctx.module.parameters(), max_norm)


def accumulation_step(ctx: Any, *, micro_batches: int) -> None:
    """A DDP training step accumulating ``micro_batches`` micro-batches per rank with
    ``no_sync()`` (``dpverify.no_sync_accumulation_step``: one synchronisation, each
    micro-batch's loss weighted by its share of the rows), for the training checks, whose
    context runs one micro-batch unless told otherwise."""
    from dpverify.ddp.rank import no_sync_accumulation_step

    ctx.micro_batches = micro_batches
    no_sync_accumulation_step(ctx)
