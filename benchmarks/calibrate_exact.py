"""Calibration of exact mode on scenarios dpverify does not generate itself.

An independent random generator of exact scenarios, written here without
``dpverify.strategies``: models of the exact set built here (Linear/ReLU stacks, LeakyReLU
with a dyadic slope, residual blocks, two branches concatenated, Conv1d and Conv2d with max
or average pooling over windows of 2, Embedding with the tokens summed or averaged over a
power-of-two count), 1 to 3 hidden layers of 1 to 16 features, MSE or L1 with a mean or a
sum, batches of 2 to 32 rows (a power of two where a mean divides by them), DataParallel on
2 to 8 virtual devices (any ids of 0..7, any output device), and DDP, FSDP2, tensor and
pipeline parallelism on 2 or 4 ranks of one shared pool per world size; a gradient check,
or one SGD step (lr, momentum and weight decay short dyadic numbers) with the training
helper (DataParallel and DDP). Every scenario is correct code of the exact set, so every
check must pass, bit for bit.

For each scenario, through dpverify's public API with ``exact=True``:

- a ``ParallelMismatch`` is a false alarm, an ``InvalidArgument`` a refusal (by its
  reason: a model past the exact bounds is refused, never checked with less certainty),
  any other exception a crash;
- every ``SENSITIVITY_EVERY``-th scenario (a gradient check) is run four times more with an
  injected error of one unit in the last place in the parallel step's reduced gradient of
  the first parameter: in the whole tensor (every element moved to the next float up) and
  in a single element (its largest), in exact mode and in the default mode (a float32
  copy, one float32 ulp) for contrast. DataParallel: a ``DataParallel`` subclass with a
  gradient hook; DDP, FSDP2 and tensor parallel: a per-rank step that moves the gradient
  after backward (its local shard); pipelines: a schedule class that moves it after
  ``step()``;
- every ``COST_EVERY``-th scenario is also checked in the default mode, both timed: the
  cost of exact mode as a ratio, measured in one run.

Every scenario prints as a one-line spec; ``build(spec)`` reconstructs it exactly.

Usage:
    python benchmarks/calibrate_exact.py [--n 10000] [--seed 0] [--show 20] [--progress 500]
    python benchmarks/calibrate_exact.py --only INDEX [--seed 0]     # one scenario, full messages
    python benchmarks/calibrate_exact.py --spec 'i=3 backend=dp ...'  # a pasted spec
"""

from __future__ import annotations

import functools
import math
import random
import statistics
import sys
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from calibration import ClassTally, drive, error_lines
from torch import nn
from torch.distributed.pipelining import ScheduleGPipe

import dpverify

BACKENDS = ("dp", "ddp", "fsdp", "tp", "pp")
#: Most scenarios are DataParallel (fast, on virtual devices); a share runs on ranks.
BACKEND_WEIGHTS = (85, 6, 3, 3, 3)
KINDS = ("mlp", "leaky", "residual", "concat", "conv1d", "conv2d", "embed")
#: The kinds whose batch DDP and FSDP2 shard along dim 0 as they are (all of them).
RANKED_KINDS = KINDS
SLOPES = (0.5, 0.25, 0.125, 0.375)
LRS = (0.5, 0.25, 0.125, 0.0625)
MOMENTA = (0.0, 0.5, 0.25)
DECAYS = (0.0, 0.0625)
SENSITIVITY_EVERY = 10
COST_EVERY = 10
WHERE = ("whole", "one")


# --------------------------------------------------------------------------------------
# The scenario spec: a line you can paste, and the generator that draws it.


