"""Data-path and evaluation mutants: the user's loader construction
(``loader_factory(dataset, rank, world_size, epoch)``, checked by
``assert_ddp_data_matches`` or ``assert_ddp_metric_matches``) and evaluation loop
(``eval_fn(model, loader)``, checked by ``assert_ddp_metric_matches``), each written with a
bug people make, next to the correct ones. Module-level, so that they pickle to the ranks.

An evaluation comes with the loader it was written for: ``sum_count_eval`` (an
``all_reduce`` of the loss sum and the sample count) is correct over ``unpadded_loader``
(every sample on one rank, none repeated), ``gather_trim_eval`` (per-sample losses gathered
and trimmed to ``len(dataset)``) over ``padded_loader`` (``DistributedSampler``, which
pads). The metric is the mean cross-entropy of the model's logits over the dataset (an
accuracy for ``integer_mean_eval``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, Subset

__all__ = [
    "drop_last_eval_loader",
    "fixed_rank_loader",
    "gather_trim_eval",
    "integer_mean_eval",
    "mean_of_rank_means_eval",
    "no_set_epoch_loader",
    "padded_loader",
    "padded_sum_eval",
    "same_shuffle_loader",
    "sum_count_eval",
    "unpadded_loader",
]

#: The batch size of the loaders below.
BATCH_SIZE = 2


# --------------------------------------------------------------------------- loaders


def padded_loader(dataset: Any, rank: int, world_size: int, epoch: int) -> DataLoader[Any]:
    """A correct evaluation loader: ``DistributedSampler(shuffle=False)``, which pads every
    rank to ``ceil(len(dataset) / world_size)`` samples by repeating the first ones; the
    evaluation must keep the repeats out of its metric (``gather_trim_eval``)."""
    sampler: DistributedSampler[Any] = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
    return DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler)


def unpadded_loader(dataset: Any, rank: int, world_size: int, epoch: int) -> DataLoader[Any]:
    """A correct evaluation loader without padding: rank ``r`` takes samples ``r, r + W,
    r + 2W, ...``; every sample is on one rank, the ranks' shares differ by one when the
    world size does not divide the dataset."""
    return DataLoader(Subset(dataset, range(rank, len(dataset), world_size)), batch_size=BATCH_SIZE)


def no_set_epoch_loader(dataset: Any, rank: int, world_size: int, epoch: int) -> DataLoader[Any]:
    """A shuffling training loader that never calls ``sampler.set_epoch(epoch)``: the
    sampler seeds its shuffle with ``seed + 0`` every epoch, so every epoch repeats the
    first one's order."""
    sampler: DistributedSampler[Any] = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    return DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler)


#: The seed ``fixed_rank_loader`` meant to pass.
SEED = 0


def fixed_rank_loader(dataset: Any, rank: int, world_size: int, epoch: int) -> DataLoader[Any]:
    """A training loader whose sampler is given the seed where the rank belongs
    (``rank=SEED``, a fixed value on every rank): every rank takes the same part, and the
    other parts are never loaded."""
    sampler: DistributedSampler[Any] = DistributedSampler(dataset, num_replicas=world_size, rank=SEED, shuffle=True, seed=SEED)
    sampler.set_epoch(epoch)
    return DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler)


def same_shuffle_loader(dataset: Any, rank: int, world_size: int, epoch: int) -> DataLoader[Any]:
    """A training loader that shuffles with a generator seeded alike on every rank and no
    distributed sampler: every rank draws the same order of the whole dataset."""
    generator = torch.Generator().manual_seed(SEED + epoch)
    return DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=True, generator=generator)


def drop_last_eval_loader(dataset: Any, rank: int, world_size: int, epoch: int) -> DataLoader[Any]:
    """An evaluation loader with the training loader's ``drop_last=True``: each rank's
    last partial batch is never evaluated."""
    sampler: DistributedSampler[Any] = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
    return DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler, drop_last=True)


# --------------------------------------------------------------------------- evaluations


def _losses(model: Any, loader: Any) -> torch.Tensor:
    """The per-sample cross-entropy of every sample ``loader`` yields, in float64, in order."""
    model.eval()
    losses = [torch.zeros(0, dtype=torch.float64)]
    with torch.no_grad():
        for x, y in loader:
            losses.append(F.cross_entropy(model(x), y, reduction="none").double())
    return torch.cat(losses)


def sum_count_eval(model: Any, loader: Any) -> float:
    """A correct evaluation over a loader that does not pad (``unpadded_loader``): each
    rank's loss sum and sample count, both ``all_reduce``d in float64, then divided."""
    losses = _losses(model, loader)
    total = torch.stack([losses.sum(), torch.tensor(float(len(losses)), dtype=torch.float64)])
    dist.all_reduce(total)
    return float(total[0] / total[1])


def gather_trim_eval(model: Any, loader: Any) -> float:
    """A correct evaluation over ``DistributedSampler``'s padded shards (``padded_loader``):
    every rank's per-sample losses ``all_gather``ed, interleaved back into the sampler's
    order (rank ``r`` holds positions ``r, r + W, ...``) and trimmed to ``len(dataset)``,
    which drops the padding at the end; then the mean."""
    mine = _losses(model, loader)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    ordered = torch.stack(parts, dim=1).reshape(-1)[: len(loader.dataset)]
    return float(ordered.mean())


def padded_sum_eval(model: Any, loader: Any) -> float:
    """The sum-and-count evaluation over ``DistributedSampler``'s padded shards: the
    samples it repeats to pad the ranks are counted twice."""
    return sum_count_eval(model, loader)


def mean_of_rank_means_eval(model: Any, loader: Any) -> float:
    """Each rank's mean loss, ``all_reduce``d and divided by the world size: the ranks'
    means weighted alike, though ``unpadded_loader`` gives them different numbers of
    samples."""
    losses = _losses(model, loader)
    mean = losses.mean().reshape(1)
    dist.all_reduce(mean)
    return float(mean / dist.get_world_size())


def integer_mean_eval(model: Any, loader: Any) -> float:
    """Accuracy from integer states synchronised as a mean (a metric state whose
    reduction is the mean): the correct-prediction and sample counts (int64)
    ``all_reduce``d, then ``// world_size`` each, which floors both before the division."""
    model.eval()
    correct = torch.zeros((), dtype=torch.int64)
    seen = torch.zeros((), dtype=torch.int64)
    with torch.no_grad():
        for x, y in loader:
            correct += (model(x).argmax(dim=1) == y).sum()
            seen += len(y)
    for state in (correct, seen):
        dist.all_reduce(state)
        state //= dist.get_world_size()
    return float(correct / seen)
