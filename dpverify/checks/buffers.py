"""What state survives a DataParallel step: buffers updated in place in ``forward``.

torch's ``replicate`` gives replica 0 the module's own buffers and every other replica a
copy (``comm.broadcast_coalesced``), so in-place updates made by replica 0 persist and the
others' are lost: after one step, the module's buffers are those of the module run on the
first chunk alone (docs/semantics.md, section 5, Replicate). BatchNorm's running statistics
and ``num_batches_tracked``, and spectral norm's power-iteration vectors, rely on this.

That is torch's semantics, not the model's intent: a running statistic a forward updates
from the rows it sees (an EMA of batch means, a usage count) then follows replica 0's chunk,
not the full batch one device sees. The check also compares every buffer with the
single-device full-batch update and says which differ; ``full_batch=True`` fails on them,
but for BatchNorm's running statistics in train mode, a known, explained divergence.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parallel.scatter_gather import scatter_kwargs

from dpverify.checks.dp import Check, Parallel, raise_unless_ok
from dpverify.core.comparison import (
    Msg,
    StepComparison,
    TensorComparison,
    TensorId,
    compare_tensors,
)
from dpverify.core.divergence import divergence_sources
from dpverify.core.errors import InvalidArgument
from dpverify.core.step import convert_tensors, copy_module, default_dtype, seed_step
from dpverify.core.text import plural
from dpverify.core.tree import first_batched
from dpverify.core.virtual import replica_device, virtual_primitives

__all__ = ["assert_dp_buffers_match", "buffers_match"]


def _first_chunk(check: Check) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments torch's scatter hands replica 0 (the whole call on one device)."""
    if len(check.device_ids) == 1:
        return check.args, check.kwargs
    with torch.no_grad(), virtual_primitives(views_only=True):
        inputs, kwargs = scatter_kwargs(check.args, check.kwargs, check.device_ids, check.dim)
    return tuple(inputs[0]), dict(kwargs[0])


