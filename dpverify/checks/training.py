"""DataParallel training: the user's optimizer steps through a DataParallel wrapper against
single-device training on the full batches.

One gradient step on deep copies cannot see what a training step carries from one forward
to the next: torch's ``replicate`` runs each forward on replicas whose ``__dict__`` is a
shallow copy of the module's, so attributes a forward assigns (``self.calls += 1``,
``self.cache = x.detach()``) are set on the replicas and lost, and of the buffers it
updates in place only replica 0's update, made from its chunk, reaches the module
(docs/semantics.md, section 5, Replicate). ``assert_dp_training_matches`` trains both ways
for several steps and compares, after every step, the outputs and the loss of the step,
then the parameters, buffers, optimizer state and Python attributes it left.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.parallel.scatter_gather import scatter_kwargs

from dpverify.checks.dp import Check, Parallel, ParallelLoss, raise_unless_ok
from dpverify.core.comparison import (
    Msg,
    StepComparison,
    TensorComparison,
    TensorId,
    compare_tensors,
    steps_with_second_look,
)
from dpverify.core.errors import InvalidArgument
from dpverify.core.numerics import jitter_for
from dpverify.core.step import (
    LossFn,
    as_inputs,
    batch_size_of,
    convert_tensors,
    copy_module,
    default_dtype,
    flatten_tensors,
    jitter_parameters,
    quiet_size_warnings,
    seed_step,
)
from dpverify.core.text import plural
from dpverify.core.tree import first_batched
from dpverify.core.validation import require_callable, require_mapping, require_target_rows
from dpverify.core.virtual import virtual_primitives
from dpverify.exact.proof import Proof, Prover, proving
from dpverify.ranked.rank import (
    AfterBackward,
    RankContext,
    ReferenceContext,
    after_backward_note,
    one_rank_group,
    one_rank_group_held,
)

__all__ = ["DPContext", "assert_dp_training_matches", "training_matches"]

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
#: One batch of a training run: ``(inputs, kwargs, target)``.
_Batch = tuple[tuple[Any, ...], dict[str, Any], Any]
#: An attribute whose value cannot be compared (a function, a module-level object).
_OPAQUE = object()


@dataclass
class DPContext(RankContext):
    """What an ``after_backward`` hook sees in the DataParallel run: the one process that
    runs every replica (``rank`` 0, ``world_size`` 1, the full batch), ``reference`` False,
    ``module`` the module DataParallel wraps (its ``.grad`` holds the replicas' summed
    gradients), ``group`` a process group of this process alone, as in the single-device
    reference (``ReferenceContext``)."""

    one_rank: Any = None

    @property
    def group(self) -> Any:
        return self.one_rank

    @property
    def wrapped(self) -> bool:
        return True


# --------------------------------------------------------------------------- validation


def _batches(batches: Any, forward_kwargs: Mapping[str, Any]) -> list[_Batch]:
    """``(inputs, kwargs, target)`` per step from ``(inputs, target)`` pairs and
    ``(inputs, kwargs, target)`` triples; ``forward_kwargs`` go to every batch (a triple's
    own keyword arguments win)."""
    if isinstance(batches, (str, bytes)) or not isinstance(batches, Sequence) or not batches:
        raise InvalidArgument(
            f"batches={batches!r}: pass a non-empty list of (inputs, target) pairs or (inputs, kwargs, target) "
            "triples, one per optimizer step"
        )
    found: list[_Batch] = []
    for index, entry in enumerate(batches):
        if not isinstance(entry, (tuple, list)) or len(entry) not in (2, 3):
            raise InvalidArgument(f"batches[{index}] is not an (inputs, target) pair or an (inputs, kwargs, target) triple")
        own = dict(require_mapping(entry[1], f"batches[{index}][1]", "{'attention_mask': mask}")) if len(entry) == 3 else {}
        kwargs = {**forward_kwargs, **own}
        inputs = as_inputs(entry[0], keywords=bool(kwargs))
        batch_size_of(inputs, argument=f"batches[{index}] inputs", kwargs=kwargs)
        found.append((inputs, kwargs, entry[-1]))
    return found


# --------------------------------------------------------------------------- one training run


@dataclass
class _Snapshot:
    """What one optimizer step left, detached on the CPU."""

    outputs: dict[str, torch.Tensor]
    loss: torch.Tensor
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    optimizer: dict[tuple[str, str], Any]
    attributes: dict[tuple[str, str], Any]
    #: replica forwards seen in the step (the DataParallel run; 0 on one device)
    forwards: int = 0
    #: rows each replica forward received, in the order they ran
    rows: tuple[int, ...] = ()


@dataclass
class _Training:
    steps: list[_Snapshot] = field(default_factory=list)
    #: the Python attributes before the first step
    initial: dict[tuple[str, str], Any] = field(default_factory=dict)
    #: exact mode: what ``proving`` established over the run, optimizer steps included
    proof: Proof | None = None


@dataclass
class _Watch:
    """Where a training run under ``proving`` is (exact mode), for its refusals; a run
    outside exact mode has no ``prover``."""

    prover: Prover | None = None
    step: int = 0

    def at(self, step: int, stage: str) -> None:
        """The run enters ``stage`` (the loss, the hook, the optimizer step) of ``step``."""
        self.step = step
        if self.prover is not None:
            self.prover.stage = f"{stage} of step {step}"


@contextlib.contextmanager
def _proving_training(model: nn.Module, steps: int, exact: bool) -> Iterator[_Watch]:
    """In exact mode, ``proving`` over a training run of ``model``: every operation of
    its ``steps`` steps, optimizer steps included, is shown exact, and a refusal says in
    which step it came.

    Raises:
        InvalidArgument: an operation cannot be shown exact.
    """
    watch = _Watch()
    if not exact:
        yield watch
        return
    try:
        with proving(model) as prover:
            watch.prover = prover
            yield watch
    except InvalidArgument as refusal:
        if watch.prover is None or watch.prover.refusal is None:
            raise
        text = f"{refusal} (in step {watch.step} of {steps} of the single-device training"
        proof = watch.prover.proof()
        if watch.step > 1 and proof.bits > proof.precision:
            # digits that no longer fit after exact steps: the weights' new ones, not the model's size
            text += (
                "; every optimizer step adds the digits of the learning rate times the gradient to the weights, "
                f"so exact training lasts a few steps: pass at most {plural(watch.step - 1, 'batch', 'batches')}"
            )
        raise InvalidArgument(text + ")") from None


def _plain(value: Any) -> Any:
    """A comparable copy of an attribute's value: tensors detached on the CPU, numbers,
    strings and containers of them; ``_OPAQUE`` for anything else."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        items = tuple(_plain(v) for v in value)
        return _OPAQUE if any(i is _OPAQUE for i in items) else items
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        pairs = tuple((k, _plain(v)) for k, v in sorted(value.items()))
        return _OPAQUE if any(v is _OPAQUE for _k, v in pairs) else pairs
    return _OPAQUE


