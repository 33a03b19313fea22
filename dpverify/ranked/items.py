"""What each rank's (or micro-batch's) mean loss averages over, for the ranked checks (DDP,
FSDP2, tensor parallel): rows, or the tokens a language-model loss does not ignore, read
from the evidence as for DataParallel (``dpverify.core.items.choose_items``) or counted by
``items=``. Why it matters, and the exact recipe: docs/distributed.md, "Token-level losses";
what is weighed: ``count_piece_items``.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dpverify.core.errors import InvalidArgument
from dpverify.core.items import Items, choose_items, count_items, ignore_indices_of, item_candidates
from dpverify.core.step import convert_tensors, copy_module, default_dtype
from dpverify.core.tree import tensor_leaves
from dpverify.core.validation import require_callable
from dpverify.ranked.rank import even_shards, shard_bounds, take_rows

__all__ = ["Piece", "PieceItems", "count_piece_items", "cut_pieces", "measure_losses", "require_items"]

CPU = torch.device("cpu")

#: A count the evidence does not bear out: its weighting misses the full-batch loss by more
#: than this (relative to the largest loss), far beyond float64 rounding and beyond the
#: float32 rounding of a loss computed in float32 inside float64 code.
_MISMATCH = 1e-6

_ITEMS_EXAMPLE = (
    "items(args, kwargs) -> the number of items (rows, tokens) one shard's loss averages over; "
    "the shard's target is args[-1]"
)


def require_items(items: Any) -> Items | None:
    """``items`` when it is None or a callable (it runs in this process: it need not pickle)."""
    if items is not None:
        require_callable(items, "items", _ITEMS_EXAMPLE)
    return items  # type: ignore[no-any-return]


@dataclass(frozen=True)
class PieceItems:
    """The items each piece's mean loss averages over; a piece is a rank's shard, or one of
    its micro-batches.

    Attributes:
        kind: ``"rows"``, ``"tokens (target != -100)"`` (what was counted, as
            ``choose_items`` names it), or ``"items"`` for counts given by ``items=``.
        counts: per rank, the count of each of its micro-batches.
        rows: per rank, the rows of each of its micro-batches.
        losses: per rank, each micro-batch's mean loss in float64 on one device (empty when
            not measured).
        full_loss: the full-batch loss in float64 (None when not measured).
        candidates: every candidate count the evidence was weighed on, flattened in piece
            order (rank by rank), by name.
    """

    kind: str
    counts: tuple[tuple[int, ...], ...]
    rows: tuple[tuple[int, ...], ...]
    losses: tuple[tuple[float, ...], ...] = ()
    full_loss: float | None = None
    candidates: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def by_tokens(self) -> bool:
        """The pieces' losses are means over something other than rows."""
        return self.kind != "rows"

    @property
    def noun(self) -> str:
        return "tokens" if self.kind.startswith("tokens") else self.kind

    @property
    def singular(self) -> str:
        """``token`` (as in "the token count"), ``item`` or ``row``."""
        return self.noun.removesuffix("s")

    @property
    def detail(self) -> str:
        """What was counted, ``" (target != -100)"``, or ``""``."""
        inner = self.kind.partition("(")[2].rstrip(")")
        return f" ({inner})" if inner else ""

    @property
    def per_rank(self) -> tuple[int, ...]:
        return tuple(sum(pieces) for pieces in self.counts)

    @property
    def flat(self) -> tuple[int, ...]:
        return tuple(count for pieces in self.counts for count in pieces)

    @property
    def total(self) -> int:
        return sum(self.flat)

    @property
    def unequal_ranks(self) -> bool:
        """The ranks hold different numbers of items: plain ``ddp_step`` is biased."""
        return len(set(self.per_rank)) > 1

    @property
    def unequal_pieces(self) -> bool:
        """The micro-batches (over every rank) hold different numbers of items: dividing
        each one's mean loss by the number of micro-batches is biased."""
        return len(set(self.flat)) > 1

    @property
    def measured(self) -> bool:
        return bool(self.losses) and self.full_loss is not None

    def rank_losses(self) -> list[float] | None:
        """Each rank's mean loss over its items, from its micro-batches' (float64)."""
        if not self.measured:
            return None
        found = []
        for counts, losses in zip(self.counts, self.losses, strict=True):
            total = sum(counts)
            found.append(losses[0] if len(losses) == 1 else (
                math.fsum(c * loss for c, loss in zip(counts, losses, strict=True)) / total if total else math.nan
            ))
        return found

    def predicted_rank_bias(self) -> float | None:
        """``sum((1/W - t_r/T) * L_r)``: the bias of DDP's average of the ranks' mean
        losses that the counts predict (plain ``ddp_step``)."""
        losses = self.rank_losses()
        if losses is None:
            return None
        world, total = len(self.counts), self.total
        return math.fsum((1.0 / world - t / total) * loss for t, loss in zip(self.per_rank, losses, strict=True))

    def predicted_piece_bias(self) -> float | None:
        """``sum((1/(W k) - t_p/T) * L_p)`` over every micro-batch ``p``: the bias of
        dividing each micro-batch's mean loss by the number of micro-batches ``k``."""
        if not self.measured:
            return None
        pieces = len(self.flat)
        losses = [loss for rank in self.losses for loss in rank]
        return math.fsum((1.0 / pieces - t / self.total) * loss for t, loss in zip(self.flat, losses, strict=True))

    def weighting_error(self, counts: Sequence[int]) -> float | None:
        """``sum(t_p * L_p) / sum(t_p)`` minus the full-batch loss, for these counts."""
        if not self.measured or self.full_loss is None or sum(counts) <= 0:
            return None
        losses = [loss for rank in self.losses for loss in rank]
        return math.fsum(t * loss for t, loss in zip(counts, losses, strict=True)) / sum(counts) - self.full_loss

    def given_note(self) -> str | None:
        """For counts given by ``items=``: a sentence when the evidence does not bear them
        out (their weighting of the piece losses misses the full-batch loss), naming the
        counts that do; else None."""
        if self.kind != "items" or not self.measured or self.full_loss is None:
            return None
        error = self.weighting_error(self.flat)
        losses = [abs(loss) for rank in self.losses for loss in rank]
        scale = max([abs(self.full_loss), *losses])
        if error is None or not math.isfinite(scale) or abs(error) <= _MISMATCH * scale:
            return None
        text = (
            f"items= counts {[list(c) for c in self.counts] if len(self.counts[0]) > 1 else list(self.per_rank)} "
            f"do not match the loss: weighting the pieces' mean losses by them gives "
            f"{self.full_loss + error:.8g}, the full batch's loss is {self.full_loss:.8g} "
            f"(off by {error:+.3g}), so the recipe built on them (ctx.loss_weight) is not exact."
        )
        found = [
            (name, counts) for name, counts in self.candidates.items()
            if (gap := self.weighting_error(counts)) is not None and abs(gap) <= _MISMATCH * scale
        ]
        if found:
            name, counts = found[0]
            text += f" The counts {name}, {list(counts)}, reproduce it; return those from items=, or leave items= out."
        else:
            text += " Return from items= what the loss averages over (its rows, or its tokens that are not ignored)."
        return text