class _ReplicaZero:
    """The arguments the replica on ``device_ids[0]`` really received: replica 0's chunk as
    the wrapper split the batch (a balanced wrapper gives it fewer rows than torch would)."""

    def __init__(self, device: int) -> None:
        self.device = device
        self.args: tuple[Any, ...] | None = None
        self.kwargs: dict[str, Any] = {}
        #: every replica forward seen: the evidence that the step ran in parallel
        self.forwards = 0
        self._lock = threading.Lock()

    def see(self, replica: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        with self._lock:  # replicas run in concurrent threads
            self.forwards += 1
        where = replica_device(first_batched(args))
        if where is None:  # one device: the module itself, on device_ids[0]
            where = self.device
        if where == self.device and self.args is None:
            self.args = convert_tensors(args, None, torch.device("cpu"))
            self.kwargs = convert_tensors(dict(kwargs), None, torch.device("cpu"))


def _buffers_after_forward(
    check: Check, args: tuple[Any, ...], kwargs: dict[str, Any], *, parallel: bool, dtype: torch.dtype | None,
    replica_zero: _ReplicaZero | None = None,
) -> dict[str, torch.Tensor]:
    model = copy_module(check.module, dtype).to(check.device)
    if replica_zero is not None:
        model.register_forward_pre_hook(replica_zero.see, with_kwargs=True)
    args = convert_tensors(args, dtype, check.device)
    kwargs = convert_tensors(kwargs, dtype, check.device)
    fork_devices = [check.device] if check.device.type == "cuda" else []
    devices = check.devices() if parallel else contextlib.nullcontext()
    with torch.random.fork_rng(devices=fork_devices), default_dtype(dtype), devices:
        runner: Any = check.wrap(model) if parallel else model  # built where it runs
        seed_step(0, check.device)
        runner(*args, **kwargs)
    return {name: buffer.detach() for name, buffer in model.named_buffers()}


def _compare_exact(name: TensorId, actual: torch.Tensor, expected: torch.Tensor, reference: str = "replica 0's chunk alone") -> TensorComparison:
    differs = int((actual.cpu() != expected.cpu()).sum()) if actual.shape == expected.shape else expected.numel()
    problem = None
    if differs:
        problem = f"is {actual.tolist()} after the parallel step, {expected.tolist()} after {reference}"
    return TensorComparison(name, tuple(expected.shape), expected.numel(), mismatched=differs, problem=problem)


def _compare(
    label: TensorId, got: torch.Tensor | None, want: torch.Tensor, anchor: torch.Tensor, check: Check, reference: str,
) -> TensorComparison:
    if got is None:
        return TensorComparison(label, tuple(want.shape), want.numel(), mismatched=1, problem="is missing after the parallel step")
    if want.is_floating_point():
        return compare_tensors(label, got, want, anchor, check.tolerance)
    return _compare_exact(label, got, want, reference)


def _batch_statistics(check: Check) -> set[str]:
    """The modules whose buffers follow replica 0's chunk by a known, explained divergence:
    BatchNorm in train mode (``divergence_sources``)."""
    return {source.module for source in divergence_sources(check.module) if source.kind == "batch statistics"}


def _owner(buffer: str) -> str:
    return buffer.rpartition(".")[0]


def _full_batch_findings(
    check: Check, actual: Mapping[str, torch.Tensor], rows_zero: int, *, fail: bool,
) -> tuple[list[TensorComparison], list[str]]:
    """Every buffer after the parallel step against the single-device full-batch update:
    the rows that fail (``fail``: those not explained), and notes for the others."""
    if len(check.plan.chunk_sizes) < 2:
        return [], []  # one chunk: replica 0's update is the full batch's
    full = _buffers_after_forward(check, check.args, check.kwargs, parallel=False, dtype=None)
    anchor = _buffers_after_forward(check, check.args, check.kwargs, parallel=False, dtype=torch.float64)
    explained = _batch_statistics(check)
    rows: list[TensorComparison] = []
    plain: list[str] = []
    batchnorm: list[str] = []
    for name, buffer in full.items():
        label = TensorId("buffer", name, variant="full batch")
        row = _compare(label, actual.get(name), buffer, anchor[name], check, "the full batch on one device")
        if row.ok:
            continue
        if _owner(name) in explained:
            batchnorm.append(name)
        elif fail:
            rows.append(row)
        else:
            plain.append(name)
    batch = sum(check.plan.chunk_sizes)
    notes = []
    if plain or rows:
        names = ", ".join(repr(n) for n in plain or [r.id.name for r in rows])
        notes.append(
            f"Buffers {names} differ from the single-device full-batch update: DataParallel keeps replica 0's "
            f"buffers, updated from its chunk ({plural(rows_zero, 'row')} of {batch}), and drops the other replicas' "
            "updates, so a running statistic updated in forward follows replica 0's chunk, not the full batch. "
            "Compute it over the full batch outside the DataParallel forward"
            + ("." if rows else "; full_batch=True fails on this.")
        )
    if batchnorm:
        modules = ", ".join(repr(m) for m in dict.fromkeys(_owner(n) for n in batchnorm))
        notes.append(
            f"BatchNorm {modules} in train mode: its running statistics follow replica 0's chunk, not the full "
            "batch (a known divergence: each replica normalises its chunk with that chunk's statistics, and "
            "DataParallel keeps replica 0's buffers). Compare in eval mode, or use SyncBatchNorm under "
            "DistributedDataParallel."
        )
    return rows, notes


def assert_dp_buffers_match(
    module: nn.Module,
    inputs: Any,
    *,
    device_ids: Sequence[int],
    output_device: int | None = None,
    parallel: Parallel | None = None,
    forward_kwargs: Mapping[str, Any] | None = None,
    msg: Msg = None,
    dim: int = 0,
    full_batch: bool = False,
) -> StepComparison:
    """Asserts the module's buffers after a parallel forward are replica 0's.

    Runs one forward through ``parallel`` on a deep copy of ``module`` and one of another
    copy on the first chunk alone (the rows torch's scatter gives replica 0; the whole
    batch with a single device), and compares every buffer: floating ones with the
    float64-anchored tolerance, integer ones exactly. A wrapper that keeps another
    replica's updates, averages them, or loses replica 0's fails.

    Every buffer is also compared with the single-device full-batch update (a third copy
    run on the whole batch): torch keeps replica 0's update, so a running statistic updated
    in forward from the rows it sees (an EMA of batch means, a usage count) differs from
    what one device computes. Those buffers are named in a note; with ``full_batch=True``
    they fail the check, except BatchNorm's running statistics in train mode, a known
    divergence that stays a note (compare in eval mode to check them).

    Args: as ``assert_dp_grads_match``, without target and loss, and:
        full_batch: fail where a buffer differs from the single-device full-batch update
            (default False: a note says so).

    Raises:
        ParallelMismatch: a buffer differs from replica 0's, or, with ``full_batch``, from
            the single-device full-batch update for a reason other than train-mode BatchNorm.
    """
    __tracebackhide__ = True
    if not isinstance(full_batch, bool):
        raise InvalidArgument(f"full_batch={full_batch!r} must be True or False")
    check = Check.create(
        module, inputs, device_ids=device_ids, output_device=output_device, parallel=parallel,
        forward_kwargs=forward_kwargs, dim=dim,
    )
    return raise_unless_ok(buffers_match(check, full_batch=full_batch), msg)


def buffers_match(check: Check, *, full_batch: bool = False) -> StepComparison:
    """``assert_dp_buffers_match`` on a built ``check``, returning its comparison whatever
    it found."""
    replica_zero = _ReplicaZero(check.device_ids[0])
    actual = _buffers_after_forward(check, check.args, check.kwargs, parallel=True, dtype=None, replica_zero=replica_zero)
    # what replica 0 really ran on (the wrapper's split), else torch's first chunk
    if replica_zero.args is not None:
        first_args, first_kwargs = replica_zero.args, replica_zero.kwargs
    else:
        first_args, first_kwargs = _first_chunk(check)
    expected = _buffers_after_forward(check, first_args, first_kwargs, parallel=False, dtype=None)
    anchor = _buffers_after_forward(check, first_args, first_kwargs, parallel=False, dtype=torch.float64)
    rows = [_compare(TensorId("buffer", name), actual.get(name), buffer, anchor[name], check, "replica 0's chunk alone") for name, buffer in expected.items()]
    first = first_batched(first_args)
    rows_zero = int(first.shape[check.dim]) if first is not None else 0
    notes = [
        f"Replica 0 ran on {plural(rows_zero, 'row')}; "
        "torch keeps its in-place buffer updates and drops the other replicas'."
    ]
    full_rows, full_notes = _full_batch_findings(check, actual, rows_zero, fail=full_batch)
    rows += full_rows
    notes += full_notes
    title = "Buffers after the parallel step must be those replica 0 left"
    if full_batch:
        title += ", and equal the single-device full-batch update"
    ran = replica_zero.forwards
    return check.outcome(title, rows, notes=notes, failures=check.replica_failures(ran), replicas=ran)
