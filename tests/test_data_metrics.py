"""``assert_ddp_metric_matches`` and ``assert_dp_metric_matches`` on evaluation loops as
users write them: a sum over DistributedSampler's padding, a DataLoader that drops its last
batch, a sync mean floored in an integer dtype, a mean of per-rank means, ranks that never
synchronise, each caught with its cause (and the sample ids where samples are concerned);
a sum-and-count all_reduce over a sampler that does not pad and a gather-for-metrics-style
de-duplication passing; metrics returned as numbers, dicts and tensors; a DataParallel
forward that returns a reduced value.

The evaluation loops and loader factories are top-level functions of this module (the check
pickles them to the shared pool's ranks). The assertions compare structure, named causes and
sample ids; values are compared only through the check's own tolerance, never as float bits.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_data_path import StridedSampler
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from dpverify.core.errors import InvalidArgument, ParallelMismatch
from dpverify.data.metrics import MetricReport, assert_ddp_metric_matches, assert_dp_metric_matches


def classified(n: int = 10, seed: int = 0) -> TensorDataset:
    """``n`` samples of 4 features and a class among 3."""
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=generator), torch.randint(0, 3, (n,), generator=generator))


def classifier(seed: int = 0) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Linear(4, 3)


def one_hot_votes(labels: list[int], votes: list[int]) -> tuple[nn.Module, TensorDataset]:
    """A classifier that predicts ``votes[i]`` for sample i exactly (identity weights on
    one-hot inputs, no rounding involved) and the labels to score it against."""
    model = nn.Linear(3, 3, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.eye(3))
    return model, TensorDataset(F.one_hot(torch.tensor(votes), 3).float(), torch.tensor(labels))


def parts(n: int, world_size: int, **settings: Any) -> list[list[int]]:
    """Each rank's indices from torch's DistributedSampler, built here."""
    return [list(DistributedSampler(range(n), num_replicas=world_size, rank=r, **settings)) for r in range(world_size)]  # type: ignore[arg-type]


def caught(*args: Any, **options: Any) -> tuple[str, MetricReport]:
    with pytest.raises(ParallelMismatch) as failure:
        assert_ddp_metric_matches(*args, **options)
    report = failure.value.report
    assert isinstance(report, MetricReport)
    assert not report.ok
    return str(failure.value), report


# --------------------------------------------------------------------------- the user's loaders


def strided(dataset: Any, rank: int, world_size: int, epoch: int) -> DataLoader[Any]:
    return DataLoader(dataset, batch_size=2, sampler=StridedSampler(dataset, rank, world_size))


def strided_with_workers(dataset: Any, rank: int, world_size: int, epoch: int) -> DataLoader[Any]:
    return DataLoader(dataset, batch_size=2, sampler=StridedSampler(dataset, rank, world_size), num_workers=2)


def padded(dataset: Any, rank: int, world_size: int, epoch: int) -> DataLoader[Any]:
    """The usual evaluation loader: DistributedSampler(shuffle=False), which pads."""
    return DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, shuffle=False))


def full_batches_only(dataset: Any, rank: int, world_size: int, epoch: int) -> DataLoader[Any]:
    return DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, shuffle=False), drop_last=True)


# --------------------------------------------------------------------------- the user's evaluation loops


def _sums(model: nn.Module, loader: Any) -> torch.Tensor:
    """This rank's [loss sum, correct, count] in float64."""
    model.eval()
    total = torch.zeros(3, dtype=torch.float64)
    with torch.no_grad():
        for x, y in loader:
            logits = model(x)
            total[0] += F.cross_entropy(logits, y, reduction="sum").double()
            total[1] += (logits.argmax(1) == y).sum()
            total[2] += len(y)
    return total


def summed_loss(model: nn.Module, loader: Any) -> float:
    """Sum and count over the ranks, then divide: right when every sample is evaluated once."""
    total = _sums(model, loader)
    dist.all_reduce(total)
    return float(total[0] / total[2])


def summed_loss_and_accuracy(model: nn.Module, loader: Any) -> dict[str, float]:
    total = _sums(model, loader)
    dist.all_reduce(total)
    return {"loss": float(total[0] / total[2]), "accuracy": float(total[1] / total[2])}


def summed_as_tensor(model: nn.Module, loader: Any) -> torch.Tensor:
    total = _sums(model, loader)
    dist.all_reduce(total)
    return total[:2] / total[2]


def local_loss(model: nn.Module, loader: Any) -> float:
    """Each rank's own loss, never synchronised."""
    total = _sums(model, loader)
    return float(total[0] / total[2])