def _ignore_indices(loss_fn: Any, module: nn.Module) -> tuple[int, ...]:
    """The ignore index of ``loss_fn`` (a loss module's ``ignore_index``, or a partial's
    ``ignore_index=``) and of every loss module inside ``module``."""
    found: list[int] = []
    if isinstance(loss_fn, nn.Module):
        found += ignore_indices_of(loss_fn)
    fn = loss_fn
    while isinstance(fn, functools.partial):
        value = fn.keywords.get("ignore_index")
        if isinstance(value, int) and not isinstance(value, bool):
            found.append(value)
        fn = fn.func
    found += ignore_indices_of(module)
    return tuple(dict.fromkeys(found))


@dataclass(frozen=True)
class Piece:
    """One piece of a batch: a rank's shard, or one of its micro-batches."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    target: Any
    rows: int
    bounds: tuple[int, int, int, int]  # shard start, shard stop, piece start, piece stop (in the shard)


def cut_pieces(args: tuple[Any, ...], kwargs: Mapping[str, Any], target: Any, shard_sizes: Sequence[int], micro_batches: int) -> list[list[Piece]]:
    """Every rank's micro-batches, cut as the ranks cut them: the shard out of the batch,
    then the micro-batch out of the shard (``ShardContext.micro_batch_split``); a shard
    without rows is one empty piece."""
    batch = sum(shard_sizes)
    found = []
    for start, stop in shard_bounds(shard_sizes):
        rows = stop - start
        shard = (take_rows(args, start, stop, batch), take_rows(dict(kwargs), start, stop, batch), take_rows(target, start, stop, batch))
        found.append([
            Piece(
                take_rows(shard[0], low, high, rows), take_rows(shard[1], low, high, rows),
                take_rows(shard[2], low, high, rows), high - low, (start, stop, low, high),
            )
            for low, high in (shard_bounds(even_shards(rows, micro_batches)) if rows else [(0, 0)])
        ])
    return found


def _candidates(piece: Piece, ignore: Sequence[int]) -> dict[str, int]:
    """Rows, then the target's non-ignored entries, then every integer forward argument's."""
    return {
        "rows": piece.rows,
        **item_candidates((), {"target": piece.target}, ignore),
        **item_candidates(piece.args, piece.kwargs, ignore),
    }


def _proportional(counts: Sequence[int], rows: Sequence[int]) -> bool:
    return all(c * sum(rows) == r * sum(counts) for c, r in zip(counts, rows, strict=True))


def measure_losses(
    module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any], target: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
    pieces: Sequence[Sequence[Piece]], batch: int,
) -> tuple[tuple[tuple[float, ...], ...], float]:
    """Every piece's mean loss and the full batch's, in float64 on one device. The pieces'
    outputs are the full-batch output's rows when every output tensor has the batch's rows
    (so layers that mix rows, BatchNorm, leave the question which count the loss divides by
    alone); otherwise each piece is run on its own."""
    model = copy_module(module, torch.float64)
    f64 = functools.partial(convert_tensors, dtype=torch.float64, device=CPU)
    with torch.no_grad(), torch.random.fork_rng(devices=[]), default_dtype(torch.float64):
        torch.manual_seed(0)
        output = model(*f64(args), **f64(dict(kwargs)))
        full = float(loss_fn(output, f64(target)))
        leaves = [tensor for _path, _keys, tensor in tensor_leaves(output)]
        sliceable = bool(leaves) and all(t.dim() > 0 and t.size(0) == batch for t in leaves)
        losses = []
        for rank in pieces:
            found = []
            for piece in rank:
                start, stop, low, high = piece.bounds
                if sliceable:
                    out = take_rows(take_rows(output, start, stop, batch), low, high, stop - start)
                else:
                    torch.manual_seed(0)
                    out = model(*f64(piece.args), **f64(piece.kwargs))
                found.append(float(loss_fn(out, f64(piece.target))))
            losses.append(tuple(found))
    return tuple(losses), full


def count_piece_items(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    target: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    shard_sizes: Sequence[int],
    micro_batches: int = 1,
    items: Items | None = None,
) -> PieceItems:
    """What every rank's micro-batches' mean losses average over (``PieceItems``).

    With ``items``, its counts (``items((*args, target), kwargs)`` per piece). Otherwise the
    rows, unless another candidate count, not proportional to the rows, reproduces the
    full-batch loss from the piece losses clearly better (``choose_items``). The losses are
    measured only when that question arises, when ``items`` is given (to check it), or when
    micro-batches hold different numbers of rows (to size the accumulation trap).

    Raises:
        InvalidArgument: ``items`` returned something that is not a count, or counts that
            add up to no item.
    """
    pieces = cut_pieces(args, kwargs, target, shard_sizes, micro_batches)
    rows = tuple(tuple(p.rows for p in rank) for rank in pieces)
    flat = [p for rank in pieces for p in rank]
    ignore = _ignore_indices(loss_fn, module)
    per_piece = [_candidates(p, ignore) for p in flat]
    names = [name for name in per_piece[0] if all(name in found for found in per_piece)]
    candidates = {name: tuple(found[name] for found in per_piece) for name in names}
    flat_rows = candidates["rows"]
    given = tuple(count_items(items, (*p.args, p.target), p.kwargs) for p in flat) if items is not None else None
    if given is not None and sum(given) <= 0:
        raise InvalidArgument(f"items= counts {list(given)} add up to no item; each shard's loss must average over at least one")
    open_question = any(not _proportional(counts, flat_rows) for name, counts in candidates.items() if name != "rows")
    losses: tuple[tuple[float, ...], ...] = ()
    full: float | None = None
    # unequal micro-batches of rows: the accumulation trap note sizes its bias from the losses
    uneven_pieces = micro_batches > 1 and len(set(flat_rows)) > 1
    if given is not None or open_question or uneven_pieces:
        try:
            losses, full = measure_losses(module, args, kwargs, target, loss_fn, pieces, sum(shard_sizes))
        except Exception:  # a loss that refuses float64 or a slice: the rows stand, unmeasured
            losses, full = (), None
    if given is not None:
        kind, counts = "items", list(given)
    elif open_question and full is not None:
        kind, counts = choose_items({n: list(c) for n, c in candidates.items()}, [x for rank in losses for x in rank], full)
    else:
        kind, counts = "rows", list(flat_rows)
    flat_counts = iter(counts)
    shaped = tuple(tuple(itertools.islice(flat_counts, len(rank))) for rank in pieces)
    return PieceItems(kind, shaped, rows, losses, full, candidates)
