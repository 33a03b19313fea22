"""``assert_ddp_data_matches``: the samples the ranks see, epoch by epoch, against one device.

One device's epoch visits every sample of the dataset once. The ranks' loaders (the user's
``loader_factory``, run on every rank of the pool or of torchrun's group) must together do
the same: no sample twice (``DistributedSampler``'s padding), none missing (``drop_last``,
a wrong ``num_replicas`` or ``rank``), no two ranks sharing samples, a new order each epoch
when shuffling (``set_epoch``), and not the same order on every rank. Each finding names the
sample ids, the cause read from the loader's own settings (``LoaderFacts``) and the fix.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from dpverify.core.comparison import Msg, render
from dpverify.core.errors import InvalidArgument, ParallelMismatch
from dpverify.core.text import and_list, plural
from dpverify.core.validation import require_callable, require_int_at_least
from dpverify.data.samples import (
    LoaderFactory,
    LoaderFacts,
    ids_text,
    raise_refused,
    require_dataset,
    run_loader,
)
from dpverify.ddp.runner import RankRunner, require_picklable
from dpverify.ranked.check import callable_name, runner
from dpverify.ranked.rank import RankInfo

__all__ = ["ALLOWED", "DataFinding", "DataReport", "EpochSamples", "assert_ddp_data_matches", "data_report"]

#: What ``allow`` may accept as a cost rather than a failure: ``"padding"`` (samples seen
#: twice in an epoch, so weighted double in training) and ``"dropped"`` (samples left out of
#: an epoch; a sample left out of every epoch of several still fails).
ALLOWED = ("padding", "dropped")



@dataclass(frozen=True)
class EpochSamples:
    """What the ranks saw in one epoch.

    Attributes:
        epoch: the epoch (passed to ``loader_factory``).
        per_rank: the sample ids each rank's loader delivered, in order.
        facts: how each rank's loader was built.
    """

    epoch: int
    per_rank: tuple[tuple[int, ...], ...]
    facts: tuple[LoaderFacts, ...]

    @property
    def sizes(self) -> list[int]:
        return [len(ids) for ids in self.per_rank]


@dataclass(frozen=True)
class DataFinding:
    """One way an epoch differs from one device's.

    Attributes:
        kind: ``"outside"`` (an index outside the dataset), ``"same-order"`` (every rank sees
            the same samples in the same order), ``"padding"``, ``"overlap"`` (ranks share
            samples), ``"dropped"`` (samples never seen) or ``"repeated-order"`` (an epoch
            repeats the previous one's order while shuffling).
        epoch: the epoch it was found in.
        samples: the sample ids concerned.
        what: what happened, with the sample ids.
        why: its cause, read from the loaders' settings, and the fix.
        allowed: accepted through ``allow`` (reported as a cost, not a failure).
    """

    kind: str
    epoch: int
    samples: tuple[int, ...]
    what: str
    why: str = ""
    allowed: bool = False

    @property
    def text(self) -> str:
        return f"{self.what} {self.why}".strip()


@dataclass(frozen=True)
class DataReport:
    """The comparison of the ranks' epochs with one device's.

    Attributes:
        dataset_size: samples in the dataset (one device's epoch).
        world_size: ranks.
        backend: the process group's backend.
        loader: the loader factory's name.
        epochs: what the ranks saw, per epoch.
        findings: every difference, allowed ones included.
    """

    dataset_size: int
    world_size: int
    backend: str
    loader: str
    epochs: tuple[EpochSamples, ...]
    findings: tuple[DataFinding, ...]

    @property
    def ok(self) -> bool:
        return all(f.allowed for f in self.findings)

    @property
    def replicas(self) -> int:
        """The ranks whose loader delivered a sample: the evidence that the ranks ran."""
        return sum(1 for r in range(self.world_size) if any(epoch.per_rank[r] for epoch in self.epochs))

    @property
    def summary(self) -> str:
        """One line for a table: the first failing finding, or what passed."""
        failing = [f for f in self.findings if not f.allowed]
        if failing:
            return f"epoch {failing[0].epoch}: {failing[0].what}"
        costs = sorted({f.kind for f in self.findings})
        return "every sample once per epoch" + (f" ({', '.join(costs)} allowed)" if costs else "")

    def scenario(self) -> str:
        facts = self.epochs[0].facts[0].describe() if self.epochs and self.epochs[0].facts else "?"
        return (
            f"dataset of {plural(self.dataset_size, 'sample')} on {self.world_size} ranks ({self.backend}), "
            f"{plural(len(self.epochs), 'epoch')}; loader_factory {self.loader}, rank 0: {facts}"
        )

    def message(self) -> str:
        failing = [f for f in self.findings if not f.allowed]
        head = (
            "The samples the ranks saw differ from a single-device epoch: together, the ranks must see every "
            "sample of the dataset once per epoch."
            if failing else
            "The ranks together saw every sample once per epoch, as one device does" + (", at the costs allowed below." if self.findings else ".")
        )
        lines = [head, f"Scenario: {self.scenario()}."]
        told: dict[str, int] = {}  # each cause is explained once, at the first epoch it shows in
        for epoch in self.epochs:
            found = [f for f in self.findings if f.epoch == epoch.epoch]
            if not found and failing:
                continue
            lines.append(
                f"Epoch {epoch.epoch}: the ranks saw {epoch.sizes} samples ({sum(epoch.sizes)}); one device sees "
                f"{self.dataset_size}."
            )
            for finding in found:
                label = "allowed: " if finding.allowed else ""
                first = told.setdefault(finding.why, epoch.epoch)
                why = finding.why if first == epoch.epoch else f"(The cause, as in epoch {first}.)"
                lines.append(f"  - {label}{finding.what} {why}".rstrip())
        return "\n".join(lines)

    def __str__(self) -> str:
        if self.ok and not self.findings:
            return self.message().splitlines()[0]
        return self.message()  # with the failures, or the costs allowed


# --------------------------------------------------------------------------- ranks


@dataclass(frozen=True)
class DataTask:
    dataset: Any
    loader_factory: LoaderFactory
    epochs: int


@dataclass(frozen=True)
class RankSamples:
    ids: tuple[tuple[int, ...], ...]
    facts: tuple[LoaderFacts, ...]
    refused: str = ""  # why the rank's loader could not be read (an InvalidArgument's message)


def run_data_task(info: RankInfo, task: DataTask) -> RankSamples:
    """Every epoch of the rank's loader: the ids it delivered and how it was built. A loader
    that cannot be read comes back as ``refused`` (raised as InvalidArgument by the caller),
    not as a failed task, which would restart the pool's ranks."""
    ids: list[tuple[int, ...]] = []
    facts: list[LoaderFacts] = []
    try:
        for epoch in range(task.epochs):
            seen, built, _loader = run_loader(task.loader_factory, task.dataset, info.rank, info.world_size, epoch)
            ids.append(tuple(seen))
            facts.append(built)
    except InvalidArgument as error:
        return RankSamples((), (), str(error))
    return RankSamples(tuple(ids), tuple(facts))


# --------------------------------------------------------------------------- public


def assert_ddp_data_matches(
    dataset: Any,
    loader_factory: LoaderFactory,
    *,
    world_size: int,
    epochs: int = 2,
    allow: Collection[str] = (),
    pool: RankRunner | None = None,
    msg: Msg = None,
) -> DataReport:
    """Asserts that, every epoch, the ranks' loaders together see each sample of ``dataset``
    once, as one device's epoch does.

    ``loader_factory(dataset, rank, world_size, epoch)`` is your own construction code for
    a rank's loader (a ``DataLoader`` with a ``DistributedSampler``, a custom sampler, a
    ``set_epoch`` call or its absence); it runs on every rank of the pool (or, under
    torchrun, of the initialised group), so samplers that read the rank and world size from
    the default process group see the real ones. It gets a view of ``dataset`` that notes
    which samples are fetched (same length, items and attributes); build the loader on it.
    A factory may also return a sampler or batch sampler (its indices are the samples).

    Reported, per epoch, with the sample ids, the cause and the fix: samples seen twice
    (padding), samples never seen (``drop_last``, a wrong ``num_replicas`` or ``rank``),
    ranks whose samples overlap, an epoch that repeats the previous order although the
    sampler shuffles (no ``set_epoch``), the same order on every rank.

    Args:
        dataset: a map-style dataset (``__len__`` and ``__getitem__``), picklable.
        loader_factory: ``loader_factory(dataset, rank, world_size, epoch)``, a top-level
            function (or a ``functools.partial`` of one).
        world_size: the number of ranks.
        epochs: epochs to run (2 or more to see whether epochs reshuffle).
        allow: costs to accept rather than fail on, from ``ALLOWED``: ``"padding"`` (legit in
            training: the report says which samples carry double weight in which epoch) and
            ``"dropped"`` (samples left out of an epoch; one left out of every epoch still
            fails).
        pool: the ranks (default: the shared pool of ``world_size``, or torchrun's group).
        msg: replaces the failure message, or a callable that rewrites it.

    Returns:
        The report (``str()`` summarises it).

    Raises:
        ParallelMismatch: an epoch differs from one device's.
        InvalidArgument: an argument cannot be used; the message says which and why.
    """
    __tracebackhide__ = True
    require_dataset(dataset)
    require_callable(loader_factory, "loader_factory", "loader_factory(dataset, rank, world_size, epoch)")
    world = require_int_at_least(world_size, "world_size", 1)
    count = require_int_at_least(epochs, "epochs", 1)
    allowed = _allowed(allow)
    require_picklable(dataset, "dataset")
    require_picklable(loader_factory, "loader_factory")
    ranks = runner(pool, world)
    results: tuple[RankSamples, ...] = ranks.run(run_data_task, DataTask(dataset, loader_factory, count))
    raise_refused([result.refused for result in results])
    report = data_report(len(dataset), results, backend=ranks.backend, loader=callable_name(loader_factory), allow=allowed)
    if not report.ok:
        raise ParallelMismatch(render(report.message(), msg), report)
    return report


def _allowed(allow: Collection[str]) -> frozenset[str]:
    if isinstance(allow, str):
        raise InvalidArgument(f"allow={allow!r} is a string; pass a collection of names, e.g. allow=({allow!r},)")
    unknown = sorted(set(allow) - set(ALLOWED))
    if unknown:
        raise InvalidArgument(f"allow has {unknown}; pass names among {list(ALLOWED)}")
    return frozenset(allow)


def data_report(
    dataset_size: int, ranks: Sequence[RankSamples], *, backend: str, loader: str, allow: Collection[str] = (),
) -> DataReport:
    """The comparison of what ``ranks`` saw (one ``RankSamples`` per rank) with one device's
    epochs over ``dataset_size`` samples."""
    epochs = tuple(
        EpochSamples(e, tuple(r.ids[e] for r in ranks), tuple(r.facts[e] for r in ranks)) for e in range(len(ranks[0].ids))
    )
    findings: list[DataFinding] = []
    for epoch in epochs:
        findings += _epoch_findings(epoch, dataset_size, allow)
    for previous, epoch in itertools.pairwise(epochs):
        findings += _repeats(previous, epoch)
    findings += _never_in_any(epochs, findings)
    return DataReport(dataset_size, len(ranks), backend, loader, epochs, tuple(findings))


# --------------------------------------------------------------------------- findings


def _epoch_findings(epoch: EpochSamples, n: int, allow: Collection[str]) -> list[DataFinding]:
    ranks = epoch.per_rank
    world = len(ranks)
    e = epoch.epoch
    found: list[DataFinding] = []
    outside = sorted({i for ids in ranks for i in ids if not 0 <= i < n})
    if outside:
        found.append(DataFinding(
            "outside", e, tuple(outside), f"Indices outside the dataset of {n} samples were fetched: {ids_text(outside)}.",
            f"A sampler must yield indices 0..{n - 1} (len(dataset) of the dataset the factory is given).",
        ))
    counts = Counter(i for ids in ranks for i in ids)
    never = sorted(set(range(n)) - set(counts))
    padding = _is_padding(epoch, n, counts)  # one sample on every rank is padding too, not one order
    if world > 1 and ranks[0] and all(ids == ranks[0] for ids in ranks) and not padding:
        found.append(DataFinding("same-order", e, tuple(sorted(set(ranks[0]))), *_same_order(epoch, n, never)))
        return found
    twice = sorted(i for i, c in counts.items() if c > 1)
    if twice:
        if padding:
            found.append(DataFinding("padding", e, tuple(twice), *_padding(epoch, n, twice), allowed="padding" in allow))
        else:
            found.append(DataFinding("overlap", e, tuple(twice), *_overlap(epoch, twice)))
    if never:
        found.append(DataFinding("dropped", e, tuple(never), *_dropped(epoch, n, never), allowed="dropped" in allow))
    return found


def _same_order(epoch: EpochSamples, n: int, never: Sequence[int]) -> tuple[str, str]:
    facts = epoch.facts
    world = len(epoch.per_rank)
    size = len(epoch.per_rank[0])
    text = f"Every rank saw the same {plural(size, 'sample')} in the same order"
    text += f" (the whole dataset, {world} times over)." if not never else f", and {len(never)} samples none saw: {ids_text(never)}."
    if all(f.distributed for f in facts):
        ranks_given = sorted({f.rank for f in facts if f.rank is not None})
        replicas = sorted({f.num_replicas for f in facts if f.num_replicas is not None})
        if len(ranks_given) == 1:
            return text, (
                f"Every rank's DistributedSampler has rank={ranks_given[0]}: a fixed value (a seed, a local rank of "
                "another node) where each rank's own rank should be; pass rank=dist.get_rank() (the default)."
            )
        if replicas == [1]:
            return text, "Every rank's DistributedSampler has num_replicas=1: pass num_replicas=dist.get_world_size()."
        return text, "Each rank must take its own part: pass its own rank and the group's world size to the sampler."
    return text, (
        f"The loader ({facts[0].describe()}) does not split the dataset between the ranks: each rank draws the "
        "same order (a shuffle seeded alike everywhere, or none) and keeps all of it. Give each rank its part: "
        f"DistributedSampler(dataset, num_replicas={world}, rank=rank, seed=same_seed_on_every_rank)."
    )


def _is_padding(epoch: EpochSamples, n: int, counts: Counter[int]) -> bool:
    """Whether the repeats are padding: every sample seen, every rank ceil(n / W) samples,
    and no sample more often than repeating the order over and over gives (twice, unless
    the dataset has fewer than half as many samples as ranks)."""
    world = len(epoch.per_rank)
    per_rank = math.ceil(n / world)
    return (
        len(counts) == n and all(len(ids) == per_rank for ids in epoch.per_rank)
        and max(counts.values()) <= math.ceil(per_rank * world / n)
    )


def _padding(epoch: EpochSamples, n: int, twice: Sequence[int]) -> tuple[str, str]:
    world = len(epoch.per_rank)
    per_rank = math.ceil(n / world)
    who = "DistributedSampler (drop_last=False)" if epoch.facts[0].distributed else "The sampler"
    most = max(Counter(i for ids in epoch.per_rank for i in ids).values())
    they = "they carry" if len(twice) > 1 else "it carries"
    what = (
        f"Samples seen twice: {ids_text(twice)}; in training {they} double weight in epoch {epoch.epoch}."
        if most == 2 else
        f"Samples seen more than once: {ids_text(twice)} (up to {most} times); in training {they} up to {most} times the "
        f"weight in epoch {epoch.epoch}."
    )
    return what, (
        f"{who} pads the {n} samples to {per_rank * world} = {world} ranks x {per_rank} by repeating "
        f"{plural(per_rank * world - n, 'sample')} of the epoch's order; an evaluation that sums over the ranks counts "
        "them twice. Fix: in evaluation, keep the padding out of the metric "
        "(trim the gathered per-sample results to len(dataset), or use a sampler that does not pad); in training, "
        "accept the cost (allow=('padding',), on the command line --allow padding) or pass drop_last=True to the sampler."
    )


def _overlap(epoch: EpochSamples, twice: Sequence[int]) -> tuple[str, str]:
    ranks = epoch.per_rank
    sets = [set(ids) for ids in ranks]
    pairs = [
        f"ranks {r} and {s} share {len(sets[r] & sets[s])}"
        for r in range(len(ranks)) for s in range(r + 1, len(ranks)) if sets[r] & sets[s]
    ]
    inner = [r for r, ids in enumerate(ranks) if len(set(ids)) < len(ids)]
    text = f"Samples seen more than once: {ids_text(twice)}."
    if pairs:
        text += f" The ranks' samples overlap: {and_list(pairs[:6])}{' and more' if len(pairs) > 6 else ''}."
    if inner:
        text += f" Rank{'s' if len(inner) > 1 else ''} {and_list([str(r) for r in inner])} saw samples more than once itself (a sampler drawing with replacement?)."
    return text, _split_cause(epoch)


def _split_cause(epoch: EpochSamples) -> str:
    """Why the ranks' parts do not partition the dataset, from the samplers' settings."""
    facts = epoch.facts
    world = len(facts)
    if all(f.distributed for f in facts):
        seeds = [f.seed for f in facts]
        if len(set(seeds)) > 1:
            return (
                f"The ranks' DistributedSampler seeds differ ({seeds}): each rank cuts its part out of a different "
                "permutation. Pass the same seed on every rank (the seed is shared; the rank selects the part)."
            )
        wrong = sorted({f.num_replicas for f in facts if f.num_replicas is not None and f.num_replicas != world})
        if wrong:
            return f"The DistributedSampler has num_replicas={wrong[0]} on a group of {world} ranks: pass num_replicas=dist.get_world_size()."
        ranks = [f.rank for f in facts]
        if len(set(ranks)) < world:
            return f"The ranks' DistributedSampler ranks are {ranks}: pass each rank's own rank (dist.get_rank())."
        epochs = sorted({f.epoch for f in facts if f.epoch is not None})
        if len(epochs) > 1:
            return f"The ranks' samplers are at different epochs {epochs}: call set_epoch(epoch) with the same epoch on every rank."
        return "Each rank must take its own part of one permutation: the same seed and epoch, its own rank."
    return (
        "Each rank must take its own part of one order: the same seed on every rank (the order), each rank's own "
        "rank (the part), e.g. DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=seed)."
    )


def _dropped(epoch: EpochSamples, n: int, never: Sequence[int]) -> tuple[str, str]:
    facts = epoch.facts
    world = len(facts)
    text = f"Samples never seen: {ids_text(never)} ({len(never)} of {n})."
    causes: list[str] = []
    if all(f.distributed for f in facts):
        replicas = sorted({f.num_replicas for f in facts if f.num_replicas is not None})
        if replicas and replicas[0] > world:
            causes.append(
                f"The DistributedSampler has num_replicas={replicas[0]} on a group of {world} ranks: the parts of ranks "
                f"{world}..{replicas[0] - 1}, which do not exist, are never loaded; pass num_replicas=dist.get_world_size()."
            )
        if all(f.sampler_drop_last for f in facts):
            causes.append(
                f"DistributedSampler(drop_last=True) gives each rank {n // world} = floor({n}/{world}) samples and drops the "
                f"last {n % world} of the epoch's order."
            )
        ranks = [f.rank for f in facts]
        if len(set(ranks)) < world:
            causes.append(f"The ranks' DistributedSampler ranks are {ranks}: the parts of the missing ranks are never loaded.")
    lost = [
        (f.sampler_length % f.batch_size) if f.sampler_length is not None and f.batch_size else 0
        for f in facts if f.drop_last
    ]
    if any(lost):
        causes.append(
            f"{facts[0].loader}(drop_last=True) drops each rank's last partial batch: the ranks lose {lost} samples "
            f"(batch_size={facts[0].batch_size})."
        )
    if not causes:
        causes.append("The ranks' parts do not cover the dataset: each rank must take its own part, all parts together the whole.")
    return text, " ".join(causes) + (
        " In evaluation every sample must be seen: drop_last=False, and keep the padding out of the metric; in training "
        "with a reshuffle each epoch the dropped samples change (allow=('dropped',), on the command line --allow dropped, accepts it)."
    )


def _shuffles(epoch: EpochSamples) -> bool:
    """Whether the loaders shuffle: their samplers say so, or a rank's order is not ascending."""
    said = [f.shuffle for f in epoch.facts if f.shuffle is not None]
    if said:
        return any(said)
    return any(list(ids) != sorted(ids) for ids in epoch.per_rank)


#: Below this chance of every repeating rank drawing its previous order again by luck, a
#: repeat is read as no reshuffle where the samplers do not say their epoch.
_CHANCE = 1e-3


def _repeats(previous: EpochSamples, epoch: EpochSamples) -> list[DataFinding]:
    """A rank whose order repeats the previous epoch's while the sampler shuffles. Where
    the samplers say their epoch (a ``DistributedSampler``), a repeat after the epoch
    changed on that rank is a reshuffle that drew the same order by chance (likely with a
    few samples per rank); elsewhere a repeat counts when chance explains it too rarely."""
    same = [r for r, (a, b) in enumerate(zip(previous.per_rank, epoch.per_rank, strict=True)) if a and a == b]
    if all(f.distributed for f in epoch.facts + previous.facts):
        same = [r for r in same if epoch.facts[r].epoch == previous.facts[r].epoch]
    elif math.prod(1 / math.factorial(len(set(epoch.per_rank[r]))) for r in same) > _CHANCE:
        same = []
    if not same or not _shuffles(epoch):
        return []
    who = "every rank" if len(same) == len(epoch.per_rank) else f"rank{'s' if len(same) > 1 else ''} {and_list([str(r) for r in same])}"
    what = (
        f"Epoch {epoch.epoch} repeats epoch {previous.epoch}'s order on {who}, although the sampler shuffles: every "
        "epoch should see a new order."
    )
    epochs = {f.epoch for f in epoch.facts + previous.facts if f.epoch is not None}
    if all(f.distributed for f in epoch.facts) and len(epochs) == 1:
        why = (
            f"The DistributedSampler stayed at epoch {epochs.pop()}: it seeds its shuffle with seed + epoch, so "
            "call sampler.set_epoch(epoch) at the start of every epoch, on every rank, before iterating."
        )
    else:
        why = "Seed the shuffle with the epoch (DistributedSampler.set_epoch(epoch) before each epoch)."
    samples = tuple(sorted({i for r in same for i in epoch.per_rank[r]}))
    return [DataFinding("repeated-order", epoch.epoch, samples, what, why)]


def _never_in_any(epochs: Sequence[EpochSamples], findings: Sequence[DataFinding]) -> list[DataFinding]:
    """An allowed drop that leaves the same samples out of every epoch of several fails:
    those samples are never trained on."""
    dropped = [f for f in findings if f.kind == "dropped"]
    if len(epochs) < 2 or len(dropped) < len(epochs) or not all(f.allowed for f in dropped):
        return []
    always = set.intersection(*(set(f.samples) for f in dropped))
    if not always:
        return []
    last = epochs[-1].epoch
    return [DataFinding(
        "dropped", last, tuple(sorted(always)),
        f"Samples {ids_text(sorted(always))} were left out of all {len(epochs)} epochs: they are never trained on.",
        "Shuffle with a new order each epoch (shuffle=True and set_epoch) so that the dropped samples change, or pass drop_last=False.",
    )]
