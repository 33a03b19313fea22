"""DataParallel on any machine: torch's own orchestration over virtual devices.

Two ways in, both running torch's own DataParallel code with CPU stand-ins for the CUDA
primitives:

* ``VirtualDataParallel`` subclasses ``torch.nn.DataParallel`` and keeps its ``forward``
  and the ``scatter_kwargs``, ``scatter``, ``gather`` and ``replicate`` functions of
  ``torch.nn.parallel``; the primitives are virtual for the calling thread alone, while its
  own ``scatter``, ``replicate`` and ``gather`` run (``virtual_primitives``), and its
  ``parallel_apply`` is ``_parallel_apply``.
* ``virtual_devices(n)`` is a block in which torch believes ``n`` CUDA devices exist:
  ``torch.nn.DataParallel`` and its subclasses, built and called there, get
  ``device_ids=[0, ..., n-1]`` and run their own ``forward``, ``scatter``, ``replicate``,
  ``parallel_apply`` and ``gather``, overridden or not, over virtual devices. The block is
  process-wide (see ``virtual_devices``).

The primitives, virtual in both:

==================================  ========================================================
torch primitive                     virtual stand-in
==================================  ========================================================
``_functions.Scatter``              ``_VirtualScatter``: ``tensor.chunk`` (or ``split`` by
                                    the chunk sizes); the chunk for the source device is a
                                    view, the others are copies
``_functions.Gather``               ``_VirtualGather``: concatenation into the first
                                    output's dtype, scalar warning, backward splits the
                                    gradient by chunk size
``_functions.Broadcast``            ``_VirtualBroadcast``: replica 0 aliases the parameter,
                                    the others are copies; backward is a reduce-add (a sum)
``_functions.ReduceAddCoalesced``   ``_VirtualReduceAddCoalesced``: a sum in replica order;
                                    backward is a broadcast
``comm.broadcast``                  the first device gets the tensor itself, the others
                                    copies
``comm.broadcast_coalesced``        ``_virtual_broadcast_coalesced`` (detached replicas,
                                    buffers)
``comm.scatter``                    as ``Scatter``, without autograd (``out=`` too)
``comm.gather``                     as ``Gather``, without autograd (``out=`` too)
``comm.reduce_add``                 a sum, the destination's input first, then the others in
                                    order, as torch sums without NCCL
``parallel_apply``                  ``_parallel_apply``: one thread per replica, as torch
                                    does, without CUDA streams; one random generator per
                                    device
==================================  ========================================================

The devices, virtual inside ``virtual_devices(n)`` only:

====================================  ======================================================
torch                                 inside ``virtual_devices(n)``
====================================  ======================================================
``torch.cuda.is_available``           True
``torch.cuda.device_count``           ``n`` (the innermost block's on this thread)
``torch.cuda.current_device``         the thread's virtual device: a replica's, or the one
                                      ``torch.cuda.device(i)`` or ``set_device`` selected; 0
                                      otherwise
``torch.cuda.set_device``             selects the thread's virtual device
``torch.cuda.get_device_properties``  the same properties for every virtual device, so
                                      ``_check_balance`` does not warn
``torch.cuda.device`` (the class)     ``__enter__``/``__exit__`` select a virtual device for
                                      the block (``device_of`` inherits them)
``DataParallel.src_device_obj``       reads as ``torch.device('cpu')``: the host stands for
                                      ``device_ids[0]``, so CPU modules pass ``forward``'s
                                      check and ``__init__``'s one-device ``module.to``
``torch.nn.parallel.data_parallel``   torch's function with the host for ``device_ids[0]``
====================================  ======================================================

Everything is switched in place, on the objects torch defines, so code that imported a name
(``from torch.nn.parallel._functions import Scatter``, ``from torch.cuda.comm import
reduce_add``) is covered too: a function gets a trampoline ``__code__``, an autograd
Function class an ``apply`` attribute, ``torch.cuda.device`` its two methods, and
``DataParallel`` a ``src_device_obj`` descriptor (``_SWITCHES``). They are installed when
the first block of either kind opens and removed, restoring torch's objects exactly, when
the last one closes. ``replicate``, ``scatter``, ``scatter_kwargs``, ``gather`` and
``comm.reduce_add_coalesced`` stay torch's own: they reach the devices only through the
switched primitives, so their imported names run virtually too.

Not covered: ``tensor.get_device()`` is -1 and ``tensor.is_cuda`` False for every tensor;
``.cuda()``, ``.to('cuda:k')``, streams, events, ``synchronize``, the CUDA random
generators, memory statistics and ``torch.accelerator`` are torch's, and fail as on any
CPU-only machine; only replicas that ``parallel_apply`` runs draw from per-device
generators (code run under ``torch.cuda.device(i)`` draws from the host's); subclasses of
the four autograd Functions run torch's code; a DataParallel built outside
``virtual_devices`` keeps the ``device_ids`` it got then. dpverify's own device discovery
(``devices.cuda_device_count``) still finds the machine's devices in a block.

Device arguments are read as torch reads them: ints, ``torch.device('cuda:k')`` objects
and ``'cuda:k'`` strings alike.

Host tensors stand for tensors on the source device ``device_ids[0]``: the module's CPU
parameters are the parameters "on device_ids[0]", and a CPU batch is a batch already moved
there. So chunk 0 is a view of the batch, exactly as with a batch on ``cuda:device_ids[0]``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import sys
import threading
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from itertools import chain
from typing import Any, TypeVar

import torch
from torch import nn
from torch._utils import ExceptionWrapper, _handle_complex
from torch._utils import _get_device_index as _torch_device_index
from torch.autograd import Function
from torch.cuda._utils import _get_device_index as _cuda_device_index
from torch.nn.parallel import _functions as torch_functions
from torch.nn.parallel import comm as torch_comm
from torch.nn.parallel.data_parallel import data_parallel as _torch_data_parallel
from torch.nn.parallel.parallel_apply import parallel_apply as _torch_parallel_apply
from torch.nn.parallel.replicate import replicate as _torch_replicate
from torch.nn.parallel.scatter_gather import gather as _torch_gather
from torch.nn.parallel.scatter_gather import scatter_kwargs as _torch_scatter_kwargs

from dpverify.core import devices as devices_module
from dpverify.core.devices import (
    HOST,
    cuda_device_count,
    device_index,
    normalize_device_ids,
    normalize_output_device,
)
from dpverify.core.errors import InvalidArgument

__all__ = [
    "VirtualDataParallel",
    "current_virtual_device",
    "data_parallel",
    "observe_gathers",
    "replica_device",
    "virtual_devices",
    "virtual_primitives",
]

T = TypeVar("T", bound=nn.Module)

#: Message torch.nn.parallel._functions.Gather warns with; kept identical so filters match.
SCALAR_GATHER_WARNING = (
    "Was asked to gather along dimension 0, but all input tensors were scalars; "
    "will instead unsqueeze and return a vector."
)


class _ThreadState(threading.local):
    depth: int = 0  # open virtual_primitives blocks on this thread
    views_only: bool = False
    device: int | None = None  # the thread's virtual device: its replica's, or selected
    devices: list[int] | None = None
    count: int | None = None  # the innermost virtual_devices(n) open on this thread
    replica: bool = False  # the thread runs a replica for _parallel_apply
    gathers: list[int] | None = None  # where this thread's virtual gathers went (observe_gathers)


_state = _ThreadState()


def current_virtual_device() -> int | None:
    """The virtual device of the calling thread, or None when it has none.

    A replica's thread has its replica's device; inside ``virtual_devices``, a block of
    ``torch.cuda.device(i)`` (or ``torch.cuda.set_device(i)``) selects device ``i``.
    """
    return _state.device


def replica_device(tensor: torch.Tensor | None) -> int | None:
    """The device of the replica running in the calling thread: its virtual device, else
    the CUDA device ``tensor`` (one of its arguments or parameters) is on; None for a host
    forward outside any replica."""
    device = current_virtual_device()
    if device is None and tensor is not None and tensor.device.type == "cuda":
        device = tensor.device.index
    return device


@contextlib.contextmanager
def observe_gathers() -> Iterator[list[int]]:
    """Collects the target device (-1 for the host) of every virtual ``Gather`` the calling
    thread runs in the block: where a wrapper gathered its outputs. Nests: an inner block
    collects only its own."""
    saved = _state.gathers
    seen: list[int] = []
    _state.gathers = seen
    try:
        yield seen
    finally:
        _state.gathers = saved


def _copy_to(chunk: torch.Tensor, device: int, source: int) -> torch.Tensor:
    # comm.scatter/broadcast hand the source device its own data and copy to the others.
    if device == source or _state.views_only:
        return chunk
    return chunk.clone()


def _scatter_chunks(
    input: torch.Tensor, targets: Sequence[int], chunk_sizes: Sequence[int] | None, dim: int, source: int
) -> tuple[torch.Tensor, ...]:
    """``comm.scatter``'s chunks: ``chunk`` or ``split`` by the sizes, one per device used."""
    if chunk_sizes is None:
        chunks = input.chunk(len(targets), dim)
    else:
        if len(chunk_sizes) != len(targets):
            raise RuntimeError(
                f"Expected devices and chunk_sizes to be of same length, but got "
                f"len(devices) = {len(targets)} and len(chunk_sizes) = {len(chunk_sizes)}"
            )
        chunks = input.split(list(chunk_sizes), dim)
    return tuple(_copy_to(chunk, device, source) for chunk, device in zip(chunks, targets, strict=False))


