"""Opt-in, process-wide patching: torch's own DataParallel objects switched in place.

For a DataParallel that is not a ``VirtualDataParallel`` (``torch.nn.DataParallel``, a
third-party subclass, code that calls ``Scatter``, ``parallel_apply`` or ``torch.cuda.comm``
by a name it imported) on a machine without the GPUs it asks for. ``virtual_devices(n)``
switches everything below for the whole process while a block is open;
``virtual_primitives()`` switches the primitives for the calling thread alone. Each set of
switches is installed when the first block that needs it opens and removed, restoring
torch's objects by identity, when the last one closes; nothing is switched at import.

The primitives of ``dpverify.core.primitives`` run in place of torch's (inside either
block), and, inside ``virtual_devices(n)`` only, the devices:

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
``torch.cuda`` random functions       torch's, on the machine's devices (``manual_seed``,
                                      ``manual_seed_all``, ``seed``, ``seed_all``,
                                      ``initial_seed``, ``get_rng_state(_all)``,
                                      ``set_rng_state(_all)``): ``torch.manual_seed``
                                      in a block seeds the GPUs there are
====================================  ======================================================

Everything is switched in place, on the objects torch defines, so code that imported a name
(``from torch.nn.parallel._functions import Scatter``, ``from torch.cuda.comm import
reduce_add``) is covered too: a function (``torch.cuda.device``'s two methods included)
gets a trampoline ``__code__`` (23 of them), an autograd Function class an ``apply``
attribute, and ``DataParallel`` a ``src_device_obj`` descriptor: 28 switches, 10 for the
primitives (``_PRIMITIVE_SWITCHES``) and 18 for the devices (``_DEVICE_SWITCHES``).
``replicate``, ``scatter``, ``scatter_kwargs``, ``gather`` and
``comm.reduce_add_coalesced`` stay torch's own: they reach the devices only through the
switched primitives, so their imported names run virtually too.

Not covered: ``tensor.get_device()`` is -1 and ``tensor.is_cuda`` False for every tensor;
``.cuda()``, ``.to('cuda:k')``, streams, events, ``synchronize``, drawing from the
CUDA random generators, memory statistics and ``torch.accelerator`` are torch's, and fail as on any
CPU-only machine; only replicas that ``parallel_apply`` runs draw from per-device
generators (code run under ``torch.cuda.device(i)`` draws from the host's); subclasses of
the four autograd Functions run torch's code; a DataParallel built outside
``virtual_devices`` keeps the ``device_ids`` it got then. dpverify's own device discovery
(``devices.cuda_device_count``) still finds the machine's devices in a block.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch._utils import _get_device_index as _torch_device_index
from torch.cuda._utils import _get_device_index as _cuda_device_index
from torch.nn.parallel import _functions as torch_functions
from torch.nn.parallel import comm as torch_comm
from torch.nn.parallel.data_parallel import data_parallel as _torch_data_parallel
from torch.nn.parallel.parallel_apply import parallel_apply as _torch_parallel_apply
from torch.nn.parallel.replicate import replicate as _torch_replicate
from torch.nn.parallel.scatter_gather import gather as _torch_gather
from torch.nn.parallel.scatter_gather import scatter_kwargs as _torch_scatter_kwargs

from dpverify.core import devices as devices_module
from dpverify.core.errors import InvalidArgument
from dpverify.core.primitives import (
    VirtualBroadcast,
    VirtualGather,
    VirtualScatter,
    reduce_add_coalesced_apply,
    thread_state,
    virtual_comm_broadcast,
    virtual_comm_broadcast_coalesced,
    virtual_comm_gather,
    virtual_comm_scatter,
    virtual_parallel_apply,
    virtual_reduce_add,
)

__all__ = ["virtual_devices", "virtual_primitives"]


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
    if thread_state.count is not None:
        return thread_state.count
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


def _virtual_current_device() -> int:
    return 0 if thread_state.device is None else thread_state.device


def _virtual_set_device(device: Any) -> None:
    index = _cuda_device_index(device)
    if index >= 0:  # torch: a no-op for a negative index
        thread_state.device = _checked_device(index)


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
    self._dpverify_previous = thread_state.device
    thread_state.device = self.idx


def _virtual_device_exit(self: Any, exc_type: Any, exc_value: Any, traceback: Any) -> bool:
    """``torch.cuda.device.__exit__``: gives the thread back the device it had."""
    previous = self.__dict__.pop("_dpverify_previous", _MISSING)
    if previous is not _MISSING:
        thread_state.device = previous
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
    outputs = virtual_parallel_apply(replicas, scattered, scattered_kwargs, used_device_ids)
    return _torch_gather(outputs, target, dim)


# --- switching torch's objects in place ---------------------------------------------------

_MISSING: Any = object()

#: Every ``_CodeSwitch`` by its trampoline's key (the switches below are in install order,
#: removed in reverse).
_CODE_SWITCHES: dict[str, _CodeSwitch] = {}

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
    return _process_depth > 0 or thread_state.depth > 0


def _devices_active() -> bool:
    """The devices are virtual: a ``virtual_devices`` block is open, on any thread, and
    this thread is not inside a call that sees the machine's devices."""
    return _process_depth > 0 and not thread_state.machine


