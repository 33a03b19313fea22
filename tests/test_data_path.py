"""``assert_ddp_data_matches`` on loader code as users write it: every kind of finding
(padding, samples dropped by either ``drop_last``, a wrong ``num_replicas`` or ``rank``,
seeds that differ per rank, a shuffle without ``set_epoch``, a loader that does not split
the dataset, a factory returning a sampler or a batch sampler, a loader with workers)
caught with its sample ids and its cause, the fixed loader passing, ``allow``, the report's
fields, and the arguments it refuses.

The loader factories are top-level functions of this module: the check pickles them to the
shared pool's ranks (``pool=None``, world sizes 2 and 4), which import this module, as they
import a user's. The expected sample ids come from torch's ``DistributedSampler`` built in
this process with an explicit rank and world size, not from dpverify.
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    Sampler,
    TensorDataset,
)

from dpverify.core.errors import InvalidArgument, ParallelMismatch
from dpverify.data.path import ALLOWED, DataReport, assert_ddp_data_matches


def samples(n: int) -> TensorDataset:
    """``n`` samples: features i and label i."""
    return TensorDataset(torch.arange(n, dtype=torch.float32).unsqueeze(1), torch.arange(n))


def parts(n: int, world_size: int, epoch: int = 0, **settings: Any) -> list[list[int]]:
    """Each rank's indices from torch's DistributedSampler with these settings, built here."""
    found = []
    for rank in range(world_size):
        sampler: DistributedSampler[Any] = DistributedSampler(samples(n), num_replicas=world_size, rank=rank, **settings)
        sampler.set_epoch(epoch)
        found.append(list(sampler))
    return found


def seen_twice(ranks: Sequence[Sequence[int]]) -> list[int]:
    counts = Counter(i for ids in ranks for i in ids)
    return sorted(i for i, c in counts.items() if c > 1)


def never_seen(n: int, ranks: Sequence[Sequence[int]]) -> list[int]:
    return sorted(set(range(n)) - {i for ids in ranks for i in ids})


def shown(ids: Sequence[int]) -> str:
    """Sample ids as the report lists them."""
    return "[" + ", ".join(map(str, sorted(ids))) + "]"


def caught(dataset: Any, factory: Any, **options: Any) -> tuple[str, DataReport]:
    """The failure message and report of a check that must fail."""
    with pytest.raises(ParallelMismatch) as failure:
        assert_ddp_data_matches(dataset, factory, **options)
    report = failure.value.report
    assert isinstance(report, DataReport)
    assert not report.ok
    return str(failure.value), report


def kinds(report: DataReport) -> set[str]:
    return {finding.kind for finding in report.findings}


# --------------------------------------------------------------------------- the user's loader code


class StridedSampler(Sampler[int]):
    """An evaluation sampler that does not pad: rank r takes samples r, r + W, r + 2W, ..."""

    def __init__(self, dataset: Any, rank: int, world_size: int) -> None:
        self.indices = range(rank, len(dataset), world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def documented(dataset: Any, rank: int, world_size: int, epoch: int) -> DataLoader[Any]:
    """The torch documentation's training loader: DistributedSampler's defaults (rank and world
    size from the process group, shuffle=True, drop_last=False), set_epoch every epoch."""
    sampler: DistributedSampler[Any] = DistributedSampler(dataset)
    sampler.set_epoch(epoch)
    return DataLoader(dataset, batch_size=2, sampler=sampler)


def in_order(dataset: Any, rank: int, world_size: int, epoch: int) -> DataLoader[Any]:
    """An evaluation loader on DistributedSampler(shuffle=False): it pads."""
    return DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, shuffle=False))


def sampler_drops(dataset: Any, rank: int, world_size: int, epoch: int) -> DataLoader[Any]:
    return DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, shuffle=False, drop_last=True))


def shuffled_sampler_drops(dataset: Any, rank: int, world_size: int, epoch: int) -> DataLoader[Any]:
    sampler: DistributedSampler[Any] = DistributedSampler(dataset, shuffle=True, seed=0, drop_last=True)
    sampler.set_epoch(epoch)
    return DataLoader(dataset, batch_size=2, sampler=sampler)


def loader_drops(dataset: Any, rank: int, world_size: int, epoch: int) -> DataLoader[Any]:
    return DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, shuffle=False), drop_last=True)


def twice_the_replicas(dataset: Any, rank: int, world_size: int, epoch: int) -> DataLoader[Any]:
    """num_replicas counted in GPUs of two nodes while the group has one node's ranks."""
    return DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, num_replicas=2 * world_size, rank=rank, shuffle=False))


