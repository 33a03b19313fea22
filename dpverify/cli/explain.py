"""``dpverify explain``: the questions people ask about DataParallel, answered by measurement.

One DataParallel step of the given model runs over virtual devices (torch's own
orchestration code, see ``dpverify.core.virtual``) with hooks that record what each replica
received and held: whether its chunk is a view of the batch or a copy, whether its
parameters share storage with the module, its activations, the rows of the output gradient
that Gather's backward sent it, and its gradient contribution. Further runs measure the
loss-averaging trap, gradient sum versus average versus the full batch, state lost on
replicas, the effect of ``output_device``, and what DDP's averaging gives for the same
chunks.

This module only measures: ``explain`` returns an ``Explanation`` (frozen dataclasses of
facts, JSON-ready). ``dpverify.cli.explain_answers`` turns it into the numbered answers of
``docs/questions.md``, and ``dpverify.cli.explain_view`` draws both with rich
(``render_explanation``) or writes them as JSON (``explanation_json``).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dpverify.checks.loss_average import (
    LossAverageReport,
    check_forward_loss_average,
    chunk_weighted_loss,
    extract_loss,
)
from dpverify.core.divergence import ONE_ROW_BATCHNORM, divergence_sources
from dpverify.core.scatter import plan_scatter
from dpverify.core.step import parameter_sites, run_step, seed_step
from dpverify.core.tree import map_tensors, tensor_leaves
from dpverify.core.virtual import SCALAR_GATHER_WARNING, VirtualDataParallel, current_virtual_device
from dpverify.models.user import Batch, UserModel

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

@dataclass(frozen=True)
class ChunkFact:
    """What scatter gave one device.

    Attributes:
        device: the device.
        rows: the batch rows it received, ``"0-1"`` (empty when idle).
        size: how many rows.
        kind: ``"view"`` (of the batch, no transfer), ``"copy"`` or ``"idle"``.
        copied_bytes: bytes of its inputs that are copies, not views of the batch.
    """

    device: int
    rows: str
    size: int
    kind: str
    copied_bytes: int


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
        output_grad_rows: rows of d loss / d output that Gather's backward sent it.
        activation_bytes: bytes of the module outputs it produced (forward hooks).
        grad_bytes: bytes of its gradient contribution to the parameters.
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
    """

    parameter: str
    full_norm: float
    sum_error: float
    average_error: float
    average_ratio: float


@dataclass(frozen=True)
class SplitFact:
    """How ``torch.chunk`` splits one batch size over the devices."""

    batch_size: int
    chunk_sizes: tuple[int, ...]
    idle_devices: int


@dataclass(frozen=True)
class StateFact:
    """State that does not survive DataParallel, or a module that cannot match exactly.

    Attributes:
        kind: ``"attribute"``, ``"buffer"``, ``"batch statistics"``, ``"randomness"`` or
            ``"dropped rows"``.
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
    facts, without words (``dpverify.cli.explain_answers.answers`` gives those).

    ``eval_mode_for_losses``: the model has BatchNorm or Dropout in train mode, so the loss,
    gradient, output-device and DDP measurements (questions 3, 4, 6, 8, 11) ran on an
    eval-mode copy, where only DataParallel's own arithmetic differs; the step diagram, the
    bytes and the lost state (question 10) are of the model as given, unless
    ``eval_mode_for_step``: a chunk of one row made BatchNorm raise in train mode.
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
    gathered_on: int
    loss_average: LossAverageReport
    returned_loss_shape: tuple[int, ...]
    one_device_loss_shape: tuple[int, ...]
    scalar_warning: bool
    grads: tuple[GradFact, ...]
    replicas_built_over_two_forwards: int
    bytes: tuple[DeviceBytes, ...]
    other_output_device: int | None
    other_output_device_grad_gap: float | None
    splits: tuple[SplitFact, ...]
    state: tuple[StateFact, ...]
    ddp: DDPFact
    eval_mode_for_losses: bool
    eval_mode_for_step: bool

    @property
    def replicas_used(self) -> int:
        return len(self.chunk_sizes)

    @property
    def idle_devices(self) -> tuple[int, ...]:
        return self.device_ids[self.replicas_used :]

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


def _primary(output: Any) -> torch.Tensor:
    tensors = [t for t in _tensors(output) if t.dim() > 0]
    if not tensors:
        raise ValueError("the forward returned no tensor with a batch dimension")
    return tensors[0]


class _LossInForward(nn.Module):
    """The user's model with its loss moved into forward: ``forward(*inputs, target)``
    returns the chunk's mean loss, as a model that computes its loss in forward does."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *args: Any) -> torch.Tensor:
        *inputs, target = args
        loss: torch.Tensor = self.loss_fn(self.model(*inputs), target)
        return loss


