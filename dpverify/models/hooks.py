"""Correct code of a user's training step, as the training scenarios run it.

Module-level functions, so that they pickle by reference to the rank processes; a
scenario binds their arguments with ``functools.partial`` (``TrainingScenario.code``),
which pickles too and prints as ``global_clip(max_norm=1.0)`` in a check's report.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["accumulation_step", "global_clip", "global_grad_norm", "pipeline_clip"]


@torch.no_grad()
def global_grad_norm(ctx: Any) -> torch.Tensor:
    """The 2-norm of the whole model's gradients, as one device computes it, from what
    ``ctx`` (any training check's context) holds.

    - Plain gradients are whole on this rank (DataParallel's summed ``.grad``, DDP's
      averaged one, the parameters a tensor-parallel plan leaves alone): their norm counts
      as it is.
    - DTensor gradients (FSDP2's shards, a tensor-parallel plan's) are made whole by
      DTensor, one ``get_total_norm`` per device mesh: ``clip_grad_norm_`` refuses DTensor
      and plain gradients in one call, and DTensors of different meshes (FSDP2 over the
      data-parallel mesh of a tensor-parallel model).
    - A pipeline stage (``ctx.num_stages`` > 1) holds only its own children: the sums of
      squares are all-reduced over ``ctx.group``, every stage, and a weight tied across
      stages (``ctx.tied``) counts once, on the stage that holds it under its first name
      (Megatron-LM's ``param_is_not_shared``).

    The norm is float64 (a stage without parameters sends zeros of the same dtype).
    """
    from torch.distributed.tensor import DTensor

    tied: dict[str, str] = getattr(ctx, "tied", {}) or {}
    grads = [
        p.grad for name, p in ctx.module.named_parameters()
        if p.grad is not None and tied.get(name, name) == name
    ]
    by_mesh: list[tuple[Any, list[torch.Tensor]]] = []
    plain = []
    for grad in grads:
        if not isinstance(grad, DTensor):
            plain.append(grad)
            continue
        group = next((held for mesh, held in by_mesh if mesh == grad.device_mesh), None)
        if group is None:
            by_mesh.append((grad.device_mesh, group := []))
        group.append(grad)
    norms = [torch.nn.utils.get_total_norm(plain).double().cpu()] if plain else []
    for _mesh, held in by_mesh:
        total = torch.nn.utils.get_total_norm(held)
        norms.append((total.full_tensor() if isinstance(total, DTensor) else total).double().cpu())
    squared = torch.stack(norms).pow(2).sum() if norms else torch.zeros((), dtype=torch.float64)
    if getattr(ctx, "num_stages", 1) > 1:
        import torch.distributed as dist

        summed = squared.to(ctx.device)  # where the stage's collectives run (nccl: its GPU)
        dist.all_reduce(summed, group=ctx.group)
        squared = summed.cpu()
    return squared.sqrt()


@torch.no_grad()
def global_clip(ctx: Any, *, max_norm: float) -> None:
    """Clips the gradients to a global norm of ``max_norm``: an ``after_backward`` hook.

    Scales every gradient by ``max_norm / (norm + 1e-6)`` where that is below 1, as
    ``torch.nn.utils.clip_grad_norm_`` does, with ``norm`` the whole model's gradient norm
    (``global_grad_norm``): right under DataParallel, DDP, FSDP2, tensor parallelism (a mix
    of DTensor and plain gradients) and pipelines (each stage holding its own parameters),
    and in the single-device reference. A DTensor gradient is scaled through its local
    shard, so every rank applies the same coefficient to what it holds.
    """
    from torch.distributed.tensor import DTensor

    coef = (max_norm / (global_grad_norm(ctx) + 1e-6)).clamp(max=1.0)
    for p in ctx.module.parameters():
        if p.grad is not None:
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            grad.mul_(coef.to(grad.dtype))


def pipeline_clip(ctx: Any, *, max_norm: float) -> None:
    """A pipeline stage's ``after_backward``: sums the gradient of every weight tied across
    stages over the stages that hold it (``sync_tied_grads``: each stage holds only its own
    children's part), then clips to a global norm of ``max_norm`` over every stage
    (``global_clip``). In the single-device reference, where a tied weight is one
    parameter, only the clip runs."""
    from dpverify.sharded.pipeline_rank import sync_tied_grads

    sync_tied_grads(ctx)
    global_clip(ctx, max_norm=max_norm)


def accumulation_step(ctx: Any, *, micro_batches: int) -> None:
    """A DDP training step accumulating ``micro_batches`` micro-batches per rank with
    ``no_sync()`` (``dpverify.no_sync_accumulation_step``: one synchronisation, each
    micro-batch's loss weighted by its share of the rows), for the training checks, whose
    context runs one micro-batch unless told otherwise."""
    from dpverify.ddp.rank import no_sync_accumulation_step

    ctx.micro_batches = micro_batches
    no_sync_accumulation_step(ctx)
