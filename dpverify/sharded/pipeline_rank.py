"""The rank side of the pipeline-parallel check: one stage per rank, run by a schedule.

Each rank takes its stage's top-level children from a fresh copy of the module, keeps them
under their names in the whole module (so that a stage's ``'2.weight'`` is the module's
``'2.weight'``), wraps them in torch's ``PipelineStage`` over the ranks' default process
group, runs one ``step`` of the schedule, and reports what the stage ran (``_Evidence``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

from dpverify.core.step import flatten_tensors
from dpverify.core.tree import first_batched
from dpverify.ranked.rank import LossFn, RankInfo, cpu_copy, grads_of, outputs_of, seeded, to_device
from dpverify.sharded.mesh import quiet

__all__ = ["PipelineRankStep", "PipelineTask", "StageModule", "run_pipeline_task"]


class StageModule(nn.Module):
    """Some top-level children of a module, under their names in it, run in order: the
    first on the stage's inputs, each next one on the previous one's output."""

    def __init__(self, children: Sequence[tuple[str, nn.Module]]) -> None:
        super().__init__()
        for name, child in children:
            self.add_module(name, child)

    def forward(self, *args: Any) -> Any:
        first, *rest = self._modules.values()
        assert first is not None
        output = first(*args)
        for child in rest:
            assert child is not None
            output = child(output)
        return output


@dataclass(frozen=True)
class PipelineTask:
    """One schedule step of ``module`` cut into ``stages`` (child names per stage).

    ``schedule`` is the ``PipelineScheduleSingle`` class each rank builds around its stage,
    with ``n_microbatches``, ``loss_fn`` and ``scale_grads``.
    """

    module: nn.Module
    inputs: tuple[Any, ...]
    target: Any
    loss_fn: LossFn
    stages: tuple[tuple[str, ...], ...]
    schedule: type[Any]
    n_microbatches: int
    scale_grads: bool
    seed: int = 0


@dataclass(frozen=True)
class PipelineRankStep:
    """What one rank's stage did in the step (CPU tensors).

    Attributes:
        stage_index: the stage ``PipelineStage`` ran as.
        num_stages: the stages it knew of.
        children: the module's top-level children the stage held.
        held: every name of every parameter the stage held, aliases included (a weight tied
            between two children appears under both names).
        forwards: the microbatch of each ``forward_one_chunk`` call, in order.
        forward_rows: the rows each such forward gave the stage's module.
        backwards: the microbatch of each ``backward_one_chunk`` call, in order.
        output_grads: gradients that reached the stage's output in those backwards.
        grads: gradient of each parameter of the stage, by qualified name in the module.
        losses: the schedule's loss of each microbatch (last stage only).
        outputs: the schedule's merged output, by path (last stage only).
    """

    stage_index: int
    num_stages: int
    children: tuple[str, ...]
    held: tuple[str, ...]
    forwards: tuple[int, ...]
    forward_rows: tuple[int, ...]
    backwards: tuple[int, ...]
    output_grads: int
    grads: dict[str, torch.Tensor | None]
    losses: tuple[torch.Tensor, ...] = ()
    outputs: tuple[tuple[str, torch.Tensor], ...] = ()


class _Evidence:
    """Hooks on one stage: which microbatches it ran forward and backward, the rows of each
    forward, the gradients that reached its output.

    ``PipelineStage`` also calls the module once outside any microbatch, to infer the shapes
    it sends (``_forward_metadata_inference``, torch/distributed/pipelining/stage.py): a
    forward counts only inside ``forward_one_chunk``, so that call is left out.
    """

    def __init__(self, stage: PipelineStage, module: nn.Module) -> None:
        self.forwards: list[int] = []
        self.rows: list[int] = []
        self.backwards: list[int] = []
        self.output_grads = 0
        self._chunk: int | None = None
        module.register_forward_hook(self._forward_hook)
        forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

        def forward_one_chunk(fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            self._chunk = fwd_chunk_id
            try:
                return forward(fwd_chunk_id, *args, **kwargs)
            finally:
                self._chunk = None
                self.forwards.append(fwd_chunk_id)

        def backward_one_chunk(bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            self.backwards.append(bwd_chunk_id)
            return backward(bwd_chunk_id, *args, **kwargs)

        # Instance attributes shadow the methods the schedule calls (schedules.py calls
        # self._stage.forward_one_chunk / backward_one_chunk).
        stage.forward_one_chunk = forward_one_chunk  # type: ignore[method-assign]
        stage.backward_one_chunk = backward_one_chunk  # type: ignore[method-assign]

    def _forward_hook(self, _module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._chunk is None:
            return
        first = first_batched(args)
        self.rows.append(int(first.size(0)) if first is not None and first.dim() > 0 else 0)
        tensors = [t for _path, t in flatten_tensors(output, "output") if t.requires_grad]
        if tensors:
            tensors[0].register_hook(self._count_grad)

    def _count_grad(self, grad: torch.Tensor) -> None:
        self.output_grads += 1


def _step(schedule: Any, rank: int, last: bool, inputs: tuple[Any, ...], target: Any, losses: list[Any]) -> Any:
    """One ``schedule.step``: the batch on the first stage, the target on the last."""
    step: Callable[..., Any] = schedule.step
    if rank == 0:
        return step(*inputs, target=target if last else None, losses=losses if last else None)
    if last:
        return step(target=target, losses=losses)
    return step()


def run_pipeline_task(info: RankInfo, task: PipelineTask) -> PipelineRankStep:
    """Builds this rank's stage and runs one step of the schedule (a task for
    ``RankRunner.run``)."""
    device = torch.device(info.device)
    rank, stages = info.rank, len(task.stages)
    names = task.stages[rank]
    children = dict(task.module.named_children())
    module = StageModule([(name, children[name]) for name in names]).to(device)
    last = rank == stages - 1
    with quiet(), seeded(device, task.seed):
        stage = PipelineStage(module, rank, stages, device)
        evidence = _Evidence(stage, module)
        schedule = task.schedule(stage, task.n_microbatches, loss_fn=task.loss_fn, scale_grads=task.scale_grads)
        losses: list[Any] = []
        output = _step(schedule, rank, last, to_device(task.inputs, device), to_device(task.target, device), losses)
    return PipelineRankStep(
        stage_index=stage.stage_index,
        num_stages=stage.num_stages,
        children=names,
        held=tuple(name for name, _p in module.named_parameters(remove_duplicate=False)),
        forwards=tuple(evidence.forwards),
        forward_rows=tuple(evidence.rows),
        backwards=tuple(evidence.backwards),
        output_grads=evidence.output_grads,
        grads=grads_of(module),
        losses=tuple(cpu_copy(loss) for loss in losses if isinstance(loss, torch.Tensor)),
        outputs=outputs_of(output) if last else (),
    )
