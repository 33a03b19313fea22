"""Hypothesis strategies for data-parallel scenarios.

Every strategy draws frozen, picklable data (``ModelSpec``, ``LossSpec``, ``DeviceList``,
``Scenario``) whose ``repr`` is a line a person can paste into a script; ``build`` turns it
into modules and tensors deterministically (a ``DataScenario``, a data path, builds its
dataset, loader factory and model). Shrinking ends on the simplest model (one
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

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any, TypeVar, cast

import torch
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy
from torch import nn

from dpverify.core.devices import cuda_device_count
from dpverify.core.errors import InvalidArgument
from dpverify.core.text import plural
from dpverify.core.validation import require_bool, require_instance, require_int_at_least
from dpverify.models.data import DataScenario
from dpverify.models.layouts import (
    BACKENDS,
    SCHEDULES,
    FSDPLayout,
    PipelineLayout,
    ShardedScenario,
    TPLayout,
    even_split_points,
    linear_pairs,
    microbatch_counts,
    read_without_forward,
)
from dpverify.models.specs import (
    ACTIVATIONS,
    CLASSIFICATION_LOSSES,
    EXACT_ACTIVATIONS,
    EXACT_KINDS,
    KINDS,
    LOSSES,
    PADDING_SIDES,
    POOLINGS,
    SHARDED_KINDS,
    TOKEN_KINDS,
    BuiltScenario,
    DeviceList,
    LossSpec,
    ModelSpec,
    Scenario,
    TokenBatch,
    TokenScenario,
)
from dpverify.models.training import OPTIMIZERS, OptimizerSpec, TrainingScenario

__all__ = [
    "EXACT_BACKEND_KINDS",
    "EXACT_KINDS",
    "EXACT_LIMITS",
    "HF_FAMILIES",
    "LOSSES",
    "OPTIMIZERS",
    "PADDING_SIDES",
    "SCHEDULES",
    "SHARDED_KINDS",
    "TOKEN_KINDS",
    "BuiltScenario",
    "DataScenario",
    "DeviceList",
    "FSDPLayout",
    "LossSpec",
    "ModelSpec",
    "OptimizerSpec",
    "PipelineLayout",
    "Scenario",
    "ShardedScenario",
    "TPLayout",
    "TokenBatch",
    "TokenScenario",
    "TrainingScenario",
    "batch_sizes",
    "data_scenarios",
    "device_lists",
    "dtypes",
    "exact_scenarios",
    "fsdp_layouts",
    "hf_configs",
    "loss_specs",
    "model_specs",
    "optimizer_specs",
    "pipeline_layouts",
    "scenarios",
    "sharded_scenarios",
    "token_batches",
    "token_scenarios",
    "tp_layouts",
    "training_scenarios",
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


def _n_devices(value: int | SearchStrategy[int]) -> SearchStrategy[int]:
    """A device-count argument as a strategy (drawn counts are checked where drawn)."""
    return value if isinstance(value, SearchStrategy) else st.just(require_int_at_least(value, "n_devices", 1))


def _subset(name: str, value: Iterable[T], allowed: Sequence[T] | Callable[[T], bool], hint: str) -> tuple[T, ...]:
    """``value`` as a tuple, when it is a non-empty collection of items from ``allowed`` (or
    that ``allowed`` accepts). A bare string is refused rather than read as its characters.
    """
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise InvalidArgument(f"{name}={value!r}: {hint}")
    chosen = tuple(value)
    accepts = allowed if callable(allowed) else allowed.__contains__
    if not chosen or not all(accepts(item) for item in chosen):
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
        kinds: restrict to these kinds (default: all of ``KINDS``). The language-model
            heads of ``TOKEN_KINDS`` are drawn only when named here (their batches come
            from ``token_batches``; ``token_scenarios`` pairs the two).
        exact: only models DataParallel must reproduce exactly: batch-independent,
            deterministic, and not computing the loss in forward (BatchNorm and dropout
            then come in eval mode).
        max_features: largest input width.
        max_hidden: largest hidden width.
        max_depth: most hidden layers, blocks or recurrent layers.

    Shrinks toward ``ModelSpec(kind='linear')`` with the smallest widths.
    """
    allowed = KINDS + TOKEN_KINDS + SHARDED_KINDS + EXACT_KINDS
    chosen = KINDS if kinds is None else _subset("kinds", kinds, allowed, f"choose a non-empty subset of {allowed}")
    require_bool(exact, "exact")
    for name, value in (("max_features", max_features), ("max_hidden", max_hidden), ("max_depth", max_depth)):
        require_int_at_least(value, name, 1)
    if exact:
        losing = tuple(k for k in chosen if k == "loss-head" or k in TOKEN_KINDS)
        chosen = tuple(k for k in chosen if k not in losing)
        if not chosen:
            raise InvalidArgument(f"kinds={list(losing)!r} with exact=True leaves nothing to draw")
    # simplest first, whatever order the caller gave
    ordered = [k for k in allowed if k in chosen]
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
    return _batch_sizes(_n_devices(n_devices), max_size)


def device_lists(*, min_devices: int = 1, max_devices: int = 4) -> SearchStrategy[DeviceList]:
    """Device ids for DataParallel, with an output device drawn from them (or the default).

    Subsets and orders of the visible CUDA devices when at least ``min_devices`` are
    visible; else virtual ids from ``0 .. max_devices - 1``, and on a machine with fewer
    CUDA devices than ``min_devices`` (but some) the first ``n`` of them in any order, the
    only virtual ids a check accepts beside real devices. Shrinks toward
    ``DeviceList((0,) * min_devices ...)`` in natural order with the default output device.
    """
    require_int_at_least(min_devices, "min_devices", 1)
    require_int_at_least(max_devices, "max_devices", min_devices)
    visible = cuda_device_count()
    if visible >= min_devices:
        pool, most = list(range(visible)), min(max_devices, visible)
    else:
        pool, most = list(range(max_devices)), max_devices
    dense = 0 < visible < min_devices

    @st.composite
    def draw_list(draw: st.DrawFn) -> DeviceList:
        n = draw(st.integers(min_devices, most))
        order = draw(st.permutations(pool[:n] if dense else pool))
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


#: The ignore indices ``token_batches`` draws by default: torch's and Hugging Face's -100,
#: and two that tokenizers and hand-written loops use (a pad id of 0, -1).
IGNORE_INDICES: tuple[int, ...] = (-100, 0, -1)