def _attributes(model: nn.Module) -> dict[tuple[str, str], Any]:
    """Every submodule's public Python attributes (``vars``, not parameters, buffers or
    submodules, which live in their own dictionaries), by (module path, name)."""
    found: dict[tuple[str, str], Any] = {}
    for path, sub in model.named_modules():
        for name, value in vars(sub).items():
            if name.startswith("_") or name == "training":
                continue
            plain = _plain(value)
            if plain is not _OPAQUE:
                found[(path, name)] = plain
    return found


def _optimizer_state(opt: torch.optim.Optimizer, names: Mapping[int, str]) -> dict[tuple[str, str], Any]:
    """The optimizer's per-parameter state (``momentum_buffer``, ``exp_avg``, ``step``...),
    by (parameter name, key)."""
    found: dict[tuple[str, str], Any] = {}
    for param, state in opt.state.items():
        name = names.get(id(param))
        if name is None:
            continue
        for key, value in state.items():
            found[(name, str(key))] = value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value
    return found


class _Forwards:
    """Counts the replica forwards of a step and the rows each received (forward pre-hook on
    the module; replicas share its hooks): the evidence that replicas really ran."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.rows: list[int] = []
        self._lock = threading.Lock()

    def see(self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        first = first_batched((args, kwargs))
        rows = int(first.shape[self.dim]) if first is not None and first.dim() > self.dim else 0
        with self._lock:  # replicas run in concurrent threads
            self.rows.append(rows)

    def take(self) -> tuple[int, ...]:
        with self._lock:
            rows, self.rows = tuple(self.rows), []
        return rows


def _loss_of(loss_fn: LossFn, target: Any, output: Any) -> torch.Tensor:
    return loss_fn(output, target)


def _train(
    check: Check,
    batches: Sequence[_Batch],
    loss_fn: LossFn,
    optimizer: OptimizerFactory,
    after_backward: AfterBackward | None,
    *,
    parallel: bool,
    dtype: torch.dtype | None,
    exact: bool = False,
    jitter: float = 0.0,
) -> _Training:
    """``len(batches)`` optimizer steps on a copy of ``check.module``, through the wrapper
    (``parallel``) or alone, in ``dtype`` (None: the module's own): zero the gradients,
    forward the full batch, ``loss_fn`` on the (gathered) output, backward,
    ``after_backward(ctx)``, optimizer step; a snapshot after each step. ``exact``: the
    whole run under ``proving`` (``_proving_training``). ``jitter``: the copy's parameters
    start that far off (``jitter_parameters``), a further sample of rounding."""
    device = check.device
    model = copy_module(check.module, dtype).to(device)
    if jitter:
        jitter_parameters(model, jitter)
    names = {id(p): name for name, p in model.named_parameters()}
    opt = optimizer(model.parameters())
    forwards = _Forwards(check.dim)
    if parallel:
        model.register_forward_pre_hook(forwards.see, with_kwargs=True)
    run = _Training(initial=_attributes(model))
    fork = [device] if device.type == "cuda" else []
    devices = check.devices() if parallel else contextlib.nullcontext()
    group = one_rank_group() if after_backward is not None else contextlib.nullcontext()
    proof = _proving_training(model, len(batches), exact)
    with torch.random.fork_rng(devices=fork), default_dtype(dtype), devices, group as one_rank, proof as watch:
        runner: Callable[..., Any] = check.wrap(model) if parallel else model  # built where it runs
        seed_step(0, device)
        for index, (inputs, kwargs, target) in enumerate(batches):
            watch.at(index + 1, "the loss")
            args, keywords, goal = (convert_tensors(part, dtype, device) for part in (inputs, kwargs, target))
            opt.zero_grad(set_to_none=True)
            output = runner(*args, **keywords)
            loss = (check.parallel_loss_of(loss_fn, goal) if parallel else quiet_size_warnings(functools.partial(_loss_of, loss_fn, goal)))(output)
            loss.backward()
            if after_backward is not None:
                watch.at(index + 1, "after_backward")
                rows = batch_size_of(tuple(args), dim=check.dim, kwargs=keywords)
                context = DPContext if parallel else ReferenceContext
                ctx = context(
                    rank=0, world_size=1, module=model, inputs=tuple(args), target=goal, loss_fn=loss_fn,
                    shard_sizes=(rows,), device=device, kwargs=dict(keywords), step_index=index, one_rank=one_rank,
                )
                with after_backward_note(after_backward):
                    after_backward(ctx)
            watch.at(index + 1, "the optimizer step")
            opt.step()
            seen = forwards.take()
            run.steps.append(_Snapshot(
                outputs={path: t.detach().to("cpu", copy=True) for path, t in flatten_tensors(output, "output")},
                loss=loss.detach().to("cpu", copy=True),
                params={name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters()},
                buffers={name: b.detach().to("cpu", copy=True) for name, b in model.named_buffers()},
                optimizer=_optimizer_state(opt, names),
                attributes=_attributes(model),
                forwards=len(seen),
                rows=seen,
            ))
        run.proof = watch.prover.proof() if watch.prover is not None else None
    return run


# --------------------------------------------------------------------------- comparison


def _rows_of_step(
    check: Check, index: int, actual: _Snapshot, expected: _Snapshot, anchor: _Snapshot | None,
    jittered: _Snapshot | None = None,
) -> list[TensorComparison]:
    """Step ``index``'s outputs (but a model/criterion pair's, one per replica) and loss, then
    the parameters, buffers and optimizer state it left, against one device's
    (float64-anchored), with ``jittered``'s tensors as a further sample of rounding."""
    variant = f"step {index + 1}"
    tolerance = check.tolerance
    rows: list[TensorComparison] = []

    def compare(tensor_id: TensorId, got: Any, want: Any, anchored: Any, sample: Any = None) -> None:
        if isinstance(want, torch.Tensor) and not want.is_floating_point():
            rows.append(_exact(tensor_id, got, want))
        elif isinstance(want, torch.Tensor) or want is None:
            second = sample if isinstance(sample, torch.Tensor) and isinstance(want, torch.Tensor) and sample.shape == want.shape else None
            rows.append(compare_tensors(tensor_id, got, want, anchored, tolerance, jitter=second))
        elif got != want:  # a number kept outside a tensor (an optimizer's step count)
            rows.append(TensorComparison(tensor_id, (), 1, mismatched=1, problem=f"is {got!r} under DataParallel, {want!r} on one device"))

    def each(kind: Callable[[Any], TensorId], pick: Callable[[_Snapshot], Mapping[Any, Any]]) -> None:
        anchored = pick(anchor) if anchor is not None else {}
        samples = pick(jittered) if jittered is not None else {}
        got = pick(actual)
        for key, value in pick(expected).items():
            compare(kind(key), got.get(key), value, anchored.get(key), samples.get(key))

    if check.parallel_loss is None:  # a model/criterion pair's wrapper leaves one output per replica
        each(lambda path: TensorId("output", path, variant=variant), lambda s: s.outputs)
    compare(
        TensorId("loss", variant=variant), actual.loss, expected.loss, anchor.loss if anchor is not None else None,
        jittered.loss if jittered is not None else None,
    )
    each(lambda name: TensorId("param", name, variant=variant), lambda s: s.params)
    each(lambda name: TensorId("buffer", name, variant=variant), lambda s: s.buffers)
    each(lambda key: TensorId(f"optimizer {key[1]}", key[0], variant=variant), lambda s: s.optimizer)
    return rows


