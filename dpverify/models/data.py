"""A data path to check, as data: a labelled dataset split over DDP ranks by
``DistributedSampler``, for the data-path and evaluation-metric checks
(``dpverify.data``; Hypothesis draws it in ``dpverify.strategies.data_scenarios``).

A ``DataScenario`` prints as a line a person can paste, pickles, and builds its dataset,
its loader factory and a small classifier deterministically from its fields.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import TensorDataset

from dpverify.core.validation import require_bool, require_int_at_least
from dpverify.data.loaders import distributed_loader
from dpverify.data.samples import LoaderFactory

__all__ = ["DataScenario"]


@dataclass(frozen=True)
class DataScenario:
    """A dataset of ``size`` labelled samples on ``world_size`` DDP ranks, each rank's
    loader a ``DataLoader`` over ``DistributedSampler``, for ``epochs`` epochs.

    Attributes:
        size: samples in the dataset (a multiple of the world size or not, fewer than the
            ranks included).
        world_size: DDP ranks.
        batch_size: each rank's DataLoader batch size.
        drop_last: the ``DistributedSampler``'s ``drop_last`` (False: it pads every rank to
            ``ceil(size / world_size)`` samples by repeating some; True: it drops the last
            ``size % world_size`` of the epoch's order).
        loader_drop_last: the DataLoader's ``drop_last`` (each rank's last partial batch).
        shuffle: the sampler shuffles, seeded with ``seed + epoch`` (``set_epoch``).
        seed: the sampler's seed, and the seed the data and the model are drawn from.
        epochs: the epochs the data-path check runs.
        features: input width of every sample.
        classes: label classes (the classifier's outputs).
    """

    size: int = 8
    world_size: int = 2
    batch_size: int = 2
    drop_last: bool = False
    loader_drop_last: bool = False
    shuffle: bool = False
    seed: int = 0
    epochs: int = 1
    features: int = 3
    classes: int = 3

    def __post_init__(self) -> None:
        for name, low in (("size", 1), ("world_size", 1), ("batch_size", 1), ("seed", 0), ("epochs", 1), ("features", 1), ("classes", 2)):
            require_int_at_least(getattr(self, name), name, low)
        for name in ("drop_last", "loader_drop_last", "shuffle"):
            require_bool(getattr(self, name), name)

    @property
    def per_rank(self) -> int:
        """The samples each rank's sampler yields an epoch: ``ceil(size / world_size)``
        (padded), or ``floor(size / world_size)`` with ``drop_last``."""
        return self.size // self.world_size if self.drop_last else math.ceil(self.size / self.world_size)

    def dataset(self) -> TensorDataset:
        """``TensorDataset(features, labels)``: ``size`` rows of ``features`` float32 values
        and integer labels in ``0 .. classes - 1``, drawn from ``seed``."""
        generator = torch.Generator().manual_seed(self.seed)
        x = torch.randn(self.size, self.features, generator=generator)
        y = torch.randint(0, self.classes, (self.size,), generator=generator)
        return TensorDataset(x, y)

    def loader_factory(self) -> LoaderFactory:
        """``loader_factory(dataset, rank, world_size, epoch)``: the construction torch's
        documentation shows, with this scenario's settings and ``set_epoch(epoch)``
        (``dpverify.data.loaders.distributed_loader``; picklable)."""
        return distributed_loader(
            batch_size=self.batch_size, shuffle=self.shuffle, drop_last=self.drop_last, seed=self.seed,
            loader_drop_last=self.loader_drop_last,
        )

    def model(self) -> nn.Module:
        """A linear classifier from ``features`` to ``classes`` logits, its weights drawn
        from ``seed`` (the global random state is left as it was)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            return nn.Linear(self.features, self.classes)

    def __str__(self) -> str:
        flags = [name for name in ("shuffle", "drop_last", "loader_drop_last") if getattr(self, name)]
        return (
            f"{self.size} samples on {self.world_size} ranks, batch {self.batch_size}"
            + (f", {', '.join(flags)}" if flags else "") + f", seed {self.seed}, {self.epochs} epoch{'s' if self.epochs != 1 else ''}"
        )