def rank_zero(dataset: Any, rank: int, world_size: int, epoch: int) -> DataLoader[Any]:
    """rank=0 written in where the rank belongs (a local rank of one node, a copied config)."""
    return DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, num_replicas=world_size, rank=0, shuffle=False))


def seeded_by_rank(dataset: Any, rank: int, world_size: int, epoch: int) -> DataLoader[Any]:
    sampler: DistributedSampler[Any] = DistributedSampler(dataset, shuffle=True, seed=rank)
    sampler.set_epoch(epoch)
    return DataLoader(dataset, batch_size=2, sampler=sampler)


def no_set_epoch(dataset: Any, rank: int, world_size: int, epoch: int) -> DataLoader[Any]:
    return DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, shuffle=True))


def plain_shuffle(dataset: Any, rank: int, world_size: int, epoch: int) -> DataLoader[Any]:
    """One device's training loader, kept as it was under DDP: a reproducible shuffle, no
    distributed sampler."""
    return DataLoader(dataset, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(epoch))


def strided(dataset: Any, rank: int, world_size: int, epoch: int) -> DataLoader[Any]:
    return DataLoader(dataset, batch_size=2, sampler=StridedSampler(dataset, rank, world_size))


def padded_sampler(dataset: Any, rank: int, world_size: int, epoch: int) -> DistributedSampler[Any]:
    """A factory returning the sampler itself (its indices are the samples)."""
    return DistributedSampler(dataset, shuffle=False)


def strided_sampler(dataset: Any, rank: int, world_size: int, epoch: int) -> StridedSampler:
    return StridedSampler(dataset, rank, world_size)


def padded_batches(dataset: Any, rank: int, world_size: int, epoch: int) -> BatchSampler:
    return BatchSampler(DistributedSampler(dataset, shuffle=False), batch_size=2, drop_last=False)


def full_batches_only(dataset: Any, rank: int, world_size: int, epoch: int) -> BatchSampler:
    return BatchSampler(StridedSampler(dataset, rank, world_size), batch_size=2, drop_last=True)


def strided_batches(dataset: Any, rank: int, world_size: int, epoch: int) -> BatchSampler:
    return BatchSampler(StridedSampler(dataset, rank, world_size), batch_size=2, drop_last=False)


def in_order_with_workers(dataset: Any, rank: int, world_size: int, epoch: int) -> DataLoader[Any]:
    return DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, shuffle=False), num_workers=2)


def strided_with_workers(dataset: Any, rank: int, world_size: int, epoch: int) -> DataLoader[Any]:
    return DataLoader(dataset, batch_size=2, sampler=StridedSampler(dataset, rank, world_size), num_workers=2, persistent_workers=True)


OTHER = samples(10)


def on_another_dataset(dataset: Any, rank: int, world_size: int, epoch: int) -> DataLoader[Any]:
    """Builds the loader on a dataset of its own, not on the one it is given."""
    return DataLoader(OTHER, batch_size=2, sampler=DistributedSampler(OTHER, shuffle=False))


def a_number(dataset: Any, rank: int, world_size: int, epoch: int) -> int:
    return len(dataset)


def keyed_by_name(dataset: Any, rank: int, world_size: int, epoch: int) -> DataLoader[Any]:
    """A sampler that yields keys, not indices."""
    return DataLoader(dataset, batch_size=2, sampler=["a", "b"])  # type: ignore[arg-type]


class Numbers(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(10))


class Empty(Dataset[int]):
    def __len__(self) -> int:
        return 0

    def __getitem__(self, index: int) -> int:
        raise IndexError(index)


# --------------------------------------------------------------------------- padding