def _exact(tensor_id: TensorId, actual: torch.Tensor | None, expected: torch.Tensor) -> TensorComparison:
    if actual is None:
        return TensorComparison(tensor_id, tuple(expected.shape), expected.numel(), mismatched=expected.numel(), problem="is missing under DataParallel")
    differs = int((actual != expected).sum()) if actual.shape == expected.shape else expected.numel()
    problem = None
    if differs:
        problem = f"is {_short(actual)} under DataParallel, {_short(expected)} on one device"
    return TensorComparison(tensor_id, tuple(expected.shape), expected.numel(), mismatched=differs, problem=problem)


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return repr(value.tolist()) if value.numel() <= 8 else f"a tensor of shape {list(value.shape)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _same(actual: Any, expected: Any, anchor: Any) -> bool:
    """Whether two attribute values agree: exactly, but floating tensors and floats within
    the rounding the float64 run shows (ten times ``|expected - anchor|``, at least a few
    units of float32 roundoff)."""
    if isinstance(expected, torch.Tensor) or isinstance(actual, torch.Tensor):
        if not (isinstance(expected, torch.Tensor) and isinstance(actual, torch.Tensor)) or actual.shape != expected.shape:
            return False
        if not expected.is_floating_point():
            return bool(torch.equal(actual, expected))
        gap = (actual.double() - expected.double()).abs()
        bound = 1e-5 * expected.double().abs() + 1e-6
        if isinstance(anchor, torch.Tensor) and anchor.shape == expected.shape:
            bound = torch.maximum(bound, 10 * (expected.double() - anchor.double()).abs())
        return bool((gap <= bound).all())
    if isinstance(expected, float) and isinstance(actual, (int, float)) and not isinstance(actual, bool):
        room = max(1e-5 * abs(expected) + 1e-6, 10 * abs(expected - anchor) if isinstance(anchor, (int, float)) else 0.0)
        return math.isclose(actual, expected, abs_tol=room) or (math.isnan(actual) and math.isnan(expected))
    if isinstance(expected, tuple) and isinstance(actual, tuple) and len(actual) == len(expected):
        anchors = anchor if isinstance(anchor, tuple) and len(anchor) == len(expected) else (None,) * len(expected)
        return all(_same(a, e, n) for a, e, n in zip(actual, expected, anchors, strict=True))
    return bool(actual == expected)


