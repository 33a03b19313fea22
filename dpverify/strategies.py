"""Hypothesis strategies for data-parallel scenarios.

Every strategy draws frozen, picklable data (``ModelSpec``, ``LossSpec``, ``DeviceList``,
``Scenario``) whose ``repr`` is a line a person can paste into a script; ``build`` turns it
into modules and tensors deterministically. Shrinking ends on the simplest model (one
``Linear`` layer), the smallest batch, the fewest devices and seed 0 that still fail.

A bad argument raises ``dpverify.InvalidArgument`` (also Hypothesis's ``InvalidArgument``):
eagerly when the strategy is made, or when a value drawn from a strategy argument cannot be
used.

Example::

    from hypothesis import given
    import dpverify
    from dpverify.strategies import scenarios

    @given(scenarios())
    def test_my_model(scenario):
        s = scenario.build()
        dpverify.assert_dp_grads_match(s.module, s.inputs, s.target, loss_fn=s.loss_fn,
                                       device_ids=s.device_ids, forward_kwargs=s.kwargs)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypeVar

import torch
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from dpverify.core.devices import cuda_device_count
from dpverify.core.errors import InvalidArgument
from dpverify.core.validation import require_bool, require_instance, require_int_at_least
from dpverify.models.specs import (
    ACTIVATIONS,
    CLASSIFICATION_LOSSES,
    KINDS,
    LOSSES,
    POOLINGS,
    BuiltScenario,
    DeviceList,
    LossSpec,
    ModelSpec,
    Scenario,
)

__all__ = [
    "LOSSES",
    "BuiltScenario",
    "DeviceList",
    "LossSpec",
    "ModelSpec",
    "Scenario",
    "batch_sizes",
    "device_lists",
    "dtypes",
    "loss_specs",
    "model_specs",
    "scenarios",
]

T = TypeVar("T")


def _drawn(value: object, name: str, expected: type[T]) -> T:
    """``value`` (given, or drawn from a strategy argument) when it is an ``expected``."""
    return require_instance(value, name, expected, alternative="a strategy of them")


def _value_or_strategy(value: T | SearchStrategy[T], name: str, expected: type[T]) -> SearchStrategy[T]:
    if isinstance(value, SearchStrategy):
        return value  # drawn values are checked where they are drawn
    if value is None:
        raise InvalidArgument(f"{name}=None: pass a value or a strategy")
    return st.just(_drawn(value, name, expected))


def _subset(name: str, value: Iterable[str], allowed: Sequence[str], hint: str) -> tuple[str, ...]:
    """``value`` as a tuple, when it is a non-empty collection of names from ``allowed``.

    A bare string is refused rather than read as its characters.
    """
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise InvalidArgument(f"{name}={value!r}: {hint}")
    chosen = tuple(value)
    if not chosen or any(item not in allowed for item in chosen):
        raise InvalidArgument(f"{name}={list(chosen)!r}: {hint}")
    return chosen


def model_specs(
    *,
    kinds: Sequence[str] | None = None,
    exact: bool = False,
    max_features: int = 4,
    max_hidden: int = 8,
    max_depth: int = 2,
) -> SearchStrategy[ModelSpec]:
    """Small architectures from ``KINDS``.

    Args:
        kinds: restrict to these kinds (default: all of ``KINDS``).
        exact: only models DataParallel must reproduce exactly: batch-independent,
            deterministic, and not computing the loss in forward (BatchNorm and dropout
            then come in eval mode).
        max_features: largest input width.
        max_hidden: largest hidden width.
        max_depth: most hidden layers, blocks or recurrent layers.

    Shrinks toward ``ModelSpec(kind='linear')`` with the smallest widths.
    """
    chosen = KINDS if kinds is None else _subset("kinds", kinds, KINDS, f"choose a non-empty subset of {KINDS}")
    require_bool(exact, "exact")
    for name, value in (("max_features", max_features), ("max_hidden", max_hidden), ("max_depth", max_depth)):
        require_int_at_least(value, name, 1)
    if exact:
        chosen = tuple(k for k in chosen if k != "loss-head")
        if not chosen:
            raise InvalidArgument("kinds=['loss-head'] with exact=True leaves nothing to draw")
    # simplest first, whatever order the caller gave
    ordered = [k for k in KINDS if k in chosen]
    return st.builds(
        ModelSpec,
        kind=st.sampled_from(ordered),
        features=st.integers(1, max_features),
        hidden=st.integers(1, max_hidden),
        outputs=st.integers(1, 3),
        depth=st.integers(1, max_depth),
        activation=st.sampled_from(ACTIVATIONS),
        pooling=st.sampled_from(POOLINGS),
        train=st.just(False) if exact else st.booleans().map(lambda b: not b),
        p=st.sampled_from([0.5, 0.1, 0.9]),
    )


@st.composite
def _batch_sizes(draw: st.DrawFn, n_devices: SearchStrategy[int], max_size: int) -> int:
    n = require_int_at_least(draw(n_devices), "n_devices", 1)
    options = [st.just(1)]
    if n > 1:
        options.append(st.integers(1, min(n - 1, max_size)))  # fewer rows than devices
    if n <= max_size:
        options.append(st.integers(1, max_size // n).map(lambda k: k * n))  # equal chunks
    if n > 1 and n + 1 <= max_size:
        options.append(st.integers(n + 1, max_size).filter(lambda b: b % n != 0))  # uneven
    # more rows than devices, yet fewer chunks than devices (5 rows on 4 devices: [2, 2, 1])
    fewer_chunks = [b for b in range(n + 1, max_size + 1) if -(-b // -(-b // n)) < n]
    if fewer_chunks:
        options.append(st.sampled_from(fewer_chunks))
    options.append(st.integers(1, max_size))
    return draw(st.one_of(options))


def batch_sizes(n_devices: int | SearchStrategy[int] = 2, *, max_size: int = 16) -> SearchStrategy[int]:
    """Batch sizes biased toward the interesting splits for ``n_devices`` devices.

    One row; fewer rows than devices (idle devices); a multiple of the device count (equal
    chunks); not a multiple (uneven chunks); more rows than devices that still make fewer
    chunks than devices (5 rows on 4 devices: [2, 2, 1]); and any size up to ``max_size``.
    Shrinks toward 1.
    """
    require_int_at_least(max_size, "max_size", 1)
    if not isinstance(n_devices, SearchStrategy):
        require_int_at_least(n_devices, "n_devices", 1)
    return _batch_sizes(_value_or_strategy(n_devices, "n_devices", int), max_size)


def device_lists(*, min_devices: int = 1, max_devices: int = 4) -> SearchStrategy[DeviceList]:
    """Device ids for DataParallel, with an output device drawn from them (or the default).

    Subsets and orders of the visible CUDA devices when at least ``min_devices`` are
    visible, virtual ids ``0 .. max_devices - 1`` otherwise. Shrinks toward
    ``DeviceList((0,) * min_devices ...)`` in natural order with the default output device.
    """
    require_int_at_least(min_devices, "min_devices", 1)
    require_int_at_least(max_devices, "max_devices", min_devices)
    visible = cuda_device_count()
    if visible >= min_devices:
        pool, most = list(range(visible)), min(max_devices, visible)
    else:
        pool, most = list(range(max_devices)), max_devices

    @st.composite
    def draw_list(draw: st.DrawFn) -> DeviceList:
        n = draw(st.integers(min_devices, most))
        order = draw(st.permutations(pool))
        ids = tuple(order[:n])
        # the default, device_ids[0] named explicitly, or another device: a third each
        others = [st.sampled_from(ids[1:])] if len(ids) > 1 else []
        output = draw(st.one_of(st.none(), st.just(ids[0]), *others))
        return DeviceList(ids, output)

    return draw_list()


def loss_specs(*, names: Sequence[str] | None = None, reductions: Sequence[str] = ("mean", "sum")) -> SearchStrategy[LossSpec]:
    """Losses from ``LOSSES`` with mean or sum reduction. Shrinks toward mean MSE."""
    chosen = LOSSES if names is None else _subset("names", names, LOSSES, f"choose a non-empty subset of {LOSSES}")
    reductions = _subset("reductions", reductions, ("mean", "sum"), "choose from 'mean' and 'sum'")
    return st.builds(
        LossSpec,
        name=st.sampled_from([n for n in LOSSES if n in chosen]),
        reduction=st.sampled_from([r for r in ("mean", "sum") if r in reductions]),
    )


def dtypes(*, bfloat16: bool = False, float16: bool = False) -> SearchStrategy[torch.dtype]:
    """float32 and float64, and the 16-bit dtypes when asked. Shrinks toward float32.

    Args:
        bfloat16: also draw ``torch.bfloat16``.
        float16: also draw ``torch.float16``.
    """
    require_bool(bfloat16, "bfloat16")
    require_bool(float16, "float16")
    options = [torch.float32, torch.float64]
    options += [torch.bfloat16] if bfloat16 else []
    options += [torch.float16] if float16 else []
    return st.sampled_from(options)


@st.composite
def _scenarios(
    draw: st.DrawFn,
    models: SearchStrategy[ModelSpec],
    devices: SearchStrategy[DeviceList],
    losses: SearchStrategy[LossSpec],
    dtype_strategy: SearchStrategy[torch.dtype],
    max_batch: int,
    seeds: SearchStrategy[int],
) -> Scenario:
    # a strategy argument is only known by what it draws: check each value before use, so a
    # wrong one is an InvalidArgument naming the argument, not an AttributeError later
    model = _drawn(draw(models), "models", ModelSpec)
    device_list = _drawn(draw(devices), "devices", DeviceList)
    batch = draw(batch_sizes(len(device_list.device_ids), max_size=max_batch))
    loss = _drawn(draw(losses), "losses", LossSpec)
    if loss.name in CLASSIFICATION_LOSSES and model.output_dim < 2:
        loss = LossSpec("mse", loss.reduction)  # one logit is no classifier
    dtype = _drawn(draw(dtype_strategy), "dtype", torch.dtype)
    return Scenario(model, batch, device_list, loss, dtype, draw(seeds))


def scenarios(
    *,
    models: ModelSpec | SearchStrategy[ModelSpec] | None = None,
    devices: DeviceList | SearchStrategy[DeviceList] | None = None,
    losses: LossSpec | SearchStrategy[LossSpec] | None = None,
    dtype: torch.dtype | SearchStrategy[torch.dtype] | None = None,
    max_batch: int = 12,
) -> SearchStrategy[Scenario]:
    """Whole scenarios: a model, devices, a batch size biased for them, a loss, a dtype, a seed.

    Each of ``models``, ``devices``, ``losses`` and ``dtype`` takes a value or a strategy
    (defaults: ``model_specs()``, ``device_lists()``, ``loss_specs()``, ``dtypes()``). ``scenario.build()`` gives the
    module, inputs, keyword inputs, target, loss function and device ids. Shrinks toward
    one Linear layer, batch 1, one device, mean MSE, float32 and seed 0.
    """
    require_int_at_least(max_batch, "max_batch", 1)
    return _scenarios(
        model_specs() if models is None else _value_or_strategy(models, "models", ModelSpec),
        device_lists() if devices is None else _value_or_strategy(devices, "devices", DeviceList),
        loss_specs() if losses is None else _value_or_strategy(losses, "losses", LossSpec),
        dtypes() if dtype is None else _value_or_strategy(dtype, "dtype", torch.dtype),
        max_batch,
        st.integers(0, 2**16),
    )
