"""CPU stand-ins for the CUDA primitives of torch's DataParallel, and the thread state
they share.

Nothing here changes torch: these are the functions ``VirtualDataParallel`` and the opt-in
patching (``dpverify.core.patching``) run in place of torch's.

Each stand-in says what it does like torch and where it differs: ``VirtualScatter``,
``VirtualGather``, ``VirtualBroadcast`` and ``VirtualReduceAddCoalesced`` for the autograd
Functions of ``torch.nn.parallel._functions``, ``virtual_comm_*`` and ``virtual_reduce_add``
for ``torch.nn.parallel.comm``, ``virtual_parallel_apply`` for ``parallel_apply``.

Device arguments are read as torch reads them: ints, ``torch.device('cuda:k')`` objects
and ``'cuda:k'`` strings alike. Host tensors stand for tensors on the source device
``device_ids[0]``: the module's CPU parameters are the parameters "on device_ids[0]", and a
CPU batch is a batch already moved there. So chunk 0 is a view of the batch, exactly as with
a batch on ``cuda:device_ids[0]``.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch._utils import ExceptionWrapper, _handle_complex
from torch._utils import _get_device_index as _torch_device_index
from torch.autograd import Function

from dpverify.core.devices import HOST, device_index, output_index

__all__ = [
    "SCALAR_GATHER_WARNING",
    "VirtualBroadcast",
    "VirtualGather",
    "VirtualReduceAddCoalesced",
    "VirtualScatter",
    "current_virtual_device",
    "observe_gathers",
    "reduce_add_coalesced_apply",
    "replica_device",
    "sum_in_order",
    "thread_state",
    "virtual_comm_broadcast",
    "virtual_comm_broadcast_coalesced",
    "virtual_comm_gather",
    "virtual_comm_scatter",
    "virtual_parallel_apply",
    "virtual_reduce_add",
]

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
    replica: bool = False  # the thread runs a replica for virtual_parallel_apply
    gathers: list[int] | None = None  # where this thread's virtual gathers went (observe_gathers)
    machine: int = 0  # calls on this thread that see the machine's devices (the CUDA generators)


thread_state = _ThreadState()


def current_virtual_device() -> int | None:
    """The virtual device of the calling thread, or None when it has none.

    A replica's thread has its replica's device; inside ``virtual_devices``, a block of
    ``torch.cuda.device(i)`` (or ``torch.cuda.set_device(i)``) selects device ``i``.
    """
    return thread_state.device


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
    saved = thread_state.gathers
    seen: list[int] = []
    thread_state.gathers = seen
    try:
        yield seen
    finally:
        thread_state.gathers = saved


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
    # comm.scatter hands the source device its own data and copies to the others
    copy = not thread_state.views_only
    return tuple(
        chunk.clone() if copy and device != source else chunk
        for chunk, device in zip(chunks, targets, strict=False)
    )


class VirtualScatter(Function):
    """``torch.nn.parallel._functions.Scatter`` for virtual devices: ``tensor.chunk`` (or
    ``split`` by the chunk sizes); the source device's chunk is a view, the others copies."""

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
        return None, None, None, VirtualGather.apply(ctx.input_device, ctx.dim, *grad_output), None  # type: ignore[no-untyped-call]


def _gather_target(target_device: Any) -> int:
    """The device ``Gather`` gathers on, read as torch's ``Gather.forward`` reads it.

    torch special-cases the string ``"cpu"`` and passes anything else through
    ``_get_device_index(target_device, True)``: an index (-1 is the host), a
    ``torch.device('cuda:k')`` or ``'cuda:k'``; ``torch.device('cpu')`` is a ValueError.
    """
    if isinstance(target_device, str) and target_device == "cpu":
        return HOST
    return output_index(target_device)


