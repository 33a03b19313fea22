"""DataParallel on any machine: torch's own orchestration over virtual devices.

``VirtualDataParallel`` subclasses ``torch.nn.DataParallel`` and keeps its ``forward`` and
the ``scatter_kwargs``, ``scatter``, ``gather`` and ``replicate`` functions of
``torch.nn.parallel``. Only the CUDA communication primitives are replaced, for the calling
thread alone, by CPU autograd functions with the same forward and backward semantics:

==============================  ==============================================================
torch primitive                 virtual stand-in
==============================  ==============================================================
``_functions.Scatter``          ``_VirtualScatter``: ``tensor.chunk``; the chunk for the source
                                device is a view, the others are copies
``_functions.Gather``           ``_VirtualGather``: concatenation into the first output's
                                dtype, scalar warning, backward splits the gradient by
                                chunk size
``_functions.Broadcast``        ``_VirtualBroadcast``: replica 0 aliases the parameter, the
                                others are copies; backward is a reduce-add (a sum)
``comm.broadcast_coalesced``    ``_virtual_broadcast_coalesced`` (detached replicas, buffers)
``parallel_apply``              one thread per replica, as torch does, without CUDA streams;
                                one random generator per device (``_parallel_apply``)
==============================  ==============================================================

Device arguments are read as torch reads them: ints, ``torch.device('cuda:k')`` objects
and ``'cuda:k'`` strings alike.

Host tensors stand for tensors on the source device ``device_ids[0]``: the module's CPU
parameters are the parameters "on device_ids[0]", and a CPU batch is a batch already moved
there. So chunk 0 is a view of the batch, exactly as with a batch on ``cuda:device_ids[0]``.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from itertools import chain
from typing import Any, TypeVar

import torch
from torch import nn
from torch._utils import ExceptionWrapper
from torch.autograd import Function
from torch.nn.parallel import _functions as torch_functions
from torch.nn.parallel import comm as torch_comm
from torch.nn.parallel import scatter_gather as torch_scatter_gather

from dpverify.core.devices import (
    HOST,
    cuda_device_count,
    device_index,
    normalize_device_ids,
    normalize_output_device,
)
from dpverify.core.errors import InvalidArgument

__all__ = ["VirtualDataParallel", "current_virtual_device", "data_parallel", "virtual_primitives"]

T = TypeVar("T", bound=nn.Module)

#: Message torch.nn.parallel._functions.Gather warns with; kept identical so filters match.
SCALAR_GATHER_WARNING = (
    "Was asked to gather along dimension 0, but all input tensors were scalars; "
    "will instead unsqueeze and return a vector."
)


class _ThreadState(threading.local):
    depth: int = 0
    views_only: bool = False
    device: int | None = None
    devices: list[int] | None = None


_state = _ThreadState()


def current_virtual_device() -> int | None:
    """The virtual device whose replica runs in the calling thread, or None outside replicas."""
    return _state.device


def _copy_to(chunk: torch.Tensor, device: int, source: int) -> torch.Tensor:
    # comm.scatter/broadcast hand the source device its own data and copy to the others.
    if device == source or _state.views_only:
        return chunk
    return chunk.clone()


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
        if chunk_sizes is None:
            chunks = input.chunk(len(targets), dim)
        else:
            chunks = input.split(list(chunk_sizes), dim)
        return tuple(
            _copy_to(chunk, device, ctx.input_device)
            for chunk, device in zip(chunks, targets, strict=False)
        )

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


class _VirtualGather(Function):
    """``torch.nn.parallel._functions.Gather`` for virtual devices."""

    @staticmethod
    def forward(ctx: Any, target_device: Any, dim: int, *inputs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.target_device = _gather_target(target_device)
        ctx.dim = dim
        devices = _state.devices or range(len(inputs))
        ctx.input_gpus = tuple(devices)[: len(inputs)]
        if all(t.dim() == 0 for t in inputs) and dim == 0:
            inputs = tuple(t.view(1) for t in inputs)
            warnings.warn(SCALAR_GATHER_WARNING, stacklevel=2)
            ctx.unsqueezed_scalar = True
        else:
            ctx.unsqueezed_scalar = False
        ctx.input_sizes = tuple(i.size(ctx.dim) for i in inputs)
        # comm.gather allocates the output with the first input's dtype and copies each
        # input into it (_gather_out_impl in torch/csrc/cuda/comm.cpp): no autocast and no
        # type promotion. torch.cat inside the caller's autocast region would promote, or
        # fail on replica outputs in another low-precision dtype than the caller's.
        dtype = inputs[0].dtype
        with torch.amp.autocast("cpu", enabled=False):
            return torch.cat([t.to(dtype) for t in inputs], ctx.dim)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        grads = _VirtualScatter.apply(  # type: ignore[no-untyped-call]
            ctx.input_gpus, ctx.input_sizes, ctx.dim, grad_output, ctx.target_device
        )
        if ctx.unsqueezed_scalar:
            grads = tuple(g[0] for g in grads)
        return (None, None, *grads)


def _virtual_broadcast_coalesced(
    tensors: Sequence[torch.Tensor], devices: Sequence[int], buffer_size: int = 0
) -> list[list[torch.Tensor]]:
    """``comm.broadcast_coalesced``: the first device gets the tensors themselves."""
    del buffer_size  # coalescing is a transfer optimisation with no semantic effect
    first = list(tensors)
    return [first] + [[t.detach().clone() for t in tensors] for _ in list(devices)[1:]]


class _VirtualBroadcast(Function):
    """``torch.nn.parallel._functions.Broadcast``: parameters to every replica."""

    @staticmethod
    def forward(ctx: Any, target_gpus: Sequence[int], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.target_gpus = [int(d) for d in target_gpus]
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


class _PerThreadSwitch:
    """Stands in for one torch primitive: the virtual one inside ``virtual_primitives()``
    on the calling thread, torch's own everywhere else (a real DataParallel running in
    another thread meanwhile is unaffected)."""

    def __init__(self, original: Any, virtual: Any) -> None:
        self._dpverify_original = original
        self._dpverify_virtual = virtual

    def _pick(self) -> Any:
        return self._dpverify_virtual if _state.depth else self._dpverify_original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._pick()(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pick(), name)


# (module, attribute, virtual stand-in): every place torch's DataParallel code looks up a
# CUDA primitive. replicate() imports Broadcast from _functions at call time.
_PRIMITIVES: tuple[tuple[Any, str, Any], ...] = (
    (torch_scatter_gather, "Scatter", _VirtualScatter),
    (torch_scatter_gather, "Gather", _VirtualGather),
    (torch_functions, "Broadcast", _VirtualBroadcast),
    (torch_comm, "broadcast_coalesced", _virtual_broadcast_coalesced),
)
_install_lock = threading.Lock()


def _install_switches() -> None:
    with _install_lock:
        for module, name, virtual in _PRIMITIVES:
            current = getattr(module, name)
            if not isinstance(current, _PerThreadSwitch):
                setattr(module, name, _PerThreadSwitch(current, virtual))


@contextlib.contextmanager
def virtual_primitives(devices: Sequence[int] = (), *, views_only: bool = False) -> Iterator[None]:
    """Within the block, torch's DataParallel primitives run virtually on this thread.

    Args:
        devices: the virtual devices of the tensors being gathered, in replica order.
        views_only: scatter and broadcast hand out views instead of copies (for planning a
            scatter without paying for the copies).
    """
    _install_switches()
    saved = (_state.depth, _state.devices, _state.views_only)
    _state.depth += 1
    _state.devices = list(devices)
    _state.views_only = views_only
    try:
        yield
    finally:
        _state.depth, _state.devices, _state.views_only = saved


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
    devices: Sequence[int | torch.device] | None = None,
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
            strings such as ``'cuda:1'``; None puts replica ``i`` on device ``i``.

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
    indices = [device_index(d, "devices") for d in devices]
    grad_enabled = torch.is_grad_enabled()
    # torch reads torch.is_autocast_enabled(), the accelerator's flag; the host's autocast
    # plays the accelerator's here.
    autocast_enabled = torch.is_autocast_enabled("cpu")
    num_threads = torch.get_num_threads()
    results: dict[int, Any] = {}

    def worker(i: int, module: nn.Module, input: Any, kwargs: dict[str, Any], device: int) -> None:
        torch.set_grad_enabled(grad_enabled)
        previous, _state.device = _state.device, device
        try:
            with _intra_op_threads(num_threads), torch.amp.autocast("cpu", enabled=autocast_enabled):
                if not isinstance(input, (list, tuple)):
                    input = (input,)
                results[i] = module(*input, **kwargs)
        except Exception:
            results[i] = ExceptionWrapper(where=f"in replica {i} on device {device}")
        finally:
            _state.device = previous

    jobs = list(zip(replicas, inputs, kwargs_tup, indices, strict=True))
    # Inside a replica, this thread's caller holds the lock and waits for it.
    turn = _apply_lock if _state.device is None else contextlib.nullcontext()
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
        _install_switches()

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
) -> nn.DataParallel[Any]:
    """The real ``torch.nn.DataParallel`` when the devices exist, else ``VirtualDataParallel``.

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
        return nn.DataParallel(module, device_ids=ids, output_device=target)
    return VirtualDataParallel(module, ids, target)