def _loss_model(module: nn.Module, batch: Batch) -> tuple[nn.Module, tuple[Any, ...]]:
    """A model whose forward returns its loss, and its arguments."""
    if batch.loss_fn is None:
        return module, batch.inputs
    return _LossInForward(module, batch.loss_fn), (*batch.inputs, batch.target)


def _loss_of(batch: Batch, sizes: Sequence[int]) -> Callable[[Any], torch.Tensor]:
    """The step's loss: ``loss_fn(output, target)``, or for a model that returns its loss,
    the n_i/B-weighted replica losses (exact; a scalar on one device)."""
    loss_fn, target = batch.loss_fn, batch.target
    if loss_fn is not None:
        return lambda output: loss_fn(output, target)

    def from_forward(output: Any) -> torch.Tensor:
        losses = extract_loss(output, -1)
        if losses.dim() == 0:
            return losses
        return chunk_weighted_loss(losses.reshape(-1), list(sizes))

    return from_forward


# --------------------------------------------------------------------------- the step


class _RecordingDataParallel(VirtualDataParallel[Any]):
    """Records the ``output_device`` torch's ``DataParallel.forward`` passes to ``gather``."""

    def gather(self, outputs: Any, output_device: int | torch.device) -> Any:
        self.gathered_on = int(output_device)  # type: ignore[arg-type]
        return super().gather(outputs, output_device)


@dataclass
class _ReplicaLog:
    device: int
    shared: int = 0
    copied: int = 0
    equal: bool = True
    leaves: int = 0
    parameter_bytes: int = 0
    input_tensors: tuple[tuple[bool, int], ...] = ()  # (is a view of the batch, bytes)
    output_shape: tuple[int, ...] = ()
    output_grad_rows: int = 0
    output_grad_bytes: int = 0
    activation_bytes: int = 0
    grad_bytes: int = 0