@pytest.mark.parametrize("world_size", [2, 4])
def test_padding_of_the_documented_loader_names_the_repeated_samples_every_epoch(world_size: int) -> None:
    n = 4 * world_size + 1  # one sample past an even split: W - 1 repeated
    message, report = caught(samples(n), documented, world_size=world_size)
    assert kinds(report) == {"padding"}
    for epoch in range(2):
        twice = seen_twice(parts(n, world_size, epoch))
        assert len(twice) == world_size - 1
        (finding,) = [f for f in report.findings if f.epoch == epoch]
        assert list(finding.samples) == twice
        carry = "they carry" if len(twice) > 1 else "it carries"
        assert f"Samples seen twice: {shown(twice)}; in training {carry} double weight in epoch {epoch}." in message
    per_rank = -(-n // world_size)
    assert f"DistributedSampler (drop_last=False) pads the {n} samples to {per_rank * world_size} = {world_size} ranks x {per_rank}" in message
    assert "trim the gathered per-sample results to len(dataset)" in message
    assert message.count("pads the") == 1  # the cause once, the later epoch refers back to it
    assert "(The cause, as in epoch 0.)" in message


def test_padding_allowed_in_training_passes_and_says_what_it_costs() -> None:
    n, world_size = 10, 4
    report = assert_ddp_data_matches(samples(n), documented, world_size=world_size, allow=("padding",))
    assert report.ok
    assert [f.kind for f in report.findings] == ["padding", "padding"]
    assert all(f.allowed for f in report.findings)
    text = str(report)
    assert text.startswith("The ranks together saw every sample once per epoch, as one device does, at the costs allowed below.")
    for epoch in range(2):
        assert f"allowed: Samples seen twice: {shown(seen_twice(parts(n, world_size, epoch)))}" in text


def test_an_evaluation_loader_that_does_not_pad_passes() -> None:
    report = assert_ddp_data_matches(samples(10), strided, world_size=4)
    assert report.ok
    assert report.findings == ()
    assert str(report) == "The ranks together saw every sample once per epoch, as one device does."


def test_an_even_split_of_the_documented_loader_passes_without_allow() -> None:
    report = assert_ddp_data_matches(samples(12), documented, world_size=4)
    assert report.ok
    assert report.findings == ()
    # the shuffle changes between the epochs, as set_epoch makes it
    assert report.epochs[0].per_rank != report.epochs[1].per_rank


# --------------------------------------------------------------------------- dropped samples


def test_drop_last_in_the_sampler_names_the_samples_never_seen() -> None:
    n, world_size = 10, 4
    message, report = caught(samples(n), sampler_drops, world_size=world_size)
    never = never_seen(n, parts(n, world_size, shuffle=False, drop_last=True))
    assert never == [8, 9]
    assert kinds(report) == {"dropped"}
    assert all(list(f.samples) == never for f in report.findings)
    assert f"Samples never seen: {shown(never)} (2 of 10)." in message
    assert "DistributedSampler(drop_last=True) gives each rank 2 = floor(10/4) samples and drops the last 2" in message


def test_drop_last_in_the_dataloader_names_each_ranks_lost_partial_batch() -> None:
    n, world_size = 10, 4
    message, report = caught(samples(n), loader_drops, world_size=world_size)
    kept = [ids[:2] for ids in parts(n, world_size, shuffle=False)]  # 3 each, batches of 2: the third is lost
    never = never_seen(n, kept)
    assert kinds(report) == {"dropped"}
    assert list(report.findings[0].samples) == never
    assert f"Samples never seen: {shown(never)}" in message
    assert "DataLoader(drop_last=True) drops each rank's last partial batch: the ranks lose [1, 1, 1, 1] samples (batch_size=2)" in message


def test_dropped_allowed_with_a_reshuffle_each_epoch_passes() -> None:
    n, world_size = 10, 4
    dropped = [never_seen(n, parts(n, world_size, epoch, shuffle=True, seed=0, drop_last=True)) for epoch in range(2)]
    assert all(dropped)
    assert not set(dropped[0]) & set(dropped[1])
    report = assert_ddp_data_matches(samples(n), shuffled_sampler_drops, world_size=world_size, allow=("dropped",))
    assert report.ok
    assert [list(f.samples) for f in report.findings] == dropped
    assert all(f.kind == "dropped" and f.allowed for f in report.findings)
    assert "allowed: Samples never seen" in str(report)


def test_dropped_allowed_still_fails_when_every_epoch_drops_the_same_samples() -> None:
    message, report = caught(samples(10), sampler_drops, world_size=4, allow=("dropped",))
    failing = [f for f in report.findings if not f.allowed]
    assert [(f.kind, list(f.samples)) for f in failing] == [("dropped", [8, 9])]
    assert "Samples [8, 9] were left out of all 2 epochs: they are never trained on." in message
    assert "Shuffle with a new order each epoch (shuffle=True and set_epoch)" in message


def test_dropped_allowed_does_not_allow_padding() -> None:
    _message, report = caught(samples(10), documented, world_size=4, allow=("dropped",))
    assert {(f.kind, f.allowed) for f in report.findings} == {("padding", False)}


# --------------------------------------------------------------------------- rank and world size


def test_num_replicas_larger_than_the_group_leaves_the_missing_ranks_parts_unloaded() -> None:
    n, world_size = 8, 2
    message, report = caught(samples(n), twice_the_replicas, world_size=world_size)
    loaded = parts(n, 2 * world_size, shuffle=False)[:world_size]
    assert never_seen(n, loaded) == [2, 3, 6, 7]
    assert kinds(report) == {"dropped"}
    assert list(report.findings[0].samples) == [2, 3, 6, 7]
    assert "Samples never seen: [2, 3, 6, 7] (4 of 8)." in message
    assert "The DistributedSampler has num_replicas=4 on a group of 2 ranks: the parts of ranks 2..3, which do not exist, are never loaded" in message
    assert "pass num_replicas=dist.get_world_size()" in message


def test_a_rank_fixed_to_zero_gives_every_rank_the_same_samples() -> None:
    n, world_size = 12, 4
    message, report = caught(samples(n), rank_zero, world_size=world_size)
    rank0 = parts(n, world_size, shuffle=False)[0]
    assert kinds(report) == {"same-order"}
    assert all(list(f.samples) == sorted(rank0) for f in report.findings)
    assert all(epoch.per_rank == (tuple(rank0),) * world_size for epoch in report.epochs)
    assert "Every rank saw the same 3 samples in the same order, and 9 samples none saw" in message
    assert "Every rank's DistributedSampler has rank=0" in message
    assert "pass rank=dist.get_rank() (the default)" in message


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_seed_that_differs_per_rank_overlaps_the_ranks_parts(world_size: int) -> None:
    n = 12
    message, report = caught(samples(n), seeded_by_rank, world_size=world_size)
    for epoch in range(2):
        ranks = [parts(n, world_size, epoch, shuffle=True, seed=rank)[rank] for rank in range(world_size)]
        assert [list(ids) for ids in report.epochs[epoch].per_rank] == ranks
        found = {f.kind: list(f.samples) for f in report.findings if f.epoch == epoch}
        assert found["overlap"] == seen_twice(ranks)
        assert found["dropped"] == never_seen(n, ranks)
    assert f"The ranks' DistributedSampler seeds differ ({list(range(world_size))})" in message
    assert "Pass the same seed on every rank" in message
    assert "The ranks' samples overlap: ranks 0 and" in message


# --------------------------------------------------------------------------- shuffles


def test_a_shuffle_without_set_epoch_repeats_the_first_epochs_order() -> None:
    n, world_size = 12, 4
    message, report = caught(samples(n), no_set_epoch, world_size=world_size, epochs=3)
    assert [(f.kind, f.epoch) for f in report.findings] == [("repeated-order", 1), ("repeated-order", 2)]
    assert report.epochs[0].per_rank == report.epochs[1].per_rank == report.epochs[2].per_rank
    assert list(report.findings[0].samples) == list(range(n))
    assert "Epoch 1 repeats epoch 0's order on every rank, although the sampler shuffles" in message
    assert "The DistributedSampler stayed at epoch 0: it seeds its shuffle with seed + epoch, so call sampler.set_epoch(epoch)" in message


def test_no_set_epoch_fails_even_with_every_cost_allowed() -> None:
    _message, report = caught(samples(10), no_set_epoch, world_size=4, allow=ALLOWED)
    assert {f.kind for f in report.findings if not f.allowed} == {"repeated-order"}


def test_a_shuffling_dataloader_without_a_distributed_sampler_does_not_split_the_dataset() -> None:
    n, world_size = 10, 2
    message, report = caught(samples(n), plain_shuffle, world_size=world_size)
    assert [(f.kind, f.epoch) for f in report.findings] == [("same-order", 0), ("same-order", 1)]
    assert report.epochs[0].sizes == [n, n]
    assert all(list(f.samples) == list(range(n)) for f in report.findings)
    assert "Every rank saw the same 10 samples in the same order (the whole dataset, 2 times over)." in message
    assert "does not split the dataset between the ranks" in message
    assert "DistributedSampler(dataset, num_replicas=2, rank=rank, seed=same_seed_on_every_rank)" in message


# --------------------------------------------------------------------------- samplers, batch samplers, workers


def test_a_factory_returning_a_sampler_is_read_from_its_indices() -> None:
    n, world_size = 10, 4
    message, report = caught(samples(n), padded_sampler, world_size=world_size)
    assert [list(ids) for ids in report.epochs[0].per_rank] == parts(n, world_size, shuffle=False)
    assert kinds(report) == {"padding"}
    assert f"Samples seen twice: {shown(seen_twice(parts(n, world_size, shuffle=False)))}" in message
    assert report.epochs[0].facts[0].loader == "DistributedSampler"
    assert assert_ddp_data_matches(samples(n), strided_sampler, world_size=world_size).findings == ()


def test_a_factory_returning_a_batch_sampler_is_read_from_its_batches() -> None:
    n, world_size = 10, 4
    message, report = caught(samples(n), padded_batches, world_size=world_size)
    assert [list(ids) for ids in report.epochs[0].per_rank] == parts(n, world_size, shuffle=False)
    assert kinds(report) == {"padding"}
    assert f"Samples seen twice: {shown(seen_twice(parts(n, world_size, shuffle=False)))}" in message
    assert assert_ddp_data_matches(samples(n), strided_batches, world_size=world_size).findings == ()


def test_a_batch_sampler_dropping_its_last_partial_batch_is_named() -> None:
    message, report = caught(samples(10), full_batches_only, world_size=4)
    # strided parts [0, 4, 8], [1, 5, 9], [2, 6], [3, 7]: ranks 0 and 1 lose their third sample
    assert kinds(report) == {"dropped"}
    assert list(report.findings[0].samples) == [8, 9]
    assert "BatchSampler(drop_last=True) drops each rank's last partial batch: the ranks lose [1, 1, 0, 0] samples (batch_size=2)" in message


def test_a_loader_with_workers_is_read_in_the_rank_process() -> None:
    n, world_size = 10, 4
    started = time.monotonic()
    message, report = caught(samples(n), in_order_with_workers, world_size=world_size)
    assert kinds(report) == {"padding"}
    assert f"Samples seen twice: {shown(seen_twice(parts(n, world_size, shuffle=False)))}" in message
    assert report.epochs[0].facts[0].num_workers == 2  # as the user built it
    fixed = assert_ddp_data_matches(samples(n), strided_with_workers, world_size=world_size)
    assert fixed.findings == ()
    assert time.monotonic() - started < 10  # no worker process started for each epoch of each rank


# --------------------------------------------------------------------------- the report


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_report_holds_each_ranks_samples_and_loader_settings_per_epoch(world_size: int) -> None:
    n = 12
    report = assert_ddp_data_matches(samples(n), documented, world_size=world_size, epochs=3)
    assert report.ok
    assert (report.dataset_size, report.world_size, report.backend, report.loader) == (n, world_size, "gloo", "documented")
    assert [e.epoch for e in report.epochs] == [0, 1, 2]
    for epoch in report.epochs:
        assert [list(ids) for ids in epoch.per_rank] == parts(n, world_size, epoch.epoch)
        assert epoch.sizes == [n // world_size] * world_size
        assert [f.rank for f in epoch.facts] == list(range(world_size))
        assert {(f.num_replicas, f.epoch, f.shuffle, f.seed, f.batch_size) for f in epoch.facts} == {(world_size, epoch.epoch, True, 0, 2)}
    assert report.scenario().startswith(f"dataset of 12 samples on {world_size} ranks (gloo), 3 epochs; loader_factory documented")


def test_a_functools_partial_factory_is_named_with_its_keywords() -> None:
    factory = functools.partial(DistributedSamplerFactory.build, shuffle=False)
    report = assert_ddp_data_matches(samples(8), factory, world_size=4)
    assert report.loader == "DistributedSamplerFactory.build(shuffle=False)"


class DistributedSamplerFactory:
    @staticmethod
    def build(dataset: Any, rank: int, world_size: int, epoch: int, *, shuffle: bool) -> DataLoader[Any]:
        return DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, shuffle=shuffle))


