"""The rank side of the pipeline-parallel check: one stage per rank, run by a schedule.

Each rank takes its stage's top-level children from a fresh copy of the module, keeps them
under their names in the whole module (so that a stage's ``'2.weight'`` is the module's
``'2.weight'``), wraps them in torch's ``PipelineStage`` over the ranks' default process
group, runs one ``step`` of the schedule, and reports what the stage ran (``_Evidence``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

from dpverify.core.step import flatten_tensors
from dpverify.core.tree import first_batched
from dpverify.ranked.rank import (
    AfterBackward,
    LossFn,
    OptimizerFactory,
    RankContext,
    RankInfo,
    ReferenceContext,
    after_backward_note,
    buffers_of,
    cpu_copy,
    grads_of,
    outputs_of,
    params_of,
    seeded,
    to_device,
)
from dpverify.sharded.mesh import quiet

__all__ = [
    "PipelineContext",
    "PipelineRankStep",
    "PipelineRankTraining",
    "PipelineReferenceContext",
    "PipelineTask",
    "PipelineTrainingTask",
    "StageModule",
    "optimizer_state",
    "run_pipeline_task",
    "run_pipeline_training",
    "sync_tied_grads",
    "tied_across_stages",
]


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
        outside: forwards of the stage's module outside any microbatch (torch's shape
            inference, ``_Evidence``).
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
    outside: int = 0


class _Evidence:
    """Hooks on one stage: which microbatches it ran forward and backward, the rows of each
    forward, the gradients that reached its output.

    ``PipelineStage`` also calls the module once outside any microbatch, to infer the shapes
    it sends (``_forward_metadata_inference``, torch/distributed/pipelining/stage.py): a
    forward counts only inside ``forward_one_chunk``, so that call is left out, and
    counted apart (``outside``): it updates buffers that the forward updates.
    """

    def __init__(self, stage: PipelineStage, module: nn.Module) -> None:
        self.forwards: list[int] = []
        self.rows: list[int] = []
        self.backwards: list[int] = []
        self.output_grads = 0
        self.outside = 0
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

    def reset(self) -> None:
        """Forget what earlier steps ran: the next step's evidence starts empty."""
        self.forwards, self.rows, self.backwards, self.output_grads, self.outside = [], [], [], 0, 0

    def _forward_hook(self, _module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._chunk is None:
            self.outside += 1
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
    return _rank_step(stage, names, module, evidence, losses, output if last else None)


def _rank_step(stage: PipelineStage, names: tuple[str, ...], module: nn.Module, evidence: _Evidence, losses: list[Any], output: Any) -> PipelineRankStep:
    """What the stage ran in one schedule step, and the gradients it left."""
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
        outputs=outputs_of(output) if output is not None else (),
        outside=evidence.outside,
    )


# --------------------------------------------------------------------------- training


@dataclass
class PipelineContext(RankContext):
    """What an ``after_backward`` hook sees on a pipeline stage, after the schedule's step
    (every microbatch's forward and backward) and before the stage's optimizer step.

    Attributes:
        stage_index: this rank's stage, 0 for the first.
        num_stages: the stages of the pipeline (its ranks).
        tied: the parameters of this stage that other stages hold too, by their name in
            ``module`` (the stage's children under their names in the whole module), each
            mapped to the whole module's first name for it: a weight tied between children
            of different stages (an input embedding shared with the output projection),
            of which every stage trains its own copy.
        tied_group: the process group of the stages that hold such a weight (the first and
            the last for a tied embedding), made by the harness on every rank (torch's
            ``new_group`` is collective); None when no weight is tied across stages. A
            stage's gradient of a tied weight is only its own children's part: summing it
            over this group gives each copy the whole gradient.

    ``module`` is the stage's module, ``inputs`` the batch on the first stage (``()`` on
    the others), ``target`` the batch's target on the last (None on the others), and
    ``shard_sizes`` the whole batch's rows: every stage runs every row.
    """

    stage_index: int = 0
    num_stages: int = 1
    tied: dict[str, str] = field(default_factory=dict)
    tied_group: Any = None

    @property
    def shard_index(self) -> int:
        return 0

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    @property
    def group(self) -> Any:
        """The pipeline's process group (every stage): torch.distributed's default group."""
        import torch.distributed as dist

        return dist.group.WORLD

    @property
    def wrapped(self) -> bool:
        return True


