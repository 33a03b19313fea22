"""A catalogue of real data-parallel bugs, and correct implementations to compare with.

Each mutant is a small, readable data-parallel implementation with one bug that people
really make (docs/semantics.md, docs/questions.md). The DataParallel mutants have DataParallel's
signature, ``Wrapper(module, device_ids=..., output_device=...)``, and can be passed as
``Target(parallel=...)`` to a registry check, as ``parallel=`` to every assertion helper or
as ``dpverify verify --parallel``; reduction mutants have ``reduce(replica_losses,
chunk_sizes)``'s signature (``Target(reduce=...)``); DDP and FSDP2 mutants are per-rank
steps, ``step(ctx)`` (``Target(step=...)``), tensor-parallel mutants plan builders
``plan(layout, module)`` (``Target(plan=...)``) and pipeline mutants schedule classes
(``Target(schedule=...)``). ``MUTANTS`` describes them all: the bug,
the registry check that catches it (``dpverify.checks.registry.CHECKS``), and a phrase the
failure message contains; ``PROPERTIES`` gives each of those checks the random scenarios it
runs on. ``ScratchDataParallel`` (a DataParallel written from scratch) and
``manual_allreduce_step`` (a DDP step with a hand-written all-reduce) are correct: they must
pass everything the mutants fail.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from hypothesis.strategies import SearchStrategy
from torch import nn
from torch.nn.parallel.scatter_gather import gather

from dpverify.checks.loss_average import chunk_weighted_loss
from dpverify.core.tree import concatenate, first_batched, map_tensors
from dpverify.core.virtual import VirtualDataParallel
from dpverify.ddp.rank import ShardContext
from dpverify.models.layouts import ShardedScenario, TPLayout
from dpverify.models.specs import KINDS
from dpverify.registry import CHECKS, MICRO_BATCHES, Case, Target
from dpverify.sharded.fsdp import fsdp_summed_loss_step, fsdp_undivided_step, fsdp_wrong_weight_step
from dpverify.sharded.pipeline import SkipLastMicrobatchGPipe, UnscaledGPipe
from dpverify.sharded.tensor_parallel import LocalOutputColwiseParallel, NoAllReduceRowwiseParallel
from dpverify.strategies import (
    Scenario,
    device_lists,
    loss_specs,
    model_specs,
    scenarios,
    sharded_scenarios,
)

__all__ = [
    "MUTANTS",
    "PROPERTIES",
    "AveragingDataParallel",
    "BalancedDropsChunkDataParallel",
    "BalancedOffsetDataParallel",
    "DeepCopyDataParallel",
    "DetachedReplicasDataParallel",
    "LastReplicaBuffersDataParallel",
    "MeanCriterionParallel",
    "Mutant",
    "OutputDeviceFirstDataParallel",
    "Property",
    "ReplicaOutputsDataParallel",
    "ReversedGatherDataParallel",
    "ScratchDataParallel",
    "TinyErrorDataParallel",
    "WeightedCriterionParallel",
    "forward_outside_no_sync_step",
    "local_output_plan",
    "manual_allreduce_step",
    "mean_of_replica_losses",
    "no_allreduce_plan",
    "rank_seeded_init_step",
    "summed_allreduce_step",
    "summed_loss_step",
    "undivided_accumulation_step",
    "weighted_replica_losses",
    "zero_grad_in_loop_step",
]


def _replica_parameters(replica: nn.Module) -> list[torch.Tensor]:
    """A replica's parameter copies (torch stores them as plain attributes, not Parameters)."""
    found = []
    for sub in replica.modules():
        for name in getattr(sub, "_former_parameters", {}):
            tensor = getattr(sub, name)
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                found.append(tensor)
    return found


class AveragingDataParallel(VirtualDataParallel[Any]):
    """Averages replica gradients instead of summing them.

    The classic misreading of DataParallel: "each GPU computed a gradient, so average
    them". With a mean loss over the gathered batch each replica already contributes
    (1/B) x its rows' sum, so dividing by the number of replicas shrinks every gradient.
    """

    def replicate(self, module: nn.Module, device_ids: Sequence[int | torch.device]) -> list[nn.Module]:
        replicas = super().replicate(module, device_ids)
        count = len(replicas)
        for replica in replicas:
            for tensor in _replica_parameters(replica):
                tensor.register_hook(lambda g: g / count)
        return replicas


