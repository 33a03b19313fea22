"""Calibration of the data checks on scenarios dpverify does not generate itself.

An independent random scenario generator, written here without ``dpverify.strategies`` or
``dpverify.mutants``: datasets of 1 to 200 samples (some up to 5000) on 2 to 4 ranks, 1 to 3
epochs, loaders in several user styles (a ``DistributedSampler`` with shuffle, seed and
``set_epoch``, which pads; custom strided and contiguous-block samplers, which do not; a
``BatchSampler`` returned directly or passed as ``batch_sampler``; per-rank ``Subset``
datasets), DataLoader batch sizes 1 to 17, with and without ``num_workers=1``. The
evaluations are written as users write them: a sum and a count all-reduced (float64, or a
float32 sum with an integer count divided as floats), an integer correct-count accuracy, an
``all_gather`` of per-sample losses interleaved and trimmed to the dataset (the padding out),
an ``all_gather_object`` of ``(index, value)`` pairs de-duplicated by index, a dict of loss
and accuracy, per-class prediction counts as a float tensor; over a linear classifier, a
small MLP classifier, or a regression MLP with MSE; inputs at scales 1e-3 .. 1e3. A third
kind runs ``assert_dp_metric_matches`` on 2 to 4 virtual devices with forwards returning
per-sample outputs. Every scenario is correct code, so every check must pass.

For each scenario, through dpverify's public data API only:

- ``assert_ddp_data_matches`` (``allow=("padding",)`` where the loader is a padding
  ``DistributedSampler``), ``assert_ddp_metric_matches`` or ``assert_dp_metric_matches``: a
  ``ParallelMismatch`` is a false alarm, any other exception a crash;
- on every 5th scenario, sensitivity: the same scenario with one bug injected (``padding``
  counted: the gathered ``(index, value)`` pairs averaged without de-duplication, ``drop_last`` on the loader, no ``set_epoch`` while
  shuffling over 2+ epochs, ``rank_seed``: sampler seeds that differ per rank, ``floor``: an
  integer floor-divided accuracy, ``mean_of_means`` over uneven shares, ``no_sync``). Whether
  the injection can show at all is decided independently of the check, from the scenario:
  the loaders are run here, in this process, for every rank (the dataset carries each
  sample's index), and the metric is recomputed here in float64 from per-sample values; an
  injection whose effect is nil (padding when N % W == 0, a floor of 0 or 1, a drop of
  nothing, a repeat too likely by chance to be evidence) is "not applicable".

Every scenario prints as a one-line spec; ``build(spec)`` reconstructs it exactly.

Usage:
    python benchmarks/calibrate_data.py [--n 300] [--seed 0] [--show 20]
    python benchmarks/calibrate_data.py --only INDEX [--seed 0]     # one scenario, full messages
    python benchmarks/calibrate_data.py --spec 'i=3 check=data ...'  # a pasted spec
"""

from __future__ import annotations

import functools
import math
import random
import sys
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from calibration import ClassTally, drive, error_lines
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    Sampler,
    Subset,
    TensorDataset,
)

import dpverify

CHECKS = ("data", "metric", "dp")
STYLES = ("dist", "strided", "block", "batch", "subset")
#: Loader styles that give each sample to exactly one rank (no padding).
PARTITIONS = ("strided", "block", "batch", "subset")
EVALS = ("sum64", "sum32", "acc_int", "gather_trim", "gather_obj", "dict", "perclass")
DP_EVALS = ("local64", "local_dict")
MODELS = ("linear", "mlp", "reg")
DATA_BUGS = ("drop_last", "no_set_epoch", "rank_seed")
METRIC_BUGS = ("padding", "drop_last", "floor", "mean_of_means", "no_sync")
BUGS = ("padding", "drop_last", "no_set_epoch", "rank_seed", "floor", "mean_of_means", "no_sync")
SENSITIVITY_EVERY = 5
#: An injection shows in the metric when it moves it by more than this (relative): twice the
#: metric checks' default rtol (1e-5), clear of the float32 rounding of the per-sample losses.
VISIBLE = 2e-5
#: A repeated order is evidence of no reshuffle only when chance repeats it less often than this.
CHANCE = 1e-3


