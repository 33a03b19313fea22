"""Which samples a loader really delivers, and what it was built with.

The user's ``loader_factory(dataset, rank, world_size, epoch)`` is given a ``SampleLog``
in place of the dataset: a map-style view of it that notes the index of every sample
fetched, in order, and otherwise behaves as the dataset (its length, its items, its other
attributes). Iterating the loader once is an epoch; the indices it fetched are the sample
ids the epoch saw. A factory that returns a sampler or a batch sampler (indices, never
fetching) is read from what it yields. ``LoaderFacts`` records how the loader was built
(its batch size and ``drop_last``, a ``DistributedSampler``'s ``num_replicas``, ``rank``,
``shuffle``, ``seed``, ``epoch`` and ``drop_last``): the evidence a finding names its cause
from.

Shared by the data-path check and the metric checks, on ranks and in this process.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
)

from dpverify.core.errors import InvalidArgument
from dpverify.ranked.rank import one_rank_group

__all__ = [
    "LoaderFactory",
    "LoaderFacts",
    "SampleLog",
    "collectives_seen",
    "ids_text",
    "in_process",
    "loader_facts",
    "one_rank_world",
    "raise_refused",
    "read_epoch",
    "require_dataset",
    "run_loader",
]

#: ``loader_factory(dataset, rank, world_size, epoch)``: the user's construction of a rank's
#: loader for one epoch.
LoaderFactory = Callable[[Any, int, int, int], Any]


#: Sample ids shown in one finding or cause.
SHOWN_IDS = 12


def ids_text(samples: Sequence[int]) -> str:
    """``[0, 4, 7]``: sample ids sorted, the first ``SHOWN_IDS`` and ``...`` for the rest."""
    shown = sorted(samples)
    return "[" + ", ".join(map(str, shown[:SHOWN_IDS])) + (", ..." if len(shown) > SHOWN_IDS else "") + "]"


def raise_refused(refusals: Sequence[str]) -> None:
    """Raises the first rank's refusal (an ``InvalidArgument`` a rank returned as its
    result, so that the pool keeps its ranks), naming the ranks that refused; nothing when
    every refusal is empty.

    Raises:
        InvalidArgument: a rank refused.
    """
    refused = [rank for rank, text in enumerate(refusals) if text]
    if refused:
        where = f"rank {refused[0]}" if len(refused) == 1 else f"ranks {refused}"
        raise InvalidArgument(f"{refusals[refused[0]]} (on {where})")


def require_dataset(dataset: object, argument: str = "dataset") -> Any:
    """``dataset`` when it is map-style: a length and items by index.

    Raises:
        InvalidArgument: an ``IterableDataset`` (its samples have no ids to compare), or an
            object without ``__len__`` and ``__getitem__``.
    """
    if isinstance(dataset, IterableDataset):
        raise InvalidArgument(
            f"{argument} is an IterableDataset ({type(dataset).__name__}); pass a map-style dataset (with "
            "__len__ and __getitem__): the check compares which sample indices each rank saw, and an iterable "
            "dataset's samples have no index"
        )
    if not (hasattr(type(dataset), "__len__") and hasattr(type(dataset), "__getitem__")):
        raise InvalidArgument(
            f"{argument}={type(dataset).__name__} has no __len__ and __getitem__; pass a map-style dataset "
            "(torch.utils.data.TensorDataset, a list, or a Dataset subclass with both)"
        )
    if len(dataset) == 0:  # type: ignore[arg-type]
        raise InvalidArgument(f"{argument} is empty; pass a dataset with at least one sample")
    return dataset


class SampleLog(Dataset[Any]):
    """``dataset`` as the loader sees it, noting in ``fetched`` the index of every sample
    it fetches (``__getitem__``, or ``__getitems__`` for a batch of indices, which the
    DataLoader prefers where the dataset has it)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.fetched: list[int] = []

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> Any:
        self.fetched.append(_sample_id(index))
        return self.dataset[index]

    def __getitems__(self, indices: Sequence[Any]) -> list[Any]:
        self.fetched.extend(_sample_id(index) for index in indices)
        many = getattr(self.dataset, "__getitems__", None)
        return list(many(indices)) if many is not None else [self.dataset[index] for index in indices]

    def __getattr__(self, name: str) -> Any:
        # only reached for names the log lacks: the dataset's own attributes (targets, classes)
        if name in ("dataset", "fetched") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def since(self, start: int) -> list[int]:
        return self.fetched[start:]