@dataclass(frozen=True)
class _LostAttribute:
    module: str
    type_name: str
    name: str
    parallel: Any
    single: Any
    initial: Any
    step: int
    #: the values after the last step (DataParallel, one device), when it is a later one
    last: tuple[Any, Any] | None = None

    @property
    def where(self) -> str:
        return f"of the root module ({self.type_name})" if not self.module else f"of module '{self.module}' ({self.type_name})"

    @property
    def lost(self) -> bool:
        """The DataParallel run left the attribute as it was before training."""
        return self.initial is not _OPAQUE and _same(self.parallel, self.initial, None)


def _attribute_differences(
    model: nn.Module, actual: _Training, expected: _Training, anchor: _Training | None,
) -> list[_LostAttribute]:
    """The Python attributes that differ from one device's after some step: each at the
    first step it differs."""
    found: dict[tuple[str, str], _LostAttribute] = {}
    for index, (got, want) in enumerate(zip(actual.steps, expected.steps, strict=True)):
        anchored = anchor.steps[index].attributes if anchor is not None else {}
        for key, value in want.attributes.items():
            if key in found:
                continue
            other = got.attributes.get(key, _OPAQUE)
            if other is not _OPAQUE and _same(other, value, anchored.get(key)):
                continue
            path, name = key
            final = (actual.steps[-1].attributes.get(key, _OPAQUE), expected.steps[-1].attributes.get(key, _OPAQUE))
            found[key] = _LostAttribute(
                path, type(model.get_submodule(path)).__name__, name, other, value,
                actual.initial.get(key, _OPAQUE), index, final if index < len(expected.steps) - 1 else None,
            )
    return list(found.values())


