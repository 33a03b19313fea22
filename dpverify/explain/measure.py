"""``dpverify explain``: the questions people ask about DataParallel, answered by measurement.

One DataParallel step of the given model runs over virtual devices (torch's own
orchestration code, see ``dpverify.core.virtual``), or through the user's wrapper inside
``dpverify.virtual_devices(n)``, with hooks that record what each replica received, held
and contributed; further runs take the other measurements ``explain`` lists.

This module only measures: ``explain`` returns an ``Explanation`` (frozen dataclasses of
facts, JSON-ready). ``dpverify.explain.answers`` words it, and ``dpverify.cli.explain_view``
draws both with rich or writes them as JSON.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import Any, TypeVar, cast

import torch
from torch import nn

from dpverify.checks.loss_average import (
    LossAverageReport,
    check_forward_loss_average,
    chunk_weighted_loss,
    extract_loss,
)
from dpverify.core.devices import device_index
from dpverify.core.divergence import ONE_ROW_BATCHNORM, divergence_sources
from dpverify.core.errors import InvalidArgument
from dpverify.core.scatter import plan_scatter
from dpverify.core.step import (
    ReplicaGradRecorder,
    ReplicaRecord,
    batch_size_of,
    convert_tensors,
    parameter_sites,
    quiet_size_warnings,
    run_step,
    seed_step,
)
from dpverify.core.tracebacks import describe_exception
from dpverify.core.tree import first_batched, map_tensors, tensor_leaves
from dpverify.core.virtual import (
    SCALAR_GATHER_WARNING,
    VirtualDataParallel,
    virtual_devices,
)
from dpverify.models.user import Batch, UserModel
from dpverify.planner import require_batch_dim, require_rows_along

__all__ = [
    "ChunkFact",
    "DDPFact",
    "DeviceBytes",
    "Explanation",
    "GradFact",
    "ReplicaFact",
    "SplitFact",
    "StateFact",
    "explain",
]

T = TypeVar("T")

@dataclass(frozen=True)
class ChunkFact:
    """What scatter gave one device.

    Attributes:
        device: the device.
        rows: the batch rows it received, ``"0-1"`` (empty when idle).
        size: how many rows.
        kind: ``"view"`` (of the batch, no transfer), ``"copy"`` or ``"idle"``.
        copied_bytes: bytes of its inputs that are copies, not views of the batch.
        start: the batch row its rows start at (``rows`` is ``"?"`` and this None when they
            are no contiguous rows of the batch, or the device is idle).
    """

    device: int
    rows: str
    size: int
    kind: str
    copied_bytes: int
    start: int | None = None


@dataclass(frozen=True)
class ReplicaFact:
    """What one replica held and did, recorded by hooks while it ran.

    Attributes:
        replica: its index.
        device: its device.
        shared_parameters: parameters that share storage with the module's.
        copied_parameters: parameters that are copies.
        equal_to_module: every parameter equals the module's (at forward time).
        leaf_parameters: parameters that are leaf tensors (replicas' are Broadcast outputs).
        parameter_bytes: bytes of parameter and buffer copies (0 when shared).
        output_shape: shape of its output (its part of the batch).
        output_grad_rows: rows (entries along the split dimension) of d loss / d output
            that Gather's backward sent it; 0 when its output is only a scalar loss.
        activation_bytes: bytes of the module outputs it produced (forward hooks).
        grad_bytes: bytes of its gradient contribution to the parameters.
        loss_grad: for a forward that returns its loss, the gradient Gather's backward sent
            that scalar: d (step's loss) / d (this replica's loss), its weight in the step's
            loss (None when its output had no scalar loss).
    """

    replica: int
    device: int
    shared_parameters: int
    copied_parameters: int
    equal_to_module: bool
    leaf_parameters: int
    parameter_bytes: int
    output_shape: tuple[int, ...]
    output_grad_rows: int
    activation_bytes: int
    grad_bytes: int
    loss_grad: float | None = None


@dataclass(frozen=True)
class DeviceBytes:
    """Estimated bytes on one device during the step, from the sizes of the tensors there."""

    device: int
    inputs: int
    parameters: int
    activations: int
    outputs: int
    gradients: int

    @property
    def total(self) -> int:
        return self.inputs + self.parameters + self.activations + self.outputs + self.gradients


@dataclass(frozen=True)
class GradFact:
    """One parameter's gradient: full batch, sum of replica gradients, their average.

    Attributes:
        parameter: its name.
        full_norm: norm of the full-batch mean-loss gradient.
        sum_error: greatest ``|sum - full|``.
        average_error: greatest ``|average - full|``.
        average_ratio: ``|average| / |full|`` (``1 / replicas``).
        sum_ratio: ``|sum| / |full|`` (1: the sum is the full-batch gradient).
    """

    parameter: str
    full_norm: float
    sum_error: float
    average_error: float
    average_ratio: float
    sum_ratio: float = 1.0


@dataclass(frozen=True)
class SplitFact:
    """How one batch size is split over the devices: by ``torch.chunk``, or, for a user's
    wrapper, as measured by running it (the rows each replica's forward received).

    Attributes:
        note: why a wrapper's split of this batch size was not measured (it raised).
    """

    batch_size: int
    chunk_sizes: tuple[int, ...]
    idle_devices: int
    note: str = ""


@dataclass(frozen=True)
class StateFact:
    """State that does not survive DataParallel, or a module that cannot match exactly.

    Attributes:
        kind: ``"attribute"``, ``"buffer"``, ``"batch statistics"``, ``"randomness"``,
            ``"dropped rows"`` or (a user's wrapper) ``"repeated rows"``.
        where: the attribute, buffer, module or input.
        detail: what was measured and why.
    """

    kind: str
    where: str
    detail: str


@dataclass(frozen=True)
class DDPFact:
    """DDP's gradients against DataParallel's for the same chunks.

    Attributes:
        mode: ``"simulated"`` (DDP's arithmetic, per-shard gradients averaged, in one
            process) or ``"measured"`` (real DDP ranks).
        mean_loss_gap: greatest relative gradient difference with a mean loss.
        sum_loss_ratio: DDP's gradient over DataParallel's with a summed loss (None when
            the loss is computed in forward).
        detail: one line from a real DDP run, when measured.
    """

    mode: str
    mean_loss_gap: float
    sum_loss_ratio: float | None
    detail: str = ""


@dataclass(frozen=True)
class Explanation:
    """Everything ``dpverify explain`` measured for one model, batch and device list: the
    facts, without words (``dpverify.explain.answers.answers`` gives those).

    ``eval_mode_for_losses``: the model has BatchNorm or Dropout in train mode, so the loss,
    gradient, output-device and DDP measurements (questions 3, 4, 6, 8, 11) ran on an
    eval-mode copy, where only DataParallel's own arithmetic differs; the step diagram, the
    bytes and the lost state (question 10) are of the model as given, unless
    ``eval_mode_for_step``: a chunk of one row made BatchNorm raise in train mode.

    ``wrapper``: the user's DataParallel-like wrapper every run went through (None: torch's
    DataParallel on virtual devices). ``chunk_sizes`` are the rows each replica's forward
    received, in ``device_ids`` order; ``planned_chunk_sizes`` torch's scatter of the same
    batch. ``unanswered``: ``(question, reason)`` for each question whose measurement the
    wrapper could not take (its fields are then None or empty). ``gathered_on`` is None when
    no ``gather`` call was seen (a wrapper without one). ``replica_devices_known`` is False
    when the wrapper ran its replicas outside ``parallel_apply`` and ``torch.cuda.device``:
    they are placed on ``device_ids`` in the order they ran.

    ``dim``: the dimension the batch is split and gathered along (DataParallel's ``dim``);
    ``batch_size``, chunk sizes and rows count entries along it. ``loss_in_forward``: the
    forward returns its loss, and the step reduces the gathered replica losses weighting
    replica i by ``loss_counts[i]`` over their sum: the items its loss is a mean over,
    ``loss_items`` (its rows, or its tokens), as question 4 measured them.
    """

    model: str
    parameters: int
    batch_size: int
    batch_source: str
    device_ids: tuple[int, ...]
    output_device: int
    dtype: str
    loss: str
    chunk_sizes: tuple[int, ...]
    chunks: tuple[ChunkFact, ...]
    replicas: tuple[ReplicaFact, ...]
    batch_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    loss_value: float
    gathered_on: int | None
    loss_average: LossAverageReport | None
    returned_loss_shape: tuple[int, ...] | None
    one_device_loss_shape: tuple[int, ...] | None
    scalar_warning: bool
    grads: tuple[GradFact, ...]
    replicas_built_over_two_forwards: int | None
    bytes: tuple[DeviceBytes, ...]
    other_output_device: int | None
    other_output_device_grad_gap: float | None
    splits: tuple[SplitFact, ...]
    state: tuple[StateFact, ...]
    ddp: DDPFact
    eval_mode_for_losses: bool
    eval_mode_for_step: bool
    wrapper: str | None = None
    planned_chunk_sizes: tuple[int, ...] = ()
    unanswered: tuple[tuple[int, str], ...] = ()
    replica_devices_known: bool = True
    dim: int = 0
    loss_in_forward: bool = False
    loss_counts: tuple[int, ...] = ()
    loss_items: str = "rows"

    @property
    def replicas_used(self) -> int:
        return len(self.chunk_sizes)

    @property
    def idle_devices(self) -> tuple[int, ...]:
        """The devices whose replica ran no forward (no chunk)."""
        return tuple(chunk.device for chunk in self.chunks if chunk.kind == "idle")

    @property
    def under_test(self) -> str:
        """What ran the step, in words: the user's wrapper, or torch's DataParallel."""
        return self.wrapper or "DataParallel"

    @property
    def weighting(self) -> str:
        """What the step weighted replica i's loss by, for a forward that returns its loss:
        ``"t_i/T"`` (its share of the tokens its loss is a mean over) or ``"n_i/B"`` (of
        the rows); ``""`` for a loss computed on the gathered output."""
        if not self.loss_in_forward:
            return ""
        return "t_i/T" if self.loss_items != "rows" and self.loss_counts else "n_i/B"

    @property
    def grads_add_up(self) -> bool | None:
        """Whether the replica gradients add up to the full-batch gradient (float64: within
        1e-9 of the largest full-batch gradient norm), as a correct DataParallel's do; None
        when question 3 was not measured."""
        if not self.grads:
            return None
        scale = max(g.full_norm for g in self.grads) or 1.0
        return max(g.sum_error for g in self.grads) <= 1e-9 * scale

    @property
    def replicated(self) -> bool:
        """Whether DataParallel replicated the module (with one device it runs the module
        itself: torch/nn/parallel/data_parallel.py, ``forward``)."""
        return len(self.device_ids) > 1


# --------------------------------------------------------------------------- helpers


def _nbytes(tensor: torch.Tensor) -> int:
    return int(tensor.numel() * tensor.element_size())


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors nested in ``obj``, in the order scatter and gather see them."""
    return [tensor for _path, _keys, tensor in tensor_leaves(obj)]


def _storage(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage().data_ptr())


def _along(tensor: torch.Tensor, dim: int) -> int:
    """Entries of ``tensor`` along ``dim`` (its rows for dim 0); 0 when it has no such
    dimension."""
    return int(tensor.shape[dim]) if -tensor.dim() <= dim < tensor.dim() else 0


def _primary(output: Any) -> torch.Tensor:
    tensors = [t for t in _tensors(output) if t.dim() > 0]
    if not tensors:
        raise ValueError("the forward returned no tensor with a batch dimension")
    return tensors[0]


class _KeywordCall(nn.Module):
    """A keyword-only model called by position: ``forward(*args)`` passes the first
    ``positional`` arguments by position and the rest as ``names``, in order. explain's
    hooks and steps walk positional calls; DataParallel scatters a keyword tensor exactly as
    the same tensor by position."""

    def __init__(self, model: nn.Module, positional: int, names: Sequence[str]) -> None:
        super().__init__()
        self.model = model
        self.positional = positional
        self.names = tuple(names)

    def forward(self, *args: Any) -> Any:
        keywords = dict(zip(self.names, args[self.positional :], strict=True))
        return self.model(*args[: self.positional], **keywords)


def _positional(model: UserModel, first: Batch) -> UserModel:
    """``model`` unchanged when its batches are positional; for keyword batches (a model
    called as ``model(**batch)``), the model behind ``_KeywordCall`` with every batch's
    keyword arguments appended to its positional ones, in the first batch's key order."""
    if not first.kwargs:
        return model
    names, positional = list(first.kwargs), len(first.inputs)

    def make(size: int) -> Batch:
        made = model.make_batch(size)
        if list(made.kwargs) != names or len(made.inputs) != positional:
            raise InvalidArgument(
                f"{model.batch_source} gives keyword arguments {list(made.kwargs)} for batch size {size} "
                f"and {names} for another; give every batch the same arguments"
            )
        return replace(made, inputs=(*made.inputs, *(made.kwargs[name] for name in names)), kwargs={})

    call = ", ".join([*(["…"] * positional), *(f"{name}=…" for name in names)])
    return replace(model, module=_KeywordCall(model.module, positional, names), make_batch=make, batch_source=f"{model.batch_source} (called as model({call}))")


class _LossInForward(nn.Module):
    """The user's model with its loss moved into forward: ``forward(*inputs, target)``
    returns the chunk's mean loss, as a model that computes its loss in forward does. Split
    along ``dim`` other than 0, the loss has ``dim + 1`` dimensions of one entry: torch's
    gather concatenates along ``dim`` and stacks scalars only for dim 0."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor], dim: int = 0) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.dim = dim

    def forward(self, *args: Any) -> torch.Tensor:
        *inputs, target = args
        loss: torch.Tensor = self.loss_fn(self.model(*inputs), target)
        return loss.reshape((1,) * (self.dim + 1)) if self.dim > 0 else loss


def _loss_model(module: nn.Module, batch: Batch, dim: int = 0) -> tuple[nn.Module, tuple[Any, ...]]:
    """A model whose forward returns its loss, and its arguments."""
    if batch.loss_fn is None:
        return module, batch.inputs
    return _LossInForward(module, batch.loss_fn, dim), (*batch.inputs, batch.target)


def _loss_of(batch: Batch, sizes: Sequence[int], counts: Sequence[int] = ()) -> Callable[[Any], torch.Tensor]:
    """The step's loss: ``loss_fn(output, target)``, or for a model that returns its loss,
    the replica losses weighted by ``counts`` over their sum (the items each replica's loss
    is a mean over: its tokens for a token-mean loss), by the rows ``sizes`` when there is
    no count per replica; exact either way for the right counts (a scalar on one device)."""
    loss_fn, target = batch.loss_fn, batch.target
    if loss_fn is not None:
        return lambda output: loss_fn(output, target)

    def from_forward(output: Any) -> torch.Tensor:
        losses = extract_loss(output, -1)
        if losses.dim() == 0:
            return losses
        losses = losses.reshape(-1)
        weights = counts if len(counts) == losses.numel() and sum(counts) > 0 else sizes
        return chunk_weighted_loss(losses, list(weights))

    return from_forward


# --------------------------------------------------------------------------- the wrapper


@dataclass(frozen=True)
class _Runner:
    """The DataParallel every run of ``explain`` goes through: torch's over virtual devices
    (``VirtualDataParallel``), or a user's wrapper, built and run inside
    ``virtual_devices`` (where ``torch.nn.DataParallel`` and its subclasses see the devices
    and run their own code over virtual ones).

    Attributes:
        parallel: ``parallel(module, device_ids=..., output_device=...)``, or None for torch's.
        name: the wrapper in words (``MODULE:CALLABLE``).
        dim: the dimension the batch is split and gathered along.
    """

    parallel: Callable[..., Any] | None = None
    name: str | None = None
    dim: int = 0

    @property
    def users(self) -> bool:
        return self.parallel is not None

    def build(self, module: nn.Module, device_ids: Sequence[int], output_device: int | None = None) -> Any:
        """The wrapper around ``module``, splitting along ``dim`` (a user's wrapper gets
        ``dim=`` only when it is not 0, as ``dpverify check --parallel`` builds it); call it
        inside ``devices``."""
        ids = list(device_ids)
        if self.parallel is None:
            return VirtualDataParallel(module, ids, output_device, dim=self.dim)
        extra = {"dim": self.dim} if self.dim else {}
        return self.parallel(module, device_ids=ids, output_device=ids[0] if output_device is None else output_device, **extra)

    def devices(self, device_ids: Sequence[int]) -> contextlib.AbstractContextManager[Any]:
        """Where a user's wrapper is built and runs, forward and backward (a custom autograd
        Function's backward may call the virtual primitives too); nothing for torch's."""
        return virtual_devices(max(device_ids) + 1) if self.parallel is not None else contextlib.nullcontext()

    def measure(self, question: int, unanswered: list[tuple[int, str]], run: Callable[[], T]) -> T | None:
        """``run()``; for a user's wrapper whatever it raises makes ``question`` unanswered
        (with the reason) and gives None. torch's own DataParallel raises as it raises."""
        if self.parallel is None:
            return run()
        try:
            return run()
        except Exception as error:  # the wrapper's (its sys.exit() ends the command, as any code under test's)
            unanswered.append((question, f"running it raised {describe_exception(error)}"))
            return None


def _watch_gather(wrapper: Any, seen: list[int]) -> None:
    """Records in ``seen`` the ``output_device`` each call of ``wrapper.gather`` receives
    (torch's ``DataParallel.forward`` calls ``self.gather(outputs, self.output_device)``);
    a wrapper without a ``gather`` method is left alone."""
    gather = getattr(wrapper, "gather", None)
    if not callable(gather):
        return

    def recording(outputs: Any, output_device: Any, *args: Any, **kwargs: Any) -> Any:
        with contextlib.suppress(Exception):  # an output device dpverify cannot read: not recorded
            seen.append(device_index(output_device, "output_device"))
        return gather(outputs, output_device, *args, **kwargs)

    # an instance attribute, found before the class's method
    object.__setattr__(wrapper, "gather", recording)


# --------------------------------------------------------------------------- the step


@dataclass
class _ReplicaLog(ReplicaRecord):
    placed: int = 0  # the device it is reported on: its own, else the one it stands for
    input_tensors: tuple[tuple[bool, int], ...] = ()  # (is a view of the batch, bytes)
    shared_parameters: int = 0
    copied_parameters: int = 0
    equal_to_module: bool = True
    leaf_parameters: int = 0
    parameter_bytes: int = 0
    output_shape: tuple[int, ...] = ()
    output_grad_rows: int = 0
    output_grad_bytes: int = 0
    loss_grad: float | None = None  # the gradient its scalar output (a loss) received
    activation_bytes: int = 0


class _StepRecorder(ReplicaGradRecorder):
    """The replica recorder of the checks, recording also what every replica received,
    held and produced: its chunk (views or copies of the batch), its parameters (shared
    with the module or copies), its activations and outputs, and the gradients Gather's
    backward sent them. ``ReplicaRecord.device`` says on which device, when the wrapper ran
    it through ``parallel_apply`` or ``torch.cuda.device``.
    """

    record_type = _ReplicaLog

    def __init__(
        self, module: nn.Module, batch: Sequence[torch.Tensor], device_ids: Sequence[int], dim: int = 0, loss_in_forward: bool = False,
    ) -> None:
        super().__init__(parameter_sites(module), keep=False, dim=dim)
        self.device_ids = list(device_ids)
        self.loss_in_forward = loss_in_forward
        self.originals = {name: getattr(module.get_submodule(path), attr) for name, path, attr in self.sites}
        self.buffers = dict(module.named_buffers())
        self.batch_storages = {_storage(t) for t in batch}
        self.seen: set[tuple[int, int]] = set()

    def attach(self, module: nn.Module) -> None:
        super().attach(module)
        self.handles.append(module.register_forward_hook(self._on_output))
        for sub in module.modules():
            self.handles.append(sub.register_forward_hook(self._on_activation))

    def logs(self) -> tuple[tuple[_ReplicaLog, ...], bool]:
        """The replicas' logs, one per device, in ``device_ids`` order, and whether their
        devices were known. A replica whose device is unknown (run outside
        ``parallel_apply`` and ``torch.cuda.device``) is placed on ``device_ids`` in the
        order the replicas started; a single one is the module on ``device_ids[0]``."""
        calls = [cast(_ReplicaLog, record) for record in self.replicas]
        devices = [log.device for log in calls]
        known = all(d in self.device_ids for d in devices) and len(set(devices)) == len(devices)
        if known:
            calls.sort(key=lambda log: self.device_ids.index(log.placed))
        else:
            for log, device in zip(calls, self.device_ids, strict=False):
                log.placed = device
            calls = calls[: len(self.device_ids)]
        return tuple(calls), known or len(calls) <= 1

    def sizes(self) -> list[int]:
        """The rows each replica's forward received so far, in ``device_ids`` order."""
        return [log.rows or 0 for log in self.logs()[0]]

    def _log(self) -> _ReplicaLog | None:
        return cast("_ReplicaLog | None", self.current())

    def new_record(self, replica: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _ReplicaLog:
        log = cast(_ReplicaLog, super().new_record(replica, args, kwargs))
        log.placed = self.device_ids[0] if log.device is None else log.device
        log.input_tensors = tuple((_storage(t) in self.batch_storages, _nbytes(t)) for t in _tensors((args, kwargs)))
        for name, buffer in replica.named_buffers():
            if name in self.buffers and buffer.data_ptr() != self.buffers[name].data_ptr():
                log.parameter_bytes += _nbytes(buffer)
        return log

    def on_parameter(self, record: ReplicaRecord, name: str, tensor: torch.Tensor) -> None:
        log = cast(_ReplicaLog, record)
        original = self.originals[name]
        shared = tensor.data_ptr() == original.data_ptr()
        log.shared_parameters += shared
        log.copied_parameters += not shared
        log.parameter_bytes += 0 if shared else _nbytes(tensor)
        log.equal_to_module &= bool(torch.equal(tensor.detach(), original.detach()))
        log.leaf_parameters += tensor.is_leaf

    def _on_output(self, replica: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        del replica, args
        log = self._log()
        if log is None:
            return
        # a forward that returns only its loss (a scalar) has no batched output
        primary = _primary(output) if any(t.dim() > 0 for t in _tensors(output)) else None
        log.output_shape = tuple(primary.shape) if primary is not None else ()
        loss = None
        if self.loss_in_forward:
            with contextlib.suppress(InvalidArgument):  # no loss where the step looks for it: the step says so
                loss = extract_loss(output, -1)
        for tensor in _tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(self._output_grad_recorder(log, is_loss=tensor is loss))

    def _output_grad_recorder(self, log: _ReplicaLog, *, is_loss: bool = False) -> Callable[[torch.Tensor], None]:
        def record(grad: torch.Tensor) -> None:
            if is_loss:
                if grad.numel() == 1:
                    log.loss_grad = float(grad.detach().reshape(()))
            elif grad.dim() > 0 and not log.output_grad_rows:
                log.output_grad_rows = _along(grad, self.dim)
            log.output_grad_bytes += _nbytes(grad)

        return record

    def _on_activation(self, sub: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        del sub, args
        log = self._log()
        if log is None:
            return
        for tensor in _tensors(output):
            key = (id(log), _storage(tensor))
            if key not in self.seen:  # a container's output is its last child's
                self.seen.add(key)
                log.activation_bytes += _nbytes(tensor)


@dataclass(frozen=True)
class _Step:
    logs: tuple[_ReplicaLog, ...]
    devices_known: bool  # every replica's device was seen (else they are placed in call order)
    output_shape: tuple[int, ...]
    output_bytes: int
    loss: float
    gathered_on: int | None
    grad_bytes: int  # the module's .grad, on device_ids[0]
    batch_bytes: int
    parameter_bytes: int  # the module's parameters and buffers, on device_ids[0]


def _recorded_step(
    runner: _Runner, module: nn.Module, batch: Batch, device_ids: list[int], output_device: int, counts: Sequence[int] = (),
) -> _Step:
    model = copy.deepcopy(module)
    batch_tensors = _tensors(batch.inputs)
    recorder = _StepRecorder(model, batch_tensors, device_ids, runner.dim, loss_in_forward=batch.loss_fn is None)
    gathered: list[int] = []
    recorder.attach(model)
    try:
        with runner.devices(device_ids), torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=SCALAR_GATHER_WARNING)
            wrapper = runner.build(model, device_ids, output_device)
            _watch_gather(wrapper, gathered)
            seed_step(0, torch.device("cpu"))
            output = wrapper(*batch.inputs)
            # the loss of a model that returns it weights each replica by the items (rows, or
            # tokens) its loss is a mean over, else by the rows it really got
            loss = _step_loss(runner, batch, recorder.sizes(), output, counts)
            loss.backward()
    finally:
        recorder.detach()
    primary = _primary(output)
    own = [*model.parameters(), *model.buffers()]
    logs, known = recorder.logs()
    return _Step(
        logs=logs,
        devices_known=known,
        output_shape=tuple(primary.shape),
        output_bytes=sum(_nbytes(t) for t in _tensors(output)),
        loss=float(loss.detach()),
        # with one device nothing is gathered: the loss is computed where the module ran
        gathered_on=gathered[-1] if gathered else (device_ids[0] if len(device_ids) == 1 else None),
        grad_bytes=sum(_nbytes(p.grad) for p in model.parameters() if p.grad is not None),
        batch_bytes=sum(_nbytes(t) for t in batch_tensors),
        parameter_bytes=sum(_nbytes(t) for t in own),
    )


def _step_loss(runner: _Runner, batch: Batch, sizes: Sequence[int], output: Any, counts: Sequence[int] = ()) -> torch.Tensor:
    """The step's loss of what the wrapper returned; for a user's wrapper, a loss that
    cannot be computed from it is a usage error naming ``--parallel`` (what explain measures
    is a wrapper that gathers the outputs, as DataParallel does)."""
    if not runner.users:
        return quiet_size_warnings(_loss_of(batch, sizes, counts))(output)
    try:
        loss = quiet_size_warnings(_loss_of(batch, sizes, counts))(output)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"the loss is {type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}, not a scalar")
        return loss
    except Exception as error:
        returned = f"{type(output).__name__} of {len(output)}" if isinstance(output, (list, tuple)) else type(output).__name__
        rows = batch_size_of(batch.inputs, dim=runner.dim)
        if sum(sizes) < rows:
            hint = (
                f"Its replicas' forwards received {list(sizes)} rows, {sum(sizes)} of the batch's {rows}: rows that "
                "reach no replica leave an output that does not line up with the batch (dpverify check --parallel "
                "reports it as a failure)"
            )
        else:
            hint = (
                "explain measures a wrapper that gathers the replicas' outputs as DataParallel does; a "
                "model/criterion pair, whose wrapper returns one output per replica, is checked by dpverify check "
                "--parallel MODULE:CALLABLE --parallel-loss MODULE:CALLABLE"
            )
        raise InvalidArgument(
            f"--parallel {runner.name}: the loss ({batch.loss_name}) of what the wrapper returned ({returned}) "
            f"raised {describe_exception(error)}. {hint}"
        ) from error


def _chunks(step: _Step, device_ids: Sequence[int], batch: Batch, dim: int = 0) -> tuple[ChunkFact, ...]:
    """What each device received, from the rows its replica's forward really got: where
    they sit in the batch (a view's offset, or the rows a copy equals), and whether they
    are a view of the batch or a copy."""
    facts: list[ChunkFact] = []
    start = 0
    logs = {log.placed: log for log in step.logs}
    whole = first_batched(batch.inputs)
    for device in device_ids:
        log = logs.get(device)
        if log is None or not log.rows:
            facts.append(ChunkFact(device, "", 0, "idle", 0))
            continue
        size = log.rows
        views = log.input_tensors
        copied = sum(nbytes for is_view, nbytes in views if not is_view)
        kind = "view" if views and all(is_view for is_view, _ in views) else "copy"
        found = _rows_in_batch(whole, log.first_input, expected=start, dim=dim)
        rows = "?" if found is None else (f"{found}" if size == 1 else f"{found}-{found + size - 1}")
        facts.append(ChunkFact(device, rows, size, kind, copied, found))
        start = (found if found is not None else start) + size
    return tuple(facts)


def _rows_in_batch(whole: torch.Tensor | None, chunk: torch.Tensor | None, *, expected: int, dim: int = 0) -> int | None:
    """The first row (entry along ``dim``) of ``whole`` that ``chunk``'s rows start at:
    ``expected`` (where the previous chunk ended) when they are equal there, else the first
    offset where they are; None when they are no contiguous rows of the batch."""
    if whole is None or chunk is None or chunk.dim() != whole.dim() or not -whole.dim() <= dim < whole.dim():
        return None
    if any(a != b for i, (a, b) in enumerate(zip(whole.shape, chunk.shape, strict=True)) if i != dim % whole.dim()):
        return None
    rows, size = int(whole.shape[dim]), int(chunk.shape[dim])
    if size > rows:
        return None
    candidates = [expected] if 0 <= expected <= rows - size else []
    candidates += [offset for offset in range(rows - size + 1) if offset != expected]
    with torch.no_grad():
        return next((o for o in candidates if torch.equal(whole.narrow(dim, o, size), chunk.to(whole.device))), None)


def _replicas(step: _Step) -> tuple[ReplicaFact, ...]:
    # the log's fields carry ReplicaFact's names, after its replica index and device
    names = [f.name for f in fields(ReplicaFact)][2:]
    return tuple(ReplicaFact(i, log.placed, *(getattr(log, name) for name in names)) for i, log in enumerate(step.logs))


def _device_bytes(step: _Step, chunks: Sequence[ChunkFact], device_ids: Sequence[int], output_device: int) -> tuple[DeviceBytes, ...]:
    logs = {log.placed: log for log in step.logs}
    # where the outputs were gathered (a wrapper's gather may not use its output_device)
    output_device = output_device if step.gathered_on is None else step.gathered_on
    first = device_ids[0]
    # With one device the module itself runs: its output is an activation, its gradient
    # contributions are its .grad, and nothing is gathered.
    replicated = len(device_ids) > 1
    rows: list[DeviceBytes] = []
    for chunk in chunks:
        device = chunk.device
        log = logs.get(device)
        on_first = device == first
        gathered = device == output_device and replicated
        rows.append(
            DeviceBytes(
                device=device,
                # the batch starts on device_ids[0]; other devices hold copies of their chunk
                inputs=(step.batch_bytes if on_first else 0) + chunk.copied_bytes,
                parameters=(step.parameter_bytes if on_first else 0) + (log.parameter_bytes if log else 0),
                activations=log.activation_bytes if log else 0,
                outputs=step.output_bytes if gathered else 0,
                # replica contributions and the output-chunk gradient everywhere; the summed
                # .grad on device_ids[0]; the gathered output's gradient on output_device
                gradients=((log.grad_bytes if replicated else 0) + log.output_grad_bytes if log else 0)
                + (step.grad_bytes if on_first else 0)
                + (step.output_bytes if gathered else 0),
            )
        )
    return tuple(rows)


# --------------------------------------------------------------------------- further runs


def _target_in_float64(batch: Batch) -> Batch:
    """``batch`` with its floating targets in float64, for a step run in float64: the
    loss then sees one dtype, as the checks give it (``mse_loss`` of a float64 output and a
    float32 target fails in backward on torch 2.11: "Found dtype Float but expected Double")."""
    return replace(batch, target=convert_tensors(batch.target, torch.float64, torch.device("cpu")))


def _float64_grads(
    runner: _Runner, module: nn.Module, batch: Batch, device_ids: list[int], sizes: Sequence[int], counts: Sequence[int] = (),
) -> tuple[GradFact, ...]:
    """Sum and average of the replica gradients against the full-batch gradient, in float64."""
    batch = _target_in_float64(batch)
    loss = quiet_size_warnings(_loss_of(batch, sizes, counts))
    with runner.devices(device_ids):
        parallel = run_step(
            module, batch.inputs, loss, wrap=lambda m: runner.build(m, device_ids),
            dtype=torch.float64, record_replicas=True, device_ids=device_ids, dim=runner.dim,
        )
    single = run_step(module, batch.inputs, _loss_of(batch, [sum(sizes)]), dtype=torch.float64)
    contributions = [grads for _device, grads in parallel.contributions]
    facts: list[GradFact] = []
    for name, full in single.grads.items():
        parts = [c[name] for c in contributions if name in c]
        if full is None or not parts:
            continue
        total = torch.stack(parts).sum(0)
        average = total / len(parts)
        norm = float(full.norm())
        facts.append(
            GradFact(
                parameter=name,
                full_norm=norm,
                sum_error=float((total - full).abs().max()),
                average_error=float((average - full).abs().max()),
                average_ratio=float(average.norm()) / norm if norm else 0.0,
                sum_ratio=float(total.norm()) / norm if norm else 0.0,
            )
        )
    return tuple(facts)


def _returned_loss(runner: _Runner, module: nn.Module, batch: Batch, device_ids: list[int]) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
    """Shape of the loss DataParallel returns on these devices and on one, and whether
    torch warned that it unsqueezed scalars."""
    model, args = _loss_model(module, batch, runner.dim)
    shapes: list[tuple[int, ...]] = []
    warned = False
    for ids in (device_ids, device_ids[:1]):
        with runner.devices(ids), warnings.catch_warnings(record=True) as caught, torch.no_grad(), torch.random.fork_rng(devices=[]):
            warnings.simplefilter("always")
            output = runner.build(copy.deepcopy(model), ids)(*args)
        shapes.append(tuple(extract_loss(output, -1).shape))
        warned |= ids is device_ids and any(SCALAR_GATHER_WARNING in str(w.message) for w in caught)
    return shapes[0], shapes[1], warned


def _replicas_per_forward(runner: _Runner, module: nn.Module, batch: Batch, device_ids: list[int]) -> int:
    """Distinct replica objects over two forwards (replicas are rebuilt on every call)."""
    model = copy.deepcopy(module)
    seen: list[nn.Module] = []  # references keep ids unique
    handle = model.register_forward_pre_hook(lambda replica, args: seen.append(replica))
    try:
        with runner.devices(device_ids), torch.no_grad(), torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=SCALAR_GATHER_WARNING)
            wrapper = runner.build(model, device_ids)
            wrapper(*batch.inputs)
            wrapper(*batch.inputs)
    finally:
        handle.remove()
    return len({id(replica) for replica in seen})


def _output_device_gap(
    runner: _Runner, module: nn.Module, batch: Batch, device_ids: list[int], output_device: int, sizes: Sequence[int], used: Sequence[int],
    counts: Sequence[int] = (),
) -> tuple[int | None, float | None]:
    """Greatest gradient difference when the outputs are gathered on another of the
    devices ``used`` (those whose replica ran)."""
    others = [d for d in used if d != output_device]
    if not others:
        return None, None
    other = others[-1]
    loss = quiet_size_warnings(_loss_of(batch, sizes, counts))
    with runner.devices(device_ids):
        steps = [run_step(module, batch.inputs, loss, wrap=partial(runner.build, device_ids=device_ids, output_device=out)) for out in (output_device, other)]
    gaps = [
        float((a - b).abs().max())
        for name, a in steps[0].grads.items()
        if a is not None and (b := steps[1].grads.get(name)) is not None
    ]
    return other, max(gaps, default=0.0)


def _split_sizes(batch_size: int, n_devices: int) -> list[int]:
    """Batch sizes worth showing for this device count: fewer rows than devices, as many,
    one more, uneven chunks, and the batch explained."""
    return sorted({1, max(1, n_devices - 1), n_devices, n_devices + 1, 2 * n_devices + 1, batch_size})


def _splits(batch_size: int, n_devices: int) -> tuple[SplitFact, ...]:
    """torch.chunk itself, on batches of interesting sizes for this device count."""
    facts = []
    for size in _split_sizes(batch_size, n_devices):
        chunks = tuple(int(c.size(0)) for c in torch.empty(size).chunk(n_devices))
        facts.append(SplitFact(size, chunks, n_devices - len(chunks)))
    return tuple(facts)


def _measured_splits(runner: _Runner, model: UserModel, module: nn.Module, batch_size: int, device_ids: list[int]) -> tuple[SplitFact, ...]:
    """How a user's wrapper splits batches of the sizes ``_splits`` shows: one forward of
    each (no gradient), recording the rows each replica's forward received, in
    ``device_ids`` order. A size the wrapper (or the batch function) raises on says so in
    its note."""
    facts = []
    for size in _split_sizes(batch_size, len(device_ids)):
        copy_ = copy.deepcopy(module)
        recorder = ReplicaGradRecorder([], dim=runner.dim)
        recorder.attach(copy_)
        try:
            inputs = model.make_batch(size).inputs
            with runner.devices(device_ids), torch.no_grad(), torch.random.fork_rng(devices=[]), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=SCALAR_GATHER_WARNING)
                runner.build(copy_, device_ids)(*inputs)
        except Exception as error:  # the wrapper's, or the batch function's
            facts.append(SplitFact(size, (), len(device_ids), note=f"raised {describe_exception(error)}"))
            continue
        finally:
            recorder.detach()
        rows = {device_ids[0] if r.device is None else r.device: r.rows or 0 for r in recorder.replicas}
        chunks = tuple(rows[d] for d in device_ids if rows.get(d))
        facts.append(SplitFact(size, chunks, len(device_ids) - len(chunks)))
    return tuple(facts)


def _plain(value: Any) -> bool:
    if isinstance(value, (bool, int, float, str, type(None))):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(v) for v in value.values())
    return False


def _attributes(module: nn.Module) -> Iterator[tuple[str, str, Any]]:
    for path, sub in module.named_modules():
        for key, value in vars(sub).items():
            if key.startswith("_") or key == "training" or not _plain(value):
                continue
            yield path, key, value


def _fmt(tensor: torch.Tensor) -> str:
    if tensor.numel() == 1:
        return f"{tensor.item():.6g}"
    return f"{tuple(tensor.shape)} tensor, first {tensor.reshape(-1)[0].item():.4g}"


def _state(runner: _Runner, module: nn.Module, batch: Batch, device_ids: list[int], dropped: Sequence[StateFact]) -> tuple[StateFact, ...]:
    """Runs one forward on one device and one under DataParallel (or the user's wrapper),
    and compares the state the two leave behind."""
    single, parallel = copy.deepcopy(module), copy.deepcopy(module)
    facts: list[StateFact] = []
    under = "DataParallel" if not runner.users else "the wrapper"
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SCALAR_GATHER_WARNING)
        seed_step(0, torch.device("cpu"))
        single(*batch.inputs)
        seed_step(0, torch.device("cpu"))
        try:
            with runner.devices(device_ids):
                runner.build(parallel, device_ids)(*batch.inputs)
        except (RuntimeError, ValueError) as error:
            if ONE_ROW_BATCHNORM not in str(error):
                raise
            facts.append(StateFact("batch statistics", "a replica", f"a chunk of one row made BatchNorm raise in train mode: '{ONE_ROW_BATCHNORM}'"))
            parallel = copy.deepcopy(module)  # nothing ran: compare nothing else
            single = parallel
    before, after_single = dict(module.named_buffers()), dict(single.named_buffers())
    for name, buffer in parallel.named_buffers():
        one = after_single[name]
        if not torch.equal(one, before[name]) and not torch.equal(buffer, one):
            why = " (only replica 0's update reaches the module)" if not runner.users else ""
            facts.append(StateFact(
                "buffer", name, f"updated in place in forward: one device leaves {_fmt(one)}, {under} {_fmt(buffer)}{why}",
            ))
    single_modules = dict(single.named_modules())
    parallel_modules = dict(parallel.named_modules())
    for path, key, value in _attributes(module):
        alone = getattr(single_modules[path], key, None)
        par = getattr(parallel_modules[path], key, None)
        if alone != value and par != alone:
            where = f"{path}.{key}" if path else key
            why = " (replicas are shallow copies; assignments to them are lost)" if not runner.users else ""
            facts.append(StateFact("attribute", where, f"set in forward: one device leaves {alone!r}, {under} {par!r}{why}"))
    for source in divergence_sources(module):
        facts.append(StateFact(source.kind, source.module or "the root module", f"{source.reason} Fix: {source.fix}"))
    facts += dropped
    return tuple(facts)


