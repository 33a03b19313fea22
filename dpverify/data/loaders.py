"""The usual loader constructions, as ``loader_factory(dataset, rank, world_size, epoch)``
functions: what the data checks run by default, and what the command line and the
strategies build from their options. Each is a top-level function, so a
``functools.partial`` of it can be sent to the ranks."""

from __future__ import annotations

import functools
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler

from dpverify.core.validation import require_bool, require_int_at_least
from dpverify.data.samples import LoaderFactory

__all__ = ["DEFAULT_BATCH_SIZE", "batch_loader", "distributed_loader", "sampled_loader"]

#: The batch size of the default evaluation loader.
DEFAULT_BATCH_SIZE = 8


def sampled_loader(
    dataset: Any, rank: int, world_size: int, epoch: int, *,
    batch_size: int = DEFAULT_BATCH_SIZE, shuffle: bool = False, drop_last: bool = False, seed: int = 0,
    set_epoch: bool = True, loader_drop_last: bool = False,
) -> DataLoader[Any]:
    """``DataLoader(dataset, batch_size, sampler=DistributedSampler(dataset, world_size, rank,
    shuffle, seed, drop_last))``, with ``sampler.set_epoch(epoch)`` when ``set_epoch``: the
    construction the torch documentation shows."""
    sampler: DistributedSampler[Any] = DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last,
    )
    if set_epoch:
        sampler.set_epoch(epoch)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=loader_drop_last)


def distributed_loader(
    *, batch_size: int = DEFAULT_BATCH_SIZE, shuffle: bool = False, drop_last: bool = False, seed: int = 0,
    set_epoch: bool = True, loader_drop_last: bool = False,
) -> LoaderFactory:
    """A ``loader_factory`` of ``sampled_loader`` with these settings (a picklable partial).

    Raises:
        InvalidArgument: a batch size below 1, a flag that is not a bool, a negative seed.
    """
    require_int_at_least(batch_size, "batch_size", 1)
    require_int_at_least(seed, "seed", 0)
    for value, name in ((shuffle, "shuffle"), (drop_last, "drop_last"), (set_epoch, "set_epoch"), (loader_drop_last, "loader_drop_last")):
        require_bool(value, name)
    return functools.partial(
        sampled_loader, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last, seed=seed, set_epoch=set_epoch,
        loader_drop_last=loader_drop_last,
    )


def batch_loader(dataset: Any, rank: int, world_size: int, epoch: int, *, batch_size: int = DEFAULT_BATCH_SIZE) -> DataLoader[Any]:
    """``DataLoader(dataset, batch_size)`` in dataset order, whatever the rank: one device's
    loader, and DataParallel's (one process feeds every replica)."""
    return DataLoader(dataset, batch_size=batch_size)
