"""How DataParallel's scatter splits a batch: chunk sizes, replicas used, dropped rows."""

from __future__ import annotations

import operator
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.parallel.scatter_gather import scatter_kwargs

from dpverify.core.devices import normalize_device_ids
from dpverify.core.errors import DroppedRowsWarning, InvalidArgument
from dpverify.core.text import plural
from dpverify.core.tree import tensor_leaves
from dpverify.core.virtual import virtual_primitives

__all__ = ["ScatterPlan", "chunk_sizes", "plan_scatter"]


def chunk_sizes(batch_size: int, n_devices: int) -> list[int]:
    """The chunk sizes DataParallel's scatter produces for a batch (``torch.chunk``'s rule).

    Chunks have ``ceil(batch_size / n_devices)`` rows and the last one is smaller, so there
    can be fewer chunks than devices: ``chunk_sizes(5, 4) == [2, 2, 1]``. Only that many
    replicas run; the remaining devices sit idle.

    Raises:
        InvalidArgument: ``batch_size`` < 0 or ``n_devices`` < 1.
    """
    for name, value, low in (("batch_size", batch_size, 0), ("n_devices", n_devices, 1)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgument(f"{name}={value!r} must be an int")
        if value < low:
            raise InvalidArgument(f"{name}={value} must be at least {low}")
    if batch_size == 0:
        return [0] * n_devices  # torch.chunk of an empty dimension gives n empty chunks
    size = -(-batch_size // n_devices)
    full, rest = divmod(batch_size, size)
    return [size] * full + ([rest] if rest else [])


@dataclass(frozen=True)
class ScatterPlan:
    """What torch's ``scatter_kwargs`` does with one call's arguments.

    Attributes:
        device_ids: the devices given to DataParallel.
        n_replicas: how many replicas run (``len`` of the scattered inputs).
        chunk_sizes: rows each replica receives of the batch (the first tensor argument).
        tensor_chunks: for every tensor argument, its path and the rows each replica gets.
        dropped: paths of tensors some of whose rows no replica receives, with the count.
    """

    device_ids: tuple[int, ...]
    n_replicas: int
    chunk_sizes: tuple[int, ...]
    tensor_chunks: tuple[tuple[str, tuple[int, ...]], ...]
    dropped: tuple[tuple[str, int], ...]

    @property
    def used_devices(self) -> tuple[int, ...]:
        return self.device_ids[: self.n_replicas]

    @property
    def idle_devices(self) -> tuple[int, ...]:
        return self.device_ids[self.n_replicas :]

    def describe(self) -> str:
        """One line: batch rows, devices, chunk sizes, idle devices."""
        batch = sum(self.chunk_sizes)
        text = (
            f"batch of {batch} rows on device_ids {list(self.device_ids)} -> chunk sizes "
            f"{list(self.chunk_sizes)} ({plural(self.n_replicas, 'replica')} used"
        )
        if self.idle_devices:
            idle = ", ".join(map(str, self.idle_devices))
            text += f", {'device' if len(self.idle_devices) == 1 else 'devices'} {idle} idle"
        return text + ")"


def _rows(replica_args: Any, keys: tuple[Any, ...], dim: int) -> int:
    try:
        value = replica_args
        for key in keys:
            value = operator.getitem(value, key)
    except (IndexError, KeyError, TypeError):
        return 0
    return int(value.size(dim)) if isinstance(value, torch.Tensor) and value.dim() else 0


def plan_scatter(
    inputs: Sequence[Any],
    kwargs: dict[str, Any] | None,
    device_ids: Sequence[int],
    *,
    dim: int = 0,
    warn: bool = True,
) -> ScatterPlan:
    """Runs torch's own ``scatter_kwargs`` (with views, no copies) and reports what it did.

    Args:
        inputs: the positional arguments of the forward call.
        kwargs: its keyword arguments.
        device_ids: DataParallel's devices.
        dim: the scatter dimension.
        warn: emit ``DroppedRowsWarning`` when some rows reach no replica.
    """
    ids = normalize_device_ids(device_ids)
    with torch.no_grad(), virtual_primitives(views_only=True):
        scattered_inputs, scattered_kwargs = scatter_kwargs(tuple(inputs), kwargs or {}, ids, dim)
    n_replicas = max(len(scattered_inputs), 1)
    tensor_chunks: list[tuple[str, tuple[int, ...]]] = []
    dropped: list[tuple[str, int]] = []
    arguments = (
        [(f"inputs[{i}]", arg, (0, i)) for i, arg in enumerate(inputs)]
        + [(f"kwargs[{k!r}]", arg, (1, k)) for k, arg in (kwargs or {}).items()]
    )
    for prefix, arg, (which, key) in arguments:
        source = scattered_inputs if which == 0 else scattered_kwargs
        for path, keys, tensor in tensor_leaves(arg, prefix):
            if tensor.dim() == 0:
                continue
            rows = tuple(_rows(replica, (key, *keys), dim) for replica in source)
            tensor_chunks.append((path, rows))
            lost = int(tensor.size(dim)) - sum(rows)
            if lost > 0:
                dropped.append((path, lost))
    batch_rows = tensor_chunks[0][1] if tensor_chunks else ()
    plan = ScatterPlan(tuple(ids), n_replicas, batch_rows, tuple(tensor_chunks), tuple(dropped))
    if warn and dropped:
        lost_text = "; ".join(f"{path} loses {count} rows" for path, count in dropped)
        warnings.warn(
            f"DataParallel's scatter drops rows: {lost_text}. Tensor arguments have different "
            f"sizes along dim {dim}, and torch zips their chunks with strict=False, so only "
            f"{n_replicas} replicas run (pytorch issue 7358). Give every batched argument the "
            "same number of rows.",
            DroppedRowsWarning,
            stacklevel=2,
        )
    return plan
