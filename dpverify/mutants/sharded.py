"""Sharded mutants: FSDP2 steps (``step(ctx: FSDPContext)``), tensor-parallel styles and the
plan builders that use them (``plan(layout, module)``), pipeline schedule classes, and
pipeline stages' ``after_backward`` hooks (``hook(ctx: PipelineContext)``).

Each is DELIBERATELY BROKEN, a mistake seen in real training or hand-written parallel
code, kept so that the sharded checks can be shown to catch it; never use them to train.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import ScheduleGPipe
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from dpverify.models.layouts import TPLayout
from dpverify.mutants.ulp import one_ulp_up
from dpverify.sharded.fsdp_rank import FSDPContext

__all__ = [
    "TP_CLIP_NORM",
    "LocalOutputColwiseParallel",
    "NoAllReduceRowwiseParallel",
    "OneUlpGPipe",
    "OneUlpRowwiseParallel",
    "SkipLastMicrobatchGPipe",
    "UnscaledGPipe",
    "averaged_tied_grads_hook",
    "fsdp_one_ulp_step",
    "fsdp_summed_loss_step",
    "fsdp_undivided_step",
    "fsdp_wrong_weight_step",
    "local_output_plan",
    "no_allreduce_plan",
    "one_ulp_plan",
    "tp_global_clip",
    "tp_one_rank_clip",
]


# --------------------------------------------------------------------------- FSDP2 steps


def fsdp_undivided_step(ctx: FSDPContext) -> Any:
    """DELIBERATELY BROKEN: turns off FSDP2's division of the reduce-scattered gradients by
    the world size (``set_gradient_divide_factor(1.0)`` on every sharded module; on gloo,
    which has no pre-multiplied sum, with ``set_force_sum_reduction_for_comms(True)``), so
    every gradient is the sum over ranks: ``world_size`` times the full-batch gradient."""
    model = ctx.fsdp()
    for sub in ctx.fsdp_modules():
        sub.set_gradient_divide_factor(1.0)
        sub.set_force_sum_reduction_for_comms(True)
    return ctx.backward(model)


def fsdp_summed_loss_step(ctx: FSDPContext) -> Any:
    """DELIBERATELY BROKEN: backpropagates the sum of the rank's row losses (its mean loss
    times its rows) while FSDP2 averages over ranks: gradients ``n`` times (rows per rank)
    the full-batch mean-loss gradient."""
    return ctx.backward(ctx.fsdp(), ctx.shard_size)


def fsdp_wrong_weight_step(ctx: FSDPContext) -> Any:
    """DELIBERATELY BROKEN: weights each rank's mean loss by ``n_r / B``, its share of the
    rows without the world size; FSDP2 then divides by the world size once more, so the
    gradients are ``1/world_size`` of the full-batch gradient, on any shards."""
    return ctx.backward(ctx.fsdp(), ctx.shard_size / ctx.batch_size)


def fsdp_one_ulp_step(ctx: FSDPContext) -> Any:
    """DELIBERATELY BROKEN: the exact FSDP2 step (each rank's mean loss weighted by its
    share, ``ctx.loss_weight``), after which rank 0 moves the first element of its shard of
    the first reduce-scattered gradient up by one unit in the last place: one element of
    one reduced gradient, below every tolerance; exact mode (``exact=True``) sees it."""
    model = ctx.fsdp()
    output = ctx.backward(model, ctx.loss_weight)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if ctx.rank == 0 and grads:
        one_ulp_up(grads[0])
    return output


# --------------------------------------------------------------------------- tensor-parallel styles and plans


class NoAllReduceRowwiseParallel(RowwiseParallel):
    """DELIBERATELY BROKEN: a ``RowwiseParallel`` whose output skips the all-reduce. Its
    forward produces a ``Partial`` DTensor (each rank's matmul over its input columns, a
    partial sum); this style hands on each rank's local partial sum as if it were the whole
    output, so every rank's output is off by the other ranks' partial sums."""

    @staticmethod
    def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any, device_mesh: Any) -> Any:
        return outputs.to_local() if isinstance(outputs, DTensor) else outputs


class LocalOutputColwiseParallel(ColwiseParallel):
    """DELIBERATELY BROKEN: a ``ColwiseParallel`` that uses its local shard of the output
    columns as the whole output: it pads the rank's columns with zeros to the full width
    (where they sit in the global output) instead of all-gathering the other ranks'."""

    @staticmethod
    def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any, device_mesh: Any) -> Any:
        if not isinstance(outputs, DTensor):
            return outputs
        local = outputs.to_local()
        width = outputs.shape[-1]
        rank, size = device_mesh.get_local_rank(), device_mesh.size()
        start = sum(piece.numel() for piece in torch.arange(width).chunk(size)[:rank])  # the columns of the ranks before
        return torch.nn.functional.pad(local, (start, width - start - local.shape[-1]))


