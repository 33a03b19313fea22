"""Exact mode for a helper: the dyadic float64 copies of its case, and the evidence that
the single-device step, and the parallel algorithm's arithmetic, round nothing.

A helper called with ``exact=True`` replaces its module, inputs, target and keyword
arguments by ``ExactCase.of(...)``'s copies, compares with ``EXACT`` (no tolerance), and
puts ``Evidence.note()`` in its report. ``prove`` runs, each under ``proving``:

- the single-device step on the full batch;
- the same step on the batch in reverse order, whose gradients must be bit-identical (a
  second summation order);
- the step as the parallel algorithm cuts the batch (``pieces``): forward per piece, then
  either one loss on the gathered outputs (DataParallel) or one loss per piece whose
  gradients are summed with ``weights`` (a rank's mean loss, averaged over ranks), the sum
  taken in piece order, as the replicas or ranks are reduced.

Every operation in those runs is shown exact, so the full-batch step is the exact
result, and a correct parallel step, whose arithmetic is the pieces' run, reproduces it to
the bit: any difference, one unit in the last place of one element included, is a
mismatch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree

from dpverify.core.comparison import Tolerance
from dpverify.core.errors import InvalidArgument
from dpverify.core.numerics import ulps
from dpverify.exact.grid import BITS, dyadic_module, dyadic_tree, is_power_of_two, lowest_bit
from dpverify.exact.proof import Proof, Prover, proving
from dpverify.exact.rules import Need

__all__ = ["EXACT", "Evidence", "ExactCase", "prove", "require_no_tolerance", "require_power_of_two", "ulps"]

#: The tolerance of exact mode: none.
EXACT = Tolerance(rtol=0.0, atol=0.0)


def require_no_tolerance(rtol: float | None, atol: float | None) -> None:
    """``exact=True`` compares without tolerance: an explicit one contradicts it."""
    if rtol is not None or atol is not None:
        raise InvalidArgument(
            f"exact=True with rtol={rtol!r}, atol={atol!r}: exact mode compares bit for bit; pass either "
            "exact=True or a tolerance, not both"
        )


def require_power_of_two(value: int, argument: str, why: str) -> None:
    """Refuses a count exact arithmetic divides by (a world size, a number of micro-batches)
    that is not a power of two."""
    if not is_power_of_two(value):
        raise InvalidArgument(
            f"exact=True with {argument}={value}: {why} divides every gradient by {value}, which rounds; "
            "use a power of two (1, 2, 4, 8), or check without exact=True"
        )


@dataclass(frozen=True)
class ExactCase:
    """A case on the dyadic grid: float64 copies of the module (floating parameters and
    buffers), the positional and keyword inputs and the target, each floating tensor with
    ``BITS`` significant bits (``dpverify.exact.grid``)."""

    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    target: Any

    @classmethod
    def of(cls, module: nn.Module, args: tuple[Any, ...], target: Any, kwargs: Mapping[str, Any] | None = None, *, bits: int = BITS) -> ExactCase:
        """The grid copies of a case; ``module`` and the tensors given stay as they are."""
        return cls(
            module=dyadic_module(copy.deepcopy(module), bits),
            args=tuple(dyadic_tree(args, bits)),
            kwargs=dict(dyadic_tree(dict(kwargs or {}), bits)),
            target=dyadic_tree(target, bits),
        )


@dataclass(frozen=True)
class Evidence:
    """What ``prove`` established (see the module docstring)."""

    proof: Proof
    reversed_identical: bool | None
    pieces: tuple[int, ...]
    pieces_identical: bool | None
    runs: tuple[str, ...] = field(default_factory=tuple)

    def note(self) -> str:
        """The report's sentence on exactness."""
        parts = [f"Exact: {self.proof.describe()} ({', '.join(self.runs)})"]
        if self.reversed_identical is not None:
            parts.append("the gradients are bit-identical with the batch reversed" if self.reversed_identical else "the gradients differ with the batch reversed: the model mixes rows")
        if self.pieces_identical is not None:
            parts.append(
                f"the parallel algorithm's pieces {list(self.pieces)} give the full batch's gradients bit for bit"
                if self.pieces_identical else
                f"the parallel algorithm's pieces {list(self.pieces)} give other gradients than the full batch, exactly: "
                "the split itself changes the result"
            )
        return "; ".join(parts) + ". Tolerance: none."


LossFn = Callable[[Any, Any], torch.Tensor]