def _first_bad_step(per_step: Sequence[Sequence[TensorComparison]]) -> int | None:
    return next((index for index, rows in enumerate(per_step) if not all(row.ok for row in rows)), None)


def _first_output_step(per_step: Sequence[Sequence[TensorComparison]]) -> int | None:
    return next(
        (index for index, rows in enumerate(per_step) if any(not row.ok and row.id.kind in ("output", "loss") for row in rows)),
        None,
    )


def _attribute_failure(differences: Sequence[_LostAttribute], output_step: int | None, tensors_match: bool) -> str:
    lines = []
    def shown(value: Any) -> str:
        return "missing" if value is _OPAQUE else _short(value)

    for d in differences:
        line = f"  - attribute {d.name!r} {d.where}: {shown(d.parallel)} under DataParallel, {shown(d.single)} on one device, after step {d.step + 1}"
        if d.last is not None:
            line += f"; {shown(d.last[0])} and {shown(d.last[1])} after the last"
        lines.append(line + (" (under DataParallel it kept its value from before training)" if d.lost else ""))
    lost = [d for d in differences if d.lost]
    head = (
        "Python attributes that the forward sets differ from one device's"
        if not lost
        else "The replicas' attribute changes are lost: attributes set in forward keep their value from before training"
    )
    text = f"{head}:\n" + "\n".join(lines) + "\n"
    text += (
        "DataParallel runs every forward on replicas, copies of the module whose __dict__ is a shallow copy of its "
        "own (torch.nn.parallel.replicate): an attribute a forward assigns (self.calls += 1, self.cache = x) is set "
        "on the replica and lost with it, on every replica, replica 0 included, so each forward sees the value from "
        "before training. "
    )
    if len(lost) < len(differences):
        text += (
            "A mutable attribute (a list, a dict) is not copied: every replica changes the same object, once per "
            "replica, each with its own chunk. "
        )
    if output_step is not None:
        text += f"The outputs first diverge at step {output_step + 1}. "
    elif tensors_match:
        text += "The outputs, parameters, buffers and optimizer state match here, but the module's Python state does not. "
    text += (
        "Keep such state in a buffer updated in place (self.register_buffer('calls', torch.zeros((), "
        "dtype=torch.long)); self.calls.add_(1): replica 0 updates the module's own buffer), or set it outside "
        "the forward (in the training loop, or in after_backward from ctx.step_index)."
    )
    return text


def _replica_zero_buffers(check: Check, first: _Batch, replica_rows: int) -> dict[str, torch.Tensor] | None:
    """The buffers of the module after a forward of replica 0's chunk alone (the rows torch's
    scatter gives it) from the weights before training; None when it cannot run."""
    inputs, kwargs, _target = first
    try:
        with torch.no_grad(), virtual_primitives(views_only=True):
            scattered, scattered_kwargs = scatter_kwargs(inputs, kwargs, check.device_ids, check.dim)
        args, keywords = tuple(scattered[0]), dict(scattered_kwargs[0])
        if batch_size_of(args, dim=check.dim, kwargs=keywords) != replica_rows:
            return None  # the wrapper split the batch its own way
        model = copy_module(check.module, None)
        with torch.random.fork_rng(devices=[]):
            seed_step(0, torch.device("cpu"))
            model(*convert_tensors(args, None, torch.device("cpu")), **convert_tensors(keywords, None, torch.device("cpu")))
        return {name: b.detach() for name, b in model.named_buffers()}
    except Exception:  # a second look that cannot be had leaves the first verdict standing
        return None


