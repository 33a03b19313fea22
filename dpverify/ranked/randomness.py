"""Random draws on the ranks: each shard's own random stream, the dropout masks a step drew
(with the state of the generator they were drawn from), and their replay in the
single-device reference.

Launchers seed every rank in its own stream (accelerate's ``set_seed(seed,
device_specific=True)`` adds the process index; a plain ``torch.manual_seed(seed)`` on every
rank does not), so a rank's step starts from ``rank_seed(seed, shard)``. While the step runs,
every ``nn.Dropout`` of the rank's module in train mode draws its mask through a forward
hook that records it (``recording_dropout``): its keep-mask, drawn from the generator of the
input's device, replaces the layer's own. Two ranks whose masks were drawn from the same
generator state drew the same random numbers (``same_random_numbers``), and the masks of
every rank, concatenated along the batch in rank order, replay on one device
(``replaying_dropout``; in training, each step's masks in that step's forward,
``replay_masks`` and ``replaying``), so that a train-mode Dropout model is compared exactly. Only
``nn.Dropout`` layers whose input's first dimension is the batch replay; other random
layers (``Dropout2d``, ``F.dropout`` calls, ``torch.randn`` in forward) draw as before.
Everything here must be importable by the rank processes.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "DropoutCall",
    "DropoutReplayError",
    "Masks",
    "SameStream",
    "dropout_layers",
    "generator_state",
    "rank_seed",
    "recording_dropout",
    "replay_masks",
    "replaying",
    "replaying_dropout",
    "same_random_numbers",
    "training_masks",
]


def rank_seed(seed: int, shard: int) -> int:
    """The seed of the random stream of the ranks that run shard ``shard``: ``seed + shard``,
    distinct per shard, as launchers seed each process (ranks that share a shard, a
    tensor-parallel group, share a stream)."""
    return seed + shard


@dataclass(frozen=True)
class DropoutCall:
    """One forward of an ``nn.Dropout`` layer on a rank.

    Attributes:
        module: the layer's qualified name in the rank's module.
        p: its drop probability.
        keep: the mask it applied (True: kept, scaled by ``1 / (1 - p)``), on the CPU.
        state: a digest of the random generator's state the mask was drawn from.
    """

    module: str
    p: float
    keep: torch.Tensor
    state: str


class DropoutReplayError(RuntimeError):
    """A forward of the reference reached a Dropout layer with no recorded mask of its shape."""


def dropout_layers(module: nn.Module) -> dict[str, float]:
    """The ``nn.Dropout`` layers whose masks a rank records and the reference replays: in
    train mode, ``0 < p < 1``, not in place (an in-place layer overwrites the input the mask
    applies to); by qualified name, with their ``p``."""
    return {
        name: float(sub.p)
        for name, sub in module.named_modules()
        if type(sub) is nn.Dropout and sub.training and 0.0 < sub.p < 1.0 and not sub.inplace
    }


def generator_state(device: torch.device) -> str:
    """A digest of the random generator's state: the CPU's, or ``device``'s when it is a GPU."""
    state = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()
    return hashlib.blake2b(state.numpy().tobytes(), digest_size=12).hexdigest()