class _StepRecorder:
    """Hooks that record what every replica received, held and produced.

    Replicas share the hook dictionaries of the module they were made from
    (``Module._replicate_for_data_parallel`` copies ``__dict__`` shallowly), so hooks
    registered on the module run on every replica; ``current_virtual_device()`` says which.
    """

    def __init__(self, module: nn.Module, batch: Sequence[torch.Tensor], device_ids: Sequence[int]) -> None:
        self.module = module
        self.first = device_ids[0]
        self.sites = parameter_sites(module)
        self.originals = {name: getattr(module.get_submodule(path), attr) for name, path, attr in self.sites}
        self.buffers = dict(module.named_buffers())
        self.batch_storages = {_storage(t) for t in batch}
        self.logs: dict[int, _ReplicaLog] = {}
        self.seen: set[tuple[int, int]] = set()
        self.handles: list[Any] = []

    def device(self) -> int:
        current = current_virtual_device()
        return self.first if current is None else current

    def attach(self) -> None:
        self.handles.append(self.module.register_forward_pre_hook(self._on_replica, with_kwargs=True))
        self.handles.append(self.module.register_forward_hook(self._on_output))
        for sub in self.module.modules():
            self.handles.append(sub.register_forward_hook(self._on_activation))

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _on_replica(self, replica: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        log = self.logs.setdefault(self.device(), _ReplicaLog(self.device()))
        log.input_tensors = tuple(
            (_storage(t) in self.batch_storages, _nbytes(t)) for t in _tensors((args, kwargs))
        )
        for name, path, attr in self.sites:
            tensor = getattr(replica.get_submodule(path), attr)
            original = self.originals[name]
            shared = tensor.data_ptr() == original.data_ptr()
            log.shared += shared
            log.copied += not shared
            log.parameter_bytes += 0 if shared else _nbytes(tensor)
            log.equal &= bool(torch.equal(tensor.detach(), original.detach()))
            log.leaves += tensor.is_leaf
            if tensor.requires_grad:
                tensor.register_hook(self._grad_recorder(log))
        for name, buffer in replica.named_buffers():
            if name in self.buffers and buffer.data_ptr() != self.buffers[name].data_ptr():
                log.parameter_bytes += _nbytes(buffer)

    def _grad_recorder(self, log: _ReplicaLog) -> Callable[[torch.Tensor], None]:
        def record(grad: torch.Tensor) -> None:
            log.grad_bytes += _nbytes(grad)

        return record

    def _on_output(self, replica: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        del replica, args
        log = self.logs[self.device()]
        primary = _primary(output) if _tensors(output) else None
        log.output_shape = tuple(primary.shape) if primary is not None else ()
        for tensor in _tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(self._output_grad_recorder(log))

    def _output_grad_recorder(self, log: _ReplicaLog) -> Callable[[torch.Tensor], None]:
        def record(grad: torch.Tensor) -> None:
            if grad.dim() > 0 and not log.output_grad_rows:
                log.output_grad_rows = int(grad.shape[0])
            log.output_grad_bytes += _nbytes(grad)

        return record

    def _on_activation(self, sub: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        del sub, args
        device = self.device()
        log = self.logs.setdefault(device, _ReplicaLog(device))
        for tensor in _tensors(output):
            key = (device, _storage(tensor))
            if key not in self.seen:  # a container's output is its last child's
                self.seen.add(key)
                log.activation_bytes += _nbytes(tensor)


@dataclass(frozen=True)
class _Step:
    logs: tuple[_ReplicaLog, ...]
    output_shape: tuple[int, ...]
    output_bytes: int
    loss: float
    gathered_on: int
    grad_bytes: int  # the module's .grad, on device_ids[0]
    batch_bytes: int
    parameter_bytes: int  # the module's parameters and buffers, on device_ids[0]


def _recorded_step(module: nn.Module, batch: Batch, device_ids: list[int], output_device: int, sizes: Sequence[int]) -> _Step:
    model = copy.deepcopy(module)
    batch_tensors = _tensors(batch.inputs)
    recorder = _StepRecorder(model, batch_tensors, device_ids)
    wrapper = _RecordingDataParallel(model, device_ids, output_device)
    wrapper.gathered_on = device_ids[0]  # with one device nothing is gathered
    recorder.attach()
    try:
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=SCALAR_GATHER_WARNING)
            seed_step(0, torch.device("cpu"))
            output = wrapper(*batch.inputs)
            loss = _loss_of(batch, sizes)(output)
            loss.backward()
    finally:
        recorder.detach()
    primary = _primary(output)
    own = [*model.parameters(), *model.buffers()]
    return _Step(
        logs=tuple(recorder.logs[d] for d in device_ids if d in recorder.logs),
        output_shape=tuple(primary.shape),
        output_bytes=sum(_nbytes(t) for t in _tensors(output)),
        loss=float(loss.detach()),
        gathered_on=int(wrapper.gathered_on),
        grad_bytes=sum(_nbytes(p.grad) for p in model.parameters() if p.grad is not None),
        batch_bytes=sum(_nbytes(t) for t in batch_tensors),
        parameter_bytes=sum(_nbytes(t) for t in own),
    )


def _chunks(step: _Step, device_ids: Sequence[int], sizes: Sequence[int]) -> tuple[ChunkFact, ...]:
    facts: list[ChunkFact] = []
    start = 0
    logs = {log.device: log for log in step.logs}
    for i, device in enumerate(device_ids):
        if i >= len(sizes) or device not in logs:
            facts.append(ChunkFact(device, "", 0, "idle", 0))
            continue
        size = sizes[i]
        views = logs[device].input_tensors
        copied = sum(nbytes for is_view, nbytes in views if not is_view)
        kind = "view" if views and all(is_view for is_view, _ in views) else "copy"
        rows = f"{start}" if size == 1 else f"{start}-{start + size - 1}"
        facts.append(ChunkFact(device, rows, size, kind, copied))
        start += size
    return tuple(facts)


def _replicas(step: _Step) -> tuple[ReplicaFact, ...]:
    return tuple(
        ReplicaFact(
            replica=i,
            device=log.device,
            shared_parameters=log.shared,
            copied_parameters=log.copied,
            equal_to_module=log.equal,
            leaf_parameters=log.leaves,
            parameter_bytes=log.parameter_bytes,
            output_shape=log.output_shape,
            output_grad_rows=log.output_grad_rows,
            activation_bytes=log.activation_bytes,
            grad_bytes=log.grad_bytes,
        )
        for i, log in enumerate(step.logs)
    )


def _device_bytes(step: _Step, chunks: Sequence[ChunkFact], device_ids: Sequence[int], output_device: int) -> tuple[DeviceBytes, ...]:
    logs = {log.device: log for log in step.logs}
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


def _float64_grads(module: nn.Module, batch: Batch, device_ids: list[int], sizes: Sequence[int]) -> tuple[GradFact, ...]:
    """Sum and average of the replica gradients against the full-batch gradient, in float64."""
    loss = _loss_of(batch, sizes)
    parallel = run_step(
        module, batch.inputs, loss, wrap=lambda m: VirtualDataParallel(m, device_ids),
        dtype=torch.float64, record_replicas=True,
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
            )
        )
    return tuple(facts)


def _returned_loss(module: nn.Module, batch: Batch, device_ids: list[int]) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
    """Shape of the loss DataParallel returns on these devices and on one, and whether
    torch warned that it unsqueezed scalars."""
    model, args = _loss_model(module, batch)
    shapes: list[tuple[int, ...]] = []
    warned = False
    for ids in (device_ids, device_ids[:1]):
        with warnings.catch_warnings(record=True) as caught, torch.no_grad(), torch.random.fork_rng(devices=[]):
            warnings.simplefilter("always")
            output = VirtualDataParallel(copy.deepcopy(model), ids)(*args)
        shapes.append(tuple(extract_loss(output, -1).shape))
        warned |= ids is device_ids and any(SCALAR_GATHER_WARNING in str(w.message) for w in caught)
    return shapes[0], shapes[1], warned


def _replicas_per_forward(module: nn.Module, batch: Batch, device_ids: list[int]) -> int:
    """Distinct replica objects over two forwards (replicas are rebuilt on every call)."""
    model = copy.deepcopy(module)
    seen: list[nn.Module] = []  # references keep ids unique
    handle = model.register_forward_pre_hook(lambda replica, args: seen.append(replica))
    wrapper = VirtualDataParallel(model, device_ids)
    with torch.no_grad(), torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SCALAR_GATHER_WARNING)
        wrapper(*batch.inputs)
        wrapper(*batch.inputs)
    handle.remove()
    return len({id(replica) for replica in seen})


