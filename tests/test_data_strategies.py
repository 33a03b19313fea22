"""``data_scenarios`` and ``DataScenario``: validation, coverage of the splits that matter,
shrinking, determinism, and what a scenario builds (the dataset, torch's loader
construction with the scenario's settings, a classifier)."""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable

import pytest
import torch
from hypothesis import find, given, settings
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import dpverify
from dpverify.strategies import DataScenario, data_scenarios


@given(data_scenarios())
def test_data_scenarios_print_as_pasteable_specs_and_pickle(scenario: DataScenario) -> None:
    assert eval(repr(scenario), {"DataScenario": DataScenario}) == scenario
    assert pickle.loads(pickle.dumps(scenario)) == scenario
    assert pickle.loads(pickle.dumps(scenario.loader_factory())) is not None  # the ranks get it pickled


@given(data_scenarios())
def test_the_dataset_and_model_are_deterministic_and_leave_the_global_seed_alone(scenario: DataScenario) -> None:
    state = torch.random.get_rng_state()
    a, b = scenario.dataset(), scenario.dataset()
    assert isinstance(a, TensorDataset)
    assert len(a) == scenario.size
    for x, y in zip(a.tensors, b.tensors, strict=True):
        assert torch.equal(x, y)
    features, labels = a.tensors
    assert features.shape == (scenario.size, scenario.features)
    assert features.dtype == torch.float32
    assert labels.dtype == torch.int64
    assert int(labels.min()) >= 0
    assert int(labels.max()) < scenario.classes
    first, second = scenario.model(), scenario.model()
    assert first(features).shape == (scenario.size, scenario.classes)
    for p, q in zip(first.parameters(), second.parameters(), strict=True):
        assert torch.equal(p, q)
    assert torch.equal(torch.random.get_rng_state(), state)


@given(data_scenarios())
def test_the_loader_factory_is_torchs_construction_with_the_scenarios_settings(scenario: DataScenario) -> None:
    dataset = scenario.dataset()
    for rank in range(scenario.world_size):
        loader = scenario.loader_factory()(dataset, rank, scenario.world_size, scenario.epochs - 1)
        assert isinstance(loader, DataLoader)
        assert (loader.batch_size, loader.drop_last) == (scenario.batch_size, scenario.loader_drop_last)
        sampler = loader.sampler
        assert isinstance(sampler, DistributedSampler)
        assert (sampler.num_replicas, sampler.rank, sampler.shuffle, sampler.seed, sampler.drop_last, sampler.epoch) == (
            scenario.world_size, rank, scenario.shuffle, scenario.seed, scenario.drop_last, scenario.epochs - 1,
        )
        # per_rank from first principles: floor with the sampler's drop_last, ceil without
        expected = scenario.size // scenario.world_size if scenario.drop_last else math.ceil(scenario.size / scenario.world_size)
        assert len(sampler) == scenario.per_rank == expected


SPLITS: dict[str, Callable[[DataScenario], bool]] = {
    "one sample": lambda s: s.size == 1,
    "fewer samples than ranks, more than one": lambda s: 1 < s.size < s.world_size,
    "a multiple of the world size": lambda s: s.size % s.world_size == 0,
    "not a multiple, more than the ranks": lambda s: s.size > s.world_size and s.size % s.world_size != 0,
    "4 ranks": lambda s: s.world_size == 4,
    "3 epochs": lambda s: s.epochs == 3,
    "both drop_lasts and shuffle": lambda s: s.drop_last and s.loader_drop_last and s.shuffle,
    "a batch larger than a rank's share": lambda s: s.batch_size > s.per_rank >= 1,
}


@pytest.mark.parametrize("label", sorted(SPLITS))
def test_data_scenarios_draw_every_split_that_matters(label: str) -> None:
    predicate = SPLITS[label]
    assert predicate(find(data_scenarios(), predicate, settings=settings(database=None, max_examples=2000))), label


def test_data_scenarios_shrink_to_one_sample_on_the_fewest_ranks() -> None:
    simplest = find(data_scenarios(world_sizes=(3, 2)), lambda s: True, settings=settings(database=None))
    assert simplest == DataScenario(size=1, world_size=2, batch_size=1, seed=0, epochs=1)


@given(data_scenarios(world_sizes=(3,), max_size=5, max_batch=2, max_epochs=2))
def test_data_scenarios_keep_to_their_bounds(scenario: DataScenario) -> None:
    assert scenario.world_size == 3
    assert 1 <= scenario.size <= 5
    assert 1 <= scenario.batch_size <= 2
    assert 1 <= scenario.epochs <= 2


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: data_scenarios(world_sizes=()), r"world_sizes=\[\]"),
        (lambda: data_scenarios(world_sizes="2"), "world_sizes='2'"),
        (lambda: data_scenarios(world_sizes=(0, 2)), "world_sizes=0 must be an int >= 1"),
        (lambda: data_scenarios(max_size=0), "max_size=0 must be an int >= 1"),
        (lambda: data_scenarios(max_batch=True), "max_batch=True must be an int >= 1"),
        (lambda: data_scenarios(max_epochs=0), "max_epochs=0 must be an int >= 1"),
        (lambda: DataScenario(size=0), "size=0 must be an int >= 1"),
        (lambda: DataScenario(world_size=2.0), "world_size=2.0 must be an int >= 1"),
        (lambda: DataScenario(seed=-1), "seed=-1 must be an int >= 0"),
        (lambda: DataScenario(classes=1), "classes=1 must be an int >= 2"),
        (lambda: DataScenario(shuffle=1), "shuffle=1 must be True or False"),
    ],
)
def test_bad_arguments_name_the_argument(make: Callable[[], object], match: str) -> None:
    with pytest.raises(dpverify.InvalidArgument, match=match):
        make()


def test_str_says_the_scenario_in_words() -> None:
    text = str(DataScenario(size=5, world_size=4, batch_size=2, drop_last=True, shuffle=True, seed=3, epochs=2))
    assert text == "5 samples on 4 ranks, batch 2, shuffle, drop_last, seed 3, 2 epochs"
