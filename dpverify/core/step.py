"""One training step (forward, loss, backward) on a private copy of the user's module."""

from __future__ import annotations

import contextlib
import copy
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dpverify.core.comparison import Terms
from dpverify.core.errors import InvalidArgument
from dpverify.core.numerics import magnitudes
from dpverify.core.tree import concatenate, first_batched, map_tensors, tensor_leaves
from dpverify.core.virtual import replica_device

__all__ = [
    "Key",
    "LossFn",
    "ReplicaGradRecorder",
    "ReplicaRecord",
    "StepResult",
    "as_inputs",
    "batch_size_of",
    "convert_tensors",
    "copy_module",
    "default_dtype",
    "flatten_tensors",
    "jitter_parameters",
    "no_tf32",
    "quiet_size_warnings",
    "run_step",
    "seed_step",
]

#: ``loss_fn(output, target)`` -> a scalar loss.
LossFn = Callable[[Any, Any], torch.Tensor]
LossOfOutput = Callable[[Any], torch.Tensor]
Wrap = Callable[[nn.Module], Callable[..., Any]]

#: The start of the warning torch's regression losses give when the input and the target
#: differ in size (``mse_loss``, ``l1_loss``, ``smooth_l1_loss``, ``huber_loss`` in
#: torch/nn/functional.py), as a ``warnings.filterwarnings`` pattern.
SIZE_MISMATCH_WARNING = r"Using a target size \(.*\) that is different to the input size"


def quiet_size_warnings(loss_of_output: LossOfOutput) -> LossOfOutput:
    """``loss_of_output`` without torch's size-mismatch warning, for a parallel step's loss
    only: a wrapper that loses rows returns fewer rows than the target has, which dpverify
    reports itself, so the warning would only repeat it. Every other warning is kept."""

    def loss(output: Any) -> torch.Tensor:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=SIZE_MISMATCH_WARNING, category=UserWarning)
            return loss_of_output(output)

    return loss


def as_inputs(inputs: Any, *, keywords: bool = False) -> tuple[Any, ...]:
    """One tensor, or a tuple of positional forward arguments, as a tuple; ``()`` only when
    the call has ``keywords`` (a keyword-only forward, ``model(**batch)``)."""
    if isinstance(inputs, tuple):
        if not inputs and not keywords:
            raise InvalidArgument(
                "inputs=() is empty; pass the batch tensor, a tuple of forward arguments, or "
                "the batch's tensors as forward_kwargs (a keyword-only call, model(**batch))"
            )
        return inputs
    return (inputs,)


def batch_size_of(
    inputs: tuple[Any, ...], *, argument: str = "inputs", dim: int = 0, kwargs: Mapping[str, Any] | None = None,
) -> int:
    """Rows along ``dim`` of the first tensor argument, positional first, then keyword (as
    torch's ``scatter_kwargs`` splits both); an empty batch is an error."""
    first = first_batched((inputs, dict(kwargs or {})))
    if kwargs and not inputs:
        argument = "forward_kwargs"
    if first is not None:
        if not -first.dim() <= dim < first.dim():
            raise InvalidArgument(
                f"dim={dim} is not a dimension of {argument}'s first tensor (shape {tuple(first.shape)}); "
                "pass the dimension the batch is split along"
            )
        rows = int(first.size(dim))
        if rows == 0:
            raise InvalidArgument(
                f"{argument} has an empty batch (0 rows along dim {dim}); pass at least one row"
            )
        return rows
    raise InvalidArgument(
        f"{argument} holds no tensor with a batch dimension; pass the batch as a tensor"
    )


