"""A model and a recipe for its batches, whoever wrote it: the built-in models, or a
user's factory as the command line loads it (``dpverify.cli.user_model``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from dpverify.core.errors import InvalidArgument
from dpverify.core.step import LossFn
from dpverify.models.builtin import BUILTIN_MODELS, VERIFY_MODELS, builtin_case

__all__ = ["Batch", "LossFn", "UserModel", "builtin_model"]


@dataclass(frozen=True)
class Batch:
    """One batch for the user's model, and how its loss is computed.

    Attributes:
        inputs: positional forward arguments (``()`` for a keyword-only call).
        target: the loss target, or None when the forward returns the loss.
        loss_fn: ``loss_fn(output, target)``, or None when the forward returns the loss.
        loss_name: the loss in words.
        per_row_mean_loss: the forward's loss is known to be its chunk's per-row mean (the
            built-in models), so ``loss.mean()`` of replica losses must be biased exactly
            when the chunks are uneven.
        kwargs: keyword forward arguments (scattered like ``inputs``), as trainers call
            models with ``model(**batch)``.
    """

    inputs: tuple[Any, ...]
    target: Any
    loss_fn: LossFn | None
    loss_name: str
    per_row_mean_loss: bool = False
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def returns_loss(self) -> bool:
        return self.loss_fn is None


@dataclass(frozen=True)
class UserModel:
    """A model and a recipe for batches of any size.

    Attributes:
        name: what the user named (``pkg.models:make`` or a built-in name).
        module: the model, as the factory returned it.
        batch_source: where batches come from, in words.
        make_batch: ``make_batch(batch_size)`` gives a ``Batch``, deterministically.
        make_step_batch: ``make_step_batch(batch_size, step)`` gives the batch of optimizer
            step ``step`` of the training checks (step 0's is ``make_batch``'s), or None
            when the model has one batch per size (every step trains on it).
    """

    name: str
    module: nn.Module
    batch_source: str
    make_batch: Callable[[int], Batch]
    make_step_batch: Callable[[int, int], Batch] | None = None

    def step_batches(self, batch_size: int, steps: int) -> tuple[Batch, ...]:
        """The batches of ``steps`` optimizer steps: each its own where the model has
        ``make_step_batch``, else ``make_batch``'s every time."""
        if self.make_step_batch is None:
            return (self.make_batch(batch_size),) * steps
        return tuple(self.make_step_batch(batch_size, step) for step in range(steps))

    @property
    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.module.parameters())


def builtin_model(name: str, *, seed: int = 0) -> UserModel:
    """One of dpverify's built-in models (``mlp``, ``conv``, ``embedding``,
    ``loss-in-forward``, or another of ``VERIFY_MODELS``) with its batches; the batches
    of ``time-major`` are split along dim 1 (``builtin_case(name, ...).dim``).

    Raises:
        InvalidArgument: unknown name.
    """
    if name not in VERIFY_MODELS:
        raise InvalidArgument(f"--model {name!r} is not a built-in model; choose from {sorted(BUILTIN_MODELS)}")

    def make(batch_size: int, step: int = 0) -> Batch:
        # a step's batch: the inputs and target of the case seeded seed + step
        case = builtin_case(name, batch=batch_size, seed=seed + step)
        if case.loss_fn is None:
            return Batch(case.inputs, None, None, "computed in forward (each replica's chunk mean)", per_row_mean_loss=True, kwargs=case.kwargs)
        return Batch(case.inputs, case.target, case.loss_fn, getattr(case.loss_fn, "__name__", "loss"), kwargs=case.kwargs)

    module = builtin_case(name, batch=1, seed=seed).module
    return UserModel(name, module, "built in", make, make)