def mean_of_rank_means(model: nn.Module, loader: Any) -> float:
    """Each rank's mean loss, averaged over the ranks with equal weight."""
    total = _sums(model, loader)
    mean = (total[0] / total[2]).reshape(1)
    dist.all_reduce(mean)
    return float(mean / dist.get_world_size())


def integer_sync_mean(model: nn.Module, loader: Any) -> float:
    """Accuracy with an int64 'correct' state synchronised as a mean (a sum over the ranks
    floored by ``// world_size``), divided by this rank's count."""
    correct = torch.zeros((), dtype=torch.int64)
    seen = 0
    with torch.no_grad():
        for x, y in loader:
            correct += (model(x).argmax(1) == y).sum()
            seen += len(y)
    dist.all_reduce(correct)
    correct = correct // dist.get_world_size()
    return float(correct / seen)


def gathered_loss(model: nn.Module, loader: Any) -> float:
    """Gather-for-metrics: per-sample losses gathered from every rank, interleaved back into
    the sampler's order, trimmed to len(dataset) (the padding dropped), then averaged."""
    model.eval()
    with torch.no_grad():
        mine = torch.cat([F.cross_entropy(model(x), y, reduction="none") for x, y in loader])
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    ordered = torch.stack(gathered, dim=1).reshape(-1)[: len(loader.dataset)]
    return float(ordered.double().mean())


def never_reads(model: nn.Module, loader: Any) -> float:
    return 0.5


# --------------------------------------------------------------------------- counted twice, never evaluated


def test_a_sum_over_the_padded_sampler_counts_the_repeated_samples_twice() -> None:
    n, world_size = 10, 4
    message, report = caught(classifier(), classified(n), summed_loss, world_size=world_size, loader_factory=padded)
    counts = Counter(i for ids in parts(n, world_size, shuffle=False) for i in ids)
    twice = sorted(i for i, c in counts.items() if c > 1)
    assert twice == [0, 1]
    assert "samples [0, 1] were counted twice (DistributedSampler pads the dataset to a multiple of the world size" in message
    assert "de-duplicate the padding" in message
    assert "the ranks evaluated [3, 3, 3, 3] samples" in report.scenario
    assert len(report.parallel) == world_size


def test_the_default_loader_pads_too() -> None:
    message, _report = caught(classifier(), classified(10), summed_loss, world_size=4)
    assert "samples [0, 1] were counted twice" in message


def test_drop_last_in_the_evaluation_dataloader_names_the_samples_never_evaluated() -> None:
    n, world_size = 10, 4
    message, report = caught(classifier(), classified(n), summed_loss, world_size=world_size, loader_factory=full_batches_only)
    kept = {i for ids in parts(n, world_size, shuffle=False) for i in ids[:2]}
    never = sorted(set(range(n)) - kept)
    assert never == [8, 9]
    assert "samples [8, 9] were never evaluated (drop_last=True in the DataLoader)" in message
    assert "the ranks evaluated [2, 2, 2, 2] samples" in report.scenario


def test_a_sum_and_count_over_a_sampler_that_does_not_pad_passes() -> None:
    report = assert_ddp_metric_matches(classifier(), classified(10), summed_loss, world_size=4, loader_factory=strided)
    assert report.ok
    assert report.failures == ()
    assert "the ranks evaluated [3, 3, 2, 2] samples" in report.scenario
    assert str(report).startswith("The metric every rank reports must be the single-device metric over the whole dataset: it does")


def test_a_pass_runs_one_device_once_and_only_a_failure_runs_the_counterfactuals(monkeypatch: pytest.MonkeyPatch) -> None:
    import dpverify.data.metrics as metrics

    runs: list[Any] = []
    real = metrics._single_device

    def counted(*args: Any, **kwargs: Any) -> Any:
        runs.append(args[4] if len(args) > 4 else kwargs.get("ids"))
        return real(*args, **kwargs)

    monkeypatch.setattr(metrics, "_single_device", counted)
    assert_ddp_metric_matches(classifier(), classified(10), summed_loss, world_size=4, loader_factory=strided)
    assert runs == [None]  # the whole dataset, once
    runs.clear()
    caught(classifier(), classified(10), mean_of_rank_means, world_size=4, loader_factory=strided)
    assert runs[0] is None
    assert sorted(map(list, runs[1:])) == [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]]  # each rank's samples


def test_gathering_per_sample_results_and_trimming_the_padding_passes() -> None:
    report = assert_ddp_metric_matches(classifier(), classified(10), gathered_loss, world_size=4, loader_factory=padded)
    assert report.ok
    assert "the ranks evaluated [3, 3, 3, 3] samples" in report.scenario  # padded, and de-duplicated by eval_fn