# --------------------------------------------------------------------------------------
# The scenario spec: a line you can paste, and the generator that draws it.


@dataclass(frozen=True)
class Spec:
    """One scenario. ``str(spec)`` is a line that ``Spec.parse`` reads back exactly."""

    i: int  # index in the run (informative)
    check: str  # CHECKS
    N: int  # samples
    W: int  # ranks (data, metric) or devices (dp)
    E: int  # epochs (data check)
    style: str  # STYLES
    bs: int  # batch size
    nw: int  # DataLoader num_workers
    shuf: int  # 1: the sampler shuffles
    sseed: int  # the sampler's seed
    ev: str  # EVALS or DP_EVALS ("-" for the data check)
    model: str  # MODELS
    F: int  # input features
    C: int  # classes, or regression outputs
    xs: float  # input scale
    bug: str  # BUGS, injected in the sensitivity run; "-" for none
    seed: int  # torch seed for weights and data

    def __str__(self) -> str:
        return " ".join(f"{f.name}={getattr(self, f.name)!r}" if isinstance(getattr(self, f.name), float)
                        else f"{f.name}={getattr(self, f.name)}" for f in fields(self))

    @classmethod
    def parse(cls, text: str) -> Spec:
        values: dict[str, Any] = {}
        types = {f.name: str(f.type) for f in fields(cls)}
        for part in text.split():
            key, _, raw = part.partition("=")
            if key not in types:
                raise ValueError(f"unknown spec field {key!r} in {text!r}")
            values[key] = int(raw) if types[key] == "int" else float(raw) if types[key] == "float" else raw
        missing = set(types) - set(values)
        if missing:
            raise ValueError(f"spec lacks {sorted(missing)}: {text!r}")
        return cls(**values)

    @property
    def classes(self) -> list[str]:
        tags = [f"check:{self.check}", f"style:{self.style}" if self.check != "dp" else "style:dp"]
        if self.check != "data":
            tags += [f"eval:{self.ev}", f"model:{self.model}"]
        tags.append("N<W" if self.N < self.W else "N%W=0" if self.N % self.W == 0 else "N%W>0")
        if self.N > 200:
            tags.append("N>200")
        if self.nw:
            tags.append("num_workers=1")
        if self.shuf:
            tags.append("shuffle")
        return tags


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return float(f"{10 ** rng.uniform(lo, hi):.4g}")


def generate(index: int, seed: int) -> Spec:
    """The scenario at ``index`` of the run with ``seed``: deterministic, independent of order."""
    rng = random.Random(f"calibrate-data:{seed}:{index}")
    sens = index % SENSITIVITY_EVERY == 0
    n = rng.randint(1, 200) if rng.random() < 0.9 else rng.randint(201, 5000)
    w = rng.randint(2, 4)
    bug = "-"
    if sens:
        check = rng.choice(("data", "metric"))
        bug = rng.choice(DATA_BUGS if check == "data" else METRIC_BUGS)
    else:
        check = rng.choices(CHECKS, weights=(40, 45, 15))[0]
    style = rng.choice(STYLES)
    shuf = int(rng.random() < 0.5)
    ev, model = "-", rng.choice(MODELS)
    if check == "metric":
        ev = rng.choice(EVALS)
    elif check == "dp":
        ev, style, w = rng.choice(DP_EVALS), "-", rng.randint(2, 4)
    # the bug's scenario, as correct code (the injection changes only the bug's line)
    if bug == "padding":
        style, ev = "dist", "gather_obj"
    elif bug == "drop_last" and check == "metric":
        ev = "gather_obj"  # correct with padding and without
    elif bug == "floor":
        ev = "acc_int"
    elif bug in ("mean_of_means", "no_sync"):
        ev = "sum64"
        if bug == "mean_of_means" and n % w == 0 and rng.random() < 0.75:
            n += 1  # mostly uneven shares, where the bug can show
    elif bug == "no_set_epoch":
        shuf = 1
    elif bug == "rank_seed":
        shuf, style = 1, rng.choice(("dist", "strided", "block", "subset"))
    # evaluations that need a partition of the samples, or a non-shuffled DistributedSampler
    if ev in ("sum64", "sum32", "acc_int", "dict", "perclass") and style == "dist" and bug != "padding" and n % w:
        style = rng.choice(PARTITIONS)
    if ev == "gather_trim":
        style, shuf = "dist", 0
    if ev in ("acc_int", "dict", "perclass") and model == "reg":
        model = rng.choice(("linear", "mlp"))
    return Spec(
        i=index, check=check, N=n, W=w, E=rng.randint(2, 3) if bug == "no_set_epoch" else rng.randint(1, 3),
        style=style, bs=rng.randint(1, 17), nw=int(rng.random() < 0.2), shuf=shuf, sseed=rng.randrange(1000),
        ev=ev, model=model, F=rng.randint(1, 6), C=rng.randint(2, 5), xs=_log_uniform(rng, -3, 3), bug=bug,
        seed=rng.randrange(2**31),
    )


