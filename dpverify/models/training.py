"""A training run to check, as data: the optimizer, and several steps of a scenario.

An ``OptimizerSpec`` is an optimizer factory that prints as a line a person can paste,
pickles, and parses from the command line's short spelling (``sgd:lr=0.1,momentum=0.9``).
A ``TrainingScenario`` runs a generated scenario for a few optimizer steps, each on a batch
of its own, on any backend: a ``Scenario`` under DDP (or DataParallel, ``dp=True``), a
``ShardedScenario`` under its layout's backend (FSDP2, tensor parallel, pipeline). Between
backward and the optimizer step it runs a correct global gradient clip where asked, and,
under DDP, gradient accumulation over micro-batches (``dpverify.models.hooks``); the
training checks of the registry (``CheckSpec.training``) run it: ``Case.from_scenario``
takes its batches and optimizer, ``TrainingScenario.code`` its hook and step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from dpverify.core.errors import InvalidArgument
from dpverify.models.hooks import accumulation_step, global_clip, pipeline_clip
from dpverify.models.layouts import ShardedScenario
from dpverify.models.specs import Scenario

__all__ = ["OPTIMIZERS", "OptimizerSpec", "TrainingScenario"]

#: The optimizers an ``OptimizerSpec`` names: torch's SGD, Adam and AdamW.
OPTIMIZERS: tuple[str, ...] = ("sgd", "adam", "adamw")
_CLASSES: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW,
}
#: The learning rate of a spelling that names none (torch's SGD has no default of its own
#: worth training with; Adam's and AdamW's is 1e-3).
_DEFAULT_LR = {"sgd": 0.1, "adam": 1e-3, "adamw": 1e-3}
_KEYS = ("lr", "momentum", "weight_decay")


@dataclass(frozen=True)
class OptimizerSpec:
    """One of torch's optimizers with its learning rate, momentum (SGD) and weight decay.

    Attributes:
        name: one of ``OPTIMIZERS``.
        lr: the learning rate.
        momentum: SGD's momentum (0 for Adam and AdamW, whose betas are torch's defaults).
        weight_decay: the weight decay (AdamW's decoupled one for ``adamw``).
    """

    name: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise InvalidArgument(f"name={self.name!r} is not one of {OPTIMIZERS}")
        if not self.lr > 0:
            raise InvalidArgument(f"lr={self.lr!r} must be positive")
        if self.momentum and self.name != "sgd":
            raise InvalidArgument(f"momentum={self.momentum!r} is SGD's; {self.name} takes lr and weight_decay")
        if not 0 <= self.momentum < 1 or self.weight_decay < 0:
            raise InvalidArgument(f"momentum={self.momentum!r} must be in [0, 1) and weight_decay={self.weight_decay!r} at least 0")

    def factory(self) -> Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]:
        """``params -> Optimizer``, picklable, as a report names it: ``SGD(lr=0.1, momentum=0.9)``."""
        keywords: dict[str, float] = {"lr": self.lr}
        keywords |= {"momentum": self.momentum} if self.momentum else {}
        keywords |= {"weight_decay": self.weight_decay} if self.weight_decay else {}
        return functools.partial(_CLASSES[self.name], **keywords)

    def __str__(self) -> str:
        """The command line's spelling, ``sgd:lr=0.1,momentum=0.9`` (what ``parse`` reads)."""
        values = [f"lr={self.lr:g}"] + [f"{key}={getattr(self, key):g}" for key in _KEYS[1:] if getattr(self, key)]
        return f"{self.name}:{','.join(values)}"

    @classmethod
    def parse(cls, text: str, option: str = "--optimizer") -> OptimizerSpec:
        """``NAME[:KEY=VALUE,...]``: a name of ``OPTIMIZERS`` and its ``lr``, ``momentum``
        (SGD) and ``weight_decay``; ``lr`` defaults to 0.1 for SGD and 1e-3 for Adam and AdamW.

        Raises:
            InvalidArgument: another name, key or value; the message names ``option`` and
                says what to write instead.
        """
        name, _, rest = text.partition(":")
        name = name.strip().lower()
        if name not in OPTIMIZERS:
            raise InvalidArgument(
                f"{option} {text!r}: {name!r} is not a built-in optimizer; write one of {', '.join(OPTIMIZERS)} with "
                "KEY=VALUE options (sgd:lr=0.1,momentum=0.9, adam:lr=1e-3), or MODULE:FACTORY, a function params -> Optimizer"
            )
        values: dict[str, float] = {"lr": _DEFAULT_LR[name]}
        for item in filter(None, (part.strip() for part in rest.split(","))):
            key, equals, value = (part.strip() for part in item.partition("="))
            if not equals or key not in _KEYS:
                raise InvalidArgument(
                    f"{option} {text!r}: {item!r} is not one of {', '.join(f'{k}=VALUE' for k in _KEYS)}; for "
                    "other options pass MODULE:FACTORY, a function params -> Optimizer"
                )
            try:
                values[key] = float(value)
            except ValueError:
                raise InvalidArgument(f"{option} {text!r}: {key}={value!r} is not a number") from None
        try:
            return cls(name, **values)
        except InvalidArgument as error:
            raise InvalidArgument(f"{option} {text!r}: {error}") from None


@dataclass(frozen=True)
class TrainingScenario:
    """``steps`` optimizer steps of ``scenario``, on the backend it names (``backend``): DDP
    ranks for a ``Scenario`` (its device count is the world size), DataParallel on its
    devices with ``dp=True``, and for a ``ShardedScenario`` its layout's backend (FSDP2,
    tensor parallel, pipeline).

    Attributes:
        scenario: the model, first batch, loss, devices or ranks, dtype and seed; step
            ``i`` trains on the batch of the same scenario with seed ``seed + i`` (of the
            same shapes: a pipeline stage sizes its buffers on the first).
        optimizer: the optimizer every rank and the single-device run build.
        steps: optimizer steps.
        clip: the global gradient norm clipped to between backward and the optimizer step
            (``Target.after_backward``): ``global_clip``, or for a pipeline
            ``pipeline_clip`` (the stages' tied weights summed first); None for no clip.
        micro_batches: micro-batches each rank accumulates under ``no_sync()`` per optimizer
            step (``accumulation_step``, ``Target.step``); DDP only, 1 for none. (A
            pipeline accumulates over its layout's microbatches; DataParallel, FSDP2 and
            tensor parallelism train each step on the whole batch.)
        dp: train a ``Scenario`` through DataParallel on its devices (virtual where CUDA
            devices are missing) instead of on DDP ranks.
    """

    scenario: Scenario | ShardedScenario = field(default_factory=Scenario)
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    steps: int = 2
    clip: float | None = None
    micro_batches: int = 1
    dp: bool = False

    def __post_init__(self) -> None:
        if self.dp and isinstance(self.scenario, ShardedScenario):
            raise InvalidArgument(f"dp=True trains a Scenario through DataParallel; scenario={self.scenario!r} has a layout of its own backend")
        if self.steps < 1:
            raise InvalidArgument(f"steps={self.steps} must be at least 1")
        if self.clip is not None and not self.clip > 0:
            raise InvalidArgument(f"clip={self.clip!r} must be a positive norm, or None for no clip")
        if self.micro_batches < 1:
            raise InvalidArgument(f"micro_batches={self.micro_batches} must be at least 1")
        if self.micro_batches > 1 and self.backend != "ddp":
            raise InvalidArgument(
                f"micro_batches={self.micro_batches}: accumulation under no_sync() is DDP's; {self.backend} scenarios take 1 "
                "(a pipeline accumulates over its layout's n_microbatches)"
            )
        if self.backend in ("ddp", "fsdp") and self.plain.batch_size < self.micro_batches * self.world_size:
            raise InvalidArgument(
                f"batch_size={self.plain.batch_size} gives some rank fewer rows than its {self.micro_batches} micro-batches "
                f"on {self.world_size} ranks"
            )

    @property
    def plain(self) -> Scenario:
        """The scenario without its layout."""
        return self.scenario.scenario if isinstance(self.scenario, ShardedScenario) else self.scenario

    @property
    def backend(self) -> str:
        """``"dp"``, ``"ddp"``, ``"fsdp"``, ``"tp"`` or ``"pp"``: the backend whose training
        check runs this."""
        if isinstance(self.scenario, ShardedScenario):
            return self.scenario.backend
        return "dp" if self.dp else "ddp"

    @property
    def world_size(self) -> int:
        """Ranks, or DataParallel's devices."""
        return len(self.plain.devices.device_ids)

    def batches(self) -> tuple[tuple[Any, ...], ...]:
        """One ``(inputs, target)`` pair, or ``(inputs, kwargs, target)`` triple, per step."""
        made = []
        for index in range(self.steps):
            built = replace(self.plain, seed=self.plain.seed + index).build()
            made.append((built.inputs, built.kwargs, built.target) if built.kwargs else (built.inputs, built.target))
        return tuple(made)

    def code(self) -> dict[str, Any]:
        """The user's code this scenario runs, by ``Target`` field: ``after_backward`` (the
        clip) and ``step`` (the accumulation), where it has them."""
        found: dict[str, Any] = {}
        if self.clip is not None:
            found["after_backward"] = functools.partial(pipeline_clip if self.backend == "pp" else global_clip, max_norm=self.clip)
        if self.micro_batches > 1:
            found["step"] = functools.partial(accumulation_step, micro_batches=self.micro_batches)
        return found