def _equal_token_lengths(
    draw: st.DrawFn, sizes: list[int], seq_len: int, side: str, causal: bool, all_padding_rows: bool,
) -> list[int] | None:
    """Row lengths that give every chunk of ``sizes`` rows the same number of counted
    tokens (uneven chunks too), or None when no such count fits."""
    cap = seq_len - 1 if causal else seq_len  # the most tokens one row can count
    # the fewest one row counts: a row without real tokens needs all_padding_rows, and a
    # right-padded causal row of one real token counts none
    least = 0 if all_padding_rows or (causal and side == "right") else 1
    low, high = max(1, max(sizes) * least), min(sizes) * cap
    if low > high:
        return None
    total = draw(st.integers(low, high), label="tokens per chunk")
    counted: list[int] = []
    for size in sizes:
        row_counts, left = [least] * size, total - size * least
        for i in range(size):
            row_counts[i] += min(cap - least, left)
            left -= row_counts[i] - least
        counted += row_counts
    # a causal row counts its real tokens but the first: right-padded, one real token more;
    # left-padded, as many (the first label is padding while the row is shorter than seq_len)
    return [c + 1 if causal and side == "right" else c for c in counted]


@st.composite
def _token_batches(
    draw: st.DrawFn,
    n_devices: SearchStrategy[int],
    causal: bool,
    max_rows: int,
    max_seq_len: int,
    sides: tuple[str, ...],
    ignores: tuple[int, ...],
    all_padding_rows: bool,
    empty_chunks: bool,
) -> TokenBatch:
    from dpverify.core.scatter import chunk_sizes

    n = require_int_at_least(draw(n_devices), "n_devices", 1)
    rows = draw(batch_sizes(n, max_size=max_rows), label="rows")
    seq_len = draw(st.integers(2 if causal else 1, max_seq_len), label="seq_len")
    side = draw(st.sampled_from(sides), label="padding_side")
    ignore = draw(st.sampled_from(ignores), label="ignore_index")
    seed = draw(st.integers(0, 2**16), label="seed")
    sizes = chunk_sizes(rows, n)
    equal = None
    if len(sizes) > 1 and draw(st.booleans(), label="equal tokens per chunk"):
        equal = _equal_token_lengths(draw, sizes, seq_len, side, causal, all_padding_rows)
    if equal is not None:
        return TokenBatch(tuple(equal), seq_len, side, ignore, seed)
    # drawn as padding per row, so that shrinking removes padding
    most = seq_len if all_padding_rows else seq_len - 1
    padding = draw(st.lists(st.integers(0, most), min_size=rows, max_size=rows), label="padding")
    lengths = [seq_len - p for p in padding]
    batch = TokenBatch(tuple(lengths), seq_len, side, ignore, seed)
    if not empty_chunks:
        # a chunk with no token to average over would make its replica's loss NaN (0/0):
        # its first row loses its padding instead (seq_len >= 2 for a causal head, so a full
        # row counts at least one token)
        start = 0
        for size, count in zip(sizes, batch.chunk_counts(n, causal), strict=True):
            if count == 0:
                lengths[start] = seq_len
            start += size
        batch = replace(batch, lengths=tuple(lengths))
    return batch


def token_batches(
    n_devices: int | SearchStrategy[int] = 1,
    *,
    causal: bool = False,
    max_rows: int = 8,
    max_seq_len: int = 6,
    padding_sides: Sequence[str] = PADDING_SIDES,
    ignore_indices: Iterable[int] = IGNORE_INDICES,
    all_padding_rows: bool = True,
    empty_chunks: bool = False,
) -> SearchStrategy[TokenBatch]:
    """Padded batches of token ids and labels (``TokenBatch``), split over ``n_devices``.

    Draws the rows (``batch_sizes(n_devices)``), the padded length, each row's padding, the
    padding side and the ignore index that marks padding in the labels; ``batch.build()``
    gives ``input_ids`` and ``labels``. Equal chunks of rows then hold different numbers of
    tokens, which makes ``loss.mean()`` of the replicas' token-mean losses biased; about half
    the draws that split into several chunks give every chunk the same number of counted
    tokens instead (uneven chunks of rows included), where ``loss.mean()`` is exact.

    Every chunk holds at least one token a mean loss counts (a label that is not the ignore
    index, after the shift when ``causal``): a mean over no token is NaN, which no weighting
    repairs. Rows without such a token are drawn, never a whole chunk of them (that chunk's
    first row is then unpadded), unless ``empty_chunks=True``.

    Args:
        n_devices: the devices the batch is split over (an int or a strategy of them).
        causal: count as a causal head does, shifted by one (each row's first label is never
            counted); the padded length is then at least 2.
        max_rows: most rows.
        max_seq_len: longest padded length (at least 2 when ``causal``).
        padding_sides: draw from these sides, ``"right"`` and/or ``"left"``.
        ignore_indices: draw the ignore index from these ints (default -100, 0 and -1).
        all_padding_rows: also draw rows of padding only.
        empty_chunks: also draw chunks without a counted token (their loss is NaN).

    Shrinks toward one row of the shortest length without padding, right-padded, the first
    ignore index (-100) and seed 0.
    """
    require_bool(causal, "causal")
    require_int_at_least(max_rows, "max_rows", 1)
    require_int_at_least(max_seq_len, "max_seq_len", 2 if causal else 1)
    sides = _subset("padding_sides", padding_sides, PADDING_SIDES, f"choose a non-empty subset of {PADDING_SIDES}")
    ignores = _subset(
        "ignore_indices", ignore_indices, lambda i: isinstance(i, int) and not isinstance(i, bool),
        "pass a non-empty collection of ints, e.g. (-100, 0, -1)",
    )
    require_bool(all_padding_rows, "all_padding_rows")
    require_bool(empty_chunks, "empty_chunks")
    return _token_batches(
        _n_devices(n_devices), causal, max_rows, max_seq_len,
        tuple(s for s in PADDING_SIDES if s in sides), tuple(dict.fromkeys(ignores)), all_padding_rows,
        empty_chunks,
    )