def _on_the_machine(function: Callable[..., Any]) -> Callable[..., Any]:
    """The stand-in of a ``torch.cuda`` random function: torch's own, run with the machine's
    devices on this thread. ``torch.manual_seed`` seeds every CUDA generator by
    ``device_count()``; with ``n`` virtual devices on a machine with fewer GPUs it would
    index generators that do not exist."""

    def on_the_machine(*args: Any, **kwargs: Any) -> Any:
        thread_state.machine += 1
        try:
            return _switch_of(function).original(*args, **kwargs)
        finally:
            thread_state.machine -= 1

    return on_the_machine


def _trampoline_template(*args: Any, **kwargs: Any) -> Any:
    # Becomes the __code__ of a switched torch function, so it runs with that function's
    # globals, a torch module's: it can name nothing of this module, so it imports it (a
    # lookup in sys.modules once dpverify is imported). _CodeSwitch replaces the string
    # constant with the switch's key.
    from dpverify.core.patching import _dispatch

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
        self.trampoline = template.replace(co_consts=consts, co_name=code.co_name, co_qualname=code.co_qualname)
        self.saved_code = code
        self.original: types.FunctionType = function  # replaced by a copy when installed
        _CODE_SWITCHES[self.key] = self

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


def _install(switches: Sequence[_CodeSwitch | _AttributeSwitch]) -> None:
    done: list[_CodeSwitch | _AttributeSwitch] = []
    try:
        for switch in switches:
            switch.install()
            done.append(switch)
    except BaseException:
        _uninstall(done)
        raise


def _uninstall(switches: Sequence[_CodeSwitch | _AttributeSwitch]) -> None:
    for switch in reversed(switches):
        switch.uninstall()


def _switch_of(function: Callable[..., Any]) -> _CodeSwitch:
    return next(s for s in _CODE_SWITCHES.values() if s.function is function)


def _acquire(block: _OpenBlock | None) -> None:
    """Counts a block in: the primitives' switches are installed for the first block of
    either kind, the devices' for the first ``virtual_devices`` block (``block``), which
    also makes everything virtual, process-wide."""
    global _users, _process_depth
    with _switch_lock:
        first = _users == 0
        if first:
            _install(_PRIMITIVE_SWITCHES)
        if block is not None and _process_depth == 0:
            try:
                _install(_DEVICE_SWITCHES)
            except BaseException:
                if first:
                    _uninstall(_PRIMITIVE_SWITCHES)
                raise
            # dpverify's own device discovery keeps finding the machine's devices.
            devices_module._torch_queries = (
                _switch_of(torch.cuda.is_available).original,
                _switch_of(torch.cuda.device_count).original,
            )
        _users += 1
        if block is not None:
            _open_blocks.append(block)
            _process_depth += 1


def _release(block: _OpenBlock | None) -> None:
    """Counts a block out, restoring torch's objects after the last that needs them."""
    global _users, _process_depth
    with _switch_lock:
        if block is not None:
            _open_blocks.remove(block)
            _process_depth -= 1
            if _process_depth == 0:
                devices_module._torch_queries = None
                _uninstall(_DEVICE_SWITCHES)
        _users -= 1
        if _users == 0:
            _uninstall(_PRIMITIVE_SWITCHES)


#: The primitives: virtual in virtual_devices and in virtual_primitives.
_PRIMITIVE_SWITCHES: tuple[_CodeSwitch | _AttributeSwitch, ...] = (
    _ApplySwitch(torch_functions.Scatter, VirtualScatter.apply),
    _ApplySwitch(torch_functions.Gather, VirtualGather.apply),
    _ApplySwitch(torch_functions.Broadcast, VirtualBroadcast.apply),
    _ApplySwitch(torch_functions.ReduceAddCoalesced, reduce_add_coalesced_apply),
    _CodeSwitch(torch_comm.broadcast, virtual_comm_broadcast, _primitives_active),
    _CodeSwitch(torch_comm.broadcast_coalesced, virtual_comm_broadcast_coalesced, _primitives_active),
    _CodeSwitch(torch_comm.scatter, virtual_comm_scatter, _primitives_active),
    _CodeSwitch(torch_comm.gather, virtual_comm_gather, _primitives_active),
    _CodeSwitch(torch_comm.reduce_add, virtual_reduce_add, _primitives_active),
    _CodeSwitch(_torch_parallel_apply, virtual_parallel_apply, _primitives_active),
)