# --------------------------------------------------------------------------------------
# Loaders: module-level, sent to the ranks as partials.


def _order(n: int, shuffle: bool, seed: int) -> list[int]:
    if not shuffle:
        return list(range(n))
    generator = torch.Generator()
    generator.manual_seed(seed)
    return torch.randperm(n, generator=generator).tolist()


def _block(order: Sequence[int], rank: int, world: int) -> list[int]:
    base, extra = divmod(len(order), world)
    start = rank * base + min(rank, extra)
    return list(order[start:start + base + (rank < extra)])


class StridedSampler(Sampler[int]):
    """Every ``world``-th index of one order, from ``rank``: no padding, uneven shares."""

    def __init__(self, n: int, rank: int, world: int, shuffle: bool, seed: int) -> None:
        self.ids = _order(n, shuffle, seed)[rank::world]

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids)

    def __len__(self) -> int:
        return len(self.ids)


class BlockSampler(Sampler[int]):
    """A contiguous block of one order per rank, sizes differing by one at most."""

    def __init__(self, n: int, rank: int, world: int, shuffle: bool, seed: int) -> None:
        self.ids = _block(_order(n, shuffle, seed), rank, world)

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids)

    def __len__(self) -> int:
        return len(self.ids)


def make_loader(dataset: Any, rank: int, world_size: int, epoch: int, *, style: str, bs: int, nw: int, shuf: int,
                sseed: int, bug: str, raw: bool) -> Any:
    """One rank's loader as the user wrote it; ``bug`` changes one line; ``raw``: a batch
    sampler is returned itself (the data check reads its indices)."""
    seed = sseed + (rank if bug == "rank_seed" else 0)
    shuffle_seed = seed + (0 if bug == "no_set_epoch" else epoch)  # the custom samplers' set_epoch
    drop = bug == "drop_last"
    n = len(dataset)
    if style == "dist":
        sampler: Any = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=bool(shuf), seed=seed)
        if bug != "no_set_epoch":
            sampler.set_epoch(epoch)
        return DataLoader(dataset, batch_size=bs, sampler=sampler, drop_last=drop, num_workers=nw)
    if style == "strided":
        return DataLoader(dataset, batch_size=bs, sampler=StridedSampler(n, rank, world_size, bool(shuf), shuffle_seed),
                          drop_last=drop, num_workers=nw)
    if style == "block":
        return DataLoader(dataset, batch_size=bs, sampler=BlockSampler(n, rank, world_size, bool(shuf), shuffle_seed),
                          drop_last=drop, num_workers=nw)
    if style == "batch":
        batches = BatchSampler(StridedSampler(n, rank, world_size, bool(shuf), shuffle_seed), bs, drop_last=drop)
        return batches if raw else DataLoader(dataset, batch_sampler=batches, num_workers=nw)
    if style == "subset":
        ids = _order(n, bool(shuf), shuffle_seed)[rank::world_size]
        return DataLoader(Subset(dataset, ids), batch_size=bs, drop_last=drop, num_workers=nw)
    raise ValueError(f"unknown loader style {style!r}")