@dataclass(frozen=True)
class Spec:
    """One scenario. ``str(spec)`` is a line that ``Spec.parse`` reads back exactly."""

    i: int  # index in the run (informative)
    backend: str  # BACKENDS
    kind: str  # KINDS
    B: int  # batch rows
    dev: str  # DataParallel device ids, comma-separated; ranked: "-"
    out: int  # DataParallel output device (-2: the default)
    W: int  # world size (ranked), else 0
    loss: str  # mse or l1
    red: str  # mean or sum
    F: int  # input features (channels for conv, vocabulary for embed)
    H: int  # hidden width
    O: int  # outputs  # noqa: E741
    D: int  # hidden layers / blocks
    T: int  # sequence length or spatial size (conv, embed)
    opt: int  # kind option: LeakyReLU slope index, pooling (0 max, 1 avg), token pooling (0 sum, 1 mean)
    steps: int  # 0: gradient check; 1: one SGD step with the training helper
    lr: float
    mom: float
    wd: float
    mb: int  # pipeline microbatches
    sens: int  # 1: one-ulp injections run on this scenario
    cost: int  # 1: also checked in the default mode, both timed
    seed: int

    def __str__(self) -> str:
        return " ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))

    @classmethod
    def parse(cls, text: str) -> Spec:
        types = {f.name: str(f.type) for f in fields(cls)}
        values: dict[str, Any] = {}
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
    def device_ids(self) -> list[int]:
        return [int(d) for d in self.dev.split(",")] if self.dev != "-" else list(range(self.W))

    @property
    def classes(self) -> list[str]:
        tags = [f"backend:{self.backend}", f"kind:{self.kind}", f"loss:{self.loss}-{self.red}"]
        tags.append("training" if self.steps else "gradients")
        if self.backend == "dp":
            tags.append(f"devices:{len(self.device_ids)}")
            if self.B % len(self.device_ids):
                tags.append("uneven chunks")
        else:
            tags.append(f"world:{self.W}")
        return tags


def _power(rng: random.Random, lo: int, hi: int) -> int:
    """A power of two in ``[2**lo, 2**hi]``."""
    return 2 ** rng.randint(lo, hi)


def generate(index: int, seed: int) -> Spec:
    """The scenario at ``index`` of the run with ``seed``: deterministic, independent of order."""
    rng = random.Random(f"calibrate-exact:{seed}:{index}")
    sens = int(index % SENSITIVITY_EVERY == 0)
    cost = int(index % COST_EVERY == COST_EVERY // 2)
    backend = rng.choices(BACKENDS, weights=BACKEND_WEIGHTS)[0]
    kind = rng.choice(KINDS) if backend in ("dp", "ddp", "fsdp") else "mlp"
    red = rng.choice(("mean", "sum")) if backend == "dp" else "mean"  # DDP & co. average means
    loss = rng.choice(("mse", "l1"))
    o = _power(rng, 0, 2) if red == "mean" else rng.randint(1, 4)
    h = rng.randint(1, 16)
    t = rng.choice((2, 4)) if kind in ("conv1d", "conv2d", "embed") else 1
    dev, out, w, mb = "-", -2, 0, 1
    if backend == "dp":
        n = rng.randint(2, 8)
        ids = rng.sample(range(8), n)
        dev = ",".join(map(str, ids))
        out = rng.choice([-2, ids[0], rng.choice(ids)])
        b = _power(rng, 1, 5) if red == "mean" else rng.randint(2, 32)
    else:
        w = 4 if backend in ("ddp", "fsdp") and rng.random() < 0.25 else 2
        if backend == "tp":
            h = w * rng.randint(1, 4)  # the colwise layer's rows shard evenly
        if backend == "pp":
            mb = _power(rng, 0, 2)
            b = mb * _power(rng, 0, 2)  # every microbatch a power of two rows
        elif backend == "tp":
            b = _power(rng, 1, 4)  # every rank runs the whole batch
        else:
            b = w * _power(rng, 0, 2)  # every rank a power of two rows
    steps = 0 if sens or backend not in ("dp", "ddp") else int(rng.random() < 0.3)
    return Spec(
        i=index, backend=backend, kind=kind, B=b, dev=dev, out=out, W=w, loss=loss, red=red,
        F=rng.randint(1, 8), H=h, O=o, D=rng.randint(1, 2) if backend != "pp" else 2, T=t,
        opt=rng.randrange(len(SLOPES)) if kind == "leaky" else rng.randrange(2),
        steps=steps, lr=rng.choice(LRS), mom=rng.choice(MOMENTA), wd=rng.choice(DECAYS), mb=mb,
        sens=sens, cost=cost, seed=rng.randrange(2**31),
    )


# --------------------------------------------------------------------------------------
# The models, written here.


class Residual(nn.Module):
    def __init__(self, features: int, hidden: int, outputs: int, depth: int) -> None:
        super().__init__()
        self.inp = nn.Linear(features, hidden)
        self.blocks = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(depth))
        self.head = nn.Linear(hidden, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(F.relu(x))
        return self.head(F.relu(x))


class Concat(nn.Module):
    def __init__(self, features: int, hidden: int, outputs: int) -> None:
        super().__init__()
        self.left, self.right = nn.Linear(features, hidden), nn.Linear(features, hidden + 1)
        self.head = nn.Linear(2 * hidden + 1, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(torch.cat([self.left(x), self.right(x)], dim=1)))


class Tokens(nn.Module):
    def __init__(self, vocabulary: int, hidden: int, outputs: int, mean: bool) -> None:
        super().__init__()
        self.embed, self.head, self.mean = nn.Embedding(vocabulary, hidden), nn.Linear(hidden, outputs), mean

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        vectors = self.embed(ids)
        pooled = vectors.mean(dim=1) if self.mean else vectors.sum(dim=1)
        return self.head(F.relu(pooled))


def _stack(spec: Spec, activation: Callable[[], nn.Module]) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(spec.F, spec.H), activation()]
    for _ in range(spec.D - 1):
        layers += [nn.Linear(spec.H, spec.H), activation()]
    return nn.Sequential(*layers, nn.Linear(spec.H, spec.O))


