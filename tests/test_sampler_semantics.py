"""What ``torch.utils.data.distributed.DistributedSampler`` and the DataLoader around it do
in torch 2.13: one test for each claim of docs/sampler.md.

The page cites each test by name; ``test_the_page_and_this_module_cite_each_other`` keeps
the two in step. The running example is the page's: 10 samples on 4 ranks. Every sampler is
built with an explicit ``num_replicas`` and ``rank``, so no process group is needed, except
in the one test about the defaults, which starts a one-rank gloo group and destroys it.
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "sampler.md"

#: The page's running example: N samples on W ranks.
N, W = 10, 4


class _Indices(Dataset[int]):
    """``n`` samples; sample i is i."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


def _shards(n: int, w: int, epoch: int = 0, **kwargs: object) -> list[list[int]]:
    """Every rank's indices, rank 0 first, for a dataset of ``n`` samples on ``w`` ranks."""
    shards = []
    for rank in range(w):
        sampler: DistributedSampler[int] = DistributedSampler(_Indices(n), num_replicas=w, rank=rank, **kwargs)  # type: ignore[arg-type]
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    return shards


def _interleave(shards: Sequence[Sequence[int]]) -> list[int]:
    """The sampler's global order back from the shards: position ``i * W + r`` is rank r's
    i-th index (what ``torch.stack(gathered, dim=1).flatten()`` gives)."""
    return [shard[i] for i in range(len(shards[0])) for shard in shards]


def _permutation(n: int, seed: int) -> list[int]:
    """``torch.randperm(n)`` drawn from a fresh generator seeded with ``seed``."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


# --- num_replicas and rank --------------------------------------------------------------


def test_defaults_raise_valueerror_without_a_process_group() -> None:
    assert not dist.is_initialized()
    message = "Default process group has not been initialized"
    with pytest.raises(ValueError, match=message):
        DistributedSampler(_Indices(N))
    # one default is enough to need the group
    with pytest.raises(ValueError, match=message):
        DistributedSampler(_Indices(N), num_replicas=W)
    with pytest.raises(ValueError, match=message):
        DistributedSampler(_Indices(N), rank=0)


def test_defaults_come_from_the_default_process_group() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        sampler: DistributedSampler[int] = DistributedSampler(_Indices(N), shuffle=False)
        assert (sampler.num_replicas, sampler.rank) == (dist.get_world_size(), dist.get_rank()) == (1, 0)
        assert list(sampler) == list(range(N))
        # either default may be given alone: the other comes from the group
        assert DistributedSampler(_Indices(N), num_replicas=W).rank == 0
        assert DistributedSampler(_Indices(N), rank=0).num_replicas == 1
        # an explicit rank is checked against the group's world size
        with pytest.raises(ValueError, match=re.escape("Invalid rank 1, rank should be in the interval [0, 0]")):
            DistributedSampler(_Indices(N), rank=1)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("rank", [W, W + 1, -1])
def test_a_rank_outside_0_to_w_minus_1_is_a_valueerror(rank: int) -> None:
    with pytest.raises(ValueError, match=re.escape(f"Invalid rank {rank}, rank should be in the interval [0, {W - 1}]")):
        DistributedSampler(_Indices(N), num_replicas=W, rank=rank)
    for valid in range(W):
        assert DistributedSampler(_Indices(N), num_replicas=W, rank=valid).rank == valid


# --- drop_last=False: padding -----------------------------------------------------------


@pytest.mark.parametrize("shuffle", [False, True])
def test_padding_makes_total_size_ceil_n_over_w_times_w(shuffle: bool) -> None:
    for n in range(1, 14):
        for w in range(1, 9):
            shards = _shards(n, w, shuffle=shuffle)
            per_rank = math.ceil(n / w)
            for rank, shard in enumerate(shards):
                sampler: DistributedSampler[int] = DistributedSampler(_Indices(n), num_replicas=w, rank=rank, shuffle=shuffle)
                assert (sampler.num_samples, sampler.total_size) == (per_rank, per_rank * w)
                assert len(sampler) == len(shard) == per_rank
            # every sample at least once; exactly total_size - n extra positions
            seen = Counter(i for shard in shards for i in shard)
            assert set(seen) == set(range(n))
            assert sum(seen.values()) - n == per_rank * w - n


def test_padding_repeats_the_first_samples_of_the_order() -> None:
    # unshuffled: the order is 0..9, padded with 0 and 1
    assert _interleave(_shards(N, W, shuffle=False)) == [*range(N), 0, 1]
    # shuffled: the first two of the epoch's permutation are repeated
    for seed, epoch in ((0, 0), (7, 3)):
        order = _permutation(N, seed + epoch)
        assert _interleave(_shards(N, W, epoch, seed=seed)) == [*order, *order[:2]]


def test_padding_wraps_around_when_it_exceeds_n() -> None:
    # 3 samples on 8 ranks: 5 positions to fill, more than the 3 samples
    shards = _shards(3, 8, shuffle=False)
    assert _interleave(shards) == [0, 1, 2, 0, 1, 2, 0, 1]
    assert shards == [[0], [1], [2], [0], [1], [2], [0], [1]]
    order = _permutation(3, 5)
    assert _interleave(_shards(3, 8, seed=5)) == [*order, *order, *order[:2]]


def test_each_rank_takes_every_w_th_position_not_a_block() -> None:
    shards = _shards(N, W, shuffle=False)
    assert shards == [[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]]
    padded = [*range(N), 0, 1]
    for rank, shard in enumerate(shards):
        assert shard == padded[rank : len(padded) : W]
    assert shards[0] != padded[:3]  # not the contiguous block [0, 1, 2]


@pytest.mark.parametrize("shuffle", [False, True])
def test_the_repeats_are_the_last_sample_of_the_last_ranks(shuffle: bool) -> None:
    for n in range(1, 14):
        for w in range(1, n + 1):  # n >= w: fewer than w positions to fill
            shards = _shards(n, w, shuffle=shuffle)
            repeated = (_permutation(n, 0) if shuffle else list(range(n)))[: len(shards[0]) * w - n]
            assert len(repeated) == (w - n % w) % w
            seen = Counter(i for shard in shards for i in shard)
            assert sorted(i for i, count in seen.items() if count > 1) == sorted(repeated)
            assert max(seen.values()) <= 2
            # the j-th repeated sample: first of rank j, last of rank n % w + j
            assert [shard[-1] for shard in shards[w - len(repeated) :]] == repeated
            assert [shard[0] for shard in shards[: len(repeated)]] == repeated


# --- evaluating over the padded order ---------------------------------------------------


def _scores(shards: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Each rank's per-sample results, in its sampler's order: sample i scores i + 1."""
    return [torch.tensor(shard, dtype=torch.float64) + 1 for shard in shards]