class _VirtualScatter(Function):
    """``torch.nn.parallel._functions.Scatter`` for virtual devices."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        target_gpus: Sequence[int],
        chunk_sizes: Sequence[int] | None,
        dim: int,
        input: torch.Tensor,
        source: int | None = None,
    ) -> tuple[torch.Tensor, ...]:
        # torch's Scatter reads each target with _get_device_index(x, True): ints,
        # torch.device objects and 'cuda:k' strings alike.
        targets = [device_index(d, "device_ids") for d in target_gpus]
        ctx.dim = dim
        ctx.input_device = targets[0] if source is None else source
        return _scatter_chunks(input, targets, chunk_sizes, dim, ctx.input_device)

    @staticmethod
    def backward(ctx: Any, *grad_output: torch.Tensor) -> tuple[Any, ...]:
        return None, None, None, _VirtualGather.apply(ctx.input_device, ctx.dim, *grad_output), None  # type: ignore[no-untyped-call]


def _gather_target(target_device: Any) -> int:
    """The device ``Gather`` gathers on, read as torch's ``Gather.forward`` reads it.

    torch special-cases the string ``"cpu"`` and passes anything else through
    ``_get_device_index(target_device, True)``: an index (-1 is the host), a
    ``torch.device('cuda:k')`` or ``'cuda:k'``; ``torch.device('cpu')`` is a ValueError.
    """
    if isinstance(target_device, str) and target_device == "cpu":
        return HOST
    index = device_index(target_device, "output_device")
    if index < HOST:
        raise InvalidArgument(
            f"output_device={index} is not a device; pass a device index, or -1 for the host"
        )
    return index


def _concatenate(inputs: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    # comm.gather allocates the output with the first input's dtype and copies each
    # input into it (_gather_out_impl in torch/csrc/cuda/comm.cpp): no autocast and no
    # type promotion. torch.cat inside the caller's autocast region would promote, or
    # fail on replica outputs in another low-precision dtype than the caller's.
    dtype = inputs[0].dtype
    with torch.amp.autocast("cpu", enabled=False):
        return torch.cat([t.to(dtype) for t in inputs], dim)


class _VirtualGather(Function):
    """``torch.nn.parallel._functions.Gather`` for virtual devices."""

    @staticmethod
    def forward(ctx: Any, target_device: Any, dim: int, *inputs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.target_device = _gather_target(target_device)
        ctx.dim = dim
        if _state.gathers is not None:
            _state.gathers.append(ctx.target_device)
        devices = _state.devices or range(len(inputs))
        ctx.input_gpus = tuple(devices)[: len(inputs)]
        if all(t.dim() == 0 for t in inputs) and dim == 0:
            inputs = tuple(t.view(1) for t in inputs)
            warnings.warn(SCALAR_GATHER_WARNING, stacklevel=2)
            ctx.unsqueezed_scalar = True
        else:
            ctx.unsqueezed_scalar = False
        ctx.input_sizes = tuple(i.size(ctx.dim) for i in inputs)
        return _concatenate(inputs, ctx.dim)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        grads = _VirtualScatter.apply(  # type: ignore[no-untyped-call]
            ctx.input_gpus, ctx.input_sizes, ctx.dim, grad_output, ctx.target_device
        )
        if ctx.unsqueezed_scalar:
            grads = tuple(g[0] for g in grads)
        return (None, None, *grads)


def _virtual_broadcast_coalesced(
    tensors: Sequence[torch.Tensor], devices: Sequence[Any], buffer_size: int = 0
) -> list[list[torch.Tensor]]:
    """``comm.broadcast_coalesced``: the first device gets the tensors themselves."""
    del buffer_size  # coalescing is a transfer optimisation with no semantic effect
    first = list(tensors)
    return [first] + [[t.detach().clone() for t in tensors] for _ in list(devices)[1:]]


class _VirtualBroadcast(Function):
    """``torch.nn.parallel._functions.Broadcast``: parameters to every replica."""

    @staticmethod
    def forward(ctx: Any, target_gpus: Sequence[Any], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.target_gpus = [device_index(d, "target_gpus") for d in target_gpus]
        if len(inputs) == 0:
            return ()
        ctx.num_inputs = len(inputs)
        ctx.input_device = ctx.target_gpus[0]
        outputs = _virtual_broadcast_coalesced(inputs, ctx.target_gpus)
        non_differentiables: list[torch.Tensor] = []
        for idx, input_requires_grad in enumerate(ctx.needs_input_grad[1:]):
            if not input_requires_grad:
                non_differentiables.extend(output[idx] for output in outputs)
        ctx.mark_non_differentiable(*non_differentiables)
        return tuple(chain.from_iterable(outputs))

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:
        grads = _VirtualReduceAddCoalesced.apply(  # type: ignore[no-untyped-call]
            ctx.input_device, ctx.num_inputs, ctx.target_gpus, *grad_outputs
        )
        return (None, *grads)


class _VirtualReduceAddCoalesced(Function):
    """``ReduceAddCoalesced``: replica gradients are summed, in replica order, like comm.reduce_add."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, destination: int, num_inputs: int, target_gpus: Sequence[int], *grads: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        del destination
        ctx.target_gpus = list(target_gpus)
        per_replica = [grads[i : i + num_inputs] for i in range(0, len(grads), num_inputs)]
        results = []
        for column in zip(*per_replica, strict=True):
            total = column[0].clone() if len(column) == 1 else column[0] + column[1]
            for other in column[2:]:
                total.add_(other)
            results.append(total)
        return tuple(results)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:
        return (None, None, None, *_VirtualBroadcast.apply(ctx.target_gpus, *grad_outputs))  # type: ignore[no-untyped-call]