#: torch.cuda's random functions, which find the generators by device_count() or
#: current_device(): they keep the machine's devices (torch.manual_seed calls one).
_CUDA_RANDOM = (
    torch.cuda.random.manual_seed,
    torch.cuda.random.manual_seed_all,
    torch.cuda.random.seed,
    torch.cuda.random.seed_all,
    torch.cuda.random.initial_seed,
    torch.cuda.random.get_rng_state,
    torch.cuda.random.get_rng_state_all,
    torch.cuda.random.set_rng_state,
    torch.cuda.random.set_rng_state_all,
)

#: The devices: installed and virtual in virtual_devices only.
_DEVICE_SWITCHES: tuple[_CodeSwitch | _AttributeSwitch, ...] = (
    _CodeSwitch(torch.cuda.is_available, _virtual_is_available, _devices_active),
    _CodeSwitch(torch.cuda.device_count, _device_count, _devices_active),
    _CodeSwitch(torch.cuda.current_device, _virtual_current_device, _devices_active),
    _CodeSwitch(torch.cuda.set_device, _virtual_set_device, _devices_active),
    _CodeSwitch(torch.cuda.get_device_properties, _virtual_get_device_properties, _devices_active),
    _CodeSwitch(torch.cuda.device.__enter__, _virtual_device_enter, _devices_active),
    _CodeSwitch(torch.cuda.device.__exit__, _virtual_device_exit, _devices_active),
    _AttributeSwitch(nn.DataParallel, "src_device_obj", _HostSourceDevice()),
    _CodeSwitch(_torch_data_parallel, _virtual_data_parallel_function, _devices_active),
    *(_CodeSwitch(f, _on_the_machine(f), _devices_active) for f in _CUDA_RANDOM),
)


@contextlib.contextmanager
def virtual_primitives(devices: Sequence[int] = (), *, views_only: bool = False) -> Iterator[None]:
    """Within the block, torch's DataParallel primitives run virtually on this thread.

    The primitives of ``dpverify.core.primitives``; other threads keep torch's own
    meanwhile (a real DataParallel running in another thread is unaffected), and the
    devices stay the machine's (``torch.cuda.device_count()`` is unchanged).

    Args:
        devices: the virtual devices of the tensors being gathered, in replica order.
        views_only: scatter and broadcast hand out views instead of copies (for planning a
            scatter without paying for the copies).
    """
    _acquire(None)
    saved = (thread_state.depth, thread_state.devices, thread_state.views_only)
    thread_state.depth += 1
    thread_state.devices = list(devices)
    thread_state.views_only = views_only
    try:
        yield
    finally:
        thread_state.depth, thread_state.devices, thread_state.views_only = saved
        _release(None)


@contextlib.contextmanager
def virtual_devices(n: int) -> Iterator[None]:
    """Within the block, torch believes ``n`` CUDA devices exist, and they are virtual.

    ``torch.nn.DataParallel`` and its subclasses built in the block get ``device_ids``
    ``[0, ..., n-1]`` by default and ``output_device`` 0, and run their own code, torch's
    or overridden, on the CPU stand-ins of ``dpverify.core.primitives``. The module's
    parameters and the batch stay on the CPU, which stands for ``device_ids[0]``; replicas
    run in threads with ``current_virtual_device()`` (and ``torch.cuda.current_device()``)
    set to their device. Names imported by third-party wrappers are covered, and so are
    ``Broadcast`` and ``reduce_add`` called by a custom Function's backward, provided that
    backward runs in the block; graphs of DataParallel's own primitives can be
    backpropagated after it.

    Blocks nest (the innermost ``n`` applies on its thread) and may be opened from several
    threads at once. The switch is process-wide, because replicas run in threads of their
    own: a thread with no block of its own sees the ``n`` of the most recently opened block,
    and any DataParallel it runs meanwhile is virtualized too (harmless on a CPU-only
    machine; on a GPU machine keep real DataParallel out of the block's time). Code that
    branches on ``torch.cuda.is_available()`` takes its CUDA branch (``.cuda()``, CUDA
    autocast, a gradient scaler) and fails as torch's CUDA calls do here; so open the block
    around building and running the wrappers (and the backward of custom Functions), not
    around a whole program.

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
    saved = (thread_state.count, thread_state.device)
    thread_state.count = n
    try:
        yield
    finally:
        thread_state.count, thread_state.device = saved
        _release(block)