def _ddp_fact(module: nn.Module, batch: Batch, device_ids: list[int], sizes: Sequence[int], real_ddp: bool, dim: int = 0) -> DDPFact:
    """DDP's gradient (per-shard gradients averaged) against DataParallel's for the same
    chunks, with a mean loss and with a summed loss; simulated in one process, or measured
    on real ranks with ``real_ddp``."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    given, batch = batch, _target_in_float64(batch)  # real DDP runs on the batch as given

    def rows(obj: Any, start: int, size: int) -> Any:
        # the shard's rows of every batched tensor, wherever scatter would find it
        return map_tensors(obj, lambda t: t.narrow(dim, start, size) if t.dim() > dim else t)

    def grads(loss_scale: Callable[[int], float], start: int, size: int) -> list[torch.Tensor]:
        shard = Batch(rows(batch.inputs, start, size), rows(batch.target, start, size), batch.loss_fn, batch.loss_name)
        base = _loss_of(shard, [size])
        step = run_step(module, shard.inputs, lambda out: base(out) * loss_scale(size), dtype=torch.float64)
        return [g if g is not None else torch.zeros(()) for g in step.grads.values()]

    def gap(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
        scale = max((float(t.abs().max()) for t in b if t.numel()), default=0.0) or 1.0
        return max((float((x - y).abs().max()) for x, y in zip(a, b, strict=True)), default=0.0) / scale

    def dp_and_ddp(loss_scale: Callable[[int], float]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        # the full batch's gradients, and the per-shard ones averaged over the ranks
        full = grads(loss_scale, 0, sum(sizes))
        shards = [grads(loss_scale, s, n) for s, n in zip(starts, sizes, strict=True)]
        return full, [torch.stack(parts).sum(0) / len(sizes) for parts in zip(*shards, strict=True)]

    full, ddp_mean = dp_and_ddp(lambda n: 1.0)
    ratio: float | None = None
    if batch.loss_fn is not None:
        dp_sum, ddp_sum = dp_and_ddp(float)
        norms = sum(float(t.norm()) for t in dp_sum)
        ratio = sum(float(t.norm()) for t in ddp_sum) / norms if norms else None
    fact = DDPFact("simulated", gap(ddp_mean, full), ratio)
    if real_ddp:
        fact = _measured_ddp(module, given, len(sizes), fact, dim)
    return fact


def _measured_ddp(module: nn.Module, batch: Batch, world_size: int, simulated: DDPFact, dim: int = 0) -> DDPFact:
    from dpverify.ddp import checks_if_available
    from dpverify.registry import CHECKS, Case, Verdict

    if checks_if_available() is None:
        return replace(simulated, detail="the DDP backend is not available in this build")
    if batch.loss_fn is None:
        return replace(simulated, detail="real DDP needs loss_fn(output, target); this forward returns its loss")
    if dim != 0:
        return replace(simulated, detail=f"the DDP checks shard the batch along dim 0, and this one is split along dim {dim}")
    case = Case(module, batch.inputs, batch.target, batch.loss_fn, tuple(range(world_size)))
    result = CHECKS["dp-ddp-agree"].run(case)
    if result.verdict is Verdict.PASS:
        detail = f"real DDP on {world_size} ranks agrees with DataParallel ({result.summary})"
    elif result.scale is not None:
        detail = f"real DDP on {world_size} ranks gives {result.scale:.6g} times DataParallel's gradients"
    else:
        detail = f"real DDP on {world_size} ranks gives other gradients than DataParallel ({result.summary})"
    return replace(simulated, mode="measured", detail=detail)


# --------------------------------------------------------------------------- entry


def explain(
    model: UserModel,
    *,
    batch_size: int,
    device_ids: Sequence[int],
    output_device: int | None = None,
    real_ddp: bool = False,
    parallel: Callable[..., Any] | None = None,
    parallel_name: str | None = None,
    dim: int = 0,
) -> Explanation:
    """Measures one DataParallel step of ``model`` on virtual devices, and what every
    question of docs/questions.md needs (``explain_answers.answers`` words it).

    Args:
        model: the model and its batches.
        batch_size: rows in the batch.
        device_ids: the virtual devices.
        output_device: where outputs are gathered (default ``device_ids[0]``).
        real_ddp: also run real DDP ranks for question 11 (seconds to start).
        parallel: a DataParallel-like wrapper, ``parallel(module, device_ids=...,
            output_device=...)``, that every run goes through instead of torch's, inside
            ``dpverify.virtual_devices``; the chunks are the rows its replicas' forwards
            received. A measurement it raises in leaves its question unanswered, with the
            reason (``Explanation.unanswered``).
        parallel_name: the wrapper in words (default its qualified name).
        dim: the dimension DataParallel splits and gathers the batch along (its ``dim``);
            ``batch_size`` is the entries along it, and the batches must grow along it.

    Raises:
        InvalidArgument: the wrapper's step cannot be measured at all (it raises, or what it
            returns has no loss: a wrapper that does not gather); the message names
            ``--parallel``, and the wrapper's exception is the ``__cause__``. Or the batch
            does not have ``batch_size`` entries along ``dim``, or grows along another
            dimension (a sequence-first batch split along time): ``check`` refuses the same.
    """
    name = parallel_name or (getattr(parallel, "__qualname__", type(parallel).__name__) if parallel is not None else None)
    runner = _Runner(parallel, name, dim)
    ids = list(device_ids)
    out = ids[0] if output_device is None else output_device
    first = model.make_batch(batch_size)
    # the batch check splits: batch_size entries along dim, growing along it
    require_rows_along(first.inputs, batch_size, dim, model.batch_source, dict(first.kwargs))
    require_batch_dim(model, batch_size, dim, first)
    model = _positional(model, first)
    batch = model.make_batch(batch_size)
    module = model.module
    diverges = bool(divergence_sources(module))
    # BatchNorm/Dropout in train mode make every replica differ from the full batch: the
    # arithmetic questions are answered on an eval-mode copy, where only DataParallel differs.
    exact = copy.deepcopy(module).eval() if diverges else module
    plan = plan_scatter(batch.inputs, None, ids, dim=dim, warn=False)
    unanswered: list[tuple[int, str]] = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SCALAR_GATHER_WARNING)
        loss_model, loss_args = _loss_model(exact, batch, dim)
        # question 4 first: for a forward that returns its loss it finds the items (rows, or
        # tokens) each replica's loss is a mean over, which the step weights replicas by
        loss_average = runner.measure(
            4, unanswered, lambda: check_forward_loss_average(loss_model, loss_args, device_ids=ids, parallel=parallel, dim=dim),
        )
        counts = list(loss_average.counts) if batch.loss_fn is None and loss_average is not None else []
        step, step_in_eval = _step(runner, module, exact, batch, ids, out, counts)
        chunks = _chunks(step, ids, batch, dim)
        # the rows each replica's forward received: torch's plan, or what the wrapper did
        sizes = [chunk.size for chunk in chunks if chunk.kind != "idle"]
        used = [chunk.device for chunk in chunks if chunk.kind != "idle"]
        returned = runner.measure(6, unanswered, lambda: _returned_loss(runner, exact, batch, ids))
        gap = runner.measure(8, unanswered, lambda: _output_device_gap(runner, exact, batch, ids, out, sizes, used, counts))
        grads = runner.measure(3, unanswered, lambda: _float64_grads(runner, exact, batch, ids, sizes, counts))
        replicas = runner.measure(5, unanswered, lambda: _replicas_per_forward(runner, exact if step_in_eval else module, batch, ids))
        dropped = _dropped(runner, plan.dropped, chunks, batch_size)
        state = runner.measure(10, unanswered, lambda: _state(runner, module, batch, ids, dropped))
        splits = _measured_splits(runner, model, exact, batch_size, ids) if runner.users else _splits(batch_size, len(ids))
        dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
        return Explanation(
            model=model.name,
            parameters=model.parameter_count,
            batch_size=batch_size,
            batch_source=model.batch_source,
            device_ids=tuple(ids),
            output_device=out,
            dtype=str(dtype).removeprefix("torch."),
            loss=batch.loss_name,
            chunk_sizes=tuple(sizes),
            chunks=chunks,
            replicas=_replicas(step),
            batch_shape=tuple(_tensors(batch.inputs)[0].shape),
            output_shape=step.output_shape,
            loss_value=step.loss,
            gathered_on=step.gathered_on,
            loss_average=loss_average,
            returned_loss_shape=returned[0] if returned else None,
            one_device_loss_shape=returned[1] if returned else None,
            scalar_warning=returned[2] if returned else False,
            grads=grads or (),
            replicas_built_over_two_forwards=replicas,
            bytes=_device_bytes(step, chunks, ids, out),
            other_output_device=gap[0] if gap else None,
            other_output_device_grad_gap=gap[1] if gap else None,
            splits=splits,
            state=state or (),
            ddp=_ddp_fact(exact, batch, ids, sizes, real_ddp, dim),
            eval_mode_for_losses=diverges,
            eval_mode_for_step=step_in_eval,
            wrapper=name,
            planned_chunk_sizes=tuple(plan.chunk_sizes),
            unanswered=tuple(sorted(unanswered)),
            replica_devices_known=step.devices_known,
            dim=dim,
            loss_in_forward=batch.loss_fn is None,
            loss_counts=tuple(counts),
            loss_items=loss_average.items if counts and loss_average is not None else "rows",
        )


def _step(
    runner: _Runner, module: nn.Module, exact: nn.Module, batch: Batch, ids: list[int], out: int, counts: Sequence[int] = (),
) -> tuple[_Step, bool]:
    """The recorded step of the model as given, or of its eval-mode copy when a one-row
    chunk made BatchNorm raise in train mode (and whether it is the copy's).

    Raises:
        InvalidArgument: a user's wrapper raised in the step (naming ``--parallel``).
    """
    try:
        try:
            step, in_eval = _recorded_step(runner, module, batch, ids, out, counts), False
        except (RuntimeError, ValueError) as error:
            if ONE_ROW_BATCHNORM not in str(error):
                raise
            step, in_eval = _recorded_step(runner, exact, batch, ids, out, counts), True
    except InvalidArgument:
        raise
    except Exception as error:
        if not runner.users:
            raise
        raise InvalidArgument(f"--parallel {runner.name} raised {describe_exception(error)} in the step explain measures") from error
    if not any(log.rows for log in step.logs):
        raise InvalidArgument(
            f"--parallel {runner.name}: no replica ran a forward of the module's copies (the wrapper never called "
            "the module, or a copy made by torch's replicate or deepcopy), so there is no step to explain"
        )
    return step, in_eval


def _dropped(runner: _Runner, planned: Sequence[tuple[str, int]], chunks: Sequence[ChunkFact], batch_size: int) -> list[StateFact]:
    """Rows that reached no replica, or more than one: torch's plan (positional inputs of
    different lengths), or, for a user's wrapper, the rows its replicas' forwards received
    (where they sit in the batch when every chunk is rows of it, else their count)."""
    if not runner.users:
        return [StateFact("dropped rows", path, f"{count} rows reach no replica (positional inputs of different lengths)") for path, count in planned]
    ran = [chunk for chunk in chunks if chunk.kind != "idle"]
    received = [chunk.size for chunk in ran]
    if any(chunk.start is None for chunk in ran):
        lost = batch_size - sum(received)
        if lost <= 0:
            return []
        return [StateFact("dropped rows", "the batch", f"{lost} of {batch_size} rows reached no replica: the replicas' forwards received {received} rows")]
    counts = [0] * batch_size
    for chunk in ran:
        assert chunk.start is not None
        for row in range(chunk.start, chunk.start + chunk.size):
            counts[row] += 1
    missing = [row for row, count in enumerate(counts) if count == 0]
    repeated = [row for row, count in enumerate(counts) if count > 1]
    found = (
        ("dropped rows", missing, f" ({len(missing)} of {batch_size}) reached no replica"),
        ("repeated rows", repeated, " reached more than one replica"),
    )
    got = f"the replicas' forwards received {_chunk_rows(ran)}"
    return [StateFact(kind, "the batch", f"{_row_list(rows)}{what}: {got}") for kind, rows, what in found if rows]


def _row_list(rows: Sequence[int]) -> str:
    """``row 7``, ``rows 3, 5``: batch rows in words (the first dozen)."""
    return ("row " if len(rows) == 1 else "rows ") + ", ".join(map(str, rows[:12])) + (", ..." if len(rows) > 12 else "")


def _chunk_rows(chunks: Sequence[ChunkFact]) -> str:
    """``rows 0, 1-3, 3-4 and 5-6``: what each replica's forward received, in device order."""
    return "rows " + ", ".join(chunk.rows for chunk in chunks[:-1]) + (" and " if len(chunks) > 1 else "") + chunks[-1].rows