def prove(
    case: ExactCase,
    loss_fn: LossFn,
    *,
    pieces: Sequence[int] = (),
    dim: int = 0,
    gathered: bool = True,
    weights: Sequence[float] | None = None,
) -> Evidence:
    """Runs the full batch, the reversed batch and ``pieces`` (row counts along ``dim``,
    as the parallel step cuts the batch) under ``proving`` (module docstring).

    Args:
        case: the grid copies.
        loss_fn: ``loss_fn(output, target)``.
        pieces: how the parallel step cuts the batch (empty: no pieces run).
        dim: the dimension the batch is cut along.
        gathered: one loss on the gathered outputs (DataParallel), else one per piece.
        weights: per piece, what its gradients are multiplied by before the sum (powers of
            two; default 1), when ``gathered`` is False.

    Raises:
        InvalidArgument: an operation cannot be shown exact (it names the operation, where
            it ran and what to change).
    """
    batch = _batch(case, dim)
    operations, tightest = 0, Proof(0, 0, 53, "")
    runs: list[str] = []

    def merge(proof: Proof, run: str) -> None:
        nonlocal operations, tightest
        operations += proof.operations
        runs.append(run)
        if proof.bits >= tightest.bits:
            tightest = proof

    full, proof = _step(case, loss_fn, [(0, batch)], dim, gathered=True, weights=None)
    merge(proof, "the full batch")
    order = torch.arange(batch - 1, -1, -1)
    flipped = _reordered(case, order, dim, batch)
    backwards, proof = _step(flipped, loss_fn, [(0, batch)], dim, gathered=True, weights=None)
    merge(proof, "the batch reversed")
    identical_reversed = _identical(full, backwards)
    identical_pieces: bool | None = None
    sizes = tuple(int(p) for p in pieces)
    if len(sizes) > 1:
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        cut, proof = _step(case, loss_fn, [(s, s + n) for s, n in zip(starts, sizes, strict=True) if n], dim, gathered=gathered, weights=weights)
        merge(proof, f"the pieces {list(sizes)}")
        identical_pieces = _identical(full, cut)
    final = Proof(operations, tightest.bits, tightest.precision, tightest.where)
    return Evidence(final, identical_reversed, sizes, identical_pieces, tuple(runs))


def _batch(case: ExactCase, dim: int) -> int:
    for leaf in _pytree.tree_leaves((case.args, case.kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > dim:
            return int(leaf.size(dim))
    raise InvalidArgument("exact=True needs a batch tensor among the inputs")


def _rows(value: Any, batch: int, dim: int, pick: Callable[[torch.Tensor, int], torch.Tensor]) -> Any:
    """``value`` with every tensor holding ``batch`` rows along ``dim`` replaced by ``pick``."""
    return _pytree.tree_map(lambda t: pick(t, dim) if isinstance(t, torch.Tensor) and t.dim() > dim and t.size(dim) == batch else t, value)


def _reordered(case: ExactCase, order: torch.Tensor, dim: int, batch: int) -> ExactCase:
    def take(tensor: torch.Tensor, d: int) -> torch.Tensor:
        return tensor.index_select(d, order)

    return ExactCase(case.module, _rows(case.args, batch, dim, take), _rows(case.kwargs, batch, dim, take), _rows(case.target, batch, 0, take))


def _step(
    case: ExactCase, loss_fn: LossFn, bounds: Sequence[tuple[int, int]], dim: int, *, gathered: bool, weights: Sequence[float] | None,
) -> tuple[dict[str, torch.Tensor], Proof]:
    """One step cut into ``bounds`` (a replica or rank per piece), proven; the gradients
    summed over the pieces in order."""
    batch = _batch(case, dim)
    replicas = [copy.deepcopy(case.module) for _ in bounds]
    with proving({f"replica {i}" if len(bounds) > 1 else "": r for i, r in enumerate(replicas)}) as prover:
        outputs = []
        for index, ((start, stop), replica) in enumerate(zip(bounds, replicas, strict=True)):
            def cut(t: torch.Tensor, d: int, start: int = start, stop: int = stop) -> torch.Tensor:
                return t.narrow(d, start, stop - start)

            args, kwargs = _rows(case.args, batch, dim, cut), _rows(case.kwargs, batch, dim, cut)
            output = replica(*args, **kwargs)
            if gathered:
                outputs.append(output)
            else:
                prover.stage = f"the loss of piece {index} of {len(bounds)} (rows {start}:{stop} of the batch)"
                loss_fn(output, _rows(case.target, batch, 0, cut)).backward()
        if gathered:
            prover.stage = "the loss"
            joined = outputs[0] if len(outputs) == 1 else _pytree.tree_map(lambda *ts: torch.cat(ts, dim), *outputs)
            loss_fn(joined, case.target).backward()
        prover.stage = "the sum of the pieces' gradients"
        grads = _summed(replicas, weights if not gathered else None, prover)
    return grads, prover.proof()


def _summed(replicas: Sequence[nn.Module], weights: Sequence[float] | None, prover: Prover) -> dict[str, torch.Tensor]:
    """The pieces' gradients summed in piece order, and shown exact in every order: an
    all-reduce or a reduce may add them in any, and each partial sum is bounded by the sum
    of the terms' magnitudes, on the finest of their grids."""
    terms: dict[str, list[torch.Tensor]] = {}
    for i, replica in enumerate(replicas):
        for name, param in replica.named_parameters():
            if param.grad is not None:
                terms.setdefault(name, []).append(param.grad if weights is None else param.grad * weights[i])
    total: dict[str, torch.Tensor] = {}
    for name, parts in terms.items():
        with prover.paused():
            lows = [low for low in (lowest_bit(p) for p in parts) if low is not None]
            magnitude = float(torch.stack([p.abs() for p in parts]).sum(0).max())
        prover.require(Need(min(lows) if lows else None, magnitude, parts[0].dtype), f"the sum of {name}'s gradients over the pieces")
        total[name] = parts[0].clone()
        for part in parts[1:]:
            total[name] = total[name] + part
    return total


def _identical(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
