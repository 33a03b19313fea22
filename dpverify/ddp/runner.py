"""What every rank runner shares: the ``RankRunner`` protocol, tasks pickled for the ranks,
and what a rank that failed reports (``RankFailure``)."""

from __future__ import annotations

import collections
import copyreg
import io
import pickle
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy
import torch
from torch import nn

from dpverify.core.errors import InvalidArgument

__all__ = [
    "PICKLE_PROTOCOL",
    "RankFailure",
    "RankRunner",
    "describe_exception",
    "dumps",
    "pickle_task",
    "raised_failure",
    "require_picklable",
    "summarize",
]

T = TypeVar("T")

PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL


@dataclass(frozen=True)
class RankFailure:
    """What went wrong on one rank.

    Attributes:
        rank: the rank.
        kind: ``"raised"``, ``"signal"`` (killed by a signal), ``"exited"`` (left with an
            exit code), ``"hung"`` (no answer within the timeout) or ``"blocked"`` (no
            answer after another rank had failed).
        summary: one line, e.g. ``"raised ZeroDivisionError: division by zero"``.
        traceback: the traceback of the exception, or the rank's Python stack when it was
            stopped (empty when unavailable).
    """

    rank: int
    kind: str
    summary: str
    traceback: str = ""

    def describe(self) -> str:
        text = f"rank {self.rank} {self.summary}"
        if not self.traceback:
            return text
        label = "traceback" if self.kind == "raised" else "stack when stopped"
        body = "\n".join("    " + line for line in self.traceback.rstrip().splitlines())
        return f"{text}\n  rank {self.rank} {label}:\n{body}"


class RankRunner(Protocol):
    """Runs a task on every rank of a process group: ``DDPWorkerPool`` or, under torchrun,
    ``ProcessGroupRunner``."""

    @property
    def world_size(self) -> int: ...

    @property
    def backend(self) -> str: ...

    def run(self, fn: Callable[..., T], /, *args: Any, timeout: float | None = None) -> tuple[T, ...]: ...


def _plain(tensor: torch.Tensor) -> bool:
    """A dense CPU tensor that owns its whole storage and carries nothing but its values,
    shape, dtype and ``requires_grad`` (no attributes, hooks, conjugate or negative bit,
    autograd history): what ``_rebuild_tensor`` rebuilds as torch's own unpickling would."""
    return (
        tensor.device.type == "cpu" and tensor.layout == torch.strided and not tensor.is_quantized
        and not tensor.is_nested and tensor.grad_fn is None and not tensor.__dict__
        and not getattr(tensor, "_backward_hooks", None) and not tensor.is_conj() and not tensor.is_neg()
        and tensor.is_contiguous() and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    )


def _rebuild_tensor(data: bytes, dtype: torch.dtype, shape: tuple[int, ...], requires_grad: bool, parameter: bool) -> torch.Tensor:
    """The tensor ``_reduce_tensor`` pickled: a fresh contiguous CPU tensor (an
    ``nn.Parameter`` when ``parameter``) holding ``data``."""
    tensor = torch.empty(shape, dtype=dtype)
    if data:
        tensor.reshape(-1).view(torch.uint8).numpy()[:] = numpy.frombuffer(data, dtype=numpy.uint8)
    if parameter:
        return nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad)


def _reduce_tensor(tensor: torch.Tensor) -> Any:
    """A ``_plain`` tensor or parameter as its raw bytes; any other the way torch pickles it."""
    if not _plain(tensor):
        return tensor.__reduce_ex__(PICKLE_PROTOCOL)
    data = tensor.detach().reshape(-1).view(torch.uint8).numpy().tobytes()
    return _rebuild_tensor, (data, tensor.dtype, tuple(tensor.shape), tensor.requires_grad, type(tensor) is nn.Parameter)


#: Exact types only (a subclass of Tensor or Parameter pickles as it always does), in front
#: of copyreg's table, which is read when pickling, so that later registrations count.
_DISPATCH: collections.ChainMap[type, Callable[[Any], Any]] = collections.ChainMap(
    {torch.Tensor: _reduce_tensor, nn.Parameter: _reduce_tensor}, copyreg.dispatch_table,
)


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=PICKLE_PROTOCOL)
        self.dispatch_table = _DISPATCH


def dumps(value: Any) -> bytes:
    """``value`` pickled to go to the ranks or come back from them: as ``pickle.dumps``, but
    a dense CPU tensor or parameter that owns its storage (a module's weights, a batch, a
    gradient) travels as its raw bytes, several times faster to pickle and to load than
    torch's own reduction (``torch.save`` of its storage) and loaded as the same tensor:
    values, shape, dtype, ``requires_grad``, contiguous strides. (Neither way keeps two
    tensors sharing a storage: each arrives with its own.)"""
    buffer = io.BytesIO()
    _Pickler(buffer).dump(value)
    return buffer.getvalue()


def require_picklable(value: Any, argument: str) -> None:
    """Fails early, naming ``argument``, when ``value`` cannot be sent to the ranks.

    Raises:
        InvalidArgument: pickling ``value`` failed (a lambda, a closure, a local class).
    """
    try:
        dumps(value)
    except Exception as error:
        raise InvalidArgument(
            f"{argument}={value!r} cannot be pickled to send it to the DDP ranks "
            f"({type(error).__name__}: {error}); pass a function or class defined at the top "
            "level of an importable module (torch.nn.functional.mse_loss, or a "
            "functools.partial of one), not a lambda, closure or locally defined class"
        ) from None


def pickle_task(fn: Callable[..., Any], args: tuple[Any, ...]) -> bytes:
    """``(fn, args)`` pickled once for every rank.

    Raises:
        InvalidArgument: ``fn`` is not callable, or it or an argument cannot be pickled.
    """
    if not callable(fn):
        raise InvalidArgument(f"fn={fn!r} is not callable; pass fn(rank_info, *args)")
    try:
        return dumps((fn, args))
    except Exception:
        # pickled once when it can be; only a failure pays for finding the culprit
        require_picklable(fn, "fn")
        for index, arg in enumerate(args):
            require_picklable(arg, f"args[{index}]")
        raise


def summarize(error: BaseException) -> str:
    """``Type: first line of the message``, at most 240 characters: a rank's one-line story."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = type(error).__name__ + (f": {lines[0]}" if lines else "")
    return text if len(text) <= 240 else text[:237] + "..."


def describe_exception(error: BaseException, *, skip_caller: bool = True) -> str:
    """A rank's traceback of ``error``, with a hint when the task could not be unpickled;
    ``skip_caller`` leaves out the first frame, the runner's own call of the task."""
    tb = error.__traceback__
    if skip_caller and tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(error), error, tb))
    if isinstance(error, (ModuleNotFoundError, AttributeError)) and "pickle" in text:
        text += (
            "\ndpverify: the rank could not unpickle the task; modules, functions and classes "
            "sent to the ranks must be importable by name from a fresh process (defined in a "
            "module, not in an interactive session).\n"
        )
    return text


def raised_failure(rank: int, body: tuple[str, str]) -> RankFailure:
    """A rank's exception, from the (summary, traceback) it reported."""
    summary, text = body
    return RankFailure(rank, "raised", f"raised {summary}", text)