def _output_device_gap(module: nn.Module, batch: Batch, device_ids: list[int], output_device: int, sizes: Sequence[int]) -> tuple[int | None, float | None]:
    """Greatest gradient difference when the outputs are gathered on another device."""
    used = device_ids[: len(sizes)]
    others = [d for d in used if d != output_device]
    if not others:
        return None, None
    other = others[-1]
    loss = _loss_of(batch, sizes)
    steps = [run_step(module, batch.inputs, loss, wrap=_gathering_on(device_ids, out)) for out in (output_device, other)]
    gaps = [
        float((a - b).abs().max())
        for name, a in steps[0].grads.items()
        if a is not None and (b := steps[1].grads.get(name)) is not None
    ]
    return other, max(gaps, default=0.0)


def _gathering_on(device_ids: list[int], output_device: int) -> Callable[[nn.Module], nn.Module]:
    return lambda module: VirtualDataParallel(module, device_ids, output_device)


def _splits(batch_size: int, n_devices: int) -> tuple[SplitFact, ...]:
    """torch.chunk itself, on batches of interesting sizes for this device count."""
    sizes = sorted({1, max(1, n_devices - 1), n_devices, n_devices + 1, 2 * n_devices + 1, batch_size})
    facts = []
    for size in sizes:
        chunks = tuple(int(c.size(0)) for c in torch.empty(size).chunk(n_devices))
        facts.append(SplitFact(size, chunks, n_devices - len(chunks)))
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