def _source_devices(count: int) -> list[int]:
    """The virtual devices of ``count`` per-replica tensors, in replica order.

    A tensor does not say which virtual device it is on (``get_device()`` is -1 for every
    host tensor), so this is the devices a ``VirtualDataParallel`` gather names, or
    ``0, 1, ...``: the devices of the replicas a ``virtual_devices`` DataParallel runs.
    """
    return list(_state.devices or range(count))[:count]


def _reduce_add_coalesced_apply(destination: Any, num_inputs: int, *grads: torch.Tensor) -> Any:
    """``ReduceAddCoalesced.apply(destination, num_inputs, *grads)``, torch's signature."""
    devices = _source_devices(len(grads) // num_inputs if num_inputs else 0)
    return _VirtualReduceAddCoalesced.apply(destination, num_inputs, devices, *grads)  # type: ignore[no-untyped-call]


# --- torch.nn.parallel.comm (torch.cuda.comm) -------------------------------------------


def _virtual_comm_broadcast(tensor: torch.Tensor, devices: Any = None, *, out: Any = None) -> tuple[torch.Tensor, ...]:
    """``comm.broadcast``: the first device gets the tensor itself, the others copies."""
    tensor = _handle_complex(tensor)
    if not ((devices is None) ^ (out is None)):
        raise RuntimeError(
            f"Exactly one of 'devices' and 'out' must be specified, but got devices={devices} and out={out}"
        )
    if devices is not None:
        targets = [device_index(d, "devices") for d in devices]
        return tuple(tensor if i == 0 else tensor.clone() for i in range(len(targets)))
    for target in out:
        if target.shape != tensor.shape:
            raise RuntimeError(
                f"Expected all output tensors to have the same shape as the source tensor "
                f"{tuple(tensor.shape)}, but got one of shape {tuple(target.shape)}"
            )
        target.copy_(tensor)
    return tuple(out)


def _virtual_comm_broadcast_coalesced(
    tensors: Sequence[torch.Tensor], devices: Sequence[Any], buffer_size: int = 10485760
) -> list[list[torch.Tensor]]:
    """``comm.broadcast_coalesced``: complex tensors as real views, as torch returns them."""
    targets = [device_index(d, "devices") for d in devices]
    return _virtual_broadcast_coalesced([_handle_complex(t) for t in tensors], targets, buffer_size)


def _virtual_comm_scatter(
    tensor: torch.Tensor,
    devices: Any = None,
    chunk_sizes: Sequence[int] | None = None,
    dim: int = 0,
    streams: Any = None,
    *,
    out: Any = None,
) -> tuple[torch.Tensor, ...]:
    """``comm.scatter``: ``Scatter`` without autograd; the first device's chunk is a view."""
    del streams
    tensor = _handle_complex(tensor)
    if out is None:
        targets = [device_index(d, "devices") for d in devices]
        return _scatter_chunks(tensor, targets, chunk_sizes, dim, targets[0])
    if devices is not None:
        raise RuntimeError(
            f"'devices' must not be specified when 'out' is specified, but got devices={devices}"
        )
    if chunk_sizes is not None:
        raise RuntimeError(
            f"'chunk_sizes' must not be specified when 'out' is specified, but got chunk_sizes={chunk_sizes}"
        )
    for target, chunk in zip(out, tensor.split([o.size(dim) for o in out], dim), strict=True):
        target.copy_(chunk)
    return tuple(out)


def _virtual_comm_gather(
    tensors: Sequence[torch.Tensor], dim: int = 0, destination: Any = None, *, out: Any = None
) -> torch.Tensor:
    """``comm.gather``: ``Gather`` without autograd, into the first tensor's dtype."""
    tensors = [_handle_complex(t) for t in tensors]
    if out is None:
        if destination == -1:
            warnings.warn(
                "Using -1 to represent CPU tensor is deprecated. Please use a "
                'device object or string instead, e.g., "cpu".',
                FutureWarning,
                stacklevel=2,
            )
        return _concatenate(tensors, dim)
    if destination is not None:
        raise RuntimeError(
            f"'destination' must not be specified when 'out' is specified, but got destination={destination}"
        )
    return torch.cat(tensors, dim, out=out)


def _virtual_reduce_add(inputs: Sequence[torch.Tensor], destination: Any = None) -> torch.Tensor:
    """``comm.reduce_add``: the destination's input plus the others, in order.

    Input ``i`` is on virtual device ``i`` (``_source_devices``); ``destination`` (default:
    the current virtual device) picks the input the sum starts from, as torch's sum without
    NCCL does; a destination none of the inputs is on starts from the first.
    """
    destination = _torch_device_index(destination, optional=True)
    input_size = inputs[0].size()
    for i, inp in enumerate(inputs):
        if inp.size() != input_size:
            got = "x".join(str(x) for x in inp.size())
            expected = "x".join(str(x) for x in input_size)
            raise ValueError(f"input {i} has invalid size: got {got}, but expected {expected}")
    if len(inputs) == 1:
        return inputs[0]
    devices = _source_devices(len(inputs))
    root = devices.index(destination) if destination in devices else 0
    nonroot = [t for i, t in enumerate(inputs) if i != root]
    result = inputs[root] + nonroot[0]
    for other in nonroot[1:]:
        result.add_(other)
    return result


# --- torch.cuda's devices -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _VirtualDeviceProperties:
    """What ``torch.cuda.get_device_properties`` returns for a virtual device.

    Every virtual device has the same properties, so DataParallel's ``_check_balance``
    (memory and multiprocessor counts within 75% of each other) never warns.
    """

    name: str = "dpverify virtual device"
    major: int = 8
    minor: int = 0
    total_memory: int = 16 * 2**30
    multi_processor_count: int = 108
    is_integrated: int = 0
    is_multi_gpu_board: int = 0


def _device_count() -> int:
    if _state.count is not None:
        return _state.count
    with _switch_lock:
        return _open_blocks[-1].count if _open_blocks else 0


def _checked_device(index: int) -> int:
    count = _device_count()
    if not 0 <= index < count:
        raise InvalidArgument(
            f"device {index} is not a virtual device: virtual_devices({count}) has devices "
            f"0 to {count - 1}"
        )
    return index


def _virtual_is_available() -> bool:
    return True


def _virtual_device_count() -> int:
    return _device_count()


def _virtual_current_device() -> int:
    return 0 if _state.device is None else _state.device


def _virtual_set_device(device: Any) -> None:
    index = _cuda_device_index(device)
    if index >= 0:  # torch: a no-op for a negative index
        _state.device = _checked_device(index)


def _virtual_get_device_properties(device: Any = None) -> _VirtualDeviceProperties:
    _checked_device(_cuda_device_index(device, optional=True))
    return _VirtualDeviceProperties()


def _virtual_device_enter(self: Any) -> None:
    """``torch.cuda.device.__enter__``: selects the virtual device ``self.idx``."""
    if self.idx is None or self.idx < 0:  # torch: a no-op for a negative index
        self.prev_idx = -1
        return
    _checked_device(self.idx)
    self.prev_idx = _virtual_current_device()
    self._dpverify_previous = _state.device
    _state.device = self.idx


def _virtual_device_exit(self: Any, exc_type: Any, exc_value: Any, traceback: Any) -> bool:
    """``torch.cuda.device.__exit__``: gives the thread back the device it had."""
    previous = self.__dict__.pop("_dpverify_previous", _MISSING)
    if previous is not _MISSING:
        _state.device = previous
    return False


class _HostSourceDevice:
    """``DataParallel.src_device_obj`` inside ``virtual_devices``: the host.

    torch's ``__init__`` stores ``torch.device('cuda', device_ids[0])``, which the instance
    keeps (and shows again once the switches are gone); inside the block the attribute
    reads as the CPU, which stands for ``device_ids[0]``.
    """

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        if _devices_active():
            return torch.device("cpu")
        try:
            return instance.__dict__["src_device_obj"]
        except KeyError:
            raise AttributeError(
                f"'{type(instance).__name__}' object has no attribute 'src_device_obj'"
            ) from None

    def __set__(self, instance: Any, value: Any) -> None:
        instance.__dict__["src_device_obj"] = value

    def __delete__(self, instance: Any) -> None:
        del instance.__dict__["src_device_obj"]


def _virtual_data_parallel_function(
    module: nn.Module,
    inputs: Any,
    device_ids: Sequence[int | torch.device] | None = None,
    output_device: int | torch.device | None = None,
    dim: int = 0,
    module_kwargs: Any | None = None,
) -> Any:
    """``torch.nn.parallel.data_parallel`` with the host standing for ``device_ids[0]``.

    torch's function, step for step, except the device the parameters must be on: torch
    builds ``torch.device('cuda', device_ids[0])`` in a local variable, out of reach of
    ``DataParallel.src_device_obj``'s switch.
    """
    if not isinstance(inputs, tuple):
        inputs = (inputs,) if inputs is not None else ()
    if device_ids is None:
        device_ids = list(range(_device_count()))
    if output_device is None:
        output_device = device_ids[0]
    ids = [_torch_device_index(x, True) for x in device_ids]
    target = _torch_device_index(output_device, True)
    src_device_obj = torch.device("cpu")
    for t in chain(module.parameters(), module.buffers()):
        if t.device != src_device_obj:
            raise RuntimeError(
                "module must have its parameters and buffers "
                f"on device {src_device_obj} (device_ids[0]) but found one of "
                f"them on device: {t.device}"
            )
    scattered, scattered_kwargs = _torch_scatter_kwargs(inputs, module_kwargs, ids, dim)
    if not scattered and not scattered_kwargs:
        scattered = ((),)
        scattered_kwargs = ({},)
    if len(ids) == 1:
        return module(*scattered[0], **scattered_kwargs[0])
    used_device_ids = ids[: len(scattered)]
    replicas = _torch_replicate(module, used_device_ids)
    outputs = _parallel_apply(replicas, scattered, scattered_kwargs, used_device_ids)
    return _torch_gather(outputs, target, dim)


# --- switching torch's objects in place ---------------------------------------------------

_MISSING: Any = object()

#: Prefix of the string constant that names a switch in its trampoline's code.
_SWITCH_KEY = "dpverify-switch:"

_switch_lock = threading.Lock()
#: Open blocks of either kind, on every thread: the switches are installed while > 0.
_users = 0
#: Open ``virtual_devices`` blocks, on every thread: everything is virtual while > 0.
_process_depth = 0


@dataclasses.dataclass(eq=False)
class _OpenBlock:
    """One open ``virtual_devices(count)`` block (compared by identity)."""

    count: int


_open_blocks: list[_OpenBlock] = []


def _primitives_active() -> bool:
    """The primitives are virtual: a ``virtual_devices`` block is open (on any thread), or a
    ``virtual_primitives`` block on this one."""
    return _process_depth > 0 or _state.depth > 0


def _devices_active() -> bool:
    """The devices are virtual: a ``virtual_devices`` block is open, on any thread."""
    return _process_depth > 0


def _trampoline_template(*args: Any, **kwargs: Any) -> Any:
    # Becomes the __code__ of a switched torch function, so it runs with that function's
    # globals, a torch module's: it can name nothing of this module, so it imports it (a
    # lookup in sys.modules once dpverify is imported). _CodeSwitch replaces the string
    # constant with the switch's key.
    from dpverify.core.virtual import _dispatch

    return _dispatch("dpverify-switch:", args, kwargs)


def _is_trampoline(code: types.CodeType) -> bool:
    return any(isinstance(c, str) and c.startswith(_SWITCH_KEY) for c in code.co_consts)


class _CodeSwitch:
    """Switches a torch function in place: its ``__code__`` becomes a trampoline.

    ``from torch.cuda.comm import reduce_add`` binds the function object itself, in modules
    nobody can list, so rebinding module attributes would miss it; every binding shares the
    function object, and so its ``__code__``. (A wrapper needs a new object; scanning
    ``gc.get_referrers`` for old bindings misses closures, defaults and containers.) The
    trampoline passes the call to ``_dispatch``, which runs the stand-in while the switch is
    active (``active()``), and otherwise a copy of torch's function made when the switch
    was installed: its code, globals, defaults and closure, as torch's own. Removing the
    switch puts torch's code object back, so the function is torch's again, down to
    ``__code__`` identity. Only plain functions without a closure can be switched
    (CPython requires a new ``__code__`` to have the old one's free variables).
    """

    def __init__(
        self, function: Callable[..., Any], virtual: Callable[..., Any], active: Callable[[], bool]
    ) -> None:
        if not isinstance(function, types.FunctionType) or function.__closure__:
            raise TypeError(f"{function!r} is not a plain function without a closure")
        self.function = function
        self.virtual = virtual
        self.active = active
        self.key = f"{_SWITCH_KEY}{function.__module__}.{function.__qualname__}"
        code = function.__code__
        template = _trampoline_template.__code__
        consts = tuple(self.key if c == _SWITCH_KEY else c for c in template.co_consts)
        trampoline = template.replace(co_consts=consts, co_name=code.co_name)
        if sys.version_info >= (3, 11):
            trampoline = trampoline.replace(co_qualname=code.co_qualname)
        self.trampoline = trampoline
        self.saved_code = code
        self.original: types.FunctionType = function  # replaced by a copy when installed

    def install(self) -> None:
        function = self.function
        code = function.__code__
        original = self.original
        if (
            original is function
            or code is not self.saved_code
            or function.__defaults__ is not original.__defaults__
            or function.__kwdefaults__ is not original.__kwdefaults__
        ):  # first install, or torch's function changed since: copy it again
            if _is_trampoline(code):
                raise RuntimeError(f"{self.key} is already switched (by another copy of dpverify?)")
            copy = types.FunctionType(
                code, function.__globals__, function.__name__, function.__defaults__, function.__closure__
            )
            copy.__kwdefaults__ = function.__kwdefaults__
            copy.__qualname__ = function.__qualname__
            copy.__module__ = function.__module__
            self.saved_code = code
            self.original = copy
        function.__code__ = self.trampoline

    def uninstall(self) -> None:
        self.function.__code__ = self.saved_code


def _dispatch(key: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Called by a switched function's trampoline: the stand-in or torch's own."""
    switch = _CODE_SWITCHES[key]
    target = switch.virtual if switch.active() else switch.original
    return target(*args, **kwargs)


class _AttributeSwitch:
    """Switches a class attribute in place, and puts back exactly what the class had."""

    def __init__(self, owner: type, name: str, replacement: Any) -> None:
        self.owner = owner
        self.name = name
        self.replacement = replacement
        self.saved: Any = _MISSING

    def install(self) -> None:
        self.saved = self.owner.__dict__.get(self.name, _MISSING)
        setattr(self.owner, self.name, self.replacement)

    def uninstall(self) -> None:
        if self.saved is _MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.saved)


class _MethodSwitch(_AttributeSwitch):
    """Switches a method the class defines: the stand-in while active, torch's otherwise."""

    def __init__(
        self, owner: type, name: str, virtual: Callable[..., Any], active: Callable[[], bool]
    ) -> None:
        if name not in owner.__dict__:
            raise TypeError(f"{owner.__qualname__} does not define {name}")

        def method(*args: Any, **kwargs: Any) -> Any:
            return (virtual if active() else self.saved)(*args, **kwargs)

        method.__name__ = name
        method.__qualname__ = f"{owner.__qualname__}.{name}"
        super().__init__(owner, name, method)


class _ApplySwitch(_AttributeSwitch):
    """Switches an autograd Function's ``apply`` on the class object itself.

    ``from torch.nn.parallel._functions import Scatter`` binds the class, so the switch is
    an ``apply`` classmethod set on it (torch's classes inherit ``Function.apply``). While
    the primitives are virtual it applies dpverify's Function instead, so the graph nodes
    are dpverify's and their backward, looked up on the node's Function class, stays virtual
    after the block closes (a backward outside the block works); torch's ``forward`` and
    ``backward`` are never touched. Subclasses of torch's class apply torch's code.
    """

    def __init__(self, function_class: type, virtual_apply: Callable[..., Any]) -> None:
        self.inherited: Any = None

        def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
            if cls is function_class and _primitives_active():
                return virtual_apply(*args, **kwargs)
            return self.inherited.__get__(None, cls)(*args, **kwargs)

        apply.__qualname__ = f"{function_class.__qualname__}.apply"
        super().__init__(function_class, "apply", classmethod(apply))

    def install(self) -> None:
        # The classmethod the class has now (Function's), as inspect.getattr_static finds it.
        self.inherited = next(k.__dict__["apply"] for k in self.owner.__mro__ if "apply" in k.__dict__)
        super().install()


def _install_all() -> None:
    done: list[_CodeSwitch | _AttributeSwitch] = []
    try:
        for switch in _SWITCHES:
            switch.install()
            done.append(switch)
    except BaseException:
        for switch in reversed(done):
            switch.uninstall()
        raise
    # dpverify's own device discovery keeps finding the machine's devices.
    devices_module._torch_queries = (
        _switch_of(torch.cuda.is_available).original,
        _switch_of(torch.cuda.device_count).original,
    )


def _uninstall_all() -> None:
    devices_module._torch_queries = None
    for switch in reversed(_SWITCHES):
        switch.uninstall()


def _switch_of(function: Callable[..., Any]) -> _CodeSwitch:
    return next(s for s in _CODE_SWITCHES.values() if s.function is function)


def _acquire(block: _OpenBlock | None) -> None:
    """Counts a block in, installing the switches for the first (a virtual_devices block
    also makes everything virtual, process-wide)."""
    global _users, _process_depth
    with _switch_lock:
        if _users == 0:
            _install_all()
        _users += 1
        if block is not None:
            _open_blocks.append(block)
            _process_depth += 1


def _release(block: _OpenBlock | None) -> None:
    """Counts a block out, restoring torch's objects after the last."""
    global _users, _process_depth
    with _switch_lock:
        if block is not None:
            _open_blocks.remove(block)
            _process_depth -= 1
        _users -= 1
        if _users == 0:
            _uninstall_all()


def _device_seed(host_state: bytes, device: int) -> int:
    """Seed of virtual device ``device``'s generator for one ``parallel_apply``.

    Drawn from the host generator's state as the replicas start (so from the caller's
    seed and everything drawn since), and from the device, so devices differ from each
    other and from one forward to the next, and a run repeats exactly after any reseeding:
    ``torch.manual_seed``, ``torch.default_generator.manual_seed`` or ``set_rng_state``.
    """
    digest = hashlib.blake2b(
        host_state + device.to_bytes(8, "little", signed=True), digest_size=8, person=b"dpverify-device"
    ).digest()
    return int.from_bytes(digest, "little")


@contextlib.contextmanager
def _intra_op_threads(count: int) -> Iterator[None]:
    """Runs the block, in a fresh replica thread, with ``count`` intra-op threads.

    ``torch.set_num_threads`` sets the calling thread's OpenMP count and a process-wide
    count that other threads adopt on their first parallel op (ATen's ParallelOpenMP.cpp:
    ``set_num_threads`` stores ``num_threads``, ``lazy_init_num_threads`` applies it per
    thread). A fresh replica thread so starts with the count set last by any thread, which
    is not the caller's once another thread has set one; the count changes how CPU kernels
    split reductions, so replicas would round differently from the caller. torch's own
    ``parallel_apply`` does not do this: its replicas compute on GPUs. The process-wide
    count is put back afterwards, so threads started later see what they would have.
    """
    inherited = torch.get_num_threads()
    if inherited == count:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(inherited)


#: Serialises virtual ``parallel_apply`` calls from different threads: replicas other than
#: the first swap the host generator (the one generator every thread draws from) for their
#: device's, so two interleaved calls would draw from each other's streams.
_apply_lock = threading.Lock()


def _parallel_apply(
    replicas: Sequence[nn.Module],
    inputs: Sequence[Any],
    kwargs_tup: Sequence[dict[str, Any]] | None = None,
    devices: Sequence[int | torch.device | str | None] | None = None,
) -> list[Any]:
    """torch.nn.parallel.parallel_apply without CUDA.

    As in torch, ``kwargs_tup=None`` gives every replica no keyword arguments, an input
    that is not a list or tuple is the replica's only argument, each replica runs in its
    own thread (in the calling thread when there is one replica) with the caller's grad
    mode, and a failure is re-raised as ``Caught <error> in replica {i} on device {device}``.

    Autocast is re-entered the way torch does it: the caller's autocast *flag* for the
    device type is carried into each thread, its dtype is not. torch captures
    ``torch.is_autocast_enabled()`` and enters ``torch.amp.autocast(device_type,
    enabled=...)`` with no dtype, and the autocast dtype is thread-local, so with two or
    more replicas they compute in the device type's default dtype: float16 on CUDA, and
    bfloat16 for the host's autocast, which here stands for the device's. A caller in
    ``torch.autocast(..., dtype=d)`` with a ``d`` other than the default gets replicas that
    run in the default dtype, on GPUs and here alike; a single replica keeps ``d``.

    Each replica thread also computes with the caller's ``torch.get_num_threads()``
    (see ``_intra_op_threads``).

    The threads run one after the other rather than at once: the host has one random
    generator where GPUs have one each. Replicas on ``devices[0]`` continue the caller's
    generator, as replica 0 continues the generator of ``cuda:device_ids[0]``; replicas on
    other devices draw from their device's generator, seeded by ``_device_seed`` from the
    host generator's state when the replicas start. Results are deterministic given the
    caller's seed, dropout masks differ between devices and between forwards (whenever the
    host generator moved in between, which a replica 0 that draws anything ensures), and
    the caller's generator sees replica 0's draws only. Concurrent calls from different
    threads are serialised; a replica's own nested DataParallel runs within its caller's
    turn.

    Args:
        replicas: the modules to run.
        inputs: one entry per replica: a list or tuple of positional arguments, or the
            single argument.
        kwargs_tup: one dict of keyword arguments per replica, or None for none.
        devices: the virtual device of each replica: ints, ``torch.device`` objects or
            strings such as ``'cuda:1'``; None, or a None entry, puts replica ``i`` on
            device ``i`` (torch puts it on the current device; replicas made by
            ``replicate`` live on their own devices, whose generators they draw from).

    Raises:
        AssertionError: ``replicas``, ``inputs``, ``kwargs_tup`` or ``devices`` differ in
            length (torch's check and message).
        InvalidArgument: a device that is not a CUDA device index.
    """
    # Length checks and messages follow torch.nn.parallel.parallel_apply.
    if len(replicas) != len(inputs):
        raise AssertionError(
            f"The number of modules {len(replicas)} is not equal to the number of inputs {len(inputs)}"
        )
    if kwargs_tup is None:
        kwargs_tup = ({},) * len(replicas)
    elif len(replicas) != len(kwargs_tup):
        raise AssertionError(
            f"The number of modules {len(replicas)} is not equal to "
            f"the number of kwargs_tup {len(kwargs_tup)}"
        )
    if devices is None:
        devices = range(len(replicas))
    elif len(replicas) != len(devices):
        raise AssertionError(
            f"The number of modules {len(replicas)} is not equal to the number of devices {len(devices)}"
        )
    # torch reads a None entry as the current device; replica i runs on device i here.
    indices = [i if d is None else device_index(d, "devices") for i, d in enumerate(devices)]
    grad_enabled = torch.is_grad_enabled()
    # torch reads torch.is_autocast_enabled(), the accelerator's flag; the host's autocast
    # plays the accelerator's here.
    autocast_enabled = torch.is_autocast_enabled("cpu")
    num_threads = torch.get_num_threads()
    count = _state.count  # a replica sees its caller's virtual_devices(n)
    results: dict[int, Any] = {}

    def worker(i: int, module: nn.Module, input: Any, kwargs: dict[str, Any], device: int) -> None:
        torch.set_grad_enabled(grad_enabled)
        previous = (_state.device, _state.count, _state.replica)
        _state.device, _state.count, _state.replica = device, count, True
        try:
            with _intra_op_threads(num_threads), torch.amp.autocast("cpu", enabled=autocast_enabled):
                if not isinstance(input, (list, tuple)):
                    input = (input,)
                results[i] = module(*input, **kwargs)
        except Exception:
            results[i] = ExceptionWrapper(where=f"in replica {i} on device {device}")
        finally:
            _state.device, _state.count, _state.replica = previous

    jobs = list(zip(replicas, inputs, kwargs_tup, indices, strict=True))
    # Inside a replica, this thread's caller holds the lock and waits for it.
    turn = contextlib.nullcontext() if _state.replica else _apply_lock
    with turn:
        if len(jobs) == 1:
            worker(0, *jobs[0])
        else:
            _run_in_threads(worker, jobs)

    outputs = []
    for i in range(len(jobs)):
        output = results[i]
        if isinstance(output, ExceptionWrapper):
            output.reraise()
        outputs.append(output)
    return outputs


def _run_in_threads(
    worker: Callable[..., None], jobs: Sequence[tuple[nn.Module, Any, dict[str, Any], int]]
) -> None:
    """Runs ``worker(i, *job)`` in one thread per job, one after the other, each replica
    drawing random numbers from its device's generator (see ``_parallel_apply``)."""
    source = jobs[0][3]
    host_state = torch.default_generator.get_state().numpy().tobytes()
    device_states: dict[int, torch.Tensor] = {}
    for i, job in enumerate(jobs):
        device = job[3]
        with contextlib.ExitStack() as stack:
            if device != source:
                stack.enter_context(torch.random.fork_rng(devices=[]))
                if device in device_states:  # a second replica on one device continues it
                    torch.default_generator.set_state(device_states[device])
                else:
                    torch.default_generator.manual_seed(_device_seed(host_state, device))
            thread = threading.Thread(target=worker, args=(i, *job), name=f"dpverify-replica-{i}")
            thread.start()
            thread.join()
            if device != source:
                device_states[device] = torch.default_generator.get_state()


# Every switch, in install order (removed in reverse). _CODE_SWITCHES maps a trampoline's
# key to its switch.
_CODE_SWITCHES: dict[str, _CodeSwitch] = {}


def _code_switch(
    function: Callable[..., Any], virtual: Callable[..., Any], active: Callable[[], bool]
) -> _CodeSwitch:
    switch = _CodeSwitch(function, virtual, active)
    _CODE_SWITCHES[switch.key] = switch
    return switch


_SWITCHES: tuple[_CodeSwitch | _AttributeSwitch, ...] = (
    # The primitives: virtual in virtual_devices and in virtual_primitives.
    _ApplySwitch(torch_functions.Scatter, _VirtualScatter.apply),
    _ApplySwitch(torch_functions.Gather, _VirtualGather.apply),
    _ApplySwitch(torch_functions.Broadcast, _VirtualBroadcast.apply),
    _ApplySwitch(torch_functions.ReduceAddCoalesced, _reduce_add_coalesced_apply),
    _code_switch(torch_comm.broadcast, _virtual_comm_broadcast, _primitives_active),
    _code_switch(torch_comm.broadcast_coalesced, _virtual_comm_broadcast_coalesced, _primitives_active),
    _code_switch(torch_comm.scatter, _virtual_comm_scatter, _primitives_active),
    _code_switch(torch_comm.gather, _virtual_comm_gather, _primitives_active),
    _code_switch(torch_comm.reduce_add, _virtual_reduce_add, _primitives_active),
    _code_switch(_torch_parallel_apply, _parallel_apply, _primitives_active),
    # The devices: virtual in virtual_devices only.
    _code_switch(torch.cuda.is_available, _virtual_is_available, _devices_active),
    _code_switch(torch.cuda.device_count, _virtual_device_count, _devices_active),
    _code_switch(torch.cuda.current_device, _virtual_current_device, _devices_active),
    _code_switch(torch.cuda.set_device, _virtual_set_device, _devices_active),
    _code_switch(torch.cuda.get_device_properties, _virtual_get_device_properties, _devices_active),
    _MethodSwitch(torch.cuda.device, "__enter__", _virtual_device_enter, _devices_active),
    _MethodSwitch(torch.cuda.device, "__exit__", _virtual_device_exit, _devices_active),
    _AttributeSwitch(nn.DataParallel, "src_device_obj", _HostSourceDevice()),
    _code_switch(_torch_data_parallel, _virtual_data_parallel_function, _devices_active),
)


@contextlib.contextmanager
def virtual_primitives(devices: Sequence[int] = (), *, views_only: bool = False) -> Iterator[None]:
    """Within the block, torch's DataParallel primitives run virtually on this thread.

    The primitives of the module docstring's first table; other threads keep torch's own
    meanwhile (a real DataParallel running in another thread is unaffected), and the
    devices stay the machine's (``torch.cuda.device_count()`` is unchanged).

    Args:
        devices: the virtual devices of the tensors being gathered, in replica order.
        views_only: scatter and broadcast hand out views instead of copies (for planning a
            scatter without paying for the copies).
    """
    _acquire(None)
    saved = (_state.depth, _state.devices, _state.views_only)
    _state.depth += 1
    _state.devices = list(devices)
    _state.views_only = views_only
    try:
        yield
    finally:
        _state.depth, _state.devices, _state.views_only = saved
        _release(None)


@contextlib.contextmanager
def virtual_devices(n: int) -> Iterator[None]:
    """Within the block, torch believes ``n`` CUDA devices exist, and they are virtual.

    ``torch.nn.DataParallel`` and its subclasses built in the block get ``device_ids``
    ``[0, ..., n-1]`` by default and ``output_device`` 0, and run their own code, torch's
    or overridden (``forward``, ``scatter``, ``replicate``, ``parallel_apply``, ``gather``),
    on the CPU stand-ins of the module docstring's tables. The module's parameters and the
    batch stay on the CPU, which stands for ``device_ids[0]``; replicas run in threads with
    ``current_virtual_device()`` (and ``torch.cuda.current_device()``) set to their device.
    torch's objects are switched in place, so third-party wrappers that imported
    ``Scatter``, ``parallel_apply``, ``reduce_add``... by name are covered, and so are
    ``Broadcast`` and ``reduce_add`` called by a custom Function's backward, provided the
    backward runs in the block. Graphs built from DataParallel's own primitives can be
    backpropagated after the block too.

    Blocks nest (the innermost ``n`` applies on its thread, the outer one again after it)
    and may be opened from several threads at once. While any block is open the switch is
    process-wide, not per thread, because replicas run in threads of their own: a
    DataParallel, or any other use of the switched objects, in another thread during the
    block is virtualized too, and a thread with no block of its own sees the ``n`` of the
    most recently opened block. On a CPU-only machine that is harmless for DataParallel
    (torch's primitives cannot run there anyway); on a GPU machine keep real DataParallel
    out of the block's time. Code that branches on ``torch.cuda.is_available()``, in the
    block or in another thread meanwhile, takes its CUDA branch (``.cuda()``, CUDA
    autocast, a gradient scaler), and fails as torch's CUDA calls do here; so open the
    block around building and running the wrappers (and the backward of custom
    Functions), not around a whole program. torch's objects are restored, by identity, when
    the last block closes.

    Example::

        with virtual_devices(4):
            model = BalancedDataParallel(1, module)  # any DataParallel subclass
            loss_fn(model(x), y).backward()

    Raises:
        InvalidArgument: ``n`` is not a positive int; in the block,
            ``torch.cuda.device(i)``, ``set_device(i)`` or ``get_device_properties(i)`` for
            an ``i`` that is not one of the ``n`` devices.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidArgument(f"n={n!r}: pass the number of virtual devices, an int of at least 1")
    block = _OpenBlock(n)
    _acquire(block)
    saved = (_state.count, _state.device)
    _state.count = n
    try:
        yield
    finally:
        _state.count, _state.device = saved
        _release(block)


def _check_on_host(module: nn.Module) -> None:
    for name, tensor in chain(module.named_parameters(), module.named_buffers()):
        if tensor.device.type != "cpu":
            raise InvalidArgument(
                f"module has {name!r} on {tensor.device}; VirtualDataParallel runs on the host, "
                "where the CPU stands for device_ids[0]: move the module there with module.cpu()"
            )


class VirtualDataParallel(nn.DataParallel[T]):
    """``torch.nn.DataParallel`` over virtual devices, on any machine.

    Runs torch's own ``DataParallel.forward`` (and through it ``scatter_kwargs``,
    ``replicate`` and ``gather``); only the CUDA primitives are virtual, so chunking,
    idle devices, replica aliasing, lost replica state, scalar gathering and gradient
    summation behave as on GPUs. So does autocast: with two or more replicas they run in
    the default autocast dtype (bfloat16 here, float16 on CUDA), whatever dtype the caller
    chose, because torch's ``parallel_apply`` carries the autocast flag into its threads
    but not the dtype (see ``_parallel_apply``).

    Args:
        module: the module to parallelize; its parameters and buffers must be on the CPU,
            which stands for ``device_ids[0]``.
        device_ids: distinct non-negative virtual device indices (default ``[0, 1]``).
        output_device: where outputs are gathered: a device index (default
            ``device_ids[0]``), or -1 for the host. Like torch, "cpu" is rejected.
        dim: the scatter and gather dimension.

    Raises:
        InvalidArgument: repeated, negative or malformed device ids, an unusable
            ``output_device``, a non-integer ``dim``, or a module that is not on the CPU.
    """

    def __init__(
        self,
        module: T,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
    ) -> None:
        nn.Module.__init__(self)
        ids = [0, 1] if device_ids is None else normalize_device_ids(device_ids)
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise InvalidArgument(f"dim={dim!r} must be an int, the batch dimension")
        if not isinstance(module, nn.Module):
            raise InvalidArgument(f"module={type(module).__name__} is not a torch.nn.Module")
        _check_on_host(module)
        self.dim = dim
        self.module = module
        self.device_ids = ids
        self.output_device = normalize_output_device(output_device, ids)
        self.src_device_obj = torch.device("cpu")

    def scatter(
        self, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, device_ids: Sequence[int | torch.device]
    ) -> Any:
        with virtual_primitives():
            return super().scatter(inputs, kwargs, device_ids)

    def replicate(self, module: T, device_ids: Sequence[int | torch.device]) -> list[T]:
        with virtual_primitives():
            return super().replicate(module, device_ids)

    def parallel_apply(
        self, replicas: Sequence[T], inputs: Sequence[Any], kwargs: Sequence[dict[str, Any]] | None
    ) -> list[Any]:
        return _parallel_apply(replicas, inputs, kwargs, self.device_ids[: len(replicas)])

    def gather(self, outputs: Any, output_device: int | torch.device) -> Any:
        with virtual_primitives(self.device_ids[: len(outputs)]):
            return super().gather(outputs, output_device)

    def extra_repr(self) -> str:
        return f"device_ids={self.device_ids}, output_device={self.output_device}, dim={self.dim}"


def data_parallel(
    module: nn.Module,
    device_ids: Sequence[int | torch.device],
    output_device: int | torch.device | None = None,
    dim: int = 0,
) -> nn.DataParallel[Any]:
    """The real ``torch.nn.DataParallel`` when the devices exist, else ``VirtualDataParallel``,
    splitting and gathering along ``dim``.

    Real devices are used when CUDA is available and every id in ``device_ids`` is a
    visible CUDA device; the module must then be on ``cuda:device_ids[0]``.

    Raises:
        InvalidArgument: as ``VirtualDataParallel``, or ``output_device`` is not a visible
            CUDA device on a machine that runs the real DataParallel.
    """
    ids = normalize_device_ids(device_ids)
    target = normalize_output_device(output_device, ids)
    count = cuda_device_count()
    if count and max(ids) < count:
        if target >= count:
            raise InvalidArgument(
                f"output_device={target} is not a visible CUDA device (found {count}); "
                "pass one of them, or -1 for the host"
            )
        return nn.DataParallel(module, device_ids=ids, output_device=target, dim=dim)
    return VirtualDataParallel(module, ids, target, dim)