def test_msg_replaces_the_message_and_keeps_the_report() -> None:
    with pytest.raises(ParallelMismatch) as failure:
        assert_ddp_data_matches(samples(10), in_order, world_size=4, msg="eval loader pads")
    assert str(failure.value) == "eval loader pads"
    assert kinds(failure.value.report) == {"padding"}


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("dataset", "factory", "options", "says"),
    [
        (Numbers(), strided, {}, ["dataset is an IterableDataset (Numbers)", "pass a map-style dataset"]),
        (Empty(), strided, {}, ["dataset is empty"]),
        (samples(10), "strided", {}, ["loader_factory='strided' is not callable", "loader_factory(dataset, rank, world_size, epoch)"]),
        (samples(10), lambda d, r, w, e: strided(d, r, w, e), {}, ["loader_factory=", "cannot be pickled", "not a lambda"]),
        (samples(10), strided, {"epochs": 0}, ["epochs=0 must be an int >= 1"]),
        (samples(10), strided, {"allow": "padding"}, ["allow='padding' is a string", "allow=('padding',)"]),
        (samples(10), strided, {"allow": ("padding", "overlap")}, ["allow has ['overlap']", "['padding', 'dropped']"]),
        (samples(10), strided, {"world_size": 0}, ["world_size=0 must be an int >= 1"]),
    ],
)
def test_arguments_that_cannot_be_used_are_refused_before_any_rank_runs(dataset: Any, factory: Any, options: dict[str, Any], says: list[str]) -> None:
    with pytest.raises(InvalidArgument) as refused:
        assert_ddp_data_matches(dataset, factory, **{"world_size": 2, **options})
    for words in says:
        assert words in str(refused.value)