def flatten_tensors(obj: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensor_leaves`` without the keys: each path (``output['logits']``) and tensor."""
    for name, _keys, tensor in tensor_leaves(obj, path):
        yield name, tensor


def convert_tensors(obj: Any, dtype: torch.dtype | None, device: torch.device) -> Any:
    """Fresh copies of every tensor, floating ones cast to ``dtype``; other objects kept."""

    def convert(tensor: torch.Tensor) -> torch.Tensor:
        cast = dtype if dtype is not None and tensor.is_floating_point() else None
        return tensor.detach().to(device=device, dtype=cast, copy=True)

    return map_tensors(obj, convert)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    # Forwards that create tensors (torch.zeros(n)) must follow the run's precision.
    if dtype is None or not dtype.is_floating_point or dtype in (torch.float16, torch.bfloat16):
        yield
        return
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@contextlib.contextmanager
def no_tf32() -> Iterator[None]:
    # TF32 convolutions (on by default in cuDNN on Ampere+) break fp32 comparisons.
    if not torch.cuda.is_available():
        yield
        return
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def seed_step(seed: int, device: torch.device) -> None:
    """Seeds the generators a step on ``device`` draws from (call inside ``fork_rng``).

    Not ``torch.manual_seed``: it also seeds every lazily initialised accelerator backend,
    which costs milliseconds per call, and touches generators the step does not use.
    """
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)


def parameter_sites(module: nn.Module) -> list[tuple[str, str, str]]:
    """(qualified name, owning module path, attribute) for every distinct parameter."""
    owners: dict[int, tuple[str, str, str]] = {}
    for module_path, sub in module.named_modules(remove_duplicate=False):
        for attr, param in sub._parameters.items():
            if param is not None and id(param) not in owners:
                name = f"{module_path}.{attr}" if module_path else attr
                owners[id(param)] = (name, module_path, attr)
    return list(owners.values())


@dataclass
class ReplicaRecord:
    """One replica's forward, as ``ReplicaGradRecorder`` saw it.

    Attributes:
        device: the device it ran on (``replica_device``: its virtual device, else its
            parameters' CUDA device); None when unknown.
        rows: entries along the split dimension of the first batched argument it received
            (None when it received none with that dimension).
        first_input: that argument, detached.
        grads: its gradient contribution to each parameter (kept with ``keep=True``).
        grad_bytes: bytes of its gradient contributions.
    """

    device: int | None = None
    rows: int | None = None
    first_input: torch.Tensor | None = None
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    grad_bytes: int = 0


class ReplicaGradRecorder:
    """Records every replica forward of a module and each replica's own gradient
    contribution to every parameter.

    A forward pre-hook on the root module runs on every replica (replicas share the hook
    dictionaries: ``Module._replicate_for_data_parallel`` copies ``__dict__`` shallowly), and
    registers a gradient hook on the replica's copy of each parameter, for any wrapper that
    calls the module's copies. Each call of the root module is one replica's forward, with a
    ``ReplicaRecord`` of its own (``current()`` in the thread running it).

    It always adds up, per parameter, ``sum over replicas of max |g_r|`` (and of ``||g_r||``):
    the scale of the terms the reduce-add sums, which bounds its rounding however much the
    replicas cancel. A subclass records more with its own ``record_type``, ``new_record``
    and ``on_parameter``; its hooks go in ``handles``, which ``detach`` removes.

    Args:
        sites: the parameters, as ``parameter_sites`` gives them.
        keep: keep each replica's gradients (``ReplicaRecord.grads``).
        dim: the dimension the batch is split along (``ReplicaRecord.rows`` counts it).
    """

    #: what ``new_record`` makes for each replica forward
    record_type: type[ReplicaRecord] = ReplicaRecord

    def __init__(self, sites: list[tuple[str, str, str]], *, keep: bool = True, dim: int = 0) -> None:
        self.sites = sites
        self.keep = keep
        self.dim = dim
        #: one per replica forward, in the order they started
        self.replicas: list[ReplicaRecord] = []
        self.magnitudes: dict[str, float] = {}
        self.norms: dict[str, float] = {}
        self.handles: list[Any] = []
        self._lock = threading.Lock()  # real DataParallel runs replicas in concurrent threads
        self._current = threading.local()

    def __deepcopy__(self, memo: dict[int, Any]) -> ReplicaGradRecorder:
        # A wrapper that deep-copies the module per replica copies the hook with it; the
        # copies must report to this recorder too.
        return self

    def attach(self, module: nn.Module) -> None:
        self.handles.append(module.register_forward_pre_hook(self._on_forward, with_kwargs=True))

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def current(self) -> ReplicaRecord | None:
        """The record of the replica forward the calling thread runs (its last one)."""
        record: ReplicaRecord | None = getattr(self._current, "record", None)
        return record

    def ordered(self, device_ids: Sequence[int]) -> list[ReplicaRecord]:
        """The replica forwards in ``device_ids`` order (by device index for devices not in
        it) when every one ran on its own known device (threads finish in any order), else
        in the order they started."""
        records = list(self.replicas)
        devices = [record.device for record in records]
        if not all(device is not None for device in devices) or len(set(devices)) != len(devices):
            return records
        position = {device: i for i, device in enumerate(device_ids)}

        def rank(record: ReplicaRecord) -> tuple[int, int]:
            device = record.device or 0
            return position.get(device, len(position)), device

        return sorted(records, key=rank)

    def new_record(self, replica: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ReplicaRecord:
        """A new record for a replica forward about to run with ``args`` and ``kwargs``."""
        del replica
        first = first_batched((args, kwargs))
        record = self.record_type(device=replica_device(first))
        if first is not None and -first.dim() <= self.dim < first.dim():
            record.rows, record.first_input = int(first.shape[self.dim]), first.detach()
        return record

    def on_parameter(self, record: ReplicaRecord, name: str, tensor: torch.Tensor) -> None:
        """Sees the replica's ``tensor`` of parameter ``name`` as its forward starts."""

    def _on_forward(self, replica: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # Each call of the root module is one replica's forward. (Not keyed by id(replica):
        # a wrapper may free a replica before building the next, and ids get reused.)
        record = self.new_record(replica, args, kwargs)
        with self._lock:
            self.replicas.append(record)
        self._current.record = record
        for name, module_path, attr in self.sites:
            tensor = getattr(replica.get_submodule(module_path), attr, None)
            if not isinstance(tensor, torch.Tensor):
                continue
            self.on_parameter(record, name, tensor)
            if tensor.requires_grad:
                record.device = replica_device(tensor)
                self.handles.append(tensor.register_hook(self._recorder(record, name)))

    def _recorder(self, record: ReplicaRecord, name: str) -> Callable[[torch.Tensor], None]:
        def record_grad(grad: torch.Tensor | None) -> None:
            # A replica whose forward never used the parameter (an unused submodule, a
            # branch not taken, an output the loss does not read) has no gradient to
            # contribute: autograd calls the hook with None, and that replica adds nothing
            # to the reduce-add.
            if grad is None:
                return
            grad = grad.detach()
            size, norm = magnitudes(grad)
            with self._lock:
                if self.keep:
                    record.grads[name] = grad.clone()
                record.grad_bytes += int(grad.numel() * grad.element_size())
                self.magnitudes[name] = self.magnitudes.get(name, 0.0) + size
                self.norms[name] = self.norms.get(name, 0.0) + norm

        return record_grad


@dataclass(frozen=True)
class StepResult:
    """What one step produced, detached: outputs by path, the loss, gradients by name.

    ``loss_terms`` (when measured) is ``max(|loss|, sum |d loss / d output * output|)``:
    how much the loss moves when every output entry moves by its own unit of roundoff,
    the scale of the loss's rounding (a loss of tiny residuals of large outputs rounds
    like the outputs, not like its own small value).
    """

    outputs: tuple[tuple[str, torch.Tensor], ...]
    loss: torch.Tensor
    grads: dict[str, torch.Tensor | None]
    contributions: tuple[tuple[int | None, dict[str, torch.Tensor]], ...] = ()
    magnitudes: dict[str, float] = field(default_factory=dict)
    norms: dict[str, float] = field(default_factory=dict)
    loss_terms: float | None = None
    #: rows (along the split dimension) each replica forward received, in device order
    replica_rows: tuple[int, ...] = ()
    #: the output itself, detached (containers as the module returned them)
    output: Any = None
    #: the per-replica outputs concatenated along the split dimension, by path, when the
    #: wrapper returned one output per replica (a list or tuple of them) instead of gathering
    gathered: tuple[tuple[str, torch.Tensor], ...] | None = None
    #: where the wrapper's forward gathered (virtual ``Gather`` targets, -1 the host; on real
    #: devices the device of the output), in order; empty when it did not gather
    gathered_on: tuple[int, ...] = ()
    #: the ``watch``ed submodules (dotted names) whose forward ran, in ``watch``'s order
    ran: tuple[str, ...] = ()

    def terms(self, name: str) -> Terms | None:
        """The magnitude of the replica contributions summed into ``name``'s gradient."""
        if name not in self.magnitudes:
            return None
        return Terms(self.magnitudes[name], self.norms.get(name, 0.0))


@dataclass(frozen=True)
class Key:
    """Which tensor of a step a row compares: an output by path (optionally rows
    ``start:stop`` of it), the loss, or a parameter's gradient divided by ``divisor``.
    Equal keys pick the same tensor, so a reference's tensor of a key is picked once.
    Build one with ``Key.output``, ``Key.grad`` or ``Key.loss``."""

    kind: str
    name: str = ""
    divisor: int = 1
    rows: tuple[int, int] | None = None

    @classmethod
    def output(cls, path: str, rows: tuple[int, int] | None = None) -> Key:
        return cls("output", path, rows=rows)

    @classmethod
    def grad(cls, name: str, divisor: int = 1) -> Key:
        return cls("grad", name, divisor)

    @classmethod
    def loss(cls) -> Key:
        return cls("loss")

    def __call__(self, step: StepResult) -> torch.Tensor | None:
        if self.kind == "output":
            tensor = dict(step.outputs).get(self.name)
            if self.rows is not None and tensor is not None and tensor.dim() > 0:
                return tensor[self.rows[0] : self.rows[1]]
            return tensor
        if self.kind == "loss":
            return step.loss
        grad = step.grads.get(self.name)
        return grad / self.divisor if grad is not None and self.divisor != 1 else grad


def run_step(
    module: nn.Module,
    inputs: tuple[Any, ...],
    loss_of_output: LossOfOutput,
    *,
    wrap: Wrap | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
    seed: int = 0,
    record_replicas: bool | str = False,
    loss_argument: str = "loss_fn",
    kwargs: dict[str, Any] | None = None,
    measure_terms: bool = False,
    jitter: float = 0.0,
    dim: int = 0,
    rows_seen: list[int] | None = None,
    device_ids: Sequence[int] = (),
    watch: Collection[str] = (),
) -> StepResult:
    """Runs forward, loss and backward on a deep copy of ``module``.

    Args:
        module: the user's module; never modified.
        inputs: positional forward arguments (copied, floating ones cast to ``dtype``).
        loss_of_output: maps the forward's output to a scalar loss.
        wrap: builds the parallel wrapper around the copy (None: run the copy alone).
        dtype: cast the copy and floating inputs to this dtype (None: keep).
        device: where the copy and inputs go (default CPU).
        seed: torch seed for the step, so stochastic layers draw the same way each run.
        record_replicas: capture every replica's gradient contribution (True), or only the
            sum of their magnitudes, ``sum_r max |g_r|`` (``"magnitudes"``).
        loss_argument: the argument named in errors about the loss.
        kwargs: keyword forward arguments (copied like ``inputs``).
        measure_terms: also measure ``StepResult.loss_terms``.
        jitter: multiply every floating parameter by ``1 +- jitter`` (random signs from a
            fixed generator) before the step: a step perturbed by a few units of roundoff
            shows how much rounding moves this model's results.
        dim: the dimension a wrapper splits the batch along (the rows a replica forward
            received are counted along it; per-replica outputs are concatenated along it).
        rows_seen: filled with the rows each replica forward received (device order),
            also when the step raises: what the wrapper did before it failed.
        device_ids: the wrapper's devices: replicas are reported in this order (by device
            index when not given).
        watch: submodules (dotted names) to watch: those whose forward ran are
            ``StepResult.ran`` (a divergence source the step never called makes no
            difference to it).
    """
    device = device or torch.device("cpu")
    model = copy_module(module, dtype)
    model.to(device)
    if jitter:
        jitter_parameters(model, jitter)
    args = convert_tensors(inputs, dtype, device)
    keywords = convert_tensors(dict(kwargs or {}), dtype, device)
    sites = parameter_sites(model)
    recorder = ReplicaGradRecorder(sites, keep=record_replicas is True, dim=dim) if record_replicas else None
    if recorder is not None:
        recorder.attach(model)
    ran: set[str] = set()
    for name in watch:
        model.get_submodule(name).register_forward_pre_hook(_ran_recorder(ran, name))
    runner: Callable[..., Any] = wrap(model) if wrap is not None else model
    order: list[ReplicaRecord] = []
    fork_devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=fork_devices), default_dtype(dtype), no_tf32():
            seed_step(seed, device)
            output = runner(*args, **keywords)
            watched = _retain_output_grads(output) if measure_terms else []
            loss = loss_of_output(output)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
                raise InvalidArgument(
                    f"{loss_argument} returned {shape}; it must return a scalar tensor "
                    "(a mean loss over the batch)"
                )
            if not loss.requires_grad:
                raise InvalidArgument(
                    f"{loss_argument} returned a loss that does not require grad; "
                    "it must be computed from the module's output"
                )
            loss.reshape(()).backward()
    finally:
        if recorder is not None:
            recorder.detach()
            order = recorder.ordered(device_ids)
        rows = tuple(record.rows for record in order if record.rows is not None)
        if rows_seen is not None:
            rows_seen[:] = rows
    grads = {name: _grad_of(model, module_path, attr) for name, module_path, attr in sites}
    contributions = tuple((record.device, record.grads) for record in order)
    detached = _detached(output)
    outputs = tuple((path, tensor.detach()) for path, tensor in flatten_tensors(output, "output"))
    magnitudes = recorder.magnitudes if recorder is not None else {}
    norms = recorder.norms if recorder is not None else {}
    loss_terms = None
    if measure_terms:
        propagated = sum(
            float((tensor.grad * tensor.detach()).abs().sum()) for tensor in watched if tensor.grad is not None
        )
        loss_terms = max(abs(float(loss.detach())), propagated)
    return StepResult(
        outputs, loss.detach().reshape(()), grads, contributions, magnitudes, norms, loss_terms, rows, detached,
        _gathered(detached, len(order), dim), ran=tuple(name for name in watch if name in ran),
    )


def _ran_recorder(ran: set[str], name: str) -> Callable[..., None]:
    """A forward pre-hook that adds ``name`` to ``ran`` (replicas copy it along: any of
    them running the submodule counts)."""

    def hook(module: nn.Module, args: Any) -> None:
        del module, args
        ran.add(name)

    return hook


def _detached(output: Any) -> Any:
    """``output`` with its tensors detached, or None when its containers cannot be rebuilt
    (a container class whose constructor does not take its items)."""
    try:
        return map_tensors(output, lambda tensor: tensor.detach())
    except Exception:  # a user's container class: the flat outputs remain
        return None


def _gathered(output: Any, replicas: int, dim: int) -> tuple[tuple[str, torch.Tensor], ...] | None:
    """``output``'s per-replica parts concatenated along ``dim``, by path, when ``output``
    is a list or tuple of one part per replica forward; None otherwise."""
    if not isinstance(output, (list, tuple)) or hasattr(output, "_fields") or len(output) != replicas or not replicas:
        return None
    try:
        return tuple(flatten_tensors(concatenate(list(output), dim), "output"))
    except (ValueError, RuntimeError, TypeError, IndexError):
        return None


def _retain_output_grads(output: Any) -> list[torch.Tensor]:
    watched = []
    for _path, _keys, tensor in tensor_leaves(output):
        if tensor.is_floating_point() and tensor.requires_grad:
            tensor.retain_grad()
            watched.append(tensor)
    return watched


def jitter_parameters(model: nn.Module, size: float) -> None:
    """Multiplies every floating parameter of ``model`` in place by ``1 +- size``, with
    signs from a fixed generator: a copy so perturbed by a few units of roundoff shows how
    far rounding alone moves the model's results."""
    generator = torch.Generator().manual_seed(0x5EED)
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point() and param.numel():
                signs = torch.randint(0, 2, param.shape, generator=generator).to(param.device, param.dtype) * 2 - 1
                param.mul_(1 + size * signs)


def copy_module(module: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    """A deep copy, with floating parameters and buffers already in ``dtype``.

    Converted tensors are planted in deepcopy's memo, so each is written once, in the new
    dtype, instead of being copied and then converted (this halves the cost of the float64
    anchor's copy of a large model).
    """
    memo = _fresh_empty_containers(module)
    if dtype is None:
        return copy.deepcopy(module, memo)
    with torch.no_grad():
        for param in module.parameters():
            if param.is_floating_point() and id(param) not in memo:
                # copy=True: in the module's own dtype ``to`` would return the same storage,
                # and a step on the copy (its jittered parameters, a BatchNorm's running
                # statistics) would write into the module under test
                memo[id(param)] = nn.Parameter(param.detach().to(dtype, copy=True), requires_grad=param.requires_grad)
        for buffer in module.buffers():
            if buffer.is_floating_point() and id(buffer) not in memo:
                memo[id(buffer)] = buffer.detach().to(dtype, copy=True)
    model = copy.deepcopy(module, memo)
    model.to(dtype=dtype)  # anything the memo missed (e.g. tensors held outside parameters)
    return model


#: Containers whose deep copy, when empty, is a new empty one of the same type.
_CONTAINERS = (dict, OrderedDict, set, list)


def _fresh_empty_containers(module: nn.Module) -> dict[int, Any]:
    """A ``copy.deepcopy`` memo giving every empty dict, ``OrderedDict``, set or list held
    by ``module`` and its submodules (most of a module's hook dictionaries) a new empty
    one of the same type: what deepcopy would make of it, without its generic
    ``__reduce_ex__`` path, which is most of the time a small model's copy takes."""
    memo: dict[int, Any] = {}
    for sub in module.modules():
        for value in vars(sub).values():
            if type(value) in _CONTAINERS and not value:
                memo[id(value)] = type(value)()
    return memo


def _grad_of(model: nn.Module, module_path: str, attr: str) -> torch.Tensor | None:
    param = model.get_submodule(module_path)._parameters[attr]
    return None if param is None or param.grad is None else param.grad.detach()


def first_parameter_dtype(module: nn.Module, default: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype a step runs in: the module's first floating parameter's, else ``default``."""
    for param in module.parameters():
        if param.is_floating_point():
            return param.dtype
    return default