def _conv(spec: Spec) -> nn.Sequential:
    two = spec.kind == "conv2d"
    conv = (nn.Conv2d if two else nn.Conv1d)(spec.F, spec.H, 3, padding=1)
    pool = (nn.MaxPool2d(2) if two else nn.MaxPool1d(2)) if spec.opt == 0 else (nn.AvgPool2d(2) if two else nn.AvgPool1d(2))
    cells = (spec.T // 2) ** (2 if two else 1)
    return nn.Sequential(conv, nn.ReLU(), pool, nn.Flatten(), nn.Linear(spec.H * cells, spec.O))


def model(spec: Spec) -> nn.Module:
    torch.manual_seed(spec.seed)
    if spec.kind == "mlp":
        return _stack(spec, nn.ReLU)
    if spec.kind == "leaky":
        return _stack(spec, lambda: nn.LeakyReLU(SLOPES[spec.opt]))
    if spec.kind == "residual":
        return Residual(spec.F, spec.H, spec.O, spec.D)
    if spec.kind == "concat":
        return Concat(spec.F, spec.H, spec.O)
    if spec.kind == "embed":
        return Tokens(spec.F + 1, spec.H, spec.O, mean=spec.opt == 1)
    return _conv(spec)


def batch(spec: Spec) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(spec.seed + 1)
    if spec.kind == "embed":
        inputs = torch.randint(0, spec.F + 1, (spec.B, spec.T), generator=g)
    elif spec.kind == "conv1d":
        inputs = torch.randn(spec.B, spec.F, spec.T, generator=g)
    elif spec.kind == "conv2d":
        inputs = torch.randn(spec.B, spec.F, spec.T, spec.T, generator=g)
    else:
        inputs = torch.randn(spec.B, spec.F, generator=g)
    return inputs, torch.randn(spec.B, spec.O, generator=g)


@dataclass(frozen=True)
class Scenario:
    spec: Spec
    module: nn.Module
    inputs: torch.Tensor
    target: torch.Tensor

    def loss_fn(self) -> Callable[..., torch.Tensor]:
        base = F.mse_loss if self.spec.loss == "mse" else F.l1_loss
        return functools.partial(base, reduction=self.spec.red)


def build(spec: Spec | str) -> Scenario:
    spec = Spec.parse(spec) if isinstance(spec, str) else spec
    inputs, target = batch(spec)
    return Scenario(spec, model(spec), inputs, target)


# --------------------------------------------------------------------------------------
# The one-ulp injections: the parallel step's reduced gradient of the first parameter.


def nudge(gradient: torch.Tensor, where: str) -> torch.Tensor:
    """``gradient`` with every element (``whole``) or its largest one (``one``) moved to the
    next float up: one unit in the last place."""
    moved = gradient.clone()
    flat = moved.view(-1)
    up = torch.full_like(flat, math.inf)
    if where == "whole":
        flat.copy_(torch.nextafter(flat, up))
    else:
        k = int(flat.abs().argmax())
        flat[k] = torch.nextafter(flat[k], up[k])
    return moved


def _first_gradient(module: nn.Module) -> torch.Tensor | None:
    for parameter in module.parameters():
        if parameter.grad is not None:
            return parameter.grad
    return None


def nudge_module(module: nn.Module, where: str, *, sharded: bool) -> None:
    """Moves the first gradient of ``module`` by one ulp after the step, on this rank: its
    local shard (a DTensor's) in the whole tensor on every rank; the largest element on rank
    0 only when the gradient is sharded (one element of the full tensor), on every rank when
    each holds the full tensor (DDP's)."""
    gradient = _first_gradient(module)
    if gradient is None:
        return
    local = gradient.to_local() if hasattr(gradient, "to_local") else gradient
    if where == "one" and sharded and dist.get_rank() != 0:
        return
    with torch.no_grad():
        local.copy_(nudge(local, where))


def nudged_step(ctx: Any, *, backend: str, where: str) -> Any:
    """A correct per-rank step (torch's DDP, FSDP2 or tensor parallel step), then one ulp."""
    steps = {"ddp": dpverify.ddp_step, "fsdp": dpverify.fsdp_step, "tp": dpverify.tp_step}
    output = steps[backend](ctx)
    nudge_module(ctx.module, where, sharded=backend != "ddp")
    return output


class NudgedGPipe(ScheduleGPipe):
    """torch's GPipe schedule, then one ulp in the stage's first gradient."""

    where = "whole"

    def step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().step(*args, **kwargs)
        nudge_module(self._stage.submod, self.where, sharded=True)
        return output


class NudgedGPipeWhole(NudgedGPipe):
    where = "whole"


class NudgedGPipeOne(NudgedGPipe):
    where = "one"


class _NudgedDataParallel(nn.DataParallel):  # type: ignore[type-arg]
    where = "whole"

    def __init__(self, module: nn.Module, **kwargs: Any) -> None:
        super().__init__(module, **kwargs)
        first = next(p for p in module.parameters() if p.requires_grad)
        # the gradient reaching the leaf is the replicas' reduced one
        first.register_hook(lambda g: nudge(g, type(self).where))


class NudgedWhole(_NudgedDataParallel):
    where = "whole"


class NudgedOne(_NudgedDataParallel):
    where = "one"


# --------------------------------------------------------------------------------------
# Running a scenario.


class Pools:
    """One pool of ranks per world size, shared by every ranked backend."""

    def __init__(self) -> None:
        self.pools: dict[int, Any] = {}

    def get(self, world_size: int) -> Any:
        if world_size not in self.pools:
            self.pools[world_size] = dpverify.DDPWorkerPool(world_size)
        return self.pools[world_size]

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()


def run_check(sc: Scenario, pools: Pools, *, exact: bool, inject: str = "-") -> Any:
    """The scenario's helper, in exact mode or not, with an injection (``whole``, ``one``)."""
    s = sc.spec
    loss_fn = sc.loss_fn()
    extra: dict[str, Any] = {"exact": True} if exact else {}
    if s.steps:
        optimizer = functools.partial(torch.optim.SGD, lr=s.lr, momentum=s.mom, weight_decay=s.wd)
        batches = [(sc.inputs, sc.target)]
        if s.backend == "dp":
            return dpverify.assert_dp_training_matches(
                sc.module, batches, loss_fn=loss_fn, optimizer=optimizer, device_ids=s.device_ids,
                output_device=None if s.out == -2 else s.out, **extra,
            )
        return dpverify.assert_ddp_training_matches(sc.module, batches, loss_fn=loss_fn, optimizer=optimizer, world_size=s.W, pool=pools.get(s.W), **extra)
    if s.backend == "dp":
        parallel = {"-": None, "whole": NudgedWhole, "one": NudgedOne}[inject]
        return dpverify.assert_dp_grads_match(
            sc.module, sc.inputs, sc.target, loss_fn=loss_fn, device_ids=s.device_ids,
            output_device=None if s.out == -2 else s.out, parallel=parallel, **extra,
        )
    pool = pools.get(s.W)
    if inject != "-" and s.backend != "pp":
        extra["step"] = functools.partial(nudged_step, backend=s.backend, where=inject)
    if s.backend == "ddp":
        return dpverify.assert_ddp_grads_match(sc.module, sc.inputs, sc.target, loss_fn=loss_fn, world_size=s.W, pool=pool, **extra)
    if s.backend == "fsdp":
        return dpverify.assert_fsdp_grads_match(sc.module, sc.inputs, sc.target, loss_fn=loss_fn, world_size=s.W, pool=pool, **extra)
    if s.backend == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        return dpverify.assert_tensor_parallel_grads_match(sc.module, sc.inputs, sc.target, loss_fn=loss_fn, world_size=s.W, plan=plan, pool=pool, **extra)
    if inject != "-":
        extra["schedule"] = {"whole": NudgedGPipeWhole, "one": NudgedGPipeOne}[inject]
    return dpverify.assert_pipeline_grads_match(
        sc.module, sc.inputs, sc.target, loss_fn=loss_fn, world_size=s.W, n_microbatches=s.mb, pool=pool, **extra,
    )


@dataclass
class Injection:
    spec: str
    backend: str
    where: str
    exact: bool
    outcome: str  # caught, missed, refused, crash
    message: str = ""


@dataclass
class Failure:
    outcome: str
    spec: str
    message: str


@dataclass
class Tally:
    scenarios: int = 0
    passes: int = 0
    refused: int = 0
    false_alarms: int = 0
    crashes: int = 0
    refusals: Counter[str] = field(default_factory=Counter)
    by_class: dict[str, ClassTally] = field(default_factory=lambda: defaultdict(ClassTally))
    failures: list[Failure] = field(default_factory=list)
    injections: list[Injection] = field(default_factory=list)
    #: (backend, exact seconds, default seconds, default outcome) of the cost subsample
    costs: list[tuple[str, float, float, str]] = field(default_factory=list)
    seconds: float = 0.0


def refusal_reason(error: BaseException) -> str:
    """A refusal's reason, without the values that differ between scenarios."""
    text = str(error).removeprefix("exact=True: ")
    for marker, reason in (
        ("significand bits", "too deep or too wide (more than 53 bits)"),
        ("outside the exact set", "an operation outside the exact set"),
        ("not a power of two", "a count that is not a power of two"),
        ("smallest normal", "below the smallest normal number"),
    ):
        if marker in text:
            return reason
    return text.split(":")[0][:80]


def _attempt(sc: Scenario, pools: Pools, *, exact: bool, inject: str = "-") -> tuple[str, str]:
    """``run_check``'s outcome: pass, mismatch, refused or crash, and the message."""
    try:
        run_check(sc, pools, exact=exact, inject=inject)
        return "pass", ""
    except dpverify.ParallelMismatch as error:
        return "mismatch", error_lines(error, 8)
    except dpverify.InvalidArgument as error:
        return "refused", error_lines(error)
    except Exception as error:
        return "crash", error_lines(error)


def run_scenario(spec: Spec, tally: Tally, pools: Pools, *, verbose: bool = False) -> str:
    """Builds and checks one scenario (its injections and its timing in the default mode);
    returns its outcome ("pass", "refused", "false alarm", "crash")."""
    started = time.perf_counter()
    sc: Scenario | None = None
    try:
        sc = build(spec)
        run_check(sc, pools, exact=True)
        outcome, message = "pass", ""
    except dpverify.ParallelMismatch as error:
        outcome, message = "false alarm", error_lines(error, 8)
    except dpverify.InvalidArgument as error:
        outcome, message = "refused", error_lines(error)
        tally.refusals[f"{spec.backend}: {refusal_reason(error)}"] += 1
    except Exception as error:
        outcome, message = "crash", error_lines(error)
        if verbose:
            traceback.print_exc(file=sys.stdout)
    exact_seconds = time.perf_counter() - started
    if verbose:
        print(f"--- exact mode: {outcome}\n{message}\n")
    if outcome in ("false alarm", "crash"):
        tally.failures.append(Failure(outcome, str(spec), message))
    if sc is not None and spec.cost and outcome == "pass":
        began = time.perf_counter()
        default, _ = _attempt(sc, pools, exact=False)
        tally.costs.append((spec.backend, exact_seconds, time.perf_counter() - began, default))
    if sc is not None and spec.sens and outcome == "pass":
        for exact in (True, False):
            for where in WHERE:
                caught, text = _attempt(sc, pools, exact=exact, inject=where)
                result = {"mismatch": "caught", "pass": "missed"}.get(caught, caught)
                tally.injections.append(Injection(str(spec), spec.backend, where, exact, result, text))
                if verbose:
                    print(f"--- one ulp in {where}, {'exact' if exact else 'default'} mode: {result}\n{text}\n")
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


# --------------------------------------------------------------------------------------
# Report.


def report(tally: Tally, seed: int, show: int) -> None:
    per = 1000 * tally.seconds / max(tally.scenarios, 1)
    print(f"\n{tally.scenarios} exact scenarios (seed {seed}) in {tally.seconds:.0f} s, {per:.0f} ms per scenario "
          "(injections and default-mode timings included)\n")
    print("| | count |")
    print("|---|---:|")
    print(f"| scenarios checked with exact=True | {tally.scenarios} |")
    print(f"| passed, bit-identical | {tally.passes} |")
    print(f"| refused (InvalidArgument) | {tally.refused} |")
    print(f"| false alarms (ParallelMismatch on correct code) | {tally.false_alarms} |")
    print(f"| crashes (any other exception) | {tally.crashes} |")
    if tally.refusals:
        print("\nRefusals, why: " + "; ".join(f"{r} ({n})" for r, n in tally.refusals.most_common()))

    inj = tally.injections
    print(f"\nSensitivity: one ulp injected into the parallel step's reduced gradient of the first parameter, "
          f"on every {SENSITIVITY_EVERY}th scenario that passed ({len({i.spec for i in inj})} scenarios).\n")
    print("| backend | injected | exact mode: caught | default mode: caught | refused | crashes |")
    print("|---|---|---:|---:|---:|---:|")
    for backend in BACKENDS:
        for where in WHERE:
            rows = [i for i in inj if i.backend == backend and i.where == where]
            if not rows:
                continue
            ex = [i for i in rows if i.exact]
            de = [i for i in rows if not i.exact]
            print(f"| {backend} | one ulp, {'whole tensor' if where == 'whole' else 'one element'} | "
                  f"{sum(i.outcome == 'caught' for i in ex)}/{len(ex)} | {sum(i.outcome == 'caught' for i in de)}/{len(de)} | "
                  f"{sum(i.outcome == 'refused' for i in rows)} | {sum(i.outcome == 'crash' for i in rows)} |")

    if tally.costs:
        print(f"\nCost: every {COST_EVERY}th scenario that passed, checked again in the default mode (float32, the "
              "float64-anchored tolerance), both timed in this run.\n")
        print("| backend | scenarios | exact mode, median s | default mode, median s | ratio of medians | ratio of totals | default mode passed |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for backend in ("all", *BACKENDS):
            timed = [c for c in tally.costs if backend in ("all", c[0])]
            if not timed:
                continue
            exact_s, default_s = [c[1] for c in timed], [c[2] for c in timed]
            print(f"| {backend} | {len(timed)} | {statistics.median(exact_s):.3f} | {statistics.median(default_s):.3f} | "
                  f"{statistics.median(exact_s) / statistics.median(default_s):.2f}x | {sum(exact_s) / sum(default_s):.2f}x | "
                  f"{sum(c[3] == 'pass' for c in timed)}/{len(timed)} |")

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
    odd = [i for i in inj if i.exact and i.outcome != "caught"]
    if odd and show:
        print("\nInjections exact mode did not catch:")
        for i in odd[:show]:
            print(f"- {i.where} {i.outcome}: {i.spec}\n    {i.message}")


def main(argv: Sequence[str] | None = None) -> Tally:
    tally, pools = Tally(), Pools()
    try:
        return drive(  # type: ignore[no-any-return]
            argv, description=(__doc__ or "").splitlines()[0], scenarios=10000, tally=tally, generate=generate,
            parse=Spec.parse, run=lambda spec, verbose: run_scenario(spec, tally, pools, verbose=verbose),
            report=lambda seed, show: report(tally, seed, show), describe=lambda spec: f"classes: {', '.join(spec.classes)}",
            progress=lambda: f"{tally.false_alarms} false alarms, {tally.crashes} crashes, {tally.refused} refused, {tally.seconds:.0f} s",
        )
    finally:
        pools.close()


if __name__ == "__main__":
    import calibrate_exact  # the injected steps are pickled to the ranks by this module's name

    calibrate_exact.main()