class OneUlpRowwiseParallel(RowwiseParallel):
    """DELIBERATELY BROKEN: a ``RowwiseParallel`` whose weight's gradient (the sum over the
    batch of each row's product), once accumulated, has the first element of rank 0's
    shard one unit in the last place too large: below every tolerance; exact mode
    (``exact=True``) sees it."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        import torch.distributed as dist

        applied = super()._apply(module, device_mesh)
        weight = getattr(applied, "weight", None)
        if isinstance(weight, torch.Tensor) and dist.get_rank() == 0:
            weight.register_post_accumulate_grad_hook(_one_ulp_grad)
        return applied


def _one_ulp_grad(param: torch.Tensor) -> None:
    """A post-accumulate-grad hook: ``param.grad``'s first element one ulp up, in place."""
    if param.grad is not None:
        one_ulp_up(param.grad)


def one_ulp_plan(layout: TPLayout, module: nn.Module) -> dict[str, Any]:
    """The layout's plan with every rowwise layer a ``OneUlpRowwiseParallel``: one element
    of rank 0's shard of each rowwise weight's gradient one unit in the last place off."""
    del module
    return layout.plan(rowwise=OneUlpRowwiseParallel)


def no_allreduce_plan(layout: TPLayout, module: nn.Module) -> dict[str, Any]:
    """Every rowwise layer of the layout's plan skips its all-reduce
    (``NoAllReduceRowwiseParallel``): each rank's output is its partial sum."""
    del module
    return layout.plan(rowwise=NoAllReduceRowwiseParallel)


def local_output_plan(layout: TPLayout, module: nn.Module) -> dict[str, Any]:
    """The model's last Linear is a colwise layer whose local shard of the output columns
    is used as the whole output (``LocalOutputColwiseParallel``, its columns zero-padded to
    the full width); a pair of the layout that holds that Linear is left plain."""
    plan = layout.plan()
    last = [path for path, sub in module.named_modules() if isinstance(sub, nn.Linear)][-1]
    for pair in layout.pairs:
        if last in pair:
            for path in pair:
                del plan[path]
    plan[last] = LocalOutputColwiseParallel()
    return plan


# --------------------------------------------------------------------------- pipeline schedules


class UnscaledGPipe(ScheduleGPipe):
    """Deliberately broken (a mutant for the self-tests): GPipe that never divides the
    accumulated gradients by ``n_microbatches``, whatever ``scale_grads`` says. With a
    mean loss every gradient is ``n_microbatches`` times too large; the check names the
    factor and the number of microbatches."""

    def _step_microbatches(self, *args: Any, **kwargs: Any) -> None:
        scale, self.scale_grads = self.scale_grads, False
        try:
            super()._step_microbatches(*args, **kwargs)
        finally:
            self.scale_grads = scale


