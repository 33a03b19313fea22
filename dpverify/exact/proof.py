"""The proof that a step rounds nothing: every operation checked as it runs.

``proving(modules)`` is a ``TorchDispatchMode`` over everything torch computes inside it,
forward, backward and optimizer step alike: each aten operation's result is checked
against its rule (``dpverify.exact.rules``) on the operands it really received. An
operation outside the exact set, or one whose digits do not fit, stops the step with
``InvalidArgument`` naming the operation, where it ran (the module of a forward, the
module whose forward made the autograd node of a backward, or the stage the caller
named) and what to change. What passes is a ``Proof``: how many operations were checked
and how close the tightest came to the significand's width.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from dpverify.core.errors import InvalidArgument
from dpverify.exact.grid import precision
from dpverify.exact.rules import IGNORED_NAMESPACES, Need, Refused, rule_of
from dpverify.exact.rules import bits as needed_bits

__all__ = ["EXACT_SET", "Proof", "Prover", "proving"]

#: What exact mode runs, as the refusals word it.
EXACT_SET = (
    "Linear, Conv, ReLU, LeakyReLU with a dyadic slope, max pooling, average pooling over power-of-two "
    "windows, Embedding, residual adds, concatenation, and sums or means over power-of-two counts (MSE, L1), "
    "with SGD (learning rate, momentum and weight decay short dyadic numbers such as 2**-3)"
)

_LABEL = "dpverify_module"


@dataclass(frozen=True)
class Proof:
    """What ``proving`` established: ``operations`` arithmetic operations ran, each exact,
    the tightest using ``bits`` of its result's ``precision`` significand bits (``where``)."""

    operations: int
    bits: int
    precision: int
    where: str

    def describe(self) -> str:
        if not self.operations:
            return "no arithmetic operation ran"
        return (
            f"every one of {self.operations} arithmetic operations is exact; the tightest, {self.where}, needs "
            f"{self.bits} of {self.precision} significand bits"
        )


class Prover(TorchDispatchMode):
    """Checks each operation torch runs (see the module docstring); ``names`` maps the
    modules to name (by identity) to their paths."""

    def __init__(self, names: Mapping[int, str]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.names = dict(names)
        self.stack: list[str] = []
        self.stage: str | None = None
        self.operations = 0
        self.tightest: tuple[int, int, str] = (0, 53, "")
        self.refusal: InvalidArgument | None = None

    # -- where an operation runs

    def where(self) -> str:
        node = torch._C._current_autograd_node()
        if node is not None:
            module = _metadata(node).get(_LABEL)
            inside = f"the backward of {module}" if module else f"the backward of the loss ({node.name()})"
            return inside
        if self.stack:
            return f"the forward of {self.stack[-1]}"
        return self.stage or "the loss or the code around the model"

    def name_of(self, module: nn.Module) -> str:
        path = self.names.get(id(module))
        kind = type(module).__name__
        return f"module {path!r} ({kind})" if path else f"the model ({kind})" if path == "" else kind

    def enter(self, module: nn.Module, args: Any) -> None:
        self.stack.append(self.name_of(module))

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        name = self.stack.pop() if self.stack else self.name_of(module)
        label_nodes(output, name)

    # -- the check

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs or {})
        out = func(*args, **kwargs)
        if self.refusal is None and func.namespace not in IGNORED_NAMESPACES and _floating(out):
            self.check(func, args, kwargs, out)
        return out

    def check(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        rule = rule_of(func) if func.namespace == "aten" else None
        name = f"{func.namespace}.{func.overloadpacket.__name__}"
        if rule is None:
            self.refuse(f"{name} in {self.where()} is outside the exact set: exact mode runs {EXACT_SET}. Replace it, or check without exact=True")
        try:
            needs = rule(func, args, kwargs, out)  # type: ignore[misc]
        except Refused as refused:
            self.refuse(f"{name} in {self.where()} cannot be exact: {refused}")
        self.operations += 1
        for need in needs:
            self.fits(need, name)

    @staticmethod
    def paused() -> contextlib.AbstractContextManager[Any]:
        """Runs what is inside unchecked: the caller's own measurements."""
        return _disable_current_modes()

    def require(self, need: Need, name: str) -> None:
        """Checks a requirement the caller derived itself (a sum it forms in one order,
        which another implementation may form in any other), as an operation ``name``."""
        self.operations += 1
        self.fits(need, name)

    def fits(self, need: Need, name: str) -> None:
        if need.lowest is None or need.bound == 0 or not need.dtype.is_floating_point:
            return
        width = precision(need.dtype)
        if not math.isfinite(need.bound):
            self.refuse(f"{name} in {self.where()} overflows: exact mode needs finite values")
        bits = needed_bits(need)
        if bits > self.tightest[0]:
            self.tightest = (bits, width, f"{name} in {self.where()}")
        if bits > width:
            self.refuse(
                f"{name} in {self.where()} needs {bits} significand bits to be exact and {need.dtype} has {width}: "
                "the model is too deep or too wide for exact arithmetic, or has trained too many steps (each layer "
                "adds the bits of its weights and of its width, each optimizer step the bits of the gradient to the "
                "weights); use fewer or narrower layers, fewer steps, or check without exact=True"
            )
        if need.lowest < math.frexp(torch.finfo(need.dtype).smallest_normal)[1] - width:
            self.refuse(f"{name} in {self.where()} reaches below the smallest normal number of {need.dtype}")

    def refuse(self, message: str) -> None:
        self.refusal = InvalidArgument(f"exact=True: {message}")
        raise self.refusal from None

    def proof(self) -> Proof:
        bits, width, where = self.tightest
        return Proof(self.operations, bits, width, where)


def label_nodes(output: Any, name: str) -> None:
    """Marks the autograd nodes behind ``output`` that no inner module claimed with
    ``name``, so that a backward operation can say whose forward made it."""
    pending = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
    seen: set[int] = set()
    while pending:
        node = pending.pop()
        if node is None or id(node) in seen or type(node).__name__ == "AccumulateGrad":
            continue
        seen.add(id(node))
        labels = _metadata(node)
        if _LABEL in labels:
            continue
        labels[_LABEL] = name
        pending.extend(next_node for next_node, _ in node.next_functions if next_node is not None)


def _metadata(node: Any) -> dict[str, Any]:
    """An autograd node's own dictionary (a property at run time, typed as a method)."""
    found = getattr(node, "metadata", None)
    return found if isinstance(found, dict) else {}


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _floating(out: Any) -> bool:
    return any(t.is_floating_point() for t in _tensors(out))


@contextlib.contextmanager
def proving(modules: Mapping[str, nn.Module] | nn.Module, *, stage: str | None = None) -> Iterator[Prover]:
    """Checks every operation run inside as exact (``Prover``); ``modules``: the models
    whose submodules refusals name, by path (a prefix per model); ``stage``: what code
    outside every module is (``prover.stage`` may change it).

    Raises:
        InvalidArgument: an operation is outside the exact set or its digits do not fit.
    """
    roots = {"": modules} if isinstance(modules, nn.Module) else dict(modules)
    names = {id(m): f"{prefix}.{path}".strip(".") if prefix else path for prefix, root in roots.items() for path, m in root.named_modules()}
    prover = Prover(names)
    prover.stage = stage
    before = nn.modules.module.register_module_forward_pre_hook(prover.enter)
    after = nn.modules.module.register_module_forward_hook(prover.leave)
    try:
        with prover:
            yield prover
    except Exception as error:
        if prover.refusal is not None and error is not prover.refusal:
            raise prover.refusal from None
        raise
    finally:
        before.remove()
        after.remove()