def _concatenate(inputs: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    # comm.gather allocates the output with the first input's dtype and copies each
    # input into it (_gather_out_impl in torch/csrc/cuda/comm.cpp): no autocast and no
    # type promotion. torch.cat inside the caller's autocast region would promote, or
    # fail on replica outputs in another low-precision dtype than the caller's.
    dtype = inputs[0].dtype
    with torch.amp.autocast("cpu", enabled=False):
        return torch.cat([t.to(dtype) for t in inputs], dim)


def _uneven_outputs_note(inputs: Sequence[torch.Tensor], dim: int, devices: Sequence[int]) -> str | None:
    """Why the replicas' outputs cannot be concatenated, when their shapes differ outside
    the gather dim: a length that depends on each replica's chunk."""
    shapes = [tuple(t.shape) for t in inputs]
    if len({len(s) for s in shapes}) != 1 or len({s[:dim] + s[dim + 1 :] for s in shapes}) < 2:
        return None
    each = ", ".join(f"device {d} {list(s)}" for d, s in zip(devices, shapes, strict=True))
    return (
        f"dpverify: the replicas returned outputs of different shapes outside the gather dim {dim} "
        f"({each}). DataParallel concatenates them along dim {dim}, so every other dim must "
        "agree; a length taken from each replica's chunk differs between replicas (the longest "
        "sequence in the chunk, as pad_packed_sequence pads to without total_length=). Pad to "
        "a length fixed for the whole batch, e.g. pad_packed_sequence(..., total_length=x.size(1))."
    )


class VirtualGather(Function):
    """``torch.nn.parallel._functions.Gather`` for virtual devices: concatenation into the
    first output's dtype, with torch's scalar warning (and a note naming each replica's shape when
    they differ outside ``dim``); backward splits by chunk size."""

    @staticmethod
    def forward(ctx: Any, target_device: Any, dim: int, *inputs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.target_device = _gather_target(target_device)
        ctx.dim = dim
        if thread_state.gathers is not None:
            thread_state.gathers.append(ctx.target_device)
        ctx.input_gpus = tuple(_source_devices(len(inputs)))
        ctx.unsqueezed_scalar = dim == 0 and all(t.dim() == 0 for t in inputs)
        if ctx.unsqueezed_scalar:
            inputs = tuple(t.view(1) for t in inputs)
            warnings.warn(SCALAR_GATHER_WARNING, stacklevel=2)
        ctx.input_sizes = tuple(i.size(ctx.dim) for i in inputs)
        try:
            return _concatenate(inputs, ctx.dim)
        except RuntimeError as error:
            note = _uneven_outputs_note(inputs, ctx.dim, ctx.input_gpus)
            if note is not None:
                error.add_note(note)
            raise

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        grads = VirtualScatter.apply(  # type: ignore[no-untyped-call]
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


class VirtualBroadcast(Function):
    """``torch.nn.parallel._functions.Broadcast``: parameters to every replica, replica 0
    aliasing them and the others copies; backward is a reduce-add (a sum)."""

    @staticmethod
    def forward(ctx: Any, target_gpus: Sequence[Any], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.target_gpus = [device_index(d, "target_gpus") for d in target_gpus]
        if len(inputs) == 0:
            return ()
        ctx.num_inputs = len(inputs)
        ctx.input_device = ctx.target_gpus[0]
        outputs = _virtual_broadcast_coalesced(inputs, ctx.target_gpus)
        # the copies of an input that needs no gradient need none either
        needs = ctx.needs_input_grad[1:]
        ctx.mark_non_differentiable(*(output[i] for output in outputs for i in range(len(needs)) if not needs[i]))
        return tuple(chain.from_iterable(outputs))

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:
        grads = VirtualReduceAddCoalesced.apply(  # type: ignore[no-untyped-call]
            ctx.input_device, ctx.num_inputs, ctx.target_gpus, *grad_outputs
        )
        return (None, *grads)


class VirtualReduceAddCoalesced(Function):
    """``ReduceAddCoalesced``: replica gradients are summed, in replica order, like comm.reduce_add."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, destination: int, num_inputs: int, target_gpus: Sequence[int], *grads: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        del destination
        ctx.target_gpus = list(target_gpus)
        per_replica = [grads[i : i + num_inputs] for i in range(0, len(grads), num_inputs)]
        return tuple(sum_in_order(column) for column in zip(*per_replica, strict=True))

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:
        return (None, None, None, *VirtualBroadcast.apply(ctx.target_gpus, *grad_outputs))  # type: ignore[no-untyped-call]


def _source_devices(count: int) -> list[int]:
    """The virtual devices of ``count`` per-replica tensors, in replica order.

    A tensor does not say which virtual device it is on (``get_device()`` is -1 for every
    host tensor), so this is the devices a ``VirtualDataParallel`` gather names, or
    ``0, 1, ...``: the devices of the replicas a ``virtual_devices`` DataParallel runs.
    """
    return list(thread_state.devices or range(count))[:count]


def reduce_add_coalesced_apply(destination: Any, num_inputs: int, *grads: torch.Tensor) -> Any:
    """``ReduceAddCoalesced.apply(destination, num_inputs, *grads)``, torch's signature."""
    devices = _source_devices(len(grads) // num_inputs if num_inputs else 0)
    return VirtualReduceAddCoalesced.apply(destination, num_inputs, devices, *grads)  # type: ignore[no-untyped-call]


# --- torch.nn.parallel.comm (torch.cuda.comm) -------------------------------------------


def virtual_comm_broadcast(tensor: torch.Tensor, devices: Any = None, *, out: Any = None) -> tuple[torch.Tensor, ...]:
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


def virtual_comm_broadcast_coalesced(
    tensors: Sequence[torch.Tensor], devices: Sequence[Any], buffer_size: int = 10485760
) -> list[list[torch.Tensor]]:
    """``comm.broadcast_coalesced``: complex tensors as real views, as torch returns them."""
    targets = [device_index(d, "devices") for d in devices]
    return _virtual_broadcast_coalesced([_handle_complex(t) for t in tensors], targets, buffer_size)


def virtual_comm_scatter(
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
    _refuse_with_out(devices=devices, chunk_sizes=chunk_sizes)
    for target, chunk in zip(out, tensor.split([o.size(dim) for o in out], dim), strict=True):
        target.copy_(chunk)
    return tuple(out)


def virtual_comm_gather(
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
    _refuse_with_out(destination=destination)
    return torch.cat(tensors, dim, out=out)


def _refuse_with_out(**given: Any) -> None:
    """torch's error for an argument given together with ``out=``."""
    for name, value in given.items():
        if value is not None:
            raise RuntimeError(f"'{name}' must not be specified when 'out' is specified, but got {name}={value}")


def virtual_reduce_add(inputs: Sequence[torch.Tensor], destination: Any = None) -> torch.Tensor:
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
    return sum_in_order([inputs[root], *(t for i, t in enumerate(inputs) if i != root)])


def sum_in_order(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A new tensor: the first plus the others, in order, as torch sums without NCCL."""
    total = tensors[0].clone() if len(tensors) == 1 else tensors[0] + tensors[1]
    for other in tensors[2:]:
        total.add_(other)
    return total



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


def virtual_parallel_apply(
    replicas: Sequence[nn.Module],
    inputs: Sequence[Any],
    kwargs_tup: Sequence[dict[str, Any]] | None = None,
    devices: Sequence[int | torch.device | str | None] | None = None,
) -> list[Any]:
    """torch.nn.parallel.parallel_apply without CUDA.

    As in torch, ``kwargs_tup=None`` gives every replica no keyword arguments, an input
    that is not a list or tuple is the replica's only argument, each replica runs in its
    own thread (in the calling thread when there is one replica) with the caller's grad
    mode and autocast *flag* (not its dtype, which is thread-local: replicas of two or more
    compute in the default autocast dtype, on GPUs and here alike), and a failure is
    re-raised as ``Caught <error> in replica {i} on device {device}``. Each replica thread
    computes with the caller's ``torch.get_num_threads()`` (``_intra_op_threads``).

    The threads run one after the other: the host has one random generator where GPUs have
    one each. Replicas on ``devices[0]`` continue the caller's generator; the others draw
    from their device's, seeded by ``_device_seed`` as the replicas start, so results are
    deterministic given the caller's seed and masks differ between devices and forwards
    (docs/dataparallel.md). Concurrent calls from different threads are serialised; a
    replica's own nested DataParallel runs within its caller's turn.

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
    kwargs_tup = ({},) * len(replicas) if kwargs_tup is None else kwargs_tup
    devices = range(len(replicas)) if devices is None else devices
    # Length checks and messages follow torch.nn.parallel.parallel_apply.
    for what, given in (("inputs", inputs), ("kwargs_tup", kwargs_tup), ("devices", devices)):
        if len(given) != len(replicas):
            raise AssertionError(
                f"The number of modules {len(replicas)} is not equal to the number of {what} {len(given)}"
            )
    # torch reads a None entry as the current device; replica i runs on device i here.
    indices = [i if d is None else device_index(d, "devices") for i, d in enumerate(devices)]
    grad_enabled = torch.is_grad_enabled()
    # torch reads torch.is_autocast_enabled(), the accelerator's flag; the host's autocast
    # plays the accelerator's here.
    autocast_enabled = torch.is_autocast_enabled("cpu")
    num_threads = torch.get_num_threads()
    count = thread_state.count  # a replica sees its caller's virtual_devices(n)
    results: dict[int, Any] = {}

    def worker(i: int, module: nn.Module, input: Any, kwargs: dict[str, Any], device: int) -> None:
        torch.set_grad_enabled(grad_enabled)
        previous = (thread_state.device, thread_state.count, thread_state.replica)
        thread_state.device, thread_state.count, thread_state.replica = device, count, True
        try:
            with _intra_op_threads(num_threads), torch.amp.autocast("cpu", enabled=autocast_enabled):
                if not isinstance(input, (list, tuple)):
                    input = (input,)
                results[i] = module(*input, **kwargs)
        except Exception:
            results[i] = ExceptionWrapper(where=f"in replica {i} on device {device}")
        finally:
            thread_state.device, thread_state.count, thread_state.replica = previous

    jobs = list(zip(replicas, inputs, kwargs_tup, indices, strict=True))
    # Inside a replica, this thread's caller holds the lock and waits for it.
    turn = contextlib.nullcontext() if thread_state.replica else _apply_lock
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
    drawing random numbers from its device's generator (see ``virtual_parallel_apply``)."""
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