def test_a_loader_with_workers_is_evaluated_in_the_rank_process() -> None:
    report = assert_ddp_metric_matches(classifier(), classified(10), summed_loss, world_size=2, loader_factory=strided_with_workers)
    assert "the ranks evaluated [5, 5] samples" in report.scenario


# --------------------------------------------------------------------------- the reduction


def test_an_integer_sync_mean_floors_and_is_named() -> None:
    # 12 samples on 4 ranks, no padding; 5 right in all: 5 // 4 = 1 on every rank, where one
    # device keeps 5
    labels = [0, 1, 2] * 4
    votes = [0, 1, 2, 0, 0, 0, 1, 1, 1, 2, 2, 0]
    assert sum(v == y for v, y in zip(votes, labels, strict=True)) == 5
    model, dataset = one_hot_votes(labels, votes)
    message, report = caught(model, dataset, integer_sync_mean, world_size=4)
    assert report.single == {"metric": pytest.approx(5 / 12)}
    assert all(values == {"metric": pytest.approx(1 / 3)} for values in report.parallel)
    assert "Integer flooring:" in message
    assert "The ranks synchronised integer tensors (torch.int64)." in message
    assert "Accumulate and synchronise in floating point" in message
    assert "counted twice" not in message
    assert "per-rank means" not in message


def test_an_integer_sync_mean_whose_floor_changes_nothing_passes() -> None:
    # 8 right: 8 // 4 = 2 exactly; the floor is a bug waiting for other data
    labels = [0, 1, 2] * 4
    votes = [0, 1, 2, 0, 1, 2, 0, 1, 0, 2, 0, 0]
    assert sum(v == y for v, y in zip(votes, labels, strict=True)) == 8
    model, dataset = one_hot_votes(labels, votes)
    assert assert_ddp_metric_matches(model, dataset, integer_sync_mean, world_size=4).ok


def test_a_mean_of_per_rank_means_over_an_uneven_split_is_named() -> None:
    message, report = caught(classifier(), classified(10), mean_of_rank_means, world_size=4, loader_factory=strided)
    assert "A mean of per-rank means: the ranks evaluated [3, 3, 2, 2] samples" in message
    assert "all_reduce the sum and the count, then divide" in message
    assert "The ranks disagree" not in message  # synchronised, but wrongly weighted
    assert len(report.parallel) == 4


def test_ranks_that_never_synchronise_disagree() -> None:
    message, report = caught(classifier(), classified(10), local_loss, world_size=2, loader_factory=strided)
    assert "The ranks disagree: each returns a different value" in message
    assert "Each rank returned the metric of its own samples alone" in message
    assert "the value was never synchronised" in message
    assert report.parallel[0] != report.parallel[1]


# --------------------------------------------------------------------------- what a metric may be


def test_a_metric_returned_as_a_dict_is_compared_entry_by_entry() -> None:
    report = assert_ddp_metric_matches(classifier(), classified(10), summed_loss_and_accuracy, world_size=2, loader_factory=strided)
    assert set(report.single) == {"loss", "accuracy"}
    assert all(set(values) == {"loss", "accuracy"} for values in report.parallel)
    message, failed = caught(classifier(), classified(10), summed_loss_and_accuracy, world_size=4, loader_factory=padded)
    assert set(failed.single) == {"loss", "accuracy"}
    assert "  loss: one device" in message
    assert "samples [0, 1] were counted twice" in message


def test_a_metric_returned_as_a_tensor_is_compared_element_by_element() -> None:
    report = assert_ddp_metric_matches(classifier(), classified(10), summed_as_tensor, world_size=2, loader_factory=strided)
    assert set(report.single) == {"metric[0]", "metric[1]"}
    message, _failed = caught(classifier(), classified(10), summed_as_tensor, world_size=4, loader_factory=padded)
    assert "  metric[0]: one device" in message
    assert "samples [0, 1] were counted twice" in message


def test_an_eval_fn_that_never_reads_the_loader_is_refused_not_passed() -> None:
    with pytest.raises(InvalidArgument, match="eval_fn read no sample from the loader it was given on any rank"):
        assert_ddp_metric_matches(classifier(), classified(10), never_reads, world_size=2)


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        ({"model": "linear"}, "model='linear' is str; pass a torch.Module"),
        ({"eval_fn": lambda model, loader: 0.0}, "cannot be pickled to send it to the DDP ranks"),
        ({"eval_fn": 3}, "eval_fn=3 is not callable"),
        ({"loader_factory": "padded"}, "loader_factory='padded' is not callable"),
        ({"rtol": -1.0}, "rtol=-1.0 must be a non-negative number"),
        ({"world_size": 0}, "world_size=0 must be an int >= 1"),
    ],
)
def test_arguments_that_cannot_be_used_are_refused(arguments: dict[str, Any], says: str) -> None:
    given: dict[str, Any] = {"model": classifier(), "dataset": classified(10), "eval_fn": summed_loss, "world_size": 2, **arguments}
    with pytest.raises(InvalidArgument) as refused:
        assert_ddp_metric_matches(given.pop("model"), given.pop("dataset"), given.pop("eval_fn"), **given)
    assert str(refused.value).startswith(f"{next(iter(arguments))}=")  # names the argument
    assert says in str(refused.value)