def test_summing_over_ranks_counts_the_padded_samples_twice() -> None:
    results = _scores(_shards(N, W, shuffle=False))
    true_sum = sum(range(1, N + 1))  # 55
    distributed_sum = sum(float(r.sum()) for r in results)  # what an all-reduce of local sums gives
    assert distributed_sum == true_sum + 1 + 2  # samples 0 and 1 (scores 1 and 2) twice
    count = sum(len(r) for r in results)
    assert count == 12
    assert distributed_sum / count != true_sum / N


def test_the_interleaved_gather_trimmed_to_n_has_each_sample_once() -> None:
    # unshuffled: interleaving the gathered tensors and keeping the first N is dataset order
    shards = _shards(N, W, shuffle=False)
    gathered = _scores(shards)  # what all_gather returns, rank 0 first
    for rank, shard in enumerate(shards):
        for i in range(len(shard)):
            assert _interleave(shards)[i * W + rank] == shard[i]
    merged = torch.stack(gathered, dim=1).flatten()[:N]
    assert merged.tolist() == [float(i + 1) for i in range(N)]
    # shuffled: the same trim gives each sample once, in the permutation's order; gather
    # the indices too and put the results back in dataset order with them
    shards = _shards(N, W, epoch=2, seed=0)
    indices = torch.stack([torch.tensor(s) for s in shards], dim=1).flatten()[:N]
    merged = torch.stack(_scores(shards), dim=1).flatten()[:N]
    assert sorted(indices.tolist()) == list(range(N))
    assert indices.tolist() == _permutation(N, 2)
    back = torch.empty(N, dtype=torch.float64)
    back[indices] = merged
    assert back.tolist() == [float(i + 1) for i in range(N)]