def _buffer_note(check: Check, bad: Sequence[TensorComparison], step: int, actual: _Training, first: _Batch) -> str:
    """Why buffers differ: DataParallel keeps replica 0's in-place updates, made from its
    chunk; at step 1, checked against a forward of that chunk alone."""
    names = sorted({row.id.name for row in bad})
    quoted = ", ".join(repr(n) for n in names)
    rows = actual.steps[step].rows
    text = (
        f"Buffers {quoted} differ from the single-device full-batch update from step {step + 1}. DataParallel "
        "keeps replica 0's buffers: replica 0 updates the module's own buffers in place, the other replicas update "
        "copies that are dropped (torch.nn.parallel.replicate), so a running statistic updated in forward (an EMA "
        "of batch means, a usage count) follows replica 0's chunk"
    )
    text += f" ({plural(rows[0], 'row')} of {sum(rows)})" if rows else ""
    text += ", not the full batch one device sees."
    if step == 0 and rows:
        zero = _replica_zero_buffers(check, first, rows[0])
        if zero is not None and all(
            name in zero and zero[name].shape == actual.steps[0].buffers[name].shape
            and torch.allclose(zero[name].double(), actual.steps[0].buffers[name].double(), rtol=1e-5, atol=1e-6)
            for name in names
        ):
            text += f" Here {'they equal' if len(names) > 1 else 'it equals'} the update from replica 0's chunk alone."
    text += (
        " Compute the statistic over the full batch outside the DataParallel forward (before the call, or in "
        "after_backward from ctx.inputs), or accept replica 0's as BatchNorm does."
    )
    return text


# --------------------------------------------------------------------------- the check