@dataclass
class PipelineReferenceContext(ReferenceContext):
    """What an ``after_backward`` hook written for pipeline stages sees in the single-device
    reference: one stage (``stage_index`` 0 of ``num_stages`` 1) holding the whole module,
    where a tied weight is one parameter (``tied`` empty) and ``tied_group`` is the group of
    one rank (a collective over it returns its input)."""

    stage_index: int = 0
    num_stages: int = 1
    tied: dict[str, str] = field(default_factory=dict)

    @property
    def is_first(self) -> bool:
        return True

    @property
    def is_last(self) -> bool:
        return True

    @property
    def tied_group(self) -> Any:
        return self.one_rank


def sync_tied_grads(ctx: Any) -> None:
    """Sums the gradient of every weight tied across stages over the stages that hold it
    (``ctx.tied`` over ``ctx.tied_group``), in the order of the whole module's names, so
    that every copy steps with the whole gradient, as one device's single parameter does
    (Megatron-LM all-reduces its embedding group's gradients so). A stage whose copy got
    no gradient contributes zeros. Does nothing in the single-device reference and on
    stages that hold no tied weight."""
    import torch.distributed as dist

    if ctx.reference or not ctx.tied:
        return
    params = dict(ctx.module.named_parameters(remove_duplicate=False))
    for local in sorted(ctx.tied, key=lambda name: ctx.tied[name]):
        param = params[local]
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad, group=ctx.tied_group)


def tied_across_stages(module: nn.Module, stages: Sequence[Sequence[str]]) -> dict[int, dict[str, str]]:
    """Per stage, its parameters that another stage holds too (by their name in the whole
    module), each with the module's first name for it; stages without any are left out."""
    children = dict(module.named_children())
    first: dict[int, str] = {}
    for name, param in module.named_parameters():
        first[id(param)] = name
    holders: dict[int, set[int]] = {}
    names: dict[int, dict[int, str]] = {}
    for stage, held in enumerate(stages):
        for child in held:
            for local, param in children[child].named_parameters(prefix=child, remove_duplicate=False):
                holders.setdefault(id(param), set()).add(stage)
                names.setdefault(stage, {}).setdefault(id(param), local)
    found: dict[int, dict[str, str]] = {}
    for stage, mine in names.items():
        for key, local in mine.items():
            if len(holders[key]) > 1:
                found.setdefault(stage, {})[local] = first[key]
    return found


@dataclass(frozen=True)
class PipelineTrainingTask:
    """``len(batches)`` optimizer steps of ``module`` cut into ``stages``: each rank builds
    its stage, the schedule around it and ``optimizer(stage parameters)``, then per batch
    zeroes the gradients, runs one ``schedule.step``, ``after_backward(ctx)`` when given,
    and the optimizer step."""

    module: nn.Module
    batches: tuple[tuple[tuple[Any, ...], Any], ...]
    loss_fn: LossFn
    optimizer: OptimizerFactory
    stages: tuple[tuple[str, ...], ...]
    schedule: type[Any]
    n_microbatches: int
    scale_grads: bool
    after_backward: AfterBackward | None = None
    seed: int = 0


@dataclass(frozen=True)
class PipelineRankTraining:
    """What one rank's stage did in each optimizer step (CPU tensors, by the names of the
    whole module as the stage holds them).

    Attributes:
        steps: each step's evidence, gradients (as the optimizer stepped with them: after
            ``after_backward``), losses and output (``PipelineRankStep``).
        params: the stage's parameters after each step.
        buffers: the stage's buffers after each step.
        state: the optimizer's state after each step: per parameter, each state tensor by
            its key (``'exp_avg'``, ``'momentum_buffer'``, ...).
        tied: the stage's parameters tied to another stage's (``PipelineContext.tied``).
    """

    steps: tuple[PipelineRankStep, ...]
    params: tuple[dict[str, torch.Tensor], ...]
    buffers: tuple[dict[str, torch.Tensor], ...]
    state: tuple[dict[str, dict[str, torch.Tensor]], ...]
    tied: dict[str, str]