def _apply(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    return x * (keep.to(device=x.device, dtype=x.dtype) / (1.0 - p))


@contextlib.contextmanager
def recording_dropout(module: nn.Module, calls: list[DropoutCall]) -> Iterator[None]:
    """Runs the body with every layer of ``dropout_layers(module)`` drawing its mask from the
    generator of its input's device, applying it, and appending it to ``calls``."""

    drawn: list[torch.Tensor] = []

    def draw_for(name: str, p: float) -> Any:
        # before the layer's own draw, so that the mask depends on the random state the
        # layer was called in, and not on how many numbers its own mask took
        def draw(_layer: nn.Module, args: tuple[Any, ...]) -> None:
            (x,) = args
            state = generator_state(x.device)
            keep = torch.rand(x.shape, device=x.device) >= p
            calls.append(DropoutCall(name, p, keep.detach().to("cpu"), state))
            drawn.append(keep)

        return draw

    def apply_for(p: float) -> Any:
        def apply(_layer: nn.Module, args: tuple[Any, ...], _output: Any) -> torch.Tensor:
            return _apply(args[0], drawn.pop(), p)

        return apply

    handles = []
    for name, p in dropout_layers(module).items():
        layer = module.get_submodule(name)
        handles += [layer.register_forward_pre_hook(draw_for(name, p)), layer.register_forward_hook(apply_for(p))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _per_layer(calls: Sequence[DropoutCall]) -> dict[str, list[DropoutCall]]:
    layers: dict[str, list[DropoutCall]] = {}
    for call in calls:
        layers.setdefault(call.module, []).append(call)
    return layers


#: The masks the ranks drew in one step, by layer: for each call of the layer in one
#: full-batch forward, the ranks' masks concatenated along the batch (``replay_masks``).
Masks = dict[str, list[torch.Tensor]]


def replay_masks(module: nn.Module, ranks: Sequence[Sequence[DropoutCall]], rows: Sequence[Sequence[int]]) -> Masks | None:
    """The masks a full-batch forward of ``module`` replays from one step of the ranks: per
    layer of ``dropout_layers(module)``, for each of its calls, the ranks' masks
    concatenated along the batch in rank order (each rank's forwards in order); None when
    they cannot replay (a layer some rank did not record, a call count or a mask shape
    that does not follow the rows).

    Args:
        module: the module the ranks copied.
        ranks: each rank's ``DropoutCall``s in the step, in the order they ran.
        rows: each rank's rows per forward (its micro-batches', in order; one entry for a
            one-forward step): rank ``r``'s ``k``-th forward ran ``rows[r][k]`` rows.
    """
    layers = dropout_layers(module)
    if not layers or len(ranks) != len(rows):
        return None
    masks: Masks = {}
    for name in layers:
        per_rank = [_per_layer(calls).get(name, []) for calls in ranks]
        forwards = [len(r) for r in rows]
        if any(not calls or len(calls) % k for calls, k in zip(per_rank, forwards, strict=True)):
            return None
        each = {len(calls) // k for calls, k in zip(per_rank, forwards, strict=True)}
        if len(each) != 1:
            return None
        (per_forward,) = each
        joined: list[torch.Tensor] = []
        for j in range(per_forward):
            pieces = [calls[f * per_forward + j].keep for calls, k in zip(per_rank, forwards, strict=True) for f in range(k)]
            sizes = [n for r in rows for n in r]
            if any(piece.dim() == 0 or piece.size(0) != n or piece.shape[1:] != pieces[0].shape[1:] for piece, n in zip(pieces, sizes, strict=True)):
                return None
            joined.append(torch.cat(pieces))
        masks[name] = joined
    return masks


def _replay_hooks(module: nn.Module, masks: Masks) -> list[Any]:
    """Hooks that make ``module``'s Dropout layers (``masks``' keys) apply ``masks`` in every
    full-batch forward (and, in a forward of fewer rows, the next rows of them: each rank's
    piece in turn); their handles."""
    layers = dropout_layers(module)
    positions = {name: [0] for name in masks}
    # where the next forward of fewer rows (one rank's piece, in rank order) starts, per call
    cursors = {name: [0] * len(joined) for name, joined in masks.items()}

    def restart(_module: nn.Module, _args: Any) -> None:
        for position in positions.values():
            position[0] = 0

    def hook_for(name: str, p: float) -> Any:
        def hook(_layer: nn.Module, args: tuple[Any, ...], _output: Any) -> torch.Tensor:
            (x,) = args
            position = positions[name]
            index = position[0]
            position[0] += 1
            recorded = masks[name]
            if index < len(recorded) and recorded[index].shape == x.shape:
                return _apply(x, recorded[index], p)
            if index < len(recorded) and x.dim() > 0 and recorded[index].shape[1:] == x.shape[1:] and x.size(0) < recorded[index].size(0):
                # a forward of one rank's rows (the rounding terms run each rank's piece in
                # rank order): the next rows of the recorded mask
                start = cursors[name][index]
                start = 0 if start + x.size(0) > recorded[index].size(0) else start
                cursors[name][index] = start + x.size(0)
                return _apply(x, recorded[index][start : start + x.size(0)], p)
            raise DropoutReplayError(
                f"Dropout layer {name!r}: call {index + 1} of a forward, of shape {list(x.shape)}, has no recorded mask "
                f"(the ranks recorded {[list(m.shape) for m in recorded]})"
            )

        return hook

    handles = [module.register_forward_pre_hook(restart)]
    for name in masks:
        handles.append(module.get_submodule(name).register_forward_hook(hook_for(name, layers[name])))
    return handles


def replaying_dropout(module: nn.Module, ranks: Sequence[Sequence[DropoutCall]], rows: Sequence[Sequence[int]]) -> nn.Module | None:
    """A copy of ``module`` whose Dropout layers apply the ranks' masks of one step
    (``replay_masks``: concatenated along the batch in rank order) in every full-batch
    forward, and in a forward of fewer rows the next rows of them; None when they cannot."""
    masks = replay_masks(module, ranks, rows)
    if masks is None:
        return None
    replay = copy.deepcopy(module)
    _replay_hooks(replay, masks)
    return replay


def training_masks(module: nn.Module, ranks: Sequence[Sequence[Sequence[DropoutCall]]], sizes: Sequence[Sequence[int]]) -> list[Masks] | None:
    """Each training step's masks for single-device training (``replay_masks``): ``ranks[r]``
    holds rank ``r``'s calls of every step, ``sizes[i]`` the ranks' rows in step ``i``;
    None unless every step's replay (a model without ``dropout_layers`` included).

    A rank's forwards in a step are read off its calls of the first layer: one forward of
    its shard, or, when those calls' rows add up to the shard's, one forward per call (a
    step that accumulates micro-batches, each a contiguous piece of the shard in order)."""
    layers = dropout_layers(module)
    if not layers:
        return None
    first = next(iter(layers))
    found = []
    for index, shards in enumerate(sizes):
        calls = [steps[index] if index < len(steps) else () for steps in ranks]
        rows = [_forward_rows([c for c in mine if c.module == first], n) for mine, n in zip(calls, shards, strict=False)]
        masks = replay_masks(module, calls, rows)
        if masks is None:
            return None
        found.append(masks)
    return found


def _forward_rows(calls: Sequence[DropoutCall], shard: int) -> list[int]:
    """The rows of each forward a rank ran in a step (``training_masks``)."""
    pieces = [int(call.keep.size(0)) if call.keep.dim() else 0 for call in calls]
    if len(pieces) > 1 and sum(pieces) == shard and all(pieces):
        return pieces
    return [shard]


@contextlib.contextmanager
def replaying(module: nn.Module, masks: Masks | None) -> Iterator[None]:
    """Runs the body with ``module``'s Dropout layers applying ``masks`` (one training
    step's, ``replay_masks``), or drawing as they do when ``masks`` is None."""
    handles = _replay_hooks(module, masks) if masks else []
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@dataclass(frozen=True)
class SameStream:
    """Two ranks that drew a Dropout mask from the same random generator state.

    Attributes:
        ranks: the two ranks.
        module: the layer.
        elements: how many mask entries the two ranks share from that state (the shorter
            mask's, when their shards differ in rows).
        identical: whether those entries are equal (they are, drawn from one state).
    """

    ranks: tuple[int, int]
    module: str
    elements: int
    identical: bool


def same_random_numbers(ranks: Sequence[Sequence[DropoutCall]]) -> SameStream | None:
    """The first pair of ranks (rank 0 and another) whose Dropout layers drew a mask from
    the same generator state: the ranks draw the same random numbers. None when every rank
    drew from its own state (or no rank recorded a mask)."""
    if len(ranks) < 2:
        return None
    first = ranks[0]
    for rank, calls in enumerate(ranks[1:], start=1):
        for mine, theirs in zip(first, calls, strict=False):
            if mine.module == theirs.module and mine.state == theirs.state:
                n = min(mine.keep.numel(), theirs.keep.numel())
                identical = bool(torch.equal(mine.keep.flatten()[:n], theirs.keep.flatten()[:n]))
                return SameStream((0, rank), mine.module, n, identical)
    return None