class SkipLastMicrobatchGPipe(ScheduleGPipe):
    """Deliberately broken (a mutant for the self-tests): GPipe whose loop stops one
    microbatch short (an off-by-one), averaging the gradients of the others. The ranks'
    evidence catches it: each stage ran ``n_microbatches - 1`` forwards."""

    def _step_microbatches(
        self,
        arg_mbs: list[Any] | None = None,
        kwarg_mbs: list[Any] | None = None,
        target_mbs: list[Any] | None = None,
        losses: list[Any] | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        # what follows ``losses`` (return_outputs, loss_kwargs, ...) differs across torch
        # releases and is passed on as given
        n = self._n_microbatches
        kept = max(n - 1, 1)

        def cut(items: list[Any] | None) -> list[Any] | None:
            return None if items is None else items[:kept]

        self._n_microbatches = kept
        try:
            super()._step_microbatches(cut(arg_mbs), cut(kwarg_mbs), cut(target_mbs), losses, *args, **kwargs)
        finally:
            self._n_microbatches = n


class OneUlpGPipe(ScheduleGPipe):
    """DELIBERATELY BROKEN: GPipe, after which the first stage moves the first element of
    its first parameter's gradient (summed over the microbatches and scaled by their
    number) up by one unit in the last place: below every tolerance; exact mode
    (``exact=True``) sees it."""

    def _step_microbatches(self, *args: Any, **kwargs: Any) -> None:
        super()._step_microbatches(*args, **kwargs)
        if self._stage.stage_index == 0:
            grads = [p.grad for p in self._stage.submod.parameters() if p.grad is not None]
            if grads:
                one_ulp_up(grads[0])


# --------------------------------------------------------------------------- tensor parallel training

#: The norm the tensor-parallel training hooks clip to: small, so that every step clips.
TP_CLIP_NORM = 0.01


@torch.no_grad()
def _full_grad_norm(ctx: Any) -> torch.Tensor:
    """The norm of the full gradients: of the DTensor ones by ``get_total_norm`` (a
    DTensor made whole, ``full_tensor()``: the sum over the shards, a ``Partial``
    gradient reduced first), of the plain ones (whole on every rank) as they are;
    ``clip_grad_norm_`` itself refuses a mix of DTensor and plain gradients."""
    grads = [p.grad for p in ctx.module.parameters() if p.grad is not None]
    dtensors = [g for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    norms = []
    if dtensors:
        total = torch.nn.utils.get_total_norm(dtensors)  # a Replicate() DTensor
        norms.append(total.full_tensor() if isinstance(total, DTensor) else total)
    if plain:
        norms.append(torch.nn.utils.get_total_norm(plain))
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


@torch.no_grad()
def _scale_grads(ctx: Any, norm: torch.Tensor) -> None:
    coef = (TP_CLIP_NORM / (norm + 1e-6)).clamp(max=1.0)
    for p in ctx.module.parameters():
        if p.grad is not None:
            (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).mul_(coef)


def tp_global_clip(ctx: Any) -> None:
    """A correct ``after_backward`` hook for tensor parallelism: every rank clips its
    gradients (its shards) by the norm of the full gradients, to ``TP_CLIP_NORM``."""
    _scale_grads(ctx, _full_grad_norm(ctx))


def tp_one_rank_clip(ctx: Any) -> None:
    """DELIBERATELY BROKEN: computes the norm of the full gradients on every rank (they all
    join its collectives) but clips only under ``if ctx.rank == 0``, the "main process"
    guard meant for logging: the other ranks step with unclipped gradients, and their
    shards of every parameter drift from rank 0's."""
    norm = _full_grad_norm(ctx)
    if ctx.rank == 0:
        _scale_grads(ctx, norm)


# --------------------------------------------------------------------------- pipeline training


def averaged_tied_grads_hook(ctx: Any) -> None:
    """DELIBERATELY BROKEN: all-reduces the gradient of every weight tied across stages
    (``ctx.tied``, an embedding shared with the output projection) over the stages that
    hold it, then divides by their number: the data-parallel habit of averaging, where
    every rank holds a whole gradient. Each stage holds only its own children's part, so
    the copies agree with each other but step with ``1/stages`` of the gradient one
    device's single parameter gets (the correct hook sums: ``sync_tied_grads``)."""
    import torch.distributed as dist

    if ctx.reference or not ctx.tied:
        return
    params = dict(ctx.module.named_parameters(remove_duplicate=False))
    for local in sorted(ctx.tied, key=lambda name: ctx.tied[name]):
        grad = params[local].grad
        dist.all_reduce(grad, group=ctx.tied_group)
        grad /= dist.get_world_size(ctx.tied_group)
