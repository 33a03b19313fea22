"""Validation of device arguments, shared by the virtual and the real DataParallel paths."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dpverify.core.errors import InvalidArgument

__all__ = [
    "GPUS_ENV",
    "HOST",
    "cuda_device_count",
    "device_index",
    "normalize_device_ids",
    "normalize_output_device",
    "output_index",
]

#: Index torch uses for "gather on the host" (``output_device=-1``).
HOST = -1

#: The environment variable that caps the CUDA devices dpverify uses (``0``: none, every
#: DataParallel check on virtual devices and every rank on gloo, even on a GPU machine).
GPUS_ENV = "DPVERIFY_GPUS"


def device_index(device: Any, argument: str) -> int:
    """The index of one device argument, as torch's ``_get_device_index(device, True)`` reads it.

    An int is returned as is, a ``torch.device`` or a string such as ``'cuda:1'`` gives its
    index. Unlike torch, a device without an index (``'cuda'``, None) is rejected rather than
    read as the current CUDA device: virtual devices have no current device.

    Raises:
        InvalidArgument: a bool, a CPU device (torch raises a ValueError too), a device
            without an index, or anything else that is not a device.
    """
    if isinstance(device, bool):
        raise InvalidArgument(f"{argument}={device!r} is a bool; pass a device index such as 0")
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError:
            raise InvalidArgument(
                f"{argument}={device!r} is not a device; pass an index such as 0 or 'cuda:0'"
            ) from None
    if isinstance(device, torch.device):
        if device.type == "cpu":
            # torch.nn.DataParallel rejects CPU devices here too
            # (torch._utils._get_device_index raises "Expected a non cpu device").
            raise InvalidArgument(
                f"{argument}={str(device)!r}: DataParallel does not accept a CPU device here; "
                "pass -1 as output_device to gather on the host"
            )
        if device.index is None:
            raise InvalidArgument(
                f"{argument}={str(device)!r} has no index; pass one such as 'cuda:0'"
            )
        return device.index
    raise InvalidArgument(
        f"{argument}={device!r} has type {type(device).__name__}; pass an int or a torch.device"
    )


def normalize_device_ids(device_ids: Sequence[Any] | None, *, argument: str = "device_ids") -> list[int]:
    """Validates DataParallel ``device_ids`` and returns them as distinct non-negative ints.

    Raises:
        InvalidArgument: not a sequence, empty, negative, repeated, or not a device.
    """
    if device_ids is None or isinstance(device_ids, (str, bytes, torch.device, int)):
        raise InvalidArgument(
            f"{argument}={device_ids!r}: pass a list of device indices such as [0, 1]"
        )
    ids = [device_index(d, argument) for d in device_ids]
    if not ids:
        raise InvalidArgument(f"{argument}=[] is empty; DataParallel needs at least one device")
    negative = [d for d in ids if d < 0]
    if negative:
        raise InvalidArgument(
            f"{argument}={ids} contains {negative[0]}; device indices are non-negative"
        )
    repeated = [d for i, d in enumerate(ids) if d in ids[:i]]
    if repeated:
        raise InvalidArgument(
            f"{argument}={ids} repeats device {repeated[0]}; DataParallel needs distinct devices"
        )
    return ids


def normalize_output_device(output_device: Any, device_ids: Sequence[int]) -> int:
    """Returns the gather target: ``device_ids[0]`` by default, ``HOST`` (-1) for the host."""
    if output_device is None:
        return device_ids[0]
    return output_index(output_device)


def output_index(output_device: Any) -> int:
    """The gather target ``output_device`` names: a device index, or ``HOST`` (-1)."""
    index = device_index(output_device, "output_device")
    if index < HOST:
        raise InvalidArgument(
            f"output_device={index} is not a device; pass a device index, or -1 for the host"
        )
    return index


#: torch's own ``is_available`` and ``device_count`` while ``dpverify.core.patching`` has
#: switched them for its virtual devices (set and cleared there), else None.
_torch_queries: tuple[Callable[[], bool], Callable[[], int]] | None = None


def _gpu_cap() -> int | None:
    """The ``DPVERIFY_GPUS`` cap, or None where it is unset.

    Raises:
        InvalidArgument: the variable is set to something other than a whole number >= 0.
    """
    text = os.environ.get(GPUS_ENV, "").strip()
    if not text:
        return None
    try:
        cap = int(text)
    except ValueError:
        cap = -1
    if cap < 0:
        raise InvalidArgument(
            f"{GPUS_ENV}={text!r}: set it to a whole number of CUDA devices to use (0 for none), "
            "or unset it to use every visible device"
        )
    return cap


def cuda_device_count() -> int:
    """Number of CUDA devices dpverify may use here (0 without CUDA).

    The machine's devices, after ``CUDA_VISIBLE_DEVICES``, at most ``DPVERIFY_GPUS`` of them,
    inside ``virtual_devices`` blocks too (where torch reports the virtual ones): dpverify
    puts a step on real devices only where they exist.

    Raises:
        InvalidArgument: ``DPVERIFY_GPUS`` is not a whole number >= 0.
    """
    cap = _gpu_cap()
    if cap == 0:
        return 0  # not even a query: CUDA stays uninitialised
    queries = _torch_queries
    if queries is None:
        queries = (torch.cuda.is_available, torch.cuda.device_count)
    is_available, device_count = queries
    count = device_count() if is_available() else 0
    return count if cap is None else min(count, cap)