def test_concatenating_the_ranks_results_is_not_dataset_order() -> None:
    shards = _shards(N, W, shuffle=False)
    concatenated = torch.cat([torch.tensor(s) for s in shards])
    assert concatenated.tolist() == [0, 4, 8, 1, 5, 9, 2, 6, 0, 3, 7, 1]
    trimmed = concatenated[:N].tolist()
    assert trimmed.count(0) == 2  # sample 0 twice
    assert 7 not in trimmed  # and sample 7 lost


# --- drop_last=True ---------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [False, True])
def test_drop_last_gives_floor_n_over_w_per_rank(shuffle: bool) -> None:
    for n in range(1, 14):
        for w in range(1, 9):
            shards = _shards(n, w, shuffle=shuffle, drop_last=True)
            sampler: DistributedSampler[int] = DistributedSampler(_Indices(n), num_replicas=w, rank=0, drop_last=True)
            assert len(sampler) == sampler.num_samples == n // w
            assert all(len(shard) == n // w for shard in shards)
            flat = [i for shard in shards for i in shard]
            assert len(flat) == len(set(flat))  # no sample twice
            # the last n % w of the order are left out
            order = _permutation(n, 0) if shuffle else list(range(n))
            assert set(range(n)) - set(flat) == set(order[n - n % w :])
    # fewer samples than ranks: nothing at all
    assert _shards(3, 8, drop_last=True) == [[]] * 8


def test_drop_last_drops_the_tail_of_the_order() -> None:
    shards = _shards(N, W, shuffle=False, drop_last=True)
    assert shards == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert set(range(N)) - {i for s in shards for i in s} == {8, 9}
    order = _permutation(N, 0)
    shards = _shards(N, W, drop_last=True)
    assert _interleave(shards) == order[:8]
    assert set(range(N)) - {i for s in shards for i in s} == set(order[8:])


def _dropped(epoch: int, shuffle: bool) -> set[int]:
    shards = _shards(N, W, epoch, shuffle=shuffle, drop_last=True)
    return set(range(N)) - {i for s in shards for i in s}


def test_drop_last_drops_other_samples_each_epoch_when_shuffling() -> None:
    dropped = [_dropped(epoch, shuffle=True) for epoch in range(5)]
    for epoch, samples in enumerate(dropped):
        assert samples == set(_permutation(N, epoch)[8:])
    assert len({frozenset(s) for s in dropped}) > 1
    # over a few epochs every sample is seen
    assert set().union(*(set(range(N)) - s for s in dropped)) == set(range(N))


def test_drop_last_without_shuffle_drops_the_same_samples_every_epoch() -> None:
    assert all(_dropped(epoch, shuffle=False) == {8, 9} for epoch in range(5))


# --- shuffle, seed and set_epoch ----------------------------------------------------------


def test_shuffle_is_on_by_default() -> None:
    sampler: DistributedSampler[int] = DistributedSampler(_Indices(N), num_replicas=W, rank=0)
    assert (sampler.shuffle, sampler.seed, sampler.drop_last, sampler.epoch) == (True, 0, False, 0)
    assert _interleave(_shards(N, W))[:N] == _permutation(N, 0) != list(range(N))


def test_the_order_is_randperm_from_a_generator_seeded_with_seed_plus_epoch() -> None:
    for seed, epoch in ((0, 0), (0, 1), (3, 4), (100, 2)):
        assert _interleave(_shards(N, W, epoch, seed=seed))[:N] == _permutation(N, seed + epoch)
    # only the sum counts: seed 5 at epoch 0 is seed 4 at epoch 1
    assert _shards(N, W, epoch=0, seed=5) == _shards(N, W, epoch=1, seed=4)


def test_without_set_epoch_every_epoch_repeats_the_order() -> None:
    sampler: DistributedSampler[int] = DistributedSampler(_Indices(N), num_replicas=W, rank=1)
    first = list(sampler)
    assert all(list(sampler) == first for _ in range(3))
    sampler.set_epoch(1)
    assert list(sampler) != first
    sampler.set_epoch(0)
    assert list(sampler) == first


def test_ranks_on_different_epochs_overlap_and_miss_samples() -> None:
    shards = _shards(N, W, epoch=0)
    shards[0] = _shards(N, W, epoch=1)[0]  # rank 0 alone called set_epoch(1)
    seen = Counter(i for s in shards for i in s)
    assert set(range(N)) - set(seen)  # some samples seen by no rank
    assert any(count > 1 for i, count in seen.items() if i not in _permutation(N, 0)[:2])


def test_seeds_that_differ_per_rank_overlap_and_miss_samples() -> None:
    # each rank seeds with its own rank: every rank uses a different permutation
    shards = [_shards(N, W, seed=rank)[rank] for rank in range(W)]
    seen = Counter(i for s in shards for i in s)
    assert sorted(set(range(N)) - set(seen)) == [2, 5]
    assert sorted(i for i, count in seen.items() if count > 1) == [0, 4, 6, 8]
    # the same seed on every rank covers every sample, with only the padding twice
    for seed in range(4):
        seen = Counter(i for s in _shards(N, W, seed=seed) for i in s)
        assert set(seen) == set(range(N))
        assert sorted(i for i, count in seen.items() if count > 1) == sorted(_permutation(N, seed)[:2])


def test_the_sampler_leaves_the_global_rng_alone() -> None:
    before = torch.get_rng_state()
    sampler: DistributedSampler[int] = DistributedSampler(_Indices(N), num_replicas=W, rank=1, seed=3)
    sampler.set_epoch(2)
    drawn = list(sampler)
    assert torch.equal(torch.get_rng_state(), before)
    # and the global seed does not change the order
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(12345)
        assert list(sampler) == drawn
        torch.manual_seed(0)
        assert list(sampler) == drawn


def test_a_dataloader_draws_one_number_from_the_global_rng_per_pass() -> None:
    sampler: DistributedSampler[int] = DistributedSampler(_Indices(N), num_replicas=W, rank=1)
    with torch.random.fork_rng(devices=[]):
        before = torch.get_rng_state()
        batches = list(DataLoader(_Indices(N), sampler=sampler, batch_size=2))
        assert not torch.equal(torch.get_rng_state(), before)
        # the seed for the workers' base seed; one int64 from the global generator
        torch.set_rng_state(before)
        torch.empty((), dtype=torch.int64).random_()
        after_one_draw = torch.get_rng_state()
        torch.set_rng_state(before)
        list(DataLoader(_Indices(N), sampler=sampler, batch_size=2))
        assert torch.equal(torch.get_rng_state(), after_one_draw)
        # with a generator of its own it leaves the global one alone
        torch.set_rng_state(before)
        with_generator = list(DataLoader(_Indices(N), sampler=sampler, batch_size=2, generator=torch.Generator()))
        assert torch.equal(torch.get_rng_state(), before)
    # the indices are the sampler's either way
    assert [b.tolist() for b in batches] == [b.tolist() for b in with_generator]


# --- the DataLoader ---------------------------------------------------------------------


def _loader_pass(n: int, w: int, batch: int, sampler_drop: bool, loader_drop: bool) -> list[int]:
    """Every index the ranks' loaders yield in one pass, all ranks together."""
    seen = []
    for rank in range(w):
        sampler: DistributedSampler[int] = DistributedSampler(_Indices(n), num_replicas=w, rank=rank, shuffle=False, drop_last=sampler_drop)
        loader = DataLoader(_Indices(n), batch_size=batch, sampler=sampler, drop_last=loader_drop)
        per_rank = len(sampler)
        assert len(loader) == (per_rank // batch if loader_drop else math.ceil(per_rank / batch))
        batches = [b.tolist() for b in loader]
        assert len(batches) == len(loader)
        seen += [i for b in batches for i in b]
    return seen


#: The page's table: 10 samples, 3 ranks, batches of 2. Columns: the sampler's drop_last,
#: the loader's, samples per rank, positions in all, samples never seen, samples seen twice.
DROP_LAST_TABLE = [
    (False, False, 4, 12, [], [0, 1]),
    (False, True, 4, 12, [], [0, 1]),
    (True, False, 3, 9, [9], []),
    (True, True, 2, 6, [6, 7, 8, 9], []),
]


@pytest.mark.parametrize(("sampler_drop", "loader_drop", "per_rank", "positions", "missed", "twice"), DROP_LAST_TABLE)
def test_the_loader_drop_last_drops_each_rank_s_last_partial_batch(
    sampler_drop: bool, loader_drop: bool, per_rank: int, positions: int, missed: list[int], twice: list[int]
) -> None:
    seen = _loader_pass(10, 3, 2, sampler_drop, loader_drop)
    assert len(seen) == positions == 3 * per_rank
    assert sorted(set(range(10)) - set(seen)) == missed
    assert sorted(i for i, count in Counter(seen).items() if count > 1) == twice
    # in general: the sampler drops n % w samples, the loader (per rank % batch) per rank
    for n in range(1, 12):
        for w in range(1, 5):
            for batch in (1, 2, 3):
                sampler_len = n // w if sampler_drop else math.ceil(n / w)
                kept = sampler_len - sampler_len % batch if loader_drop else sampler_len
                assert len(_loader_pass(n, w, batch, sampler_drop, loader_drop)) == w * kept


def test_dataloader_rejects_shuffle_true_with_a_sampler() -> None:
    sampler: DistributedSampler[int] = DistributedSampler(_Indices(N), num_replicas=W, rank=0)
    with pytest.raises(ValueError, match="sampler option is mutually exclusive with shuffle"):
        DataLoader(_Indices(N), shuffle=True, sampler=sampler)
    for shuffle in (False, None):  # the order is the sampler's
        loader = DataLoader(_Indices(N), shuffle=shuffle, sampler=sampler, batch_size=None)
        assert [int(i) for i in loader] == list(sampler)


class _WhoLoads(Dataset[tuple[int, int]]):
    """Sample i is ``(i, the id of the process that loaded it)``."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> tuple[int, int]:
        return index, os.getpid()


class _WhoSamples(DistributedSampler[int]):
    """A DistributedSampler that notes the process each of its passes runs in."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.passes: list[int] = []

    def __iter__(self) -> Iterator[int]:
        self.passes.append(os.getpid())
        return super().__iter__()


def test_with_workers_the_sampler_runs_in_the_main_process() -> None:
    sampler = _WhoSamples(_WhoLoads(), num_replicas=W, rank=2, seed=1)
    loader = DataLoader(_WhoLoads(), sampler=sampler, batch_size=None, num_workers=2)
    loaded = [(int(i), int(pid)) for i, pid in loader]
    # with workers the loader calls iter(sampler) twice per pass, both times here
    assert sampler.passes == [os.getpid()] * 2
    assert [i for i, _ in loaded] == list(sampler)  # the workers keep the sampler's order
    assert os.getpid() not in {pid for _, pid in loaded}  # the items come from the workers
    # the same order as without workers, where the loader calls iter(sampler) once
    sampler.passes.clear()
    alone = [int(i) for i, _ in DataLoader(_WhoLoads(), sampler=sampler, batch_size=None)]
    assert sampler.passes == [os.getpid()]
    assert alone == [i for i, _ in loaded]


def test_the_order_is_drawn_when_the_loader_s_iterator_is_made() -> None:
    sampler: DistributedSampler[int] = DistributedSampler(_Indices(N), num_replicas=W, rank=0)
    loader = DataLoader(_Indices(N), sampler=sampler, batch_size=None)
    epoch_0 = list(sampler)
    iterator = iter(loader)
    sampler.set_epoch(1)  # too late for this pass
    assert [int(i) for i in iterator] == epoch_0
    assert [int(i) for i in loader] == list(sampler) != epoch_0  # the next pass has it


# --- the page ---------------------------------------------------------------------------


def test_the_page_and_this_module_cite_each_other() -> None:
    """Every test the page cites exists here, and every test here is cited by the page."""
    page = PAGE.read_text(encoding="utf-8")
    cited = set(re.findall(r"\b(test_\w+)", page)) - {"test_sampler_semantics"}
    here = {name for name in globals() if name.startswith("test_")} - {"test_the_page_and_this_module_cite_each_other"}
    assert cited - here == set(), "the page cites tests that do not exist"
    assert here - cited == set(), "tests the page does not cite"