def optimizer_state(optimizer: torch.optim.Optimizer, module: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """CPU copies of the optimizer's per-parameter state tensors (numbers as 0-dim tensors),
    by each parameter's first name in ``module``."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for name, param in module.named_parameters():
        state = optimizer.state.get(param, {})
        entries = {
            key: cpu_copy(value) if isinstance(value, torch.Tensor) else torch.tensor(float(value), dtype=torch.float64)
            for key, value in state.items()
            if isinstance(value, torch.Tensor) or (isinstance(value, (int, float)) and not isinstance(value, bool))
        }
        if entries:
            found[name] = entries
    return found


def _tied_group(tied: Mapping[int, Mapping[str, str]], stages: int) -> Any:
    """The group of the stages holding tied weights, made on every rank (collective); the
    default group when they are all the stages, None when there are none."""
    import torch.distributed as dist

    ranks = sorted(tied)
    if not ranks:
        return None
    if len(ranks) == stages:
        return dist.group.WORLD
    return dist.new_group(ranks)


def run_pipeline_training(info: RankInfo, task: PipelineTrainingTask) -> PipelineRankTraining:
    """Builds this rank's stage, its schedule and its optimizer, and trains it for
    ``len(task.batches)`` steps (a task for ``RankRunner.run``)."""
    import torch.distributed as dist

    device = torch.device(info.device)
    rank, stages = info.rank, len(task.stages)
    names = task.stages[rank]
    children = dict(task.module.named_children())
    tied = tied_across_stages(task.module, task.stages)
    module = StageModule([(name, children[name]) for name in names]).to(device)
    last = rank == stages - 1
    group = _tied_group(tied, stages)
    ctx = PipelineContext(
        rank=rank, world_size=info.world_size, module=module, inputs=(), target=None, loss_fn=task.loss_fn,
        shard_sizes=(0,), device=device, stage_index=rank, num_stages=stages, tied=dict(tied.get(rank, {})), tied_group=group,
    )
    steps: list[PipelineRankStep] = []
    params: list[dict[str, torch.Tensor]] = []
    buffers: list[dict[str, torch.Tensor]] = []
    state: list[dict[str, dict[str, torch.Tensor]]] = []
    try:
        with quiet(), seeded(device, task.seed):
            stage = PipelineStage(module, rank, stages, device)
            evidence = _Evidence(stage, module)
            schedule = task.schedule(stage, task.n_microbatches, loss_fn=task.loss_fn, scale_grads=task.scale_grads)
            # a stage of parameterless children (an activation) has nothing to optimise;
            # torch's optimizers refuse an empty parameter list
            held = list(module.parameters())
            optimizer = task.optimizer(held) if held else None
            for index, (inputs, target) in enumerate(task.batches):
                args, goal = to_device(inputs, device), to_device(target, device)
                ctx.inputs, ctx.target = (args if rank == 0 else ()), (goal if last else None)
                ctx.shard_sizes, ctx.step_index = (int(goal.size(0)),), index
                if optimizer is not None:
                    optimizer.zero_grad(set_to_none=True)
                evidence.reset()
                losses: list[Any] = []
                try:
                    output = _step(schedule, rank, last, args, goal, losses)
                    if task.after_backward is not None:
                        with after_backward_note(task.after_backward):
                            task.after_backward(ctx)
                except Exception as error:
                    error.add_note(f"dpverify: raised in optimizer step {index + 1} of {len(task.batches)} (stage {rank})")
                    raise
                steps.append(_rank_step(stage, names, module, evidence, losses, output if last else None))
                if optimizer is not None:
                    optimizer.step()
                params.append(params_of(module))
                buffers.append(buffers_of(module))
                state.append(optimizer_state(optimizer, module) if optimizer is not None else {})
    finally:
        if group is not None and group is not dist.group.WORLD:
            dist.destroy_process_group(group)
    return PipelineRankTraining(tuple(steps), tuple(params), tuple(buffers), tuple(state), dict(tied.get(rank, {})))