def _state(module: nn.Module, batch: Batch, device_ids: list[int], plan_dropped: Sequence[tuple[str, int]]) -> tuple[StateFact, ...]:
    """Runs one forward on one device and one under DataParallel, and compares the state
    the two leave behind."""
    single, parallel = copy.deepcopy(module), copy.deepcopy(module)
    facts: list[StateFact] = []
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SCALAR_GATHER_WARNING)
        seed_step(0, torch.device("cpu"))
        single(*batch.inputs)
        seed_step(0, torch.device("cpu"))
        try:
            VirtualDataParallel(parallel, device_ids)(*batch.inputs)
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
            facts.append(StateFact(
                "buffer", name,
                f"updated in place in forward: one device leaves {_fmt(one)}, DataParallel "
                f"{_fmt(buffer)} (only replica 0's update reaches the module)",
            ))
    single_modules = dict(single.named_modules())
    parallel_modules = dict(parallel.named_modules())
    for path, key, value in _attributes(module):
        alone = getattr(single_modules[path], key, None)
        par = getattr(parallel_modules[path], key, None)
        if alone != value and par != alone:
            where = f"{path}.{key}" if path else key
            facts.append(StateFact(
                "attribute", where,
                f"set in forward: one device leaves {alone!r}, DataParallel {par!r} (replicas "
                "are shallow copies; assignments to them are lost)",
            ))
    for source in divergence_sources(module):
        facts.append(StateFact(source.kind, source.module or "the root module", f"{source.reason} Fix: {source.fix}"))
    for path, count in plan_dropped:
        facts.append(StateFact("dropped rows", path, f"{count} rows reach no replica (positional inputs of different lengths)"))
    return tuple(facts)