@st.composite
def _token_scenarios(
    draw: st.DrawFn,
    models: SearchStrategy[ModelSpec],
    devices: SearchStrategy[DeviceList],
    dtype_strategy: SearchStrategy[torch.dtype],
    batches: Callable[[int, bool], SearchStrategy[TokenBatch]],
) -> TokenScenario:
    model = _drawn(draw(models), "models", ModelSpec)
    if model.kind not in TOKEN_KINDS:
        raise InvalidArgument(f"models drew kind={model.kind!r}; token_scenarios needs one of {TOKEN_KINDS}")
    device_list = _drawn(draw(devices), "devices", DeviceList)
    batch = draw(batches(len(device_list.device_ids), model.causal))
    dtype = _drawn(draw(dtype_strategy), "dtype", torch.dtype)
    return TokenScenario(model, batch, device_list, dtype, draw(st.integers(0, 2**16)))


def token_scenarios(
    *,
    models: ModelSpec | SearchStrategy[ModelSpec] | None = None,
    devices: DeviceList | SearchStrategy[DeviceList] | None = None,
    dtype: torch.dtype | SearchStrategy[torch.dtype] | None = None,
    max_rows: int = 8,
    max_seq_len: int = 6,
    padding_sides: Sequence[str] = PADDING_SIDES,
    ignore_indices: Iterable[int] = IGNORE_INDICES,
    all_padding_rows: bool = True,
) -> SearchStrategy[TokenScenario]:
    """A language-model head on a padded token batch and devices (``TokenScenario``).

    ``models`` (default: ``model_specs(kinds=TOKEN_KINDS)``, plain and causal heads),
    ``devices`` (default ``device_lists()``) and ``dtype`` (default ``dtypes()``) take a
    value or a strategy; the batch is ``token_batches`` for the drawn devices, counting as
    the drawn head does (shifted for a causal one), with the other arguments as there: so
    every replica averages over at least one token. ``scenario.build()`` gives the head
    (its ``nn.CrossEntropyLoss`` ignores the batch's ignore index), ``inputs=()`` and the
    keyword inputs ``input_ids`` and ``labels``; ``scenario.token_counts`` are the tokens
    each replica's loss averages over.

    Shrinks toward a plain head of width 1, one device, one unpadded row of one token,
    ignore index -100, float32 and seed 0.
    """
    require_int_at_least(max_seq_len, "max_seq_len", 2)  # a causal head may be drawn

    def batches(n_devices: int, causal: bool) -> SearchStrategy[TokenBatch]:
        return token_batches(
            n_devices, causal=causal, max_rows=max_rows, max_seq_len=max_seq_len,
            padding_sides=padding_sides, ignore_indices=ignore_indices, all_padding_rows=all_padding_rows,
        )

    batches(1, True)  # bad arguments fail now, not at the first draw
    return _token_scenarios(
        model_specs(kinds=TOKEN_KINDS) if models is None else _value_or_strategy(models, "models", ModelSpec),
        device_lists() if devices is None else _value_or_strategy(devices, "devices", DeviceList),
        dtypes() if dtype is None else _value_or_strategy(dtype, "dtype", torch.dtype),
        batches,
    )


# --------------------------------------------------------------------------- sharded layouts

#: The models ``sharded_scenarios("fsdp")`` draws besides ``sequential``: what DDP's
#: properties draw that FSDP2 wraps child by child (no recurrent layers: their flattened
#: weights are not DTensor-aware; no keyword-only or loss-in-forward kinds).
FSDP_KINDS: tuple[str, ...] = ("linear", "mlp", "residual", "layernorm", "conv1d", "embedding", "attention", "tuple-output")


def fsdp_layouts(module: nn.Module) -> SearchStrategy[FSDPLayout]:
    """FSDP2 layouts for ``module``: ``fully_shard`` on the default modules (each child with
    parameters) or on a drawn subset of the modules with parameters in their subtree,
    nested ones included (no ModuleList or ModuleDict, which have no forward for
    ``fully_shard`` to hook, and no module whose parent reads its parameters without calling
    it, as MultiheadAttention's ``out_proj``), with ``reshard_after_forward`` True or False.

    Shrinks toward the default layout with ``reshard_after_forward=True``.
    """
    require_instance(module, "module", nn.Module)
    bypassed = read_without_forward(module)
    names = [
        name for name, sub in module.named_modules()
        if name and any(True for _ in sub.parameters()) and not isinstance(sub, (nn.ModuleList, nn.ModuleDict))
        and name not in bypassed
    ]
    subsets = st.lists(st.sampled_from(names), min_size=1, unique=True).map(tuple) if names else st.nothing()
    return st.builds(
        FSDPLayout,
        shard_modules=st.one_of(st.none(), subsets),
        reshard_after_forward=st.booleans().map(lambda b: not b),
    )