def _sample_id(index: Any) -> int:
    try:
        return operator.index(index)
    except TypeError:
        raise InvalidArgument(
            f"the loader fetched dataset[{index!r}]; a sample id must be an integer index (a map-style dataset "
            "indexed by position), so pass a sampler that yields ints"
        ) from None


@dataclass(frozen=True)
class LoaderFacts:
    """How one rank's loader was built, as far as it can be read from the objects.

    Attributes:
        loader: the loader's type name.
        batch_size: the DataLoader's batch size, or its ``BatchSampler``'s (None: no batching).
        drop_last: the DataLoader's ``drop_last`` (its last partial batch), or its
            ``BatchSampler``'s.
        num_workers: the DataLoader's worker count (the check reads it in this process).
        sampler: the sampler's type name.
        sampler_length: ``len(sampler)`` where it has one: the indices it yields an epoch.
        shuffle: whether the sampler shuffles (a ``DistributedSampler``'s ``shuffle``, True for
            a ``RandomSampler``), None when unknown.
        num_replicas: a ``DistributedSampler``'s ``num_replicas``.
        rank: a ``DistributedSampler``'s ``rank``.
        seed: a ``DistributedSampler``'s ``seed``.
        epoch: a ``DistributedSampler``'s ``epoch`` when the epoch was read (``set_epoch``).
        sampler_drop_last: a ``DistributedSampler``'s ``drop_last``.
    """

    loader: str
    batch_size: int | None = None
    drop_last: bool = False
    num_workers: int = 0
    sampler: str | None = None
    sampler_length: int | None = None
    shuffle: bool | None = None
    num_replicas: int | None = None
    rank: int | None = None
    seed: int | None = None
    epoch: int | None = None
    sampler_drop_last: bool | None = None

    @property
    def distributed(self) -> bool:
        return self.num_replicas is not None

    def describe(self) -> str:
        parts = [self.loader]
        if self.batch_size is not None:
            parts[0] += f"(batch_size={self.batch_size}{', drop_last=True' if self.drop_last else ''})"
        if self.sampler is not None and self.sampler != self.loader:
            text = self.sampler
            if self.distributed:
                text += (
                    f"(num_replicas={self.num_replicas}, rank={self.rank}, shuffle={self.shuffle}, seed={self.seed}, "
                    f"drop_last={self.sampler_drop_last})"
                )
            parts.append(text)
        return " over ".join(parts)


def _sampler_of(loader: Any) -> Any:
    if isinstance(loader, DataLoader):
        batch_sampler = loader.batch_sampler
        return loader.sampler if batch_sampler is None else getattr(batch_sampler, "sampler", batch_sampler)
    return getattr(loader, "sampler", loader)


def loader_facts(loader: Any) -> LoaderFacts:
    """What ``loader`` says about itself (read before the epoch runs, but a
    ``DistributedSampler``'s epoch after ``set_epoch``, which the factory calls)."""
    sampler = _sampler_of(loader)
    length: int | None
    try:
        length = len(sampler)
    except TypeError:
        length = None
    fields: dict[str, Any] = {"loader": type(loader).__name__, "sampler": type(sampler).__name__, "sampler_length": length}
    if isinstance(loader, DataLoader):
        fields.update(batch_size=loader.batch_size, drop_last=loader.drop_last, num_workers=loader.num_workers)
    batches = loader.batch_sampler if isinstance(loader, DataLoader) else loader
    if isinstance(batches, BatchSampler) and fields.get("batch_size") is None:
        # a batch sampler returned, or passed as DataLoader(batch_sampler=...): its batches and drop_last
        fields.update(batch_size=batches.batch_size, drop_last=batches.drop_last)
    if isinstance(sampler, DistributedSampler):
        fields.update(
            shuffle=sampler.shuffle, num_replicas=sampler.num_replicas, rank=sampler.rank, seed=sampler.seed,
            epoch=sampler.epoch, sampler_drop_last=sampler.drop_last,
        )
    elif isinstance(sampler, RandomSampler):
        fields.update(shuffle=True)
    return LoaderFacts(**fields)