# --------------------------------------------------------------------------- DataParallel


class MeanLoss(nn.Module):
    """A model whose forward returns its batch's mean loss (a 0-dim tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = classifier()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(x), y)


class PerSampleLoss(MeanLoss):
    """The fix: one loss per sample; the loop reduces after DataParallel's gather."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(x), y, reduction="none")


def weighted_mean_loss(model: nn.Module, loader: Any) -> float:
    """Each batch's mean of what the model returns, weighted by the batch's size."""
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in loader:
            total += float(model(x, y).mean()) * len(y)
            count += len(y)
    return total / count


@pytest.mark.parametrize("parallel", [None, nn.DataParallel], ids=["dpverify", "torch"])
def test_a_forward_returning_a_mean_is_averaged_over_uneven_chunks_and_named(parallel: Any) -> None:
    # batches of 8 on 3 devices: chunks of 3, 3 and 2, averaged alike
    with pytest.raises(ParallelMismatch) as failure:
        assert_dp_metric_matches(MeanLoss(), classified(10), weighted_mean_loss, device_ids=[0, 1, 2], parallel=parallel)
    message = str(failure.value)
    assert "The model's forward returns a reduced value (a 0-dim tensor" in message
    assert "a vector of 3 where one device returns a scalar" in message
    assert "Return per-sample values (reduction='none')" in message


@pytest.mark.parametrize("parallel", [None, nn.DataParallel], ids=["dpverify", "torch"])
def test_a_forward_returning_per_sample_values_passes(parallel: Any) -> None:
    report = assert_dp_metric_matches(PerSampleLoss(), classified(10), weighted_mean_loss, device_ids=[0, 1, 2], parallel=parallel)
    assert report.ok
    assert "DataParallel on devices [0, 1, 2]" in report.scenario


def test_a_rank_without_samples_whose_mean_is_nan_is_named() -> None:
    # 3 samples on 4 ranks without padding: rank 3 has none, its mean is 0/0, and the
    # mean of per-rank means is NaN on every rank
    from dpverify.mutants import mean_of_rank_means_eval, unpadded_loader

    with pytest.raises(ParallelMismatch) as caught:
        assert_ddp_metric_matches(classifier(), classified(3), mean_of_rank_means_eval, world_size=4, loader_factory=unpadded_loader)
    assert "Rank [3] evaluated no sample" in str(caught.value)
    assert "neither samples counted twice" not in str(caught.value)


def test_a_dataparallel_evaluation_of_one_row_batches_is_refused_and_a_one_row_last_batch_is_no_failure() -> None:
    # one-row batches run one replica in torch's DataParallel too: no evidence of anything
    # parallel (refused), but a last batch of one row after split batches is correct
    from dpverify.data.loaders import batch_loader

    with pytest.raises(InvalidArgument, match="every batch the loader gave had one row"):
        assert_dp_metric_matches(classifier(), classified(5), _sample_mean_loss, device_ids=[0, 1, 2], loader_factory=functools.partial(batch_loader, batch_size=1))
    report = assert_dp_metric_matches(classifier(), classified(5), _sample_mean_loss, device_ids=[0, 1, 2], loader_factory=functools.partial(batch_loader, batch_size=2))
    assert report.replicas == 2


def _sample_mean_loss(model: nn.Module, loader: Any) -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in loader:
            total += float(F.cross_entropy(model(x), y, reduction="sum"))
            count += len(y)
    return total / count


def two_pass_eval(model: nn.Module, loader: Any) -> dict[str, float]:
    """An evaluation that goes over its loader twice: the mean loss, then per-class counts."""
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for x, y in loader:
            total[0] += F.cross_entropy(model(x), y, reduction="sum").double()
            total[1] += len(y)
    counts = torch.zeros(3, dtype=torch.float64)
    for _x, y in loader:
        counts += torch.bincount(y, minlength=3).double()
    dist.all_reduce(total)
    dist.all_reduce(counts)
    return {"loss": float(total[0] / total[1]), "class_0": float(counts[0])}


def test_an_evaluation_that_goes_over_its_loader_twice_is_checked_once_per_pass() -> None:
    report = assert_ddp_metric_matches(classifier(), classified(8), two_pass_eval, world_size=2, loader_factory=strided)
    assert report.ok
    assert report.replicas == 2