@pytest.mark.parametrize(
    ("factory", "says"),
    [
        (a_number, ["loader_factory returned int, which is not iterable", "return a DataLoader, a sampler"]),
        (on_another_dataset, ["fetched no sample from the dataset it was given", "build the DataLoader on the factory's dataset argument"]),
        (keyed_by_name, ["the loader fetched dataset['a']", "a sample id must be an integer index"]),
    ],
)
def test_loaders_that_cannot_be_read_are_refused_and_the_pool_keeps_its_ranks(factory: Any, says: list[str]) -> None:
    from dpverify.ddp.pool import shared_pool

    pool = shared_pool(2)
    pool.run(_rank_of)  # a restart owed to an earlier test's failed task happens here, not below
    before = pool.restarts
    with pytest.raises(InvalidArgument) as refused:
        assert_ddp_data_matches(samples(10), factory, world_size=2)
    for words in says:
        assert words in str(refused.value)
    assert "(on ranks [0, 1])" in str(refused.value)
    assert pool.restarts == before


def _rank_of(info: Any) -> int:
    return int(info.rank)


# --------------------------------------------------------------------------- time


def shuffled_batches_of_64(dataset: Any, rank: int, world_size: int, epoch: int) -> DataLoader[Any]:
    sampler: DistributedSampler[Any] = DistributedSampler(dataset, shuffle=True)
    sampler.set_epoch(epoch)
    return DataLoader(dataset, batch_size=64, sampler=sampler)