def assert_dp_training_matches(
    module: nn.Module,
    batches: Sequence[tuple[Any, ...]],
    *,
    loss_fn: LossFn,
    optimizer: OptimizerFactory,
    device_ids: Sequence[int],
    output_device: int | None = None,
    parallel: Parallel | None = None,
    parallel_loss_fn: ParallelLoss | None = None,
    after_backward: AfterBackward | None = None,
    forward_kwargs: Mapping[str, Any] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    msg: Msg = None,
    dim: int = 0,
    exact: bool = False,
) -> StepComparison:
    """Asserts ``len(batches)`` optimizer steps through DataParallel match one device.

    Trains a deep copy of ``module`` through ``parallel`` and another alone, each with
    ``optimizer(params)``: for each batch, zero the gradients, forward the full batch, call
    ``loss_fn`` on the (gathered) output, backward, ``after_backward(ctx)``, step the
    optimizer. After every step the step's outputs and loss, and the parameters, buffers,
    optimizer state (``momentum_buffer``, ``exp_avg``...) and Python attributes of every
    submodule it left, must match single-device training on the full batches
    (float64-anchored tolerance: the float64 run trains float64 copies with the same
    optimizer); the message shows the first step that differs. ``module`` is left untouched.

    What this sees that a one-step check cannot: attributes a forward assigns
    (``self.calls += 1``) are lost under DataParallel, set on replicas that are thrown away,
    so a forward that uses them diverges from the second step on; and a buffer updated in
    forward from the rows it sees keeps replica 0's update, made from its chunk alone, not
    the full-batch update of one device (BatchNorm's running statistics do this too: a
    train-mode BatchNorm is listed as the likely cause).

    Args:
        module: the model to train.
        batches: one ``(inputs, target)`` pair, or ``(inputs, kwargs, target)`` triple
            (``kwargs``: that batch's keyword forward arguments), per optimizer step.
        loss_fn: ``loss_fn(output, target)`` returns a scalar mean loss.
        optimizer: factory ``params -> Optimizer``, e.g.
            ``functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)``.
        device_ids: DataParallel's devices (virtual ids when CUDA devices are missing).
        output_device: where outputs are gathered (default ``device_ids[0]``, -1 for host).
        parallel: the DataParallel implementation under test, as ``assert_dp_grads_match``
            takes it (default ``dpverify.data_parallel``).
        parallel_loss_fn: the criterion half of a model/criterion pair, as
            ``assert_dp_grads_match`` takes it: the parallel run's loss is its
            ``loss(outputs, target)``, the single-device run's ``loss_fn``.
        after_backward: your code between backward and the optimizer step, ``hook(ctx)``:
            gradient clipping, unscaling. It runs after each backward in both runs, with
            ``ctx.module`` the module being trained (under DataParallel the wrapped module,
            whose ``.grad`` holds the replicas' summed gradients), ``ctx.inputs`` and
            ``ctx.target`` the full batch, ``ctx.step_index`` the step, ``ctx.reference``
            True on one device, ``ctx.group`` a process group of this process alone.
        forward_kwargs: keyword arguments of every batch's forward (scattered like its rows).
        rtol: explicit relative tolerance (with ``atol``) instead of the anchored rule.
        atol: explicit absolute tolerance (with ``rtol``).
        msg: replaces the failure message, or a callable that rewrites it.
        dim: the dimension DataParallel splits the batch along.
        exact: compare without tolerance, where the arithmetic is exact (as
            ``assert_dp_grads_match(exact=True)``): both runs train dyadic float64 copies
            of the module and of every batch; the first batch's step is proven exact
            (``dpverify.exact.case.prove``), and the single-device training runs under
            ``dpverify.exact.proof.proving``, so every operation of every step, the
            optimizer's included, is shown exact. The optimizer's numbers must be short
            dyadic ones (SGD with ``lr=2**-3``; 0.1 or a momentum of 0.9 is refused), and
            every step adds digits to the weights: exact training lasts a few steps on
            small models (one to four for two linear layers), and a step whose digits no
            longer fit float64 is refused, naming the step. Not with ``rtol``/``atol``.

    Returns:
        The comparison of the first step that differs, else of the last step.

    Raises:
        ParallelMismatch: a tensor differs after some step, an attribute set in forward is
            lost, or the replicas did not run in parallel.
        InvalidArgument: an argument cannot be used (``batches`` empty, ``optimizer`` or
            ``after_backward`` not callable, a module without parameters to train); in
            exact mode, an operation that cannot be shown exact (named, with the step).
    """
    __tracebackhide__ = True
    factory = "a factory params -> Optimizer, e.g. functools.partial(torch.optim.SGD, lr=0.1)"
    if isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidArgument(
            f"optimizer is a {type(optimizer).__name__} instance, built over other parameters than the copies each "
            f"run trains; pass {factory}"
        )
    require_callable(optimizer, "optimizer", factory)
    require_callable(loss_fn, "loss_fn", "loss_fn(output, target) -> a scalar loss, e.g. torch.nn.functional.mse_loss")
    if after_backward is not None:
        require_callable(after_backward, "after_backward", "hook(ctx), e.g. one calling clip_grad_norm_(ctx.module.parameters(), 1.0)")
    keywords = dict(require_mapping(forward_kwargs, "forward_kwargs", "{'attention_mask': mask}")) if forward_kwargs is not None else {}
    found = _batches(batches, keywords)
    inputs, first_kwargs, _target = found[0]
    check = Check.create(
        module, inputs, device_ids=device_ids, output_device=output_device, parallel=parallel, rtol=rtol, atol=atol,
        forward_kwargs=first_kwargs or None, dim=dim, parallel_loss_fn=parallel_loss_fn, exact=exact,
    )
    if dim == 0:
        for index, (args, kwargs, target) in enumerate(found):
            require_target_rows(target, batch_size_of(args, kwargs=kwargs), argument=f"batches[{index}] target")
    title = f"{len(found)} steps of DataParallel training with {_callable_name(optimizer)} must match single-device training"
    return raise_unless_ok(training_matches(check, found, loss_fn, optimizer, after_backward, title=title), msg)


def training_matches(
    check: Check, batches: Sequence[_Batch], loss_fn: LossFn, optimizer: OptimizerFactory,
    after_backward: AfterBackward | None = None, *, title: str = "DataParallel training must match single-device training",
) -> StepComparison:
    """``assert_dp_training_matches`` on a built ``check`` and validated ``batches``,
    returning its comparison whatever it found; in exact mode (``check.exact``) the
    batches are put on the grid here. The hook of every run gets one group of this process
    alone (``one_rank_group_held``): a gloo group costs about 10 ms to tear down, ten times
    a small model's run."""
    with one_rank_group_held():
        return _training_matches(check, batches, loss_fn, optimizer, after_backward, title=title)


