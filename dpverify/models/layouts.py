"""How a sharded check lays a model out over its ranks, as frozen data.

A layout prints as a line a person can paste, pickles, and says everything the FSDP2,
tensor-parallel and pipeline checks need besides the model and the batch: which modules
``fully_shard`` wraps, which Linear layers a plan shards colwise and rowwise, where the
pipeline's stages begin and how many microbatches its schedule runs. A
``ShardedScenario`` pairs one with a generated ``Scenario`` (whose device count is the
world size). ``default_layout`` derives the layout a check uses on a model nobody
described: the user's model in ``dpverify check``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from dpverify.core.errors import InvalidArgument
from dpverify.models.specs import BuiltScenario, Scenario

__all__ = [
    "BACKENDS",
    "ELEMENTWISE",
    "SCHEDULES",
    "FSDPLayout",
    "Layout",
    "PipelineLayout",
    "ShardedScenario",
    "TPLayout",
    "default_layout",
    "even_split_points",
    "layout_of",
    "linear_pairs",
    "microbatch_counts",
]

#: The sharded backends, by the name ``check --backend`` and ``fuzz --backend`` take.
BACKENDS: tuple[str, ...] = ("fsdp", "tp", "pp")
#: Pipeline schedules by name: torch's ``ScheduleGPipe`` and ``Schedule1F1B``.
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")
#: Modules that act on each element alone: a tensor-parallel plan may leave them between a
#: colwise and a rowwise Linear, where their input is sharded along the last dimension.
ELEMENTWISE: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.Tanh, nn.GELU, nn.Sigmoid, nn.SiLU, nn.LeakyReLU, nn.ELU, nn.Identity,
)


def read_without_forward(module: nn.Module) -> dict[str, str]:
    """Submodules whose parent reads their parameters without calling their forward, each
    with that parent's qualified name: ``nn.MultiheadAttention`` hands ``out_proj.weight``
    to ``F.multi_head_attention_forward`` (torch/nn/modules/activation.py). ``fully_shard``
    gathers a group's parameters in its forward hook, so such a submodule cannot be an
    FSDP2 group of its own: its parameters would reach the parent's computation as shards
    (torch raises "got mixed torch.Tensor and DTensor")."""
    found: dict[str, str] = {}
    for name, sub in module.named_modules():
        if isinstance(sub, nn.MultiheadAttention):
            for child, _ in sub.named_children():
                found[f"{name}.{child}" if name else child] = name
    return found


@dataclass(frozen=True)
class FSDPLayout:
    """FSDP2's layout: ``fully_shard`` on each of ``shard_modules`` (qualified names; None:
    each direct child with parameters), then on the root, with ``reshard_after_forward``."""

    shard_modules: tuple[str, ...] | None = None
    reshard_after_forward: bool = True

    backend = "fsdp"


@dataclass(frozen=True)
class TPLayout:
    """A tensor-parallel plan as data: each pair ``(colwise, rowwise)`` of Linear paths is
    sharded ``ColwiseParallel`` then ``RowwiseParallel`` (Megatron's MLP split: one
    all-reduce per pair). ``data_parallel`` > 1 adds FSDP2 over a second mesh dimension
    (a ``(data_parallel, world_size // data_parallel)`` mesh)."""

    pairs: tuple[tuple[str, str], ...] = (("0", "2"),)
    data_parallel: int = 1

    backend = "tp"

    def plan(self, colwise: type[Any] | None = None, rowwise: type[Any] | None = None) -> dict[str, Any]:
        """The plan ``parallelize_module`` takes, with torch's styles or the ones given (a
        mutant's, or a user's subclass)."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        col, row = colwise or ColwiseParallel, rowwise or RowwiseParallel
        plan: dict[str, Any] = {}
        for first, second in self.pairs:
            plan[first] = col()
            plan[second] = row()
        return plan


@dataclass(frozen=True)
class PipelineLayout:
    """A pipeline: stage ``s + 1`` begins at top-level child ``split_points[s]`` (None: an
    even split), the schedule (``SCHEDULES``) runs ``n_microbatches`` microbatches."""

    split_points: tuple[int, ...] | None = None
    n_microbatches: int = 2
    schedule: str = "gpipe"

    backend = "pp"


Layout = FSDPLayout | TPLayout | PipelineLayout


@dataclass(frozen=True)
class ShardedScenario:
    """A generated scenario on ``len(scenario.devices.device_ids)`` ranks, laid out so."""

    scenario: Scenario = field(default_factory=Scenario)
    layout: Layout = field(default_factory=FSDPLayout)

    @property
    def backend(self) -> str:
        return self.layout.backend

    @property
    def world_size(self) -> int:
        return len(self.scenario.devices.device_ids)

    def build(self) -> BuiltScenario:
        return self.scenario.build()


def linear_pairs(module: nn.Module, tp_size: int) -> list[tuple[str, str]]:
    """The ``(colwise, rowwise)`` pairs a plan can shard in ``module``: inside any
    ``nn.Sequential``, a Linear, then only ``ELEMENTWISE`` modules, then a Linear that takes
    the first's output, its width divisible by ``tp_size`` (torch's sharding propagation
    refuses a matmul over unevenly sharded widths). Pairs do not overlap."""
    pairs: list[tuple[str, str]] = []
    for prefix, container in module.named_modules():
        if not isinstance(container, nn.Sequential):
            continue
        children = list(container.named_children())
        index = 0
        while index < len(children):
            name, first = children[index]
            follow = index + 1
            while follow < len(children) and isinstance(children[follow][1], ELEMENTWISE):
                follow += 1
            if (
                isinstance(first, nn.Linear) and follow < len(children)
                and isinstance(children[follow][1], nn.Linear)
                and children[follow][1].in_features == first.out_features
                and first.out_features % tp_size == 0
            ):
                path = f"{prefix}." if prefix else ""
                pairs.append((path + name, path + children[follow][0]))
                index = follow + 1
            else:
                index += 1
    return pairs


def even_split_points(n_children: int, stages: int) -> tuple[int, ...]:
    """Where stages 1 .. stages - 1 begin when ``n_children`` are split as evenly as
    possible, the first stages one child more."""
    if stages < 1 or n_children < stages:
        raise InvalidArgument(f"{n_children} top-level children cannot make {stages} pipeline stages of at least one child each")
    base, extra = divmod(n_children, stages)
    return tuple(itertools.accumulate(base + (1 if stage < extra else 0) for stage in range(stages - 1)))


def microbatch_counts(batch_size: int, most: int = 4) -> list[int]:
    """The microbatch counts up to ``most`` that cut ``batch_size`` rows into equal pieces,
    largest first (torch's pipeline schedules need equal microbatch shapes)."""
    return [n for n in range(min(most, batch_size), 0, -1) if batch_size % n == 0]


def default_layout(backend: str, module: nn.Module, world_size: int, batch_size: int) -> Layout | str:
    """The layout a check uses on ``module`` when none is given, or why there is none.

    fsdp: each child with parameters, then the root. tp: every Linear pair of
    ``linear_pairs`` (the whole world one tensor-parallel group). pp: ``module`` must be an
    ``nn.Sequential`` with at least ``world_size`` children, split evenly, and the batch is
    cut into the most equal microbatches up to 4.
    """
    if backend == "fsdp":
        return FSDPLayout()
    if backend == "tp":
        pairs = linear_pairs(module, world_size)
        if not pairs:
            return (
                "no Linear -> elementwise -> Linear pair inside an nn.Sequential with a hidden width "
                f"divisible by {world_size} to shard colwise then rowwise; pass a plan to "
                "assert_tensor_parallel_grads_match"
            )
        return TPLayout(tuple(pairs))
    if backend == "pp":
        if not isinstance(module, nn.Sequential):
            return f"the pipeline checks split an nn.Sequential's children into stages; this model is {type(module).__name__}"
        if len(module) < world_size:
            return f"{len(module)} top-level children cannot make {world_size} stages"
        return PipelineLayout(even_split_points(len(module), world_size), microbatch_counts(batch_size)[0])
    raise InvalidArgument(f"backend={backend!r} is not one of {BACKENDS}")


def layout_of(value: Any, backend: str) -> Layout | None:
    """``value`` when it is a layout of ``backend``, else None."""
    return value if getattr(value, "backend", None) == backend else None