def test_two_epochs_of_ten_thousand_samples_on_four_ranks_take_under_two_seconds_once_the_pool_is_warm() -> None:
    dataset = samples(10_000)
    assert_ddp_data_matches(dataset, shuffled_batches_of_64, world_size=4)  # the pool's ranks started, imports done
    started = time.perf_counter()
    report = assert_ddp_data_matches(dataset, shuffled_batches_of_64, world_size=4)
    elapsed = time.perf_counter() - started
    assert report.findings == ()
    assert [epoch.sizes for epoch in report.epochs] == [[2500] * 4] * 2
    assert elapsed < 2.0, f"{elapsed:.2f} s"


def test_padding_of_a_dataset_smaller_than_half_the_ranks_is_padding_not_an_overlap() -> None:
    # 2 samples on 5 ranks: DistributedSampler repeats the order until every rank has one,
    # so sample 0 is seen three times; the report is built from samplers made here (no pool
    # of 5 ranks needed: data_report is what assert_ddp_data_matches reports on)
    from dpverify.data.path import RankSamples, data_report
    from dpverify.data.samples import loader_facts

    dataset = TensorDataset(torch.arange(2.0))
    samplers = [DistributedSampler(dataset, num_replicas=5, rank=r, shuffle=False) for r in range(5)]
    ranks = [RankSamples((tuple(iter(s)),), (loader_facts(s),)) for s in samplers]
    report = data_report(2, ranks, backend="gloo", loader="DistributedSampler")
    assert [f.kind for f in report.findings] == ["padding"]
    assert report.findings[0].samples == (0, 1)
    assert "(up to 3 times)" in report.message()
    assert "--allow padding" in report.message()