def _training_matches(
    check: Check, batches: Sequence[_Batch], loss_fn: LossFn, optimizer: OptimizerFactory,
    after_backward: AfterBackward | None, *, title: str,
) -> StepComparison:
    batches = [(check.on_grid(args), check.on_grid(kwargs), check.on_grid(target)) for args, kwargs, target in batches]
    proven = check.proven(loss_fn, batches[0][2])
    expected = _train(check, batches, loss_fn, optimizer, after_backward, parallel=False, dtype=None, exact=check.exact)
    try:
        actual = _train(check, batches, loss_fn, optimizer, after_backward, parallel=True, dtype=None)
    except Exception as error:
        error.add_note(f"dpverify: raised by the DataParallel training run. Scenario: {check.scenario}.")
        raise
    anchor = None if check.tolerance.explicit else _train(check, batches, loss_fn, optimizer, after_backward, parallel=False, dtype=torch.float64)
    per_step = _per_step_rows(check, actual, expected, anchor, lambda: _jittered(check, batches, loss_fn, optimizer, after_backward))
    differences = _attribute_differences(check.module, actual, expected, anchor)
    bad_step = _first_bad_step(per_step)
    shown = bad_step if bad_step is not None else len(per_step) - 1
    rows = per_step[shown]
    failures: list[str] = []
    notes = [
        f"Outputs, loss, parameters, buffers, optimizer state and Python attributes compared after each of the "
        f"{len(batches)} optimizer steps; the table shows step {shown + 1}."
    ]
    first_attribute = min((d.step for d in differences), default=None)
    where = [f"{what} from step {step + 1}" for what, step in (("attributes", first_attribute), ("tensors", bad_step)) if step is not None]
    if where:
        first = min(step for step in (first_attribute, bad_step) if step is not None)
        notes.insert(0, f"The first step that differs: step {first + 1} of {len(batches)} ({', '.join(where)}).")
    if differences:
        failures.append(_attribute_failure(differences, _first_output_step(per_step), bad_step is None))
    bad_buffers = [row for row in rows if row.id.kind == "buffer" and not row.ok]
    if bad_buffers:
        notes.append(_buffer_note(check, bad_buffers, shown, actual, batches[shown]))
    if after_backward is not None:
        notes.append(f"{_callable_name(after_backward)}(ctx) ran after every backward, under DataParallel and on one device.")
    if expected.proof is not None:
        notes += [*proven, f"The single-device training, optimizer steps included: {expected.proof.describe()}."]
    ran = min((s.forwards for s in actual.steps), default=0)
    failures += check.replica_failures(ran)
    return check.outcome(title, rows, notes=notes, failures=failures, replicas=ran)


def _per_step_rows(
    check: Check, actual: _Training, expected: _Training, anchor: _Training | None, jittered: Callable[[], _Training],
) -> list[list[TensorComparison]]:
    """The rows of every step, a failing one compared again with the ``jittered`` run's
    tensors (``steps_with_second_look``; none with explicit tolerances)."""

    def rows_of(index: int, second: _Training | None) -> list[TensorComparison]:
        anchored = anchor.steps[index] if anchor is not None else None
        sample = second.steps[index] if second is not None else None
        return _rows_of_step(check, index, actual.steps[index], expected.steps[index], anchored, sample)

    return list(steps_with_second_look(len(expected.steps), rows_of, jittered if anchor is not None else None))


def _jittered(
    check: Check, batches: Sequence[_Batch], loss_fn: LossFn, optimizer: OptimizerFactory, after_backward: AfterBackward | None,
) -> _Training:
    """Single-device training from parameters a few units of roundoff off (``jitter_for``,
    as the ranked training checks' second sample)."""
    dtype, size = jitter_for(check.dtype)
    return _train(check, batches, loss_fn, optimizer, after_backward, parallel=False, dtype=dtype, jitter=size)


def _callable_name(fn: Any) -> str:
    # imported on use: dpverify.ranked.check brings the rank pool's modules
    from dpverify.ranked.check import callable_name

    return callable_name(fn)