def in_process(loader: Any) -> Any:
    """``loader``, a DataLoader with workers set to read in this process (``num_workers``
    0): the workers would fetch the same indices the sampler yields here, in the same order,
    but a ``SampleLog`` in a worker process would not come back."""
    if isinstance(loader, DataLoader) and loader.num_workers > 0:
        loader.num_workers = 0
    return loader


def read_epoch(loader: Any, log: SampleLog, argument: str = "loader_factory") -> list[int]:
    """The sample ids one pass over ``loader`` delivers, in order.

    A DataLoader with workers is read in this process (``in_process``).

    Raises:
        InvalidArgument: ``loader`` is not iterable, or neither fetched from the dataset it
            was given nor yields indices.
    """
    in_process(loader)
    start = len(log.fetched)
    try:
        iterator = iter(loader)
    except TypeError:
        raise InvalidArgument(
            f"{argument} returned {type(loader).__name__}, which is not iterable; return a DataLoader, a sampler "
            "or another iterable over the dataset it is given"
        ) from None
    yielded: list[Any] = []
    for item in iterator:
        if len(log.fetched) == start:  # a sampler's indices; a loader's batches are not kept
            yielded.append(item)
    fetched = log.since(start)
    if fetched:
        return fetched
    indices = _indices_of(yielded)
    if indices is None:
        raise InvalidArgument(
            f"{argument} returned {type(loader).__name__}, which fetched no sample from the dataset it was given and "
            "does not yield sample indices; build the DataLoader on the factory's dataset argument (not on a dataset "
            "of your own), or return a sampler that yields indices"
        )
    return indices


def _indices_of(yielded: Sequence[Any]) -> list[int] | None:
    """The ids a sampler (ints) or a batch sampler (lists of ints) yielded; None for anything else."""
    ids: list[int] = []
    for item in yielded:
        if isinstance(item, (list, tuple)) and all(_is_index(i) for i in item):
            ids.extend(operator.index(i) for i in item)
        elif _is_index(item):
            ids.append(operator.index(item))
        else:
            return None
    return ids


def _is_index(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and not value.is_floating_point()
    return isinstance(value, int) and not isinstance(value, bool)


def run_loader(factory: LoaderFactory, dataset: Any, rank: int, world_size: int, epoch: int) -> tuple[list[int], LoaderFacts, Any]:
    """One epoch of the user's loader: the ids it delivered, how it was built, and the loader."""
    log = SampleLog(dataset)
    loader = factory(log, rank, world_size, epoch)
    facts = loader_facts(loader)
    return read_epoch(loader, log), facts, loader


# --------------------------------------------------------------------------- collectives


_WATCHED = ("all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "gather", "reduce_scatter_tensor")


@contextlib.contextmanager
def collectives_seen(seen: list[tuple[str, str]]) -> Iterator[None]:
    """Runs the body with ``torch.distributed``'s tensor collectives appending to ``seen``
    each call's name and tensor dtype (``("all_reduce", "torch.int64")``): the evidence that
    an integer accumulator was synchronised. Calls through a name bound before the body
    (``from torch.distributed import all_reduce``) are not seen."""
    import torch.distributed as dist

    originals = {name: getattr(dist, name) for name in _WATCHED if hasattr(dist, name)}

    def watch(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if not tensors:
                tensors = [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
            if tensors:
                seen.append((name, str(tensors[-1].dtype)))
            return original(*args, **kwargs)

        return call

    for name, original in originals.items():
        setattr(dist, name, watch(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


@contextlib.contextmanager
def one_rank_world() -> Iterator[None]:
    """A default process group of this process alone, for the single-device runs of code
    that calls ``torch.distributed`` on the default group (``dist.all_reduce(t)``,
    ``dist.get_world_size()``): ``one_rank_group()``'s group, which is the new default
    group when none was initialised; under torchrun, this rank's own one-rank subgroup
    standing in as the default group for the body. Nothing when torch.distributed is not
    available."""
    import torch.distributed as dist

    with one_rank_group() as group:
        if group is None or group is dist.group.WORLD:  # no distributed, or a new default group of one
            yield
            return
        from torch.distributed import distributed_c10d as c10d

        world = c10d._world
        default = world.default_pg
        world.default_pg = group
        try:
            yield
        finally:
            world.default_pg = default