def test_one_sample_on_two_ranks_is_padding_not_one_order_on_every_rank() -> None:
    from dpverify.data.path import RankSamples, data_report
    from dpverify.data.samples import loader_facts

    dataset = TensorDataset(torch.arange(1.0))
    samplers = [DistributedSampler(dataset, num_replicas=2, rank=r, shuffle=False) for r in range(2)]
    report = data_report(1, [RankSamples((tuple(iter(s)),), (loader_facts(s),)) for s in samplers], backend="gloo", loader="s")
    assert [f.kind for f in report.findings] == ["padding"]


def test_a_reshuffle_that_draws_a_ranks_order_again_by_chance_is_no_missing_set_epoch() -> None:
    # seeds 2 and 3 permute two samples alike: rank 0 sees sample 0 in both epochs although
    # set_epoch moved the sampler from epoch 0 to 1; without set_epoch the repeat is named
    from dpverify.data.path import RankSamples, data_report
    from dpverify.data.samples import loader_facts

    dataset = TensorDataset(torch.arange(2.0))

    def ranks(set_epoch: bool) -> list[RankSamples]:
        out = []
        for r in range(2):
            ids, facts = [], []
            for epoch in range(2):
                sampler = DistributedSampler(dataset, num_replicas=2, rank=r, shuffle=True, seed=2)
                if set_epoch:
                    sampler.set_epoch(epoch)
                facts.append(loader_facts(sampler))
                ids.append(tuple(iter(sampler)))
            out.append(RankSamples(tuple(ids), tuple(facts)))
        return out

    reshuffled = ranks(set_epoch=True)
    assert reshuffled[0].ids[0] == reshuffled[0].ids[1]  # the chance repeat this test is about
    assert data_report(2, reshuffled, backend="gloo", loader="s").ok
    stale = data_report(2, ranks(set_epoch=False), backend="gloo", loader="s")
    assert [f.kind for f in stale.findings] == ["repeated-order"]


def test_msg_replaces_or_rewrites_the_message_as_in_every_helper() -> None:
    from dpverify.data.loaders import distributed_loader

    loader = distributed_loader(batch_size=2)
    with pytest.raises(ParallelMismatch) as replaced:
        assert_ddp_data_matches(samples(10), loader, world_size=4, epochs=1, msg="mine")
    assert str(replaced.value) == "mine"
    with pytest.raises(ParallelMismatch) as rewritten:
        assert_ddp_data_matches(samples(10), loader, world_size=4, epochs=1, msg=lambda text: f"rewritten: {text}")
    assert str(rewritten.value).startswith("rewritten: The samples the ranks saw")