def dp_loader(dataset: Any, rank: int, world_size: int, epoch: int, *, bs: int, nw: int) -> DataLoader[Any]:
    return DataLoader(dataset, batch_size=bs, num_workers=nw)


# --------------------------------------------------------------------------------------
# Evaluations: module-level, sent to the ranks as partials.


def _per_sample(model: Any, loader: Any, task: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample float32 losses, predicted classes and sample ids over ``loader``, in one pass."""
    losses, preds, ids = [torch.zeros(0)], [torch.zeros(0, dtype=torch.long)], [torch.zeros(0, dtype=torch.long)]
    targets = [torch.zeros(0, dtype=torch.long)]
    with torch.no_grad():
        for x, y, idx in loader:
            out = model(x)
            if task == "reg":
                losses.append(F.mse_loss(out, y, reduction="none").mean(1))
                preds.append(torch.zeros(len(y), dtype=torch.long))
            else:
                losses.append(F.cross_entropy(out, y, reduction="none"))
                preds.append(out.argmax(1))
            ids.append(idx)
            if task != "reg":
                targets.append(y)
    return torch.cat(losses), torch.cat(preds), torch.cat(ids), torch.cat(targets)


def evaluate(model: Any, loader: Any, *, ev: str, task: str, classes: int, bug: str) -> Any:
    """The evaluation loop as the user wrote it; ``bug`` changes its synchronisation."""
    losses, preds, ids, targets = _per_sample(model, loader, task)
    correct = (preds == targets).long() if task != "reg" else torch.zeros(len(losses), dtype=torch.long)
    if ev in ("local64", "local_dict"):  # DataParallel: one process, no collective
        total = float(losses.double().sum())
        if ev == "local_dict":
            return {"loss": total / len(losses), "accuracy": float(correct.sum()) / len(losses)}
        return total / len(losses)
    world = dist.get_world_size()
    if ev == "sum64":
        if bug == "mean_of_means":
            mean = losses.double().mean()
            dist.all_reduce(mean)
            return float(mean) / world
        sums = torch.stack([losses.double().sum(), torch.tensor(float(len(losses)), dtype=torch.float64)])
        if bug != "no_sync":
            dist.all_reduce(sums)
        return float(sums[0] / sums[1])
    if ev == "sum32":
        total32 = losses.sum()  # float32 accumulator
        count = torch.tensor(len(losses), dtype=torch.long)
        dist.all_reduce(total32)
        dist.all_reduce(count)
        return total32.item() / count.item()
    if ev == "acc_int":
        counts = torch.stack([correct.sum(), torch.tensor(len(correct))])
        dist.all_reduce(counts)
        if bug == "floor":  # a sync-style mean of integer states: floor-divided by the world size
            means = counts // world
            return float(means[0].double() / means[1].double())
        return counts[0].item() / counts[1].item()
    if ev == "dict":
        sums = torch.stack([losses.double().sum(), correct.double().sum(), torch.tensor(float(len(losses)), dtype=torch.float64)])
        dist.all_reduce(sums)
        return {"loss": float(sums[0] / sums[2]), "accuracy": float(sums[1] / sums[2])}
    if ev == "perclass":
        counts = torch.bincount(preds, minlength=classes).double()
        dist.all_reduce(counts)
        return counts
    if ev == "gather_trim":  # DistributedSampler(shuffle=False): rank r has samples r, r + W, ...
        parts = [torch.empty_like(losses) for _ in range(world)]
        dist.all_gather(parts, losses)
        return float(torch.stack(parts, dim=1).reshape(-1)[: len(loader.dataset)].double().mean())
    if ev == "gather_obj":
        pairs = list(zip(ids.tolist(), losses.double().tolist(), strict=True))
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, pairs)
        if bug == "padding":  # every pair counted, the padding's twice
            values = [value for part in gathered for _k, value in part]
            return math.fsum(values) / len(values) if values else math.nan
        unique = dict(pair for part in gathered for pair in part)
        return math.fsum(unique[k] for k in sorted(unique)) / len(unique) if unique else math.nan
    raise ValueError(f"unknown evaluation {ev!r}")


# --------------------------------------------------------------------------------------
# Building a scenario.


@dataclass
class Scenario:
    spec: Spec
    dataset: TensorDataset
    model: nn.Module


def build(spec: Spec | str) -> Scenario:
    s = Spec.parse(spec) if isinstance(spec, str) else spec
    generator = torch.Generator()
    generator.manual_seed(s.seed)
    x = torch.randn(s.N, s.F, generator=generator) * s.xs
    if s.model == "reg":
        y: torch.Tensor = torch.randn(s.N, s.C, generator=generator) * s.xs
    else:
        y = torch.randint(0, s.C, (s.N,), generator=generator)
    with torch.random.fork_rng():
        torch.manual_seed(s.seed)
        hidden = 8
        model: nn.Module
        if s.model == "linear":
            model = nn.Linear(s.F, s.C)
        elif s.model == "mlp":
            model = nn.Sequential(nn.Linear(s.F, hidden), nn.Tanh(), nn.Linear(hidden, s.C))
        else:
            model = nn.Sequential(nn.Linear(s.F, hidden), nn.ReLU(), nn.Linear(hidden, s.C))
    model.eval()
    return Scenario(s, TensorDataset(x, y, torch.arange(s.N)), model)


def loader_factory(s: Spec, bug: str, *, raw: bool) -> Callable[..., Any]:
    return functools.partial(make_loader, style=s.style, bs=s.bs, nw=s.nw, shuf=s.shuf, sseed=s.sseed, bug=bug, raw=raw)


def eval_fn(s: Spec, bug: str) -> Callable[..., Any]:
    return functools.partial(evaluate, ev=s.ev, task="reg" if s.model == "reg" else "cls", classes=s.C, bug=bug)


def run_check(sc: Scenario, bug: str) -> object:
    """The scenario's check on its code with ``bug`` injected ("-": none)."""
    s = sc.spec
    if s.check == "data":
        allow = ("padding",) if s.style == "dist" else ()
        return dpverify.assert_ddp_data_matches(sc.dataset, loader_factory(s, bug, raw=True), world_size=s.W, epochs=s.E, allow=allow)
    if s.check == "metric":
        return dpverify.assert_ddp_metric_matches(
            sc.model, sc.dataset, eval_fn(s, bug), world_size=s.W, loader_factory=loader_factory(s, bug, raw=False),
        )
    return dpverify.assert_dp_metric_matches(
        sc.model, sc.dataset, eval_fn(s, bug), device_ids=list(range(s.W)),
        loader_factory=functools.partial(dp_loader, bs=s.bs, nw=s.nw),
    )


# --------------------------------------------------------------------------------------
# Whether an injection can show: computed here, from the scenario, not from the check.


def rank_ids(sc: Scenario, bug: str, epoch: int) -> list[list[int]]:
    """The sample ids each rank's loader delivers in ``epoch``, read in this process."""
    s = sc.spec
    out = []
    for rank in range(s.W):
        loader = loader_factory(s, bug, raw=True)(sc.dataset, rank, s.W, epoch)
        if isinstance(loader, DataLoader):
            loader.num_workers = 0
            out.append([int(i) for _x, _y, idx in loader for i in idx])
        else:
            out.append([int(i) for batch in loader for i in batch])
    return out


def _metric_on(sc: Scenario, ids: Sequence[int]) -> float:
    """The scenario's metric (mean loss, or accuracy for acc_int) over ``ids``, float64."""
    if not ids:
        return math.nan
    x, y, _ = sc.dataset.tensors
    with torch.no_grad():
        out = sc.model(x[list(ids)]).double()
    target = y[list(ids)]
    if sc.spec.model == "reg":
        return float(F.mse_loss(out, target.double(), reduction="none").mean(1).mean())
    if sc.spec.ev == "acc_int":
        return float((out.argmax(1) == target).double().mean())
    return float(F.cross_entropy(out, target, reduction="none").mean())


def _differs(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return not (math.isnan(a) and math.isnan(b))
    return abs(a - b) > VISIBLE * max(abs(b), 1e-12)


def _valid_cover(parts: Sequence[Sequence[int]], n: int, padded: bool) -> bool:
    """Every sample seen; once each, or DistributedSampler's padding (equal shares, at most
    ceil(total / n) times each)."""
    counts = Counter(i for part in parts for i in part)
    if set(counts) != set(range(n)):
        return False
    if not padded:
        return max(counts.values()) == 1
    share = -(-n // len(parts))
    return all(len(p) == share for p in parts) and max(counts.values()) <= -(-share * len(parts) // n)


def applicable(sc: Scenario) -> tuple[bool, str]:
    """Whether the spec's bug changes what the check compares, and why not when it does not."""
    s, bug = sc.spec, sc.spec.bug
    whole = list(range(s.N))
    if bug == "no_set_epoch":
        good = [rank_ids(sc, "-", e) for e in range(s.E)]
        if not any(good[e][r] != good[e - 1][r] for e in range(1, s.E) for r in range(s.W)):
            return False, "the correct sampler's epochs repeat too"
        if s.style != "dist":
            # a custom sampler does not say its epoch: a repeat is evidence only when unlikely by chance
            chance = math.prod(1 / math.factorial(len(set(p))) for p in good[0] if p)
            if chance > CHANCE:
                return False, f"a repeat of every rank's order is likely by chance (more than {CHANCE:g})"
        return True, ""
    if bug == "rank_seed":
        if all(_valid_cover(rank_ids(sc, bug, e), s.N, s.style == "dist") for e in range(s.E)):
            return False, "the rank-seeded parts still cover the dataset"
        return True, ""
    if bug == "drop_last":
        parts = [rank_ids(sc, bug, e) for e in range(s.E if s.check == "data" else 1)]
        if all({i for p in epoch for i in p} == set(whole) for epoch in parts):
            return False, "every share is a multiple of the batch size"
        if s.check == "metric" and not _differs(_metric_on(sc, sorted({i for p in parts[0] for i in p})), _metric_on(sc, whole)):
            return False, f"the drop moves the metric by less than {VISIBLE:g}"
        return True, ""
    if bug == "padding":
        if s.N % s.W == 0:
            return False, "N % W == 0: no padding"
        ids = [i for p in rank_ids(sc, "-", 0) for i in p]
        if not _differs(_metric_on(sc, ids), _metric_on(sc, whole)):
            return False, f"the padding moves the metric by less than {VISIBLE:g}"
        return True, ""
    if bug == "floor":
        right = round(_metric_on(sc, whole) * s.N)
        floored = (right // s.W) / (s.N // s.W) if s.N >= s.W else math.nan
        if not _differs(floored, right / s.N):
            return False, "the correct count and N floor-divide by W to the same ratio"
        return True, ""
    shares = rank_ids(sc, "-", 0)
    true = _metric_on(sc, whole)
    if bug == "mean_of_means":
        means = [_metric_on(sc, p) for p in shares]
        return (True, "") if _differs(sum(means) / len(means), true) else (False, f"equal shares, or the means' mean within {VISIBLE:g} of the metric")
    if bug == "no_sync":
        return (True, "") if any(_differs(_metric_on(sc, p), true) for p in shares) else (False, f"every rank's own metric within {VISIBLE:g} of the global one")
    raise ValueError(f"unknown bug {bug!r}")


# --------------------------------------------------------------------------------------
# Running and counting.


@dataclass(frozen=True)
class Failure:
    outcome: str  # "false alarm" or "crash"
    spec: str
    message: str  # the first lines


@dataclass(frozen=True)
class Injection:
    spec: str
    bug: str
    applicable: bool
    reason: str
    outcome: str  # "caught" (ParallelMismatch), "refused" (InvalidArgument), "missed", "crash"
    message: str


@dataclass
class Tally:
    scenarios: int = 0
    passes: int = 0
    refused: int = 0
    false_alarms: int = 0
    crashes: int = 0
    by_class: dict[str, ClassTally] = field(default_factory=lambda: defaultdict(ClassTally))
    failures: list[Failure] = field(default_factory=list)
    injections: list[Injection] = field(default_factory=list)
    seconds: float = 0.0


def untestable(spec: Spec) -> bool:
    """Whether the scenario runs nothing in parallel, by its own numbers: DataParallel over
    batches of one row (a dataset of one sample, or a batch size of 1) runs one replica per
    batch, so the check must refuse it rather than pass."""
    return spec.check == "dp" and (spec.N == 1 or spec.bs == 1)


def run_scenario(spec: Spec, tally: Tally, *, verbose: bool = False) -> str:
    """Builds and checks one scenario (and its injection); returns its outcome ("pass",
    "refused", "false alarm", "crash")."""
    started = time.perf_counter()
    outcome = "pass"
    sc: Scenario | None = None
    try:
        sc = build(spec)
        result = run_check(sc, "-")
        if verbose:
            print(f"--- correct code: {result}\n")
    except dpverify.ParallelMismatch as error:
        outcome = "false alarm"
        tally.failures.append(Failure(outcome, str(spec), error_lines(error, 8)))
        if verbose:
            print(f"--- FALSE ALARM\n{error}\n")
    except dpverify.InvalidArgument as error:
        # refused as untestable: right where this scenario, by its own numbers, runs nothing in parallel
        outcome = "refused" if untestable(spec) else "crash"
        if outcome == "crash":
            tally.failures.append(Failure(outcome, str(spec), error_lines(error)))
        if verbose:
            print(f"--- {outcome.upper()}\n{error}\n")
    except Exception as error:
        outcome = "crash"
        tally.failures.append(Failure(outcome, str(spec), error_lines(error)))
        if verbose:
            traceback.print_exc(file=sys.stdout)
    if sc is not None and spec.bug != "-" and outcome == "pass":
        _inject(sc, tally, verbose)
    seconds = time.perf_counter() - started
    tally.seconds += seconds
    tally.scenarios += 1
    tally.passes += outcome == "pass"
    tally.refused += outcome == "refused"
    tally.false_alarms += outcome == "false alarm"
    tally.crashes += outcome == "crash"
    for name in ["all", *spec.classes]:
        ct = tally.by_class[name]
        ct.scenarios += 1
        ct.passes += outcome == "pass"
        ct.refused += outcome == "refused"
        ct.false_alarms += outcome == "false alarm"
        ct.crashes += outcome == "crash"
        ct.seconds += seconds
    return outcome


def _inject(sc: Scenario, tally: Tally, verbose: bool) -> None:
    s = sc.spec
    try:
        can, reason = applicable(sc)
    except Exception as error:
        tally.injections.append(Injection(str(s), s.bug, False, "", "crash", f"applicability: {error_lines(error)}"))
        return
    message = ""
    try:
        run_check(sc, s.bug)
        outcome = "missed"
    except dpverify.ParallelMismatch as error:
        outcome, message = "caught", error_lines(error, 8)
    except dpverify.InvalidArgument as error:
        outcome, message = "refused", error_lines(error)
    except Exception as error:
        outcome, message = "crash", error_lines(error)
    tally.injections.append(Injection(str(s), s.bug, can, reason, outcome, message))
    if verbose:
        print(f"--- injected {s.bug}: {outcome}; {'applicable' if can else 'not applicable: ' + reason}\n{message}\n")


# --------------------------------------------------------------------------------------
# Report.


def report(tally: Tally, seed: int, show: int) -> None:
    per = 1000 * tally.seconds / max(tally.scenarios, 1)
    print(f"\n{tally.scenarios} scenarios (seed {seed}) in {tally.seconds:.0f} s, {per:.0f} ms per scenario "
          "(its injection included)\n")
    print("| | count |")
    print("|---|---:|")
    print(f"| scenarios checked | {tally.scenarios} |")
    print(f"| passed | {tally.passes} |")
    print(f"| refused as untestable (one-row batches through DataParallel) | {tally.refused} |")
    print(f"| false alarms (ParallelMismatch on correct code) | {tally.false_alarms} |")
    print(f"| crashes (any other exception) | {tally.crashes} |")

    inj = tally.injections
    print(f"\nSensitivity: {len(inj)} injections (every {SENSITIVITY_EVERY}th scenario whose correct code passed). "
          "Applicable: the injection changes what the check compares, computed here from the scenario.\n")
    print("| injected bug | injections | not applicable | caught / applicable | refused (InvalidArgument) | missed | crashes | caught when not applicable |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for bug in BUGS:
        rows = [i for i in inj if i.bug == bug]
        if not rows:
            continue
        yes = [i for i in rows if i.applicable]
        no = [i for i in rows if not i.applicable]
        print(f"| {bug} | {len(rows)} | {len(no)} | {sum(i.outcome == 'caught' for i in yes)}/{len(yes)} | "
              f"{sum(i.outcome == 'refused' for i in yes)} | {sum(i.outcome == 'missed' for i in yes)} | "
              f"{sum(i.outcome == 'crash' for i in rows)} | {sum(i.outcome == 'caught' for i in no)}/{len(no)} |")
    reasons = Counter(f"{i.bug}: {i.reason}" for i in inj if not i.applicable)
    if reasons:
        print("\nNot applicable, why: " + "; ".join(f"{r} ({n})" for r, n in reasons.most_common()))

    print("\nPer class (a scenario counts in each of its classes):\n")
    print("| class | scenarios | passed | refused | false alarms | crashes | ms/scenario |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in sorted(tally.by_class, key=lambda k: (k != "all", k)):
        ct = tally.by_class[name]
        print(f"| {name} | {ct.scenarios} | {ct.passes} | {ct.refused} | {ct.false_alarms} | {ct.crashes} | "
              f"{1000 * ct.seconds / max(ct.scenarios, 1):.0f} |")

    if tally.failures:
        print(f"\nFailures on correct code: {len(tally.failures)}")
        for f in tally.failures[:show]:
            print(f"- {f.outcome}: {f.spec}\n    {f.message}")
    odd = [i for i in inj if i.applicable != (i.outcome in ("caught", "refused")) or i.outcome == "crash"]
    if odd and show:
        print("\nInjections caught where not applicable, applicable ones not caught, and crashes:")
        for i in odd[:show]:
            print(f"- {i.bug} {i.outcome}: {i.spec}\n    {i.message}")


def main(argv: Sequence[str] | None = None) -> Tally:
    tally = Tally()
    return drive(  # type: ignore[no-any-return]
        argv, description=(__doc__ or "").splitlines()[0], scenarios=300, tally=tally, generate=generate,
        parse=Spec.parse, run=lambda spec, verbose: run_scenario(spec, tally, verbose=verbose),
        report=lambda seed, show: report(tally, seed, show), describe=lambda spec: f"classes: {', '.join(spec.classes)}",
        progress=lambda: f"{tally.false_alarms} false alarms, {tally.crashes} crashes, {tally.seconds:.0f} s",
    )


if __name__ == "__main__":
    import calibrate_data  # the loaders and evaluations are pickled to the ranks by this module's name

    calibrate_data.main()