def _ddp_fact(module: nn.Module, batch: Batch, device_ids: list[int], sizes: Sequence[int], real_ddp: bool) -> DDPFact:
    """DDP's gradient (per-shard gradients averaged) against DataParallel's for the same
    chunks, with a mean loss and with a summed loss; simulated in one process, or measured
    on real ranks with ``real_ddp``."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]

    def rows(obj: Any, start: int, size: int) -> Any:
        # the shard's rows of every batched tensor, wherever scatter would find it
        return map_tensors(obj, lambda t: t.narrow(0, start, size) if t.dim() > 0 else t)

    def grads(loss_scale: Callable[[int], float], start: int, size: int) -> list[torch.Tensor]:
        shard = Batch(rows(batch.inputs, start, size), rows(batch.target, start, size), batch.loss_fn, batch.loss_name)
        base = _loss_of(shard, [size])
        step = run_step(module, shard.inputs, lambda out: base(out) * loss_scale(size), dtype=torch.float64)
        return [g if g is not None else torch.zeros(()) for g in step.grads.values()]

    def gap(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
        scale = max((float(t.abs().max()) for t in b if t.numel()), default=0.0) or 1.0
        return max((float((x - y).abs().max()) for x, y in zip(a, b, strict=True)), default=0.0) / scale

    k = len(sizes)
    full = grads(lambda n: 1.0, 0, sum(sizes))
    per_shard = [grads(lambda n: 1.0, s, n) for s, n in zip(starts, sizes, strict=True)]
    ddp_mean = [torch.stack(parts).sum(0) / k for parts in zip(*per_shard, strict=True)]
    ratio: float | None = None
    if batch.loss_fn is not None:
        dp_sum = grads(lambda n: float(n), 0, sum(sizes))
        shard_sums = [grads(lambda n: float(n), s, n) for s, n in zip(starts, sizes, strict=True)]
        ddp_sum = [torch.stack(parts).sum(0) / k for parts in zip(*shard_sums, strict=True)]
        norms = sum(float(t.norm()) for t in dp_sum)
        ratio = sum(float(t.norm()) for t in ddp_sum) / norms if norms else None
    fact = DDPFact("simulated", gap(ddp_mean, full), ratio)
    if real_ddp:
        fact = _measured_ddp(module, batch, k, fact)
    return fact


def _measured_ddp(module: nn.Module, batch: Batch, world_size: int, simulated: DDPFact) -> DDPFact:
    from dpverify.checks.registry import CHECKS, Case, Verdict
    from dpverify.ddp import checks_if_available

    if checks_if_available() is None:
        return DDPFact("simulated", simulated.mean_loss_gap, simulated.sum_loss_ratio, "the DDP backend is not available in this build")
    if batch.loss_fn is None:
        return DDPFact("simulated", simulated.mean_loss_gap, simulated.sum_loss_ratio, "real DDP needs loss_fn(output, target); this forward returns its loss")
    case = Case(module, batch.inputs, batch.target, batch.loss_fn, tuple(range(world_size)))
    result = CHECKS["dp-ddp-agree"].run(case)
    if result.verdict is Verdict.PASS:
        detail = f"real DDP on {world_size} ranks agrees with DataParallel ({result.summary})"
    elif result.scale is not None:
        detail = f"real DDP on {world_size} ranks gives {result.scale:.6g} times DataParallel's gradients"
    else:
        detail = f"real DDP on {world_size} ranks gives other gradients than DataParallel ({result.summary})"
    return DDPFact("measured", simulated.mean_loss_gap, simulated.sum_loss_ratio, detail)


# --------------------------------------------------------------------------- entry


def explain(
    model: UserModel,
    *,
    batch_size: int,
    device_ids: Sequence[int],
    output_device: int | None = None,
    real_ddp: bool = False,
) -> Explanation:
    """Measures one DataParallel step of ``model`` on virtual devices, and what every
    question of docs/questions.md needs (``explain_answers.answers`` words it).

    Args:
        model: the model and its batches.
        batch_size: rows in the batch.
        device_ids: the virtual devices.
        output_device: where outputs are gathered (default ``device_ids[0]``).
        real_ddp: also run real DDP ranks for question 11 (seconds to start).
    """
    ids = list(device_ids)
    out = ids[0] if output_device is None else output_device
    batch = model.make_batch(batch_size)
    module = model.module
    diverges = bool(divergence_sources(module))
    # BatchNorm/Dropout in train mode make every replica differ from the full batch: the
    # arithmetic questions are answered on an eval-mode copy, where only DataParallel differs.
    exact = copy.deepcopy(module).eval() if diverges else module
    plan = plan_scatter(batch.inputs, None, ids, warn=False)
    sizes = list(plan.chunk_sizes)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SCALAR_GATHER_WARNING)
        try:
            step, step_in_eval = _recorded_step(module, batch, ids, out, sizes), False
        except (RuntimeError, ValueError) as error:
            if ONE_ROW_BATCHNORM not in str(error):
                raise
            step, step_in_eval = _recorded_step(exact, batch, ids, out, sizes), True
        chunks = _chunks(step, ids, sizes)
        loss_model, loss_args = _loss_model(exact, batch)
        returned, one_device, warned = _returned_loss(exact, batch, ids)
        other, gap = _output_device_gap(exact, batch, ids, out, sizes)
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
            loss_average=check_forward_loss_average(loss_model, loss_args, device_ids=ids),
            returned_loss_shape=returned,
            one_device_loss_shape=one_device,
            scalar_warning=warned,
            grads=_float64_grads(exact, batch, ids, sizes),
            replicas_built_over_two_forwards=_replicas_per_forward(exact if step_in_eval else module, batch, ids),
            bytes=_device_bytes(step, chunks, ids, out),
            other_output_device=other,
            other_output_device_grad_gap=gap,
            splits=_splits(batch_size, len(ids)),
            state=_state(module, batch, ids, plan.dropped),
            ddp=_ddp_fact(exact, batch, ids, sizes, real_ddp),
            eval_mode_for_losses=diverges,
            eval_mode_for_step=step_in_eval,
        )