class DetachedReplicasDataParallel(VirtualDataParallel[Any]):
    """Detaches every replica but the first, so only replica 0's gradient arrives.

    What ``replicate(..., detach=True)`` does for all replicas when someone "saves memory"
    for the copies: the parameters only learn from the first chunk.
    """

    def replicate(self, module: nn.Module, device_ids: Sequence[int | torch.device]) -> list[nn.Module]:
        replicas = super().replicate(module, device_ids)
        for replica in replicas[1:]:
            for sub in replica.modules():
                for name in list(getattr(sub, "_former_parameters", {})):
                    setattr(sub, name, getattr(sub, name).detach())
        return replicas


def _rows(inputs: tuple[Any, ...], kwargs: dict[str, Any] | None) -> int:
    for value in (*inputs, *(kwargs or {}).values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return 1


class ReversedGatherDataParallel(VirtualDataParallel[Any]):
    """Gathers the replicas' outputs in reverse order: rows no longer line up with targets."""

    def gather(self, outputs: Any, output_device: int | torch.device) -> Any:
        return super().gather(list(reversed(outputs)), output_device)


class OutputDeviceFirstDataParallel(VirtualDataParallel[Any]):
    """Puts the output device's own chunk first when gathering, as if "local results come
    first". Harmless with the default ``output_device`` (``device_ids[0]``); with any other
    output device the rows are out of order."""

    def gather(self, outputs: Any, output_device: int | torch.device) -> Any:
        used = self.device_ids[: len(outputs)]
        target = int(output_device) if not isinstance(output_device, torch.device) else output_device.index
        if target in used and target != used[0]:
            i = used.index(target)
            outputs = [outputs[i], *outputs[:i], *outputs[i + 1 :]]
        return super().gather(outputs, output_device)


class LastReplicaBuffersDataParallel(VirtualDataParallel[Any]):
    """Keeps the buffers of the last replica instead of the first: BatchNorm running
    statistics (and any buffer updated in place in forward) come from the wrong chunk."""

    def parallel_apply(self, replicas: Sequence[nn.Module], inputs: Sequence[Any], kwargs: Any) -> list[Any]:
        outputs = super().parallel_apply(replicas, inputs, kwargs)
        if len(replicas) > 1:
            # Rebinds rather than copies: replica 0's buffers may be saved for backward.
            for own, theirs in zip(self.module.modules(), replicas[-1].modules(), strict=True):
                for name, buffer in theirs._buffers.items():
                    if buffer is not None:
                        own._buffers[name] = buffer.detach()
        return outputs


class TinyErrorDataParallel(VirtualDataParallel[Any]):
    """Correct, except the first parameter's gradient is off by a relative 1e-4: the kind of
    error a fixed ``atol`` hides (a wrong epsilon, a stray rescale)."""

    relative_error = 1e-4

    def __init__(self, module: nn.Module, device_ids: Sequence[int] | None = None, output_device: int | None = None) -> None:
        super().__init__(module, device_ids, output_device)
        first = next(module.parameters(), None)
        if first is not None:
            first.register_hook(lambda g: g * (1 + self.relative_error))


class _BalancedScatter(nn.DataParallel[Any]):
    """The scatter of a balanced-chunk DataParallel, as projects write to leave room for the
    loss on the first GPU: device 0 takes one row fewer than an even share (at least one),
    the others split the rest (the first of them one row more each, as many as the remainder). Each
    device's rows start at ``chunk_starts(sizes)``; batches of no more rows than devices
    keep torch's scatter."""

    def chunk_starts(self, sizes: Sequence[int]) -> list[int]:
        """Where each device's rows start: right after the devices before it."""
        return [sum(sizes[:i]) for i in range(len(sizes))]

    def scatter(self, inputs: Any, kwargs: Any, device_ids: Sequence[Any]) -> Any:
        first_input = next((x for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0), None)
        n = len(device_ids)
        rows = first_input.size(self.dim) if first_input is not None else 0
        if n < 2 or rows <= n:
            return super().scatter(inputs, kwargs, device_ids)
        first = max(1, rows // n - 1)
        share, extra = divmod(rows - first, n - 1)
        sizes = [first] + [share + (1 if i < extra else 0) for i in range(n - 1)]
        starts = self.chunk_starts(sizes)

        def rows_of(device: int) -> Callable[[torch.Tensor], torch.Tensor]:
            def take(x: torch.Tensor) -> torch.Tensor:
                if x.dim() == 0 or x.size(self.dim) != rows:
                    return x
                return x.narrow(self.dim, starts[device], sizes[device])

            return take

        scattered = tuple(tuple(map_tensors(inputs, rows_of(i))) for i in range(n))
        scattered_kwargs = tuple(map_tensors(dict(kwargs or {}), rows_of(i)) for i in range(n))
        return scattered, scattered_kwargs


class BalancedOffsetDataParallel(_BalancedScatter):
    """A balanced-chunk DataParallel, as projects write to leave room for the loss on the
    first GPU: device 0 takes one row fewer than an even share, the others split the rest.
    The bug: each other device's rows start at a fixed stride from the first chunk, which
    forgets the extra row given to the devices before it, so chunks overlap and the last rows
    are never seen, in a batch of the right size.

    A plain ``torch.nn.DataParallel`` subclass (its own ``scatter`` only): dpverify runs it
    through ``virtual_devices`` where the CUDA devices are missing.
    """

    def chunk_starts(self, sizes: Sequence[int]) -> list[int]:
        first, share = sizes[0], min(sizes[1:])
        return [0] + [first + i * share for i in range(len(sizes) - 1)]  # bug: the running offset is sum(sizes[:i])


class BalancedDropsChunkDataParallel(_BalancedScatter):
    """A balanced-chunk DataParallel that keeps the first device free for the loss: device
    0 takes one row fewer than an even share and the others split the rest, as
    ``BalancedOffsetDataParallel`` does with the right offsets. The bug: it replicates the
    module for one device fewer ("device 0 is busy with the loss") but still splits the
    batch over all of them, and zips replicas with chunks, so the last chunk never runs.

    A plain ``torch.nn.DataParallel`` subclass (its own ``scatter`` and ``forward``).
    """

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if not self.device_ids:
            return self.module(*inputs, **kwargs)
        scattered, scattered_kwargs = self.scatter(inputs, kwargs, self.device_ids)
        if len(scattered) < 3:
            return super().forward(*inputs, **kwargs)
        used = self.device_ids[: len(scattered) - 1]  # bug: one replica fewer than chunks
        replicas = self.replicate(self.module, used)
        chunks = list(zip(replicas, scattered, scattered_kwargs, strict=False))
        outputs = self.parallel_apply([r for r, _a, _k in chunks], [a for _r, a, _k in chunks], [k for _r, _a, k in chunks])
        return self.gather(outputs, self.output_device)


class ReplicaOutputsDataParallel(nn.DataParallel[Any]):
    """The model half of a model/criterion pair: torch's DataParallel that leaves each
    replica's output where it was computed, one per replica, instead of gathering them
    (the criterion wrapper computes the loss next to them). Correct; pass it as
    ``parallel=`` with a criterion wrapper as ``parallel_loss_fn=``."""

    def gather(self, outputs: Any, output_device: Any) -> Any:
        return list(outputs)


class _CriterionParallel(nn.DataParallel[Any]):
    """The criterion half of a model/criterion pair: scatters the target like the inputs,
    runs a replica of the criterion next to each replica's output, and combines the
    replicas' losses (gathered to the output device, one entry each) with ``combine``."""

    def forward(self, outputs: Any, *targets: Any, **kwargs: Any) -> Any:
        if not isinstance(outputs, list):  # one device: DataParallel ran the module on the batch
            return self.module(outputs, *targets, **kwargs)
        used = self.device_ids[: len(outputs)]
        scattered, scattered_kwargs = self.scatter(targets, kwargs, used)
        replicas = self.replicate(self.module, used)
        arguments = [(output, *target) for output, target in zip(outputs, scattered, strict=True)]
        losses = self.parallel_apply(replicas, arguments, scattered_kwargs)
        gathered = gather([loss.reshape(1) for loss in losses], self.output_device)  # along dim 0
        rows = [_first_rows(output, self.dim) for output in outputs]
        return self.combine(gathered, rows)

    def combine(self, losses: torch.Tensor, rows: list[int]) -> torch.Tensor:
        raise NotImplementedError


def _first_rows(output: Any, dim: int) -> int:
    """Rows along ``dim`` of the first batched tensor of one replica's output."""
    first = first_batched(output)
    return int(first.size(dim)) if first is not None else 1


class MeanCriterionParallel(_CriterionParallel):
    """A criterion wrapper that averages the replicas' mean losses with ``.mean()``: each
    replica's loss gets weight ``1/n`` whatever its rows, so on uneven chunks the loss and
    every gradient are off (the loss-averaging trap, inside a criterion wrapper)."""

    def combine(self, losses: torch.Tensor, rows: list[int]) -> torch.Tensor:
        return losses.mean()


class WeightedCriterionParallel(_CriterionParallel):
    """A correct criterion wrapper: each replica's mean loss weighted by its share of the
    rows, ``sum(n_i * loss_i) / B``, the full-batch mean loss on any split (what
    ``MeanCriterionParallel`` is compared with)."""

    def combine(self, losses: torch.Tensor, rows: list[int]) -> torch.Tensor:
        return chunk_weighted_loss(losses, rows)


class DeepCopyDataParallel(nn.Module):
    """Runs a ``copy.deepcopy`` of the module on each chunk: the copies are not connected
    to the module by autograd, so no gradient ever reaches its parameters."""

    def __init__(self, module: nn.Module, device_ids: Sequence[int] | None = None, output_device: int | None = None) -> None:
        super().__init__()
        self.module = module
        self.n = len(device_ids) if device_ids else 2

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return concatenate([copy.deepcopy(self.module)(*a, **k) for a, k in _chunk_call(inputs, kwargs, self.n)])


def _chunk_call(inputs: tuple[Any, ...], kwargs: dict[str, Any], n: int) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """torch.chunk every batched tensor argument; other arguments go to every chunk."""

    def chunks(value: Any) -> list[Any]:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return list(value.chunk(n))
        return [value] * n

    columns = [chunks(a) for a in inputs]
    kw_columns = {k: chunks(v) for k, v in kwargs.items()}
    count = min([len(c) for c in columns] + [len(c) for c in kw_columns.values()] + [n])
    return [
        (tuple(c[i] for c in columns), {k: c[i] for k, c in kw_columns.items()}) for i in range(count)
    ]


def _replicate(module: nn.Module, index: int, aliases: dict[int, torch.Tensor]) -> nn.Module:
    """A replica of ``module``: the same code and Python state, parameters replaced by
    ``aliases`` (autograd views of them), and buffers shared by replica 0 only."""
    replicas: dict[int, nn.Module] = {}
    buffer_copies: dict[int, torch.Tensor] = {}

    def build(sub: nn.Module) -> nn.Module:
        if id(sub) in replicas:
            return replicas[id(sub)]
        # Module's own replication hook (RNNs override it to copy their weight list).
        replica: nn.Module = sub._replicate_for_data_parallel()
        replicas[id(sub)] = replica
        for name, child in sub._modules.items():
            replica._modules[name] = None if child is None else build(child)
        for name, param in sub._parameters.items():
            if param is None:
                replica._parameters[name] = None
            else:
                setattr(replica, name, aliases[id(param)])
        for name, buffer in sub._buffers.items():
            if buffer is not None and index > 0:
                buffer = buffer_copies.setdefault(id(buffer), buffer.clone())
            replica._buffers[name] = buffer
        return replica

    return build(module)


class ScratchDataParallel(nn.Module):
    """A correct DataParallel written from scratch, without torch.nn.parallel.

    Chunks every batched argument with ``torch.chunk`` (so there can be fewer replicas than
    devices), builds one replica per chunk whose parameters are autograd views of the
    module's (gradients of every replica then sum into the parameters), gives replica 0 the
    module's own buffers and the others copies (so only replica 0's in-place updates
    persist), and concatenates the outputs, stacking scalars into one entry per replica.
    """

    def __init__(self, module: nn.Module, device_ids: Sequence[int] | None = None, output_device: int | None = None) -> None:
        super().__init__()
        self.module = module
        self.device_ids = list(device_ids) if device_ids else [0, 1]

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if len(self.device_ids) == 1:
            return self.module(*inputs, **kwargs)
        outputs = []
        for i, (args, kw) in enumerate(_chunk_call(inputs, kwargs, len(self.device_ids))):
            aliases = {id(p): p.view_as(p) for p in self.module.parameters()}
            outputs.append(_replicate(self.module, i, aliases)(*args, **kw))
        if all(isinstance(o, torch.Tensor) and o.dim() == 0 for o in outputs):
            warnings.warn(
                "Was asked to gather along dimension 0, but all input tensors were scalars; "
                "will instead unsqueeze and return a vector.",
                stacklevel=2,
            )
        return concatenate(outputs)


def mean_of_replica_losses(losses: torch.Tensor, chunk_sizes: list[int]) -> torch.Tensor:
    """``loss.mean()`` of DataParallel's per-replica losses: biased when chunks are uneven."""
    return losses.mean()


def weighted_replica_losses(losses: torch.Tensor, chunk_sizes: list[int]) -> torch.Tensor:
    """Each replica's loss weighted by its share of the batch: exact for any split (the
    correct reduction the ``mean-of-means`` mutant is compared with)."""
    return chunk_weighted_loss(losses, chunk_sizes)


# --------------------------------------------------------------------------- DDP steps
# Per-rank training steps (``step(ctx: ShardContext)``): module-level functions, so that
# they pickle to the ranks.


def _all_reduce_mean(module: nn.Module, world_size: int, *, divide: bool = True) -> None:
    for param in module.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)
            if divide:
                param.grad /= world_size


def manual_allreduce_step(ctx: ShardContext) -> Any:
    """A correct DDP step without DistributedDataParallel: each rank's mean loss weighted by
    its share of the batch (``n_r * W / B``), backward, then every gradient all-reduced and
    divided by the world size."""
    output = ctx.module(*ctx.inputs)
    (ctx.loss_fn(output, ctx.target) * ctx.loss_weight).backward()
    _all_reduce_mean(ctx.module, ctx.world_size)
    return output


def summed_loss_step(ctx: ShardContext) -> Any:
    """Sums the per-row losses of the shard and never divides by the batch: DDP then
    averages sums, and every gradient is ``B / W`` times too large."""
    model = ctx.ddp()
    output = model(*ctx.inputs)
    (ctx.loss_fn(output, ctx.target) * ctx.shard_size).backward()
    return output


def summed_allreduce_step(ctx: ShardContext) -> Any:
    """A hand-written all-reduce that sums gradients and forgets to divide by the world
    size (DDP averages): gradients ``W`` times too large."""
    output = ctx.module(*ctx.inputs)
    (ctx.loss_fn(output, ctx.target) * ctx.loss_weight).backward()
    _all_reduce_mean(ctx.module, ctx.world_size, divide=False)
    return output


def rank_seeded_init_step(ctx: ShardContext) -> Any:
    """Initialises the model on each rank with a rank-dependent seed and never broadcasts
    rank 0's parameters (DistributedDataParallel does at construction): ranks train
    different models."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1000 + ctx.rank)
        for sub in ctx.module.modules():
            reset = getattr(sub, "reset_parameters", None)
            if callable(reset):
                reset()
    return manual_allreduce_step(ctx)


def forward_outside_no_sync_step(ctx: ShardContext) -> None:
    """Gradient accumulation with only ``backward`` inside ``no_sync()``: DDP prepares the
    all-reduce in forward, so every micro-batch synchronises anyway."""
    model = ctx.ddp()
    parts = ctx.micro_batch_split()
    for index, part in enumerate(parts):
        output = model(*part.inputs)
        loss = ctx.loss_fn(output, part.target) * part.rows * ctx.world_size / ctx.batch_size
        with contextlib.nullcontext() if index == len(parts) - 1 else model.no_sync():
            loss.backward()


def undivided_accumulation_step(ctx: ShardContext) -> None:
    """Gradient accumulation that adds up the micro-batches' mean losses without dividing
    by their number: gradients ``k`` times too large."""
    model = ctx.ddp()
    parts = ctx.micro_batch_split()
    for index, part in enumerate(parts):
        with contextlib.nullcontext() if index == len(parts) - 1 else model.no_sync():
            ctx.loss_fn(model(*part.inputs), part.target).backward()


def zero_grad_in_loop_step(ctx: ShardContext) -> None:
    """Gradient accumulation that calls ``zero_grad()`` inside the loop: only the last
    micro-batch's gradient survives."""
    model = ctx.ddp()
    parts = ctx.micro_batch_split()
    for index, part in enumerate(parts):
        model.zero_grad()
        with contextlib.nullcontext() if index == len(parts) - 1 else model.no_sync():
            output = model(*part.inputs)
            (ctx.loss_fn(output, part.target) * part.rows * ctx.world_size / ctx.batch_size).backward()


# --------------------------------------------------------------------------- tensor-parallel plans
# Plan builders, ``plan(layout, module)`` (``Target.plan``): the layout's plan with one
# deliberately broken style from ``dpverify.sharded.tensor_parallel``.


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


# --------------------------------------------------------------------------- properties


def _runs(name: str) -> Callable[[Scenario | ShardedScenario], bool]:
    """Whether registry check ``name`` runs on a scenario: a property draws only those, so a
    scenario the check does not apply to (an eval-mode buffer counter for the buffer check)
    or skips (a one-row BatchNorm chunk, fewer rows than ranks) is never a false catch."""
    spec = CHECKS[name]

    def runs(scenario: Scenario | ShardedScenario) -> bool:
        case = Case.from_scenario(scenario)
        return spec.why_not(case) is None

    return runs


def _equal_micro_batches(scenario: Scenario) -> bool:
    # equal shards of equal micro-batches: the common case, where a missing 1/k shows as a
    # clean factor the message can name
    return scenario.batch_size % (MICRO_BATCHES * len(scenario.devices.device_ids)) == 0


@dataclass(frozen=True)
class Property:
    """A registry check over random scenarios: the check's name (a key of ``CHECKS``) and
    the scenarios it draws. Hypothesis lives here, not in the registry, so that importing
    the engine never imports it."""

    check: str
    scenarios: SearchStrategy[Scenario] | SearchStrategy[ShardedScenario]

    def run(self, scenario: Scenario | ShardedScenario, target: Target | None = None) -> None:
        """``CHECKS[check].check`` on one scenario against ``target`` (default: torch's own);
        raises what the check raises (``ParallelMismatch`` when the code under test is caught)."""
        __tracebackhide__ = True
        CHECKS[self.check].check(Case.from_scenario(scenario), target)


def _properties() -> dict[str, Property]:
    devices = device_lists(min_devices=2)  # a data-parallel bug needs two devices to show
    exact = scenarios(models=model_specs(exact=True), devices=devices)
    ddp_models = model_specs(kinds=[k for k in KINDS if k != "kwargs"], exact=True)
    # the DDP checks take a mean loss (their exact recipe weights it by n_r * W / B); the
    # device list's length is the world size (2 or 3 ranks, one pool each); float32 and
    # float64, as the DataParallel properties.
    ddp = scenarios(
        models=ddp_models, devices=device_lists(min_devices=2, max_devices=3),
        losses=loss_specs(reductions=("mean",)), max_batch=12,
    )
    drawn: dict[str, SearchStrategy[Any]] = {
        "dp-grads": exact,
        "dp-grad-sum": exact,
        "dp-buffers": scenarios(models=model_specs(kinds=["buffer-counter", "batchnorm"]), devices=devices),
        "dp-weighted-loss": scenarios(models=model_specs(kinds=["loss-head"]), devices=devices),
        "ddp-grads": ddp,
        "ddp-accumulation": ddp.filter(_equal_micro_batches),
        # the sharded checks on 2 or 3 ranks (tensor parallelism on 2: a 2-D mesh needs 4),
        # each with layouts drawn for its model (``sharded_scenarios``)
        "fsdp-grads": sharded_scenarios("fsdp", world_sizes=(2, 3)),
        "pp-grads": sharded_scenarios("pp", world_sizes=(2, 3)),
        "tp-grads": sharded_scenarios("tp", world_sizes=(2,)),
    }
    return {name: Property(name, strategy.filter(_runs(name))) for name, strategy in drawn.items()}


#: The property each registry check runs, by the check's name (``Mutant.caught_by``).
PROPERTIES: dict[str, Property] = _properties()


@dataclass(frozen=True)
class Mutant:
    """One catalogued bug.

    Attributes:
        name: short identifier.
        implementation: the wrapper class, reduction function or DDP step.
        kind: ``"dp"`` (a DataParallel-like wrapper), ``"criterion"`` (the criterion
            wrapper of a model/criterion pair, whose model wrapper is ``model``),
            ``"reduce"`` (a reduction of per-replica losses), ``"ddp-step"`` (a per-rank
            DDP training step), ``"fsdp-step"`` (a per-rank FSDP2 step), ``"tp-plan"`` (a
            tensor-parallel plan builder, ``plan(layout, module)``) or ``"pp-schedule"`` (a pipeline
            schedule class).
        bug: what is wrong, in one sentence.
        caught_by: the registry check that catches it (a key of ``CHECKS`` and
            ``PROPERTIES``).
        message: a phrase the failure message contains, pointing at the bug.
        model: a criterion mutant's model wrapper (correct: the bug is the criterion's).
    """

    name: str
    implementation: Callable[..., Any]
    kind: str
    bug: str
    caught_by: str
    message: str
    model: Callable[..., Any] | None = None

    @property
    def target(self) -> Target:
        """The mutant as the code under test: ``Target(parallel=...)``, a pair
        ``Target(parallel=model, parallel_loss=...)``, ``Target(reduce=...)`` or
        ``Target(step=...)`` by its kind."""
        if self.kind == "dp":
            return Target(parallel=self.implementation)
        if self.kind == "criterion":
            return Target(parallel=self.model, parallel_loss=self.implementation)
        if self.kind == "reduce":
            return Target(reduce=self.implementation)
        if self.kind in ("ddp-step", "fsdp-step"):
            return Target(step=self.implementation)
        if self.kind == "tp-plan":
            return Target(plan=self.implementation)
        if self.kind == "pp-schedule":
            return Target(schedule=self.implementation)
        raise ValueError(
            f"mutant {self.name!r} has kind {self.kind!r}; expected 'dp', 'criterion', 'reduce', 'ddp-step', "
            "'fsdp-step', 'tp-plan' or 'pp-schedule'"
        )

    def check(self, scenario: Scenario | ShardedScenario) -> None:
        """Runs the catching check on one scenario with this mutant (raises when caught)."""
        __tracebackhide__ = True
        PROPERTIES[self.caught_by].run(scenario, self.target)


MUTANTS: dict[str, Mutant] = {
    m.name: m
    for m in (
        Mutant("averaging", AveragingDataParallel, "dp", "averages replica gradients instead of summing them", "dp-grads", "the replica gradients were averaged"),
        Mutant("deep-copy", DeepCopyDataParallel, "dp", "runs a deep copy per replica, so no gradient reaches the module", "dp-grads", "No gradient reached the module's parameters"),
        Mutant("detached-replicas", DetachedReplicasDataParallel, "dp", "detaches every replica but the first", "dp-grad-sum", "accumulated grad"),
        Mutant("reversed-gather", ReversedGatherDataParallel, "dp", "gathers outputs in reverse replica order", "dp-grads", "gathered out of order"),
        Mutant("output-device-first", OutputDeviceFirstDataParallel, "dp", "puts the output device's chunk first when gathering", "dp-grads", "gathered out of order"),
        Mutant("last-replica-buffers", LastReplicaBuffersDataParallel, "dp", "keeps the last replica's buffers instead of the first's", "dp-buffers", "buffer '"),
        Mutant("balanced-offset", BalancedOffsetDataParallel, "dp", "a balanced-chunk DataParallel whose chunks start at a fixed stride, so they overlap and the last rows are lost", "dp-grads", "tensors are not close"),
        Mutant("balanced-drops-chunk", BalancedDropsChunkDataParallel, "dp", "a balanced-chunk DataParallel that replicates for one device fewer than it splits for, so the last chunk never runs", "dp-grads", "reached no replica"),
        Mutant("criterion-mean-of-means", MeanCriterionParallel, "criterion", "a criterion wrapper that averages the replicas' mean losses, weighting uneven chunks alike", "dp-grads", "The loss-averaging trap", model=ReplicaOutputsDataParallel),
        Mutant("tiny-error", TinyErrorDataParallel, "dp", "scales one parameter's gradient by 1 + 1e-4", "dp-grads", "tensors are not close"),
        Mutant("mean-of-means", mean_of_replica_losses, "reduce", "averages per-replica losses with loss.mean() on uneven chunks", "dp-weighted-loss", "The chunks are uneven"),
        Mutant("ddp-summed-loss", summed_loss_step, "ddp-step", "sums each rank's losses and never divides by the batch", "ddp-grads", "the sum over the rank's rows"),
        Mutant("ddp-summed-allreduce", summed_allreduce_step, "ddp-step", "a hand-written all-reduce that sums gradients without dividing by the world size", "ddp-grads", "the world size"),
        Mutant("ddp-rank-seeded-init", rank_seeded_init_step, "ddp-step", "initialises each rank with its own seed and never broadcasts rank 0's parameters", "ddp-grads", "tensors are not close"),
        Mutant("ddp-forward-outside-no-sync", forward_outside_no_sync_step, "ddp-step", "runs the forward outside no_sync(), so every micro-batch synchronises", "ddp-accumulation", "synchronised"),
        Mutant("ddp-undivided-accumulation", undivided_accumulation_step, "ddp-step", "accumulates micro-batch losses without dividing by their number", "ddp-accumulation", "the number of micro-batches"),
        Mutant("ddp-zero-grad-in-loop", zero_grad_in_loop_step, "ddp-step", "calls zero_grad() inside the accumulation loop", "ddp-accumulation", "tensors are not close"),
        Mutant("fsdp-undivided", fsdp_undivided_step, "fsdp-step", "skips the reduce-scatter's average: FSDP2 sums the ranks' gradients", "fsdp-grads", "the world size"),
        Mutant("fsdp-summed-loss", fsdp_summed_loss_step, "fsdp-step", "sums each rank's losses over its rows instead of averaging them", "fsdp-grads", "tensors are not close"),
        Mutant("tp-no-allreduce", no_allreduce_plan, "tp-plan", "a RowwiseParallel that skips its all-reduce, so each rank's output is its partial sum", "tp-grads", "no collective ran on it"),
        Mutant("tp-local-output", local_output_plan, "tp-plan", "a ColwiseParallel whose local shard of the output columns is used as the whole output", "tp-grads", "the local shard of a ColwiseParallel output was used as the whole output"),
        Mutant("pp-unscaled", UnscaledGPipe, "pp-schedule", "a GPipe schedule that does not scale gradients by 1/n_microbatches", "pp-grads", "microbatches"),
        Mutant("pp-skip-last-microbatch", SkipLastMicrobatchGPipe, "pp-schedule", "a GPipe schedule that never runs its last microbatch", "pp-grads", "microbatch"),
        Mutant("fsdp-wrong-weight", fsdp_wrong_weight_step, "fsdp-step", "weights each rank's loss by n_r / B, forgetting the world size FSDP2 divides by", "fsdp-grads", "the world size"),
    )
}
