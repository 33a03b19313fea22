"""The data checks over drawn data paths (``data_scenarios``): torch's ``DistributedSampler``
construction passes ``assert_ddp_data_matches`` exactly when it should, by a verdict derived
from the dataset size, the world size, the two ``drop_last``s and the epochs, and the report
names the samples an independent model of the sampler pads and drops; a correct distributed
evaluation passes ``assert_ddp_metric_matches`` on every scenario.

Three corner cases of torch's correct construction that the data-path check once misread
have a test of their own at the end: one sample padded onto every rank (padding, not one
order on every rank), a sample padded in three times or more (fewer samples than half the
ranks: padding, not ranks sharing samples), and a reshuffle that gives a rank the same order
as the previous epoch by chance (not a missing ``set_epoch``).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings

import dpverify
from dpverify.data.metrics import assert_ddp_metric_matches
from dpverify.data.path import DataReport, assert_ddp_data_matches
from dpverify.mutants import gather_trim_eval, sum_count_eval, unpadded_loader
from dpverify.strategies import DataScenario, data_scenarios

TRAINING = ("padding", "dropped")


def rank_orders(s: DataScenario, epoch: int) -> list[list[int]]:
    """What each rank's loader delivers in ``epoch``, from the sampler's definition: the
    epoch's order (``randperm`` seeded with ``seed + epoch`` when shuffling, else 0..N-1),
    cut to a multiple of the world size with ``drop_last`` or padded up to one by repeating
    the order from its start, rank ``r`` taking positions ``r, r + W, ...``; then each rank's
    last partial batch cut with the loader's ``drop_last``."""
    n, w = s.size, s.world_size
    order = torch.randperm(n, generator=torch.Generator().manual_seed(s.seed + epoch)).tolist() if s.shuffle else list(range(n))
    if s.drop_last:
        order = order[: n // w * w]
    else:
        while len(order) % w:
            order += order[: math.ceil(n / w) * w - len(order)]
    ranks = [order[r::w] for r in range(w)]
    if s.loader_drop_last:
        ranks = [part[: len(part) // s.batch_size * s.batch_size] for part in ranks]
    return ranks


def strict_verdict(s: DataScenario) -> bool:
    """Whether every epoch sees every sample exactly once, in closed form: the world size
    divides the dataset (no padding, nothing for the sampler's ``drop_last`` to drop) and
    the loader's ``drop_last`` has no partial batch to drop."""
    return s.size % s.world_size == 0 and not (s.loader_drop_last and (s.size // s.world_size) % s.batch_size)


def expected_findings(s: DataScenario, allow: tuple[str, ...]) -> list[tuple[str, int, tuple[int, ...], bool]]:
    """The findings (kind, epoch, samples, allowed) of the model: samples seen twice in an
    epoch (padding), samples never seen (dropped), and, where drops are allowed, the samples
    left out of every epoch of several (a failure)."""
    found = []
    never_by_epoch = []
    for epoch in range(s.epochs):
        counts = Counter(i for part in rank_orders(s, epoch) for i in part)
        twice = tuple(sorted(i for i, c in counts.items() if c > 1))
        never = tuple(sorted(set(range(s.size)) - set(counts)))
        if twice:
            found.append(("padding", epoch, twice, "padding" in allow))
        if never:
            found.append(("dropped", epoch, never, "dropped" in allow))
        never_by_epoch.append(set(never))
    always = set.intersection(*never_by_epoch)
    if s.epochs > 1 and always and "dropped" in allow:
        found.append(("dropped", s.epochs - 1, tuple(sorted(always)), False))
    return sorted(found)


def _data_report(s: DataScenario, allow: tuple[str, ...]) -> tuple[bool, DataReport]:
    passed, report = True, None
    try:
        report = assert_ddp_data_matches(s.dataset(), s.loader_factory(), world_size=s.world_size, epochs=s.epochs, allow=allow)
    except dpverify.ParallelMismatch as caught:
        passed, report = False, caught.report
    assert isinstance(report, DataReport)
    return passed, report


@given(data_scenarios())
def test_torchs_distributed_sampler_passes_exactly_when_every_epoch_sees_every_sample_once(s: DataScenario) -> None:
    passed, report = _data_report(s, ())
    assert passed == strict_verdict(s), report.message()
    assert passed == (expected_findings(s, ()) == []), report.message()
    assert sorted((f.kind, f.epoch, f.samples, f.allowed) for f in report.findings) == expected_findings(s, ()), report.message()
    # what the ranks saw, rank by rank, is the model's
    for epoch in report.epochs:
        assert [list(part) for part in epoch.per_rank] == rank_orders(s, epoch.epoch)


@given(data_scenarios())
def test_padding_and_drops_accepted_as_training_costs_fail_only_samples_never_seen(s: DataScenario) -> None:
    passed, report = _data_report(s, TRAINING)
    expected = expected_findings(s, TRAINING)
    assert sorted((f.kind, f.epoch, f.samples, f.allowed) for f in report.findings) == expected, report.message()
    # from first principles: it fails only when drops leave some sample out of every one of
    # several epochs, which needs a drop (sampler or loader) and no reshuffle to move it
    assert passed == all(allowed for *_rest, allowed in expected), report.message()
    if not passed:
        assert s.epochs > 1
        assert s.drop_last or s.loader_drop_last
        assert "were left out of all" in report.message()
    if s.epochs > 1 and not s.shuffle and s.drop_last and s.size % s.world_size:
        # the same order every epoch: the sampler drops the same last N mod W samples each
        # time (the loader's drop_last may leave out more)
        assert not passed
        assert set(range(s.size - s.size % s.world_size, s.size)) <= set(report.findings[-1].samples)


def _eval_scenario(s: DataScenario) -> DataScenario:
    """The scenario's loader as an evaluation builds it: no ``drop_last`` anywhere."""
    return replace(s, drop_last=False, loader_drop_last=False)


@given(data_scenarios())
def test_correct_evaluations_match_one_device_on_every_scenario(s: DataScenario) -> None:
    model, dataset = s.model(), s.dataset()
    # per-sample losses gathered and trimmed to len(dataset): the padding at the end drops out
    padded = assert_ddp_metric_matches(
        model, dataset, gather_trim_eval, world_size=s.world_size, loader_factory=_eval_scenario(s).loader_factory(),
    )
    # the loss sum and the count all-reduced over ranks that share out the samples unpadded
    unpadded = assert_ddp_metric_matches(model, dataset, sum_count_eval, world_size=s.world_size, loader_factory=unpadded_loader)
    assert padded.ok
    assert unpadded.ok
    assert padded.single == pytest.approx(unpadded.single, rel=1e-12)


@pytest.mark.deep
@settings(max_examples=1000)
@given(data_scenarios(max_size=24, max_batch=6))
def test_the_data_path_verdicts_hold_over_a_wider_search(s: DataScenario) -> None:
    passed, report = _data_report(s, ())
    assert passed == strict_verdict(s), report.message()
    assert sorted((f.kind, f.epoch, f.samples, f.allowed) for f in report.findings) == expected_findings(s, ()), report.message()


# --------------------------------------------------------------------------- once false alarms


def _passes_with_padding_allowed(s: DataScenario) -> None:
    assert not s.drop_last
    assert not s.loader_drop_last
    passed, report = _data_report(s, ("padding",))
    assert passed, report.message()


def test_one_sample_padded_onto_every_rank_is_padding() -> None:
    s = DataScenario(size=1, world_size=2)
    assert rank_orders(s, 0) == [[0], [0]]  # every rank the same order: the padding's
    _passes_with_padding_allowed(s)


def test_a_reshuffle_that_repeats_a_ranks_order_by_chance_is_no_missing_set_epoch() -> None:
    # seeds 2 and 3 both permute two samples as [0, 1]: rank 0 sees sample 0 in both epochs,
    # although set_epoch was called (the sampler's epoch is 0, then 1)
    s = DataScenario(size=2, world_size=2, shuffle=True, seed=2, epochs=2)
    assert rank_orders(s, 0) == rank_orders(s, 1)
    _passes_with_padding_allowed(s)


@pytest.mark.deep
def test_fewer_samples_than_half_the_ranks_are_padding() -> None:
    s = DataScenario(size=2, world_size=5)
    assert max(Counter(i for part in rank_orders(s, 0) for i in part).values()) == 3
    _passes_with_padding_allowed(s)