def tp_layouts(module: nn.Module, world_size: int, *, data_parallel: Sequence[int] = (1,)) -> SearchStrategy[TPLayout]:
    """Tensor-parallel plans for ``module``: a non-empty set of non-overlapping
    ``(colwise, rowwise)`` Linear pairs (``linear_pairs``' candidates, also those starting
    at any Linear, not only greedily), on a mesh with ``data_parallel`` groups drawn from
    the values given that divide ``world_size`` (the rest is the tensor-parallel size).

    Shrinks toward the first pair alone, without data parallelism.
    """
    require_instance(module, "module", nn.Module)
    require_int_at_least(world_size, "world_size", 1)
    sizes = [d for d in data_parallel if isinstance(d, int) and d >= 1 and world_size % d == 0]
    if not sizes:
        raise InvalidArgument(f"data_parallel={list(data_parallel)!r}: none divides world_size={world_size}; include 1")

    @st.composite
    def draw_layout(draw: st.DrawFn) -> TPLayout:
        dp = draw(st.sampled_from(sorted(sizes)))
        candidates = _all_linear_pairs(module, world_size // dp)
        if not candidates:
            raise InvalidArgument(f"module has no Linear pair a plan can shard over {world_size // dp} ranks (see linear_pairs)")
        chosen = draw(st.lists(st.sampled_from(candidates), min_size=1, unique=True))
        used: set[str] = set()
        pairs = []
        for pair in sorted(chosen, key=candidates.index):
            if used.isdisjoint(pair):
                pairs.append(pair)
                used.update(pair)
        return TPLayout(tuple(pairs), dp)

    return draw_layout()


def _all_linear_pairs(module: nn.Module, tp_size: int) -> list[tuple[str, str]]:
    """Every pair ``linear_pairs`` could choose, overlapping ones included: the greedy
    pairs of ``module`` and of each of its Sequentials with its first children dropped."""
    found: list[tuple[str, str]] = []
    for prefix, container in module.named_modules():
        if not isinstance(container, nn.Sequential):
            continue
        children = list(container.named_children())
        for start in range(len(children)):
            tail = nn.Sequential(OrderedDict(children[start:]))
            path = f"{prefix}." if prefix else ""
            for first, second in linear_pairs(tail, tp_size)[:1]:
                pair = (path + first, path + second)
                if pair not in found:
                    found.append(pair)
    return found


def pipeline_layouts(n_children: int, world_size: int, batch_size: int, *, schedules: Sequence[str] = SCHEDULES) -> SearchStrategy[PipelineLayout]:
    """Pipelines of ``world_size`` stages over ``n_children`` top-level children: sorted
    split points (every stage at least one child), a schedule from ``schedules``, and a
    microbatch count that cuts ``batch_size`` into equal microbatches (torch's schedules
    need equal shapes), at least one per stage for 1F1B (torch's ``Schedule1F1B`` refuses
    fewer; with no such count for this batch, GPipe is drawn).

    Shrinks toward the even split, GPipe and the most microbatches up to 8.
    """
    require_int_at_least(world_size, "world_size", 1)
    require_int_at_least(n_children, "n_children", world_size)
    require_int_at_least(batch_size, "batch_size", 1)
    chosen = _subset("schedules", schedules, SCHEDULES, f"choose a non-empty subset of {SCHEDULES}")
    counts = microbatch_counts(batch_size, most=min(batch_size, 8))
    enough = {"gpipe": counts, "1f1b": [n for n in counts if n >= world_size]}
    usable = [s for s in SCHEDULES if s in chosen and enough[s]]
    if not usable:
        raise InvalidArgument(
            f"schedules={list(chosen)!r}: 1F1B needs at least {world_size} equal microbatches, which a batch "
            f"of {plural(batch_size, 'row')} cannot give; add 'gpipe' or draw larger batches"
        )
    even = even_split_points(n_children, world_size)
    points = st.lists(st.integers(1, n_children - 1), min_size=world_size - 1, max_size=world_size - 1, unique=True).map(lambda p: tuple(sorted(p)))

    @st.composite
    def draw_layout(draw: st.DrawFn) -> PipelineLayout:
        schedule = draw(st.sampled_from(usable))
        split = draw(st.one_of(st.just(even), points) if world_size > 1 else st.just(()))
        return PipelineLayout(split, draw(st.sampled_from(enough[schedule])), schedule)

    return draw_layout()


@st.composite
def _sharded_scenarios(
    draw: st.DrawFn, backend: str, world_sizes: tuple[int, ...], dtype_strategy: SearchStrategy[torch.dtype], max_batch: int,
) -> ShardedScenario:
    world = draw(st.sampled_from(world_sizes))
    dp = draw(st.sampled_from([1, 2] if backend == "tp" and world % 2 == 0 and world > 2 else [1]))
    tp_size = world // dp
    kind = draw(st.sampled_from(("sequential", *FSDP_KINDS))) if backend == "fsdp" else "sequential"
    depth_min = max(1, -(-(world - 1) // 2)) if backend == "pp" else 1  # 2 * depth + 1 children
    hidden = draw(st.integers(1, 3)) * tp_size if backend == "tp" else draw(st.integers(1, 8))
    model = ModelSpec(
        kind, features=draw(st.integers(1, 4)), hidden=hidden, outputs=draw(st.integers(1, 3)),
        depth=draw(st.integers(depth_min, depth_min + 1)), activation=draw(st.sampled_from(ACTIVATIONS)), train=False,
    )
    rows_needed = world if backend == "fsdp" else dp
    batch = draw(st.integers(rows_needed, max(rows_needed, max_batch)))
    dtype = _drawn(draw(dtype_strategy), "dtype", torch.dtype)
    scenario = Scenario(model, batch, DeviceList(tuple(range(world))), LossSpec("mse"), dtype, draw(st.integers(0, 2**16)))
    module = model.build()
    layout: FSDPLayout | TPLayout | PipelineLayout
    if backend == "fsdp":
        layout = draw(fsdp_layouts(module))
    elif backend == "tp":
        layout = draw(tp_layouts(module, world, data_parallel=(dp,)))
    else:
        layout = draw(pipeline_layouts(len(list(module.children())), world, batch))
    return ShardedScenario(scenario, layout)


def sharded_scenarios(
    backend: str,
    *,
    world_sizes: Sequence[int] = (2,),
    dtype: torch.dtype | SearchStrategy[torch.dtype] | None = None,
    max_batch: int = 8,
) -> SearchStrategy[ShardedScenario]:
    """Scenarios for the sharded checks of ``backend`` (``"fsdp"``, ``"tp"`` or ``"pp"``):
    a model the API accepts, a batch, a mean MSE loss, a dtype, a world size from
    ``world_sizes`` and a layout drawn for them (``fsdp_layouts``, ``tp_layouts`` with a
    second, data-parallel mesh dimension of 2 on 4 or more ranks, ``pipeline_layouts``).

    FSDP draws a ``sequential`` model or one of ``FSDP_KINDS`` with at least one row per
    rank (uneven shards included); tensor parallelism a ``sequential`` model whose hidden
    width the tensor-parallel size divides; pipelines a ``sequential`` model with at least
    one child per stage. Shrinks toward the smallest such model on the fewest ranks, with
    the simplest layout, float32 and seed 0.
    """
    if backend not in BACKENDS:
        raise InvalidArgument(f"backend={backend!r} is not one of {BACKENDS}")
    sizes = tuple(require_int_at_least(w, "world_sizes", 1) for w in world_sizes)
    if not sizes:
        raise InvalidArgument("world_sizes=[] is empty; pass at least one world size, e.g. (2,)")
    require_int_at_least(max_batch, "max_batch", 1)
    return _sharded_scenarios(backend, sizes, dtypes() if dtype is None else _value_or_strategy(dtype, "dtype", torch.dtype), max_batch)


# --------------------------------------------------------------------------- training


def optimizer_specs(*, names: Sequence[str] = OPTIMIZERS) -> SearchStrategy[OptimizerSpec]:
    """torch's optimizers from ``names`` (``OPTIMIZERS``): SGD with and without momentum,
    Adam and AdamW, at learning rates that move a small model visibly in a few steps, with
    and without weight decay. Shrinks toward ``OptimizerSpec('sgd', lr=0.1)``."""
    chosen = _subset("names", names, OPTIMIZERS, f"choose a non-empty subset of {OPTIMIZERS}")

    @st.composite
    def draw_spec(draw: st.DrawFn) -> OptimizerSpec:
        name = draw(st.sampled_from([n for n in OPTIMIZERS if n in chosen]))
        decay = draw(st.sampled_from((0.0, 0.01)))
        if name == "sgd":
            return OptimizerSpec(name, draw(st.sampled_from((0.1, 0.01))), draw(st.sampled_from((0.0, 0.9))), decay)
        return OptimizerSpec(name, draw(st.sampled_from((1e-3, 1e-2))), weight_decay=decay)

    return draw_spec()


#: The models a DDP training scenario draws: what DDP reproduces exactly, with a loss outside
#: the forward and no keyword arguments.
_TRAINING_KINDS = tuple(k for k in KINDS if k not in ("kwargs", "loss-head"))
#: The models a DataParallel training scenario draws: those with a loss outside the forward
#: and no state of their own (the counters lose theirs under DataParallel by design, which
#: ``dp-state`` checks and ``dp-training`` rightly reports).
_DP_TRAINING_KINDS = tuple(k for k in KINDS if k not in ("loss-head", "buffer-counter", "attribute-counter"))
#: The backends a training scenario runs on (``TrainingScenario.backend``).
_TRAINING_BACKENDS: tuple[str, ...] = ("dp", "ddp", *BACKENDS)


@st.composite
def _training_scenarios(
    draw: st.DrawFn, backend: str, base: SearchStrategy[Scenario] | SearchStrategy[ShardedScenario], optimizers: SearchStrategy[OptimizerSpec],
    max_steps: int, clip_norms: tuple[float | None, ...], micro_batches: tuple[int, ...],
) -> TrainingScenario:
    scenario = draw(base)
    sharded = backend in BACKENDS
    if not isinstance(scenario, ShardedScenario if sharded else Scenario) or (sharded and scenario.backend != backend):  # type: ignore[union-attr]
        wanted = f"ShardedScenarios of {backend!r}" if sharded else "Scenarios"
        raise InvalidArgument(f"scenarios drew {scenario!r}; training_scenarios({backend!r}) takes {wanted}")
    optimizer = _drawn(draw(optimizers), "optimizers", OptimizerSpec)
    steps = draw(st.integers(1, max_steps))
    clip = draw(st.sampled_from(clip_norms))
    if backend != "ddp":
        return TrainingScenario(scenario, optimizer, steps, clip, dp=backend == "dp")
    assert isinstance(scenario, Scenario)
    # as many micro-batches as every rank has rows for
    world = len(scenario.devices.device_ids)
    fitting = [k for k in micro_batches if scenario.batch_size >= k * world] or [1]
    return TrainingScenario(scenario, optimizer, steps, clip, draw(st.sampled_from(fitting)))


def training_scenarios(
    backend: str = "ddp",
    *,
    scenarios: SearchStrategy[Scenario] | SearchStrategy[ShardedScenario] | None = None,
    optimizers: SearchStrategy[OptimizerSpec] | None = None,
    max_steps: int = 3,
    clip_norms: Sequence[float | None] = (None, 0.05, 1.0),
    micro_batches: Sequence[int] = (1, 2),
    world_sizes: Sequence[int] = (2,),
) -> SearchStrategy[TrainingScenario]:
    """Training runs for the training checks of ``backend``
    (``"dp"``, ``"ddp"``, ``"fsdp"``, ``"tp"``, ``"pp"``): a scenario from ``scenarios``,
    its device count the world size; an optimizer from ``optimizers`` (default
    ``optimizer_specs()``); 1 to ``max_steps`` optimizer steps, each on a batch of its own;
    a global gradient clip to a norm from ``clip_norms`` (None: no clip; a pipeline's sums
    its tied weights over their stages first, ``pipeline_clip``); and, for DDP, gradient
    accumulation under ``no_sync()`` over a number of micro-batches from ``micro_batches``
    that every rank has rows for (1 where none fits; the other backends take 1: a pipeline
    accumulates over its layout's microbatches, DataParallel has no ``no_sync()``).

    The default scenarios, on a world size from ``world_sizes``: DataParallel, a model
    without state of its own and with a loss outside the forward, that train mode does not
    make diverge, on 2 to the largest of ``world_sizes`` devices; DDP, such a model without
    keyword arguments, a mean loss and a row for each rank; ``sharded_scenarios(backend,
    world_sizes=world_sizes)`` for the others, half the pipelines' models tying their first
    child's embedding to their last child's output projection (``tied-sequential``).

    Shrinks toward the simplest scenario, one step of ``OptimizerSpec('sgd', lr=0.1)``, and
    the first of ``clip_norms`` and of ``micro_batches``.
    """
    if backend not in _TRAINING_BACKENDS:
        raise InvalidArgument(f"backend={backend!r}: training scenarios run on one of {_TRAINING_BACKENDS}")
    require_int_at_least(max_steps, "max_steps", 1)
    clips = tuple(clip_norms)
    if not clips or any(c is not None and not (isinstance(c, (int, float)) and c > 0) for c in clips):
        raise InvalidArgument(f"clip_norms={list(clips)!r} must be a non-empty list of positive norms or None")
    ks = tuple(require_int_at_least(k, "micro_batches", 1) for k in micro_batches)
    if not ks:
        raise InvalidArgument("micro_batches=[] is empty; pass counts of at least 1, e.g. (1, 2)")
    sizes = tuple(require_int_at_least(w, "world_sizes", 1) for w in world_sizes)
    if not sizes:
        raise InvalidArgument("world_sizes=[] is empty; pass at least one world size, e.g. (2,)")
    if scenarios is None:
        scenarios = _default_training_scenarios(backend, sizes)
    elif not isinstance(scenarios, SearchStrategy):
        wanted = "ShardedScenario" if backend in BACKENDS else "Scenario"
        raise InvalidArgument(f"scenarios={scenarios!r} must be a strategy of {wanted}s")
    return _training_scenarios(backend, scenarios, optimizer_specs() if optimizers is None else optimizers, max_steps, clips, ks)


def _tied_pipelines(pipelines: SearchStrategy[ShardedScenario]) -> SearchStrategy[ShardedScenario]:
    """Pipeline scenarios of ``sequential`` models (``sharded_scenarios("pp")``), and as
    many with the model made ``tied-sequential``: as many children (the layout stands), the
    first an embedding whose weight the last, the output projection, shares, so that the
    first and the last stage each train a copy. Shrinks toward the untied model."""
    def tie(scenario: ShardedScenario) -> ShardedScenario:
        plain = scenario.scenario
        if plain.model.kind != "sequential":
            raise InvalidArgument(f"_tied_pipelines takes sequential models; drew {plain.model!r}")
        return replace(scenario, scenario=replace(plain, model=replace(plain.model, kind="tied-sequential")))

    return st.one_of(pipelines, pipelines.map(tie))


def _default_training_scenarios(backend: str, world_sizes: tuple[int, ...]) -> SearchStrategy[Scenario] | SearchStrategy[ShardedScenario]:
    """``training_scenarios``' default scenarios of ``backend`` (its docstring says which)."""
    if backend == "pp":
        return _tied_pipelines(sharded_scenarios("pp", world_sizes=world_sizes))
    if backend in BACKENDS:
        return sharded_scenarios(backend, world_sizes=world_sizes)
    if backend == "dp":
        devices = device_lists(min_devices=min(2, max(world_sizes)), max_devices=max(world_sizes))
        return scenarios(models=model_specs(kinds=_DP_TRAINING_KINDS, exact=True), devices=devices)

    @st.composite
    def ranked(draw: st.DrawFn) -> Scenario:
        world = draw(st.sampled_from(world_sizes))
        drawn = draw(scenarios(
            models=model_specs(kinds=_TRAINING_KINDS, exact=True), devices=DeviceList(tuple(range(world))),
            losses=loss_specs(reductions=("mean",)), max_batch=max(8, 2 * world),
        ))
        return replace(drawn, batch_size=max(drawn.batch_size, world))

    return ranked()


# --------------------------------------------------------------------------- data path


@st.composite
def _data_scenarios(draw: st.DrawFn, world_sizes: tuple[int, ...], max_size: int, max_batch: int, max_epochs: int) -> DataScenario:
    world = draw(st.sampled_from(world_sizes), label="world_size")
    # the splits that matter for a sampler are the ones that matter for a batch
    size = draw(batch_sizes(world, max_size=max_size), label="size")
    return DataScenario(
        size=size,
        world_size=world,
        batch_size=draw(st.integers(1, max_batch), label="batch_size"),
        drop_last=draw(st.booleans(), label="drop_last"),
        loader_drop_last=draw(st.booleans(), label="loader_drop_last"),
        shuffle=draw(st.booleans(), label="shuffle"),
        seed=draw(st.integers(0, 2**16), label="seed"),
        epochs=draw(st.integers(1, max_epochs), label="epochs"),
    )


def data_scenarios(
    *, world_sizes: Sequence[int] = (2, 3, 4), max_size: int = 12, max_batch: int = 4, max_epochs: int = 3,
) -> SearchStrategy[DataScenario]:
    """Data paths for the data-path and metric checks (``DataScenario``): a world size from
    ``world_sizes``; a dataset size biased as ``batch_sizes`` biases a batch for that many
    ranks (one sample, fewer samples than ranks, a multiple of the world size, not a
    multiple, any size up to ``max_size``); a batch size up to ``max_batch``; the
    ``DistributedSampler``'s ``drop_last`` and shuffle, the DataLoader's ``drop_last``; a
    seed; 1 to ``max_epochs`` epochs. ``scenario.dataset()``, ``scenario.loader_factory()``
    and ``scenario.model()`` build the rest.

    Shrinks toward one sample on the smallest world size, batch 1, no ``drop_last``, no
    shuffle, seed 0 and one epoch.
    """
    worlds = tuple(sorted({require_int_at_least(w, "world_sizes", 1) for w in _subset(
        "world_sizes", world_sizes, lambda w: isinstance(w, int), "pass a non-empty list of world sizes, e.g. (2, 3, 4)",
    )}))
    for name, value in (("max_size", max_size), ("max_batch", max_batch), ("max_epochs", max_epochs)):
        require_int_at_least(value, name, 1)
    return _data_scenarios(worlds, max_size, max_batch, max_epochs)


# --------------------------------------------------------------------------- exact mode

#: The models ``exact_scenarios`` draws for each backend, simplest first: models of exact
#: mode's set (Linear, Conv with pooling over 2x2 windows, ReLU and LeakyReLU with a dyadic
#: slope, an Embedding summed over its tokens, residual adds, concatenation), as each
#: backend takes them (DDP no keyword arguments; FSDP2 ``FSDP_KINDS``' shapes;
#: tensor parallelism and pipelines a ``sequential`` model).
EXACT_BACKEND_KINDS: dict[str, tuple[str, ...]] = {
    "dp": ("linear", "mlp", "residual", *EXACT_KINDS, "embedding", "tuple-output", "dict-output", "namedtuple-output", "kwargs"),
    "ddp": ("linear", "mlp", "residual", *EXACT_KINDS, "embedding", "tuple-output"),
    "fsdp": ("linear", "sequential", "mlp", "residual", *EXACT_KINDS, "embedding"),
    "tp": ("sequential",),
    "pp": ("sequential",),
}
#: The deepest and widest models exact arithmetic leaves room for at ``dpverify.exact``'s
#: 4 significant bits per element: each Linear adds the bits of its weights to its
#: inputs', a mean squared error doubles them, and float64 has 53. With an L1 loss, two
#: hidden layers stay within about 35 bits; a squared error of two Linear layers in a
#: chain (one hidden layer) within 47, of three (two hidden layers, or a residual block
#: between its stem and head) up to 59, so those are drawn with an L1 loss only.
EXACT_LIMITS: dict[str, int] = {"max_depth": 2, "max_hidden": 8, "max_features": 4, "max_batch": 16}
#: The hidden layers a squared error leaves room for (see ``EXACT_LIMITS``): two Linear
#: layers in a chain.
_SQUARED_DEPTH = 1
#: Models that chain three Linear layers at depth 1 (a residual block between its stem and
#: its head), which a squared error leaves no room for: they take an L1 loss.
_DEEP_KINDS = ("residual",)
#: Output widths: powers of two, so that a mean over the batch's outputs divides by one.
_EXACT_OUTPUTS = (1, 2, 4)
_EXACT_LOSSES = ("mse", "l1")
_RANKED = ("ddp", *BACKENDS)


def _powers_of_two(low: int, high: int) -> list[int]:
    """The powers of two from ``low`` (itself one) to ``high``, smallest first."""
    return [2**k for k in range(low.bit_length() - 1, high.bit_length()) if low <= 2**k <= high]


@st.composite
def _exact_scenarios(
    draw: st.DrawFn, backend: str, worlds: tuple[int, ...], kinds: tuple[str, ...], losses: tuple[str, ...],
    max_features: int, max_hidden: int, max_depth: int, max_batch: int,
) -> Scenario | ShardedScenario:
    world = draw(st.sampled_from(worlds), label="world_size")
    groups = draw(st.sampled_from([1, 2] if backend == "tp" and world >= 4 else [1]), label="data_parallel")
    kind = draw(st.sampled_from(kinds), label="kind")
    # a pipeline needs a child per stage: 2 * depth + 1 children
    least = max(1, -(-(world - 1) // 2)) if backend == "pp" else 1
    # a squared error of a deeper model needs more than float64's bits: L1 goes deeper.
    # Both are drawn whatever the kind, then made to fit, so that every kind draws as many
    # choices and shrinking ends on the first kind, MSE and the shallowest model
    name = draw(st.sampled_from(losses), label="loss")
    if least > _SQUARED_DEPTH or kind in _DEEP_KINDS:
        name = "l1"
    depth = draw(st.integers(least, max(least, max_depth)), label="depth")
    if name != "l1":
        depth = min(depth, _SQUARED_DEPTH)
    per_rank = world // groups if backend == "tp" else 1  # the tensor-parallel size divides the width
    hidden = per_rank * draw(st.integers(1, max(1, max_hidden // per_rank)), label="hidden")
    model = ModelSpec(
        kind, features=draw(st.integers(1, max_features), label="features"), hidden=hidden,
        outputs=draw(st.sampled_from(_EXACT_OUTPUTS), label="outputs"), depth=depth,
        activation=draw(st.sampled_from(EXACT_ACTIVATIONS), label="activation"),
        pooling=draw(st.sampled_from(("sum", "max", "mean") if kind == "conv-pool" else ("sum",)), label="pooling"), train=False,
    )
    # DataParallel takes one loss on the gathered outputs, so any chunks are exact and a sum
    # any batch; a mean divides by the batch's outputs, a power of two. The ranked backends
    # average equal shards' (or microbatches') mean losses: powers of two throughout.
    reduction = draw(st.sampled_from(("mean", "sum") if backend == "dp" else ("mean",)), label="reduction")
    least_rows = world if backend in ("ddp", "fsdp") else groups
    if backend == "dp":
        device_list = _drawn(draw(device_lists(min_devices=world, max_devices=world)), "devices", DeviceList)
        batches = batch_sizes(world, max_size=max_batch) if reduction == "sum" else st.sampled_from(_powers_of_two(1, max_batch))
    else:
        device_list = DeviceList(tuple(range(world)))
        batches = st.sampled_from(_powers_of_two(least_rows, max(least_rows, max_batch)))
    batch = draw(batches, label="batch_size")
    scenario = Scenario(model, batch, device_list, LossSpec(name, reduction), torch.float32, draw(st.integers(0, 2**16), label="seed"))
    if backend in ("dp", "ddp"):
        return scenario
    module = model.build()
    layout: FSDPLayout | TPLayout | PipelineLayout
    if backend == "fsdp":
        layout = draw(fsdp_layouts(module))
    elif backend == "tp":
        layout = draw(tp_layouts(module, world, data_parallel=(groups,)))
    else:
        layout = draw(pipeline_layouts(len(list(module.children())), world, batch))
    return ShardedScenario(scenario, layout)


def exact_scenarios(
    backend: str = "dp",
    *,
    world_sizes: Sequence[int] | None = None,
    kinds: Sequence[str] | None = None,
    losses: Sequence[str] = _EXACT_LOSSES,
    max_features: int = 4,
    max_hidden: int = 4,
    max_depth: int = 2,
    max_batch: int = 8,
) -> SearchStrategy[Scenario] | SearchStrategy[ShardedScenario]:
    """Scenarios that exact mode (``exact=True``, ``dpverify.exact``) runs without
    rounding, for the checks of ``backend`` (``"dp"``, ``"ddp"``, ``"fsdp"``, ``"tp"``,
    ``"pp"``): a ``Scenario`` for DataParallel and DDP, a ``ShardedScenario`` with a layout
    (``fsdp_layouts``, ``tp_layouts``, ``pipeline_layouts``) for the others.

    The models are of exact mode's set (``EXACT_BACKEND_KINDS``): Linear layers,
    ``conv-pool`` (a Conv2d with max, mean or sum pooling over 2x2 windows), an Embedding
    summed over its tokens, residual adds, ``concat`` (concatenation), with ReLU or
    LeakyReLU of slope 1/8, in eval mode; output widths 1, 2 or 4, and an MSE or L1 loss
    (a deeper model than a squared error leaves bits for, two hidden layers or a residual
    block, takes L1, ``EXACT_LIMITS``).
    DataParallel draws ``world_sizes`` devices (default 1 to 4), any batch for a sum loss
    (uneven chunks included: one loss on the gathered outputs), a power of two for a mean
    loss. The ranked backends draw a power-of-two world size (default 2), a mean loss and a
    power-of-two batch: equal shards (DDP, FSDP2), data-parallel groups (tensor
    parallelism, on 4 or more ranks) and microbatches (pipelines) of power-of-two rows, so
    that every division of the step is by a power of two. Every drawn scenario is within
    the bounds the proof of exactness accepts.

    Args:
        backend: whose checks the scenarios are for.
        world_sizes: device counts (DataParallel) or world sizes (powers of two for the
            ranked backends, which divide by them; for tensor parallelism at most
            ``max_hidden``, the width it shards).
        kinds: restrict to these of ``EXACT_BACKEND_KINDS[backend]``.
        losses: draw from ``"mse"`` and ``"l1"`` (without ``"l1"``, no residual models and
            one hidden layer).
        max_features: largest input width (at most ``EXACT_LIMITS["max_features"]``).
        max_hidden: largest hidden width (at most ``EXACT_LIMITS["max_hidden"]``).
        max_depth: most hidden layers (at most ``EXACT_LIMITS["max_depth"]``; a pipeline
            of 4 stages needs 2).
        max_batch: most rows (at most ``EXACT_LIMITS["max_batch"]``).

    Shrinks toward the backend's simplest model (one Linear layer, or a ``sequential`` of
    one hidden layer) of width 1 with one output, a mean MSE, the smallest world size,
    the fewest rows, the simplest layout and seed 0.
    """
    if backend not in EXACT_BACKEND_KINDS:
        raise InvalidArgument(f"backend={backend!r}: exact scenarios run on one of {tuple(EXACT_BACKEND_KINDS)}")
    allowed = EXACT_BACKEND_KINDS[backend]
    chosen = allowed if kinds is None else _subset("kinds", kinds, allowed, f"choose a non-empty subset of {allowed} for backend={backend!r}")
    picked = _subset("losses", losses, _EXACT_LOSSES, f"choose a non-empty subset of {_EXACT_LOSSES}")
    bounds = {"max_features": max_features, "max_hidden": max_hidden, "max_depth": max_depth, "max_batch": max_batch}
    for name, value in bounds.items():
        require_int_at_least(value, name, 1)
        if value > EXACT_LIMITS[name]:
            raise InvalidArgument(
                f"{name}={value}: exact arithmetic leaves room for at most {EXACT_LIMITS[name]} (float64's 53 bits hold "
                f"the products and sums of smaller models only); pass {name}={EXACT_LIMITS[name]} or less"
            )
    worlds = _exact_worlds(backend, world_sizes)
    if backend == "pp" and max(worlds) > 2 * max_depth + 1:
        raise InvalidArgument(
            f"world_sizes={list(worlds)!r} with max_depth={max_depth}: a pipeline needs a child per stage and a sequential "
            f"model of depth d has 2 * d + 1; pass max_depth={-(-(max(worlds) - 1) // 2)} or fewer stages"
        )
    if backend == "tp" and max(worlds) > max_hidden:
        raise InvalidArgument(
            f"world_sizes={list(worlds)!r} with max_hidden={max_hidden}: tensor parallelism shards the hidden width over "
            f"the ranks, so it needs a width of at least {max(worlds)}; pass max_hidden={max(worlds)} (at most "
            f"{EXACT_LIMITS['max_hidden']}) or fewer ranks"
        )
    if "l1" not in picked and set(_DEEP_KINDS) >= set(chosen):
        raise InvalidArgument(
            f"kinds={list(chosen)!r} with losses={list(picked)!r}: a residual block between a stem and a head chains "
            "three Linear layers, more than a squared error leaves bits for; add 'l1' to losses"
        )
    if backend == "pp" and max(worlds) > 2 * _SQUARED_DEPTH + 1 and "l1" not in picked:
        raise InvalidArgument(
            f"world_sizes={list(worlds)!r} with losses={list(picked)!r}: a pipeline of more than 3 stages needs a model deeper "
            "than a squared error leaves bits for; add 'l1' to losses"
        )
    # one composite draws either kind; the backend decides which, as the annotation says
    if "l1" not in picked:  # the kinds only L1 leaves bits for
        chosen = tuple(k for k in chosen if k not in _DEEP_KINDS)
    return cast("SearchStrategy[Scenario] | SearchStrategy[ShardedScenario]", _exact_scenarios(
        backend, worlds, tuple(k for k in allowed if k in chosen), tuple(n for n in _EXACT_LOSSES if n in picked),
        max_features, max_hidden, max_depth, max_batch,
    ))


def _exact_worlds(backend: str, world_sizes: Sequence[int] | None) -> tuple[int, ...]:
    """``exact_scenarios``' device counts or world sizes, checked, smallest first."""
    if world_sizes is None:
        return (1, 2, 3, 4) if backend == "dp" else (2,)
    sizes = _subset("world_sizes", world_sizes, lambda w: isinstance(w, int) and not isinstance(w, bool), "pass a non-empty list of ints, e.g. (2, 4)")
    least = 1 if backend == "dp" else 2
    worlds = tuple(sorted({require_int_at_least(w, "world_sizes", least) for w in sizes}))
    if backend in _RANKED and not all(w & (w - 1) == 0 for w in worlds):
        raise InvalidArgument(
            f"world_sizes={list(worlds)!r}: {backend} divides every gradient by the world size, which rounds unless it is a "
            "power of two; pass powers of two, e.g. (2, 4)"
        )
    return worlds


#: The Hugging Face families ``hf_configs`` draws by default: a grouped-query decoder
#: (Llama), a mixture of experts (Mixtral) and Qwen2 (attention biases); any of them with
#: its head tied to its embedding.
HF_FAMILIES: tuple[str, ...] = ("llama", "mixtral", "qwen2")


@st.composite
def _hf_configs(draw: st.DrawFn, families: tuple[str, ...], tp: int, pp: int) -> object:
    from transformers import CONFIG_MAPPING

    from dpverify.hf import shrink

    family = draw(st.sampled_from(families))
    heads = draw(st.sampled_from([8, 16, 32]))
    # query heads per key-value head: multi-head (1) to grouped (8), key-value heads a multiple of tp
    ratio = draw(st.sampled_from([r for r in (1, 2, 4, 8) if heads // r >= 2 and (heads // r) % tp == 0]))
    overrides: dict[str, Any] = {
        "num_attention_heads": heads, "num_key_value_heads": heads // ratio, "hidden_size": heads * 128,
        "tie_word_embeddings": draw(st.booleans()),
    }
    if family == "mixtral":
        experts = draw(st.sampled_from([4, 8]))
        overrides |= {"num_local_experts": experts, "num_experts_per_tok": draw(st.integers(2, experts // 2))}
    if family == "llama":
        overrides["attention_bias"] = draw(st.booleans())
    # eight query heads per key-value head widen the shrunk model: a wider budget than shrink's
    return shrink(CONFIG_MAPPING[family](**overrides), tp=tp, pp=pp, max_params=4_000_000)


def hf_configs(families: Sequence[str] = HF_FAMILIES, *, tp: int = 2, pp: int = 2) -> SearchStrategy[object]:
    """Shrunk Hugging Face configurations (``dpverify.shrink``) of ``families``
    (``model_type`` names; default ``HF_FAMILIES``), with their structure drawn before
    shrinking: the query heads (8 to 32) and how many share a key-value head (1 to 8),
    tied embeddings, experts and experts per token for a mixture of experts, attention
    biases for Llama. Every drawn configuration divides over ``tp`` tensor-parallel ranks
    and has at least ``pp`` layers, in at most 4M parameters. Needs transformers (``pip install 'dpverify[hf]'``).
    Shrinks toward the first family, 8 heads, untied.
    """
    chosen = _subset("families", families, lambda name: isinstance(name, str), "pass model_type names such as 'llama'")
    require_int_at_least(tp, "tp", 1)
    require_int_at_least(pp, "pp", 1)
    return _hf_configs(tuple(chosen), tp, pp)
