"""A user's model as the command line loads it: the factory, a batch for it, and a loss.

``dpverify check`` and ``dpverify explain`` take ``MODULE:FACTORY`` (``user_model`` says
how the batch and the loss are made, ``OutputLoss`` what the loss is applied to). The loss
is tried once on a single-device forward before any check runs (``_try_loss``).

Everything that cannot be used (a malformed spec, a module that fails to import, a factory
or batch function that raises) is a ``dpverify.InvalidArgument`` naming the option; when the
user's code raised, that exception is its ``__cause__``, and ``user_traceback`` shows the
user's frames of it.
"""

from __future__ import annotations

import copy
import functools
import importlib
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar, cast

import torch
from torch import nn
from torch.nn.modules.conv import _ConvNd

from dpverify.checks.loss_average import extract_loss
from dpverify.core.errors import InvalidArgument
from dpverify.core.tracebacks import describe_exception
from dpverify.core.tree import first_batched
from dpverify.models.specs import LOSSES, LossSpec, primary_output
from dpverify.models.user import Batch, LossFn, UserModel

__all__ = [
    "OutputLoss",
    "first_layer_batch",
    "load_hook",
    "load_loss",
    "load_object",
    "load_optimizer",
    "select_output",
    "sendable",
    "user_model",
    "with_loss",
]

T = TypeVar("T")

#: Layers that keep the shape of their input: the next layer decides the batch's shape.
_SHAPE_KEEPING = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.Identity)

#: Spatial extent of an inferred batch for 1-, 2- and 3-d convolutions, and sequence length.
_SPATIAL = {1: (16,), 2: (8, 8), 3: (4, 4, 4)}
_SEQUENCE = 6


def _call_user(what: str, call: Callable[[], T], how: str) -> T:
    """Runs the user's ``call``; whatever it raises, or a ``sys.exit()`` in it, becomes an
    ``InvalidArgument`` naming ``what`` and ``how`` it was called, caused by the original."""
    try:
        return call()
    except (Exception, SystemExit) as error:  # not KeyboardInterrupt: the user stops the run
        raise InvalidArgument(f"{what} raised {describe_exception(error)} ({how})") from error


def load_object(spec: str, option: str) -> Any:
    """Imports ``package.module:attribute`` (the current directory is importable).

    Raises:
        InvalidArgument: ``spec`` is malformed, the module cannot be imported (or raises
            while it is), or it lacks the attribute. The error the import raised is the
            ``__cause__``.
    """
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise InvalidArgument(f"{option} {spec!r} must look like 'module:attribute'")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        # chained: an import inside the user's module that fails shows the user's line
        raise InvalidArgument(f"{option} {spec!r}: cannot import {module_name!r} ({error})") from error
    except (Exception, SystemExit) as error:
        raise InvalidArgument(f"{option} {spec!r}: importing {module_name!r} raised {describe_exception(error)}") from error
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise InvalidArgument(f"{option} {spec!r}: {module_name!r} has no attribute {attribute!r}") from None


def select_output(output: Any, key: str) -> Any:
    """The entry ``--output-key KEY`` names: a mapping's key, a namedtuple's field, or the
    index of a tuple or list.

    Raises:
        InvalidArgument: the output has no such entry; the message lists what it has.
    """
    if isinstance(output, Mapping):
        if key not in output:
            raise InvalidArgument(f"--output-key {key!r}: the forward returned a mapping with keys {list(output)}; pass one of them")
        return output[key]
    fields = getattr(output, "_fields", None)
    if isinstance(output, tuple) and fields is not None and key in fields:
        return getattr(output, key)
    if isinstance(output, (tuple, list)):
        try:
            index = int(key)
        except ValueError:
            index = None
        if index is None or not -len(output) <= index < len(output):
            named = f" or a field of {list(fields)}" if fields else ""
            raise InvalidArgument(
                f"--output-key {key!r}: the forward returned a {type(output).__name__} of {len(output)} "
                f"outputs; pass an index from 0 to {len(output) - 1}{named}"
            )
        return output[index]
    raise InvalidArgument(
        f"--output-key {key!r}: the forward returned {type(output).__name__}, which has no entries; "
        "leave --output-key out (it picks the output a loss applies to from a dict, namedtuple or tuple)"
    )


@dataclass(frozen=True)
class OutputLoss:
    """``loss(output, target)`` on the part of the forward's output the loss applies to.

    Attributes:
        fn: the loss, a ``LossSpec`` or the user's ``FN(output, target)``.
        name: the loss in words (``cross_entropy``, ``mymod:token_ce``).
        output_key: ``--output-key``: the entry of the output the loss takes (see
            ``select_output``); None gives ``fn`` the whole output (a ``LossSpec`` then takes
            the primary output itself).
    """

    fn: LossFn
    name: str
    output_key: str | None = None

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        chosen = output if self.output_key is None else select_output(output, self.output_key)
        return self.fn(chosen, target)


def user_model(
    factory_spec: str,
    *,
    inputs_spec: str | None = None,
    loss: str | None = None,
    seed: int = 0,
    output_key: str | None = None,
) -> UserModel:
    """Loads ``MODULE:FACTORY`` and works out how to make its batches and loss.

    Args:
        factory_spec: ``package.module:factory``; ``factory()`` returns the ``nn.Module``.
        inputs_spec: ``package.module:fn``; ``fn(batch_size)`` returns ``(inputs, target)``,
            ``(args, kwargs)`` or ``(args, kwargs, target)`` with ``kwargs`` a dict of
            keyword forward arguments, or a dict of keyword arguments alone or with a target,
            ``(kwargs, target)`` (a keyword-only call, ``model(**batch)``; a ``labels``
            entry makes a Hugging Face model compute its own loss, which is then checked).
        loss: a name from ``dpverify.strategies.LOSSES``, or ``package.module:fn`` with
            ``fn(output, target)`` returning the scalar loss (default: inferred).
        seed: seeds the factory, the batch and any made-up target.
        output_key: the entry of a dict, namedtuple or tuple output the loss applies to
            (``select_output``); default: the whole output for ``module:fn``, else the
            tensor itself, a tuple's first element or a mapping's ``"logits"``.

    Raises:
        InvalidArgument: the factory, inputs function or loss cannot be used, raises (the
            user's exception is the ``__cause__``), or no batch can be inferred; the
            message says what to pass.
    """
    user_loss = load_loss(loss)
    factory = load_object(factory_spec, "MODULE:FACTORY")
    if not callable(factory):
        raise InvalidArgument(f"MODULE:FACTORY {factory_spec!r} is {type(factory).__name__}, not callable; pass a function or class that returns the model")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = _call_user(f"MODULE:FACTORY {factory_spec!r}", factory, "called with no arguments")
    if not isinstance(module, nn.Module):
        raise InvalidArgument(
            f"MODULE:FACTORY {factory_spec!r} returned {type(module).__name__}; it must return a "
            "torch.nn.Module (the factory is called with no arguments)"
        )
    raw_at: Callable[[int], RawBatches]
    if inputs_spec is not None:
        fn = load_object(inputs_spec, "--inputs")
        if not callable(fn):
            raise InvalidArgument(f"--inputs {inputs_spec!r} is not callable; pass a function fn(batch_size) -> (inputs, target)")
        raw_at = functools.partial(_user_batches, fn, inputs_spec)
        source = f"--inputs {inputs_spec}"
    else:
        source = first_layer_batch(module, seed=seed)[1]
        raw_at = functools.partial(_first_layer_raw, module)
    probe = raw_at(seed)(2)
    returns_loss = _returns_loss(module, probe, source)
    if returns_loss and loss is None and output_key is not None:
        raise InvalidArgument(
            f"--output-key {output_key!r} picks the output a loss is applied to, but this forward returns its "
            "own loss (checked as a loss in forward); leave --output-key out, or pass --inputs with a target"
        )
    make = _batch_maker(module, raw_at(seed), loss, returns_loss, user_loss, output_key)
    _try_loss(module, make(2), source, output_key, inputs_given=inputs_spec is not None)

    def make_step(batch_size: int, step: int) -> Batch:
        # the training checks' step: the same batch function, with torch seeded seed + step
        return make(batch_size) if step == 0 else _batch_maker(module, raw_at(seed + step), loss, returns_loss, user_loss, output_key)(batch_size)

    return UserModel(factory_spec, module, source, make, make_step)


def _first_layer_raw(module: nn.Module, seed: int) -> RawBatches:
    return first_layer_batch(module, seed=seed)[0]


def with_loss(model: UserModel, loss: str) -> UserModel:
    """``model`` (a built-in one, for ``verify --loss``) with ``loss`` instead of its own
    wherever the loss is computed outside the forward; a forward that returns its loss keeps
    it.

    Raises:
        InvalidArgument: ``loss`` cannot be loaded, or cannot be applied to the model's
            output and target; the message names ``--loss`` and ``--models``.
    """
    user_loss = load_loss(loss)
    fn: LossFn = user_loss if user_loss is not None else LossSpec(loss)
    replaced = OutputLoss(fn, loss)

    def make(batch_size: int) -> Batch:
        batch = model.make_batch(batch_size)
        if batch.loss_fn is None:
            return batch
        return replace(batch, loss_fn=replaced, loss_name=loss)

    advice = f"Pass --models with the built-in models whose output and target it takes, leaving out {model.name!r}"
    _try_loss(model.module, make(2), model.batch_source, None, inputs_given=False, advice=advice, where=f"built-in model {model.name!r}")
    return replace(model, make_batch=make)


def load_loss(loss: str | None) -> LossFn | None:
    """``--loss MODULE:FN`` imported (None for a built-in name or no ``--loss``).

    Raises:
        InvalidArgument: neither a built-in name nor an importable callable.
    """
    if loss is None or loss in LOSSES:
        return None
    if ":" not in loss:
        raise InvalidArgument(f"--loss {loss!r} is not one of {list(LOSSES)}; or pass MODULE:FN, a function loss(output, target)")
    fn = load_object(loss, "--loss")
    if not callable(fn):
        raise InvalidArgument(f"--loss {loss!r} is {type(fn).__name__}, not callable; pass MODULE:FN, a function loss(output, target)")
    return cast(LossFn, fn)


def sendable(value: Any, what: str, instead: str) -> None:
    """``value`` pickles, as the rank processes receive it.

    Raises:
        InvalidArgument: it does not; the message names ``what`` and says ``instead``.
    """
    import pickle

    try:
        pickle.dumps(value)
    except Exception as error:
        raise InvalidArgument(f"{what} cannot be sent to the rank processes ({describe_exception(error)}); pass {instead}") from error


def load_hook(spec: str | None, option: str = "--step") -> Callable[[Any], None] | None:
    """``--step MODULE:FN``, the user's code between backward and the optimizer step
    (``FN(ctx)``, the training checks' ``after_backward``), imported; None without one.

    Raises:
        InvalidArgument: it cannot be imported, is not callable, or does not pickle.
    """
    if spec is None:
        return None
    hook = load_object(spec, option)
    instead = "a module-level function FN(ctx), e.g. one calling torch.nn.utils.clip_grad_norm_(ctx.module.parameters(), 1.0)"
    if not callable(hook):
        raise InvalidArgument(f"{option} {spec!r} is {type(hook).__name__}, not callable; pass {instead}")
    sendable(hook, f"{option} {spec!r}", instead)
    return cast(Callable[[Any], None], hook)


def load_optimizer(spec: str, module: nn.Module, option: str = "--optimizer") -> tuple[Callable[..., torch.optim.Optimizer], str]:
    """``--optimizer``: a built-in spelling ``NAME[:KEY=VALUE,...]`` (``sgd:lr=0.1,momentum=0.9``,
    ``adam:lr=1e-3``; ``OptimizerSpec.parse``) or ``MODULE:FACTORY``, a function ``params ->
    Optimizer``; the factory is tried once on a copy of ``module``'s parameters.

    Returns:
        The factory, and how to name it (``SGD(lr=0.1, momentum=0.9)``, or ``MODULE:FACTORY``).

    Raises:
        InvalidArgument: neither spelling, a factory that cannot be imported or pickled, or
            one that raises or returns no ``torch.optim.Optimizer``.
    """
    from dpverify.models.training import OPTIMIZERS, OptimizerSpec
    from dpverify.ranked.check import callable_name

    head, colon, rest = spec.partition(":")
    if head.strip().lower() in OPTIMIZERS or not colon or "=" in rest:
        parsed = OptimizerSpec.parse(spec, option)
        made_factory = parsed.factory()
        return made_factory, callable_name(made_factory)
    factory = load_object(spec, option)
    instead = "a module-level function params -> Optimizer, e.g. def make(params): return torch.optim.SGD(params, lr=0.1)"
    if not callable(factory):
        raise InvalidArgument(f"{option} {spec!r} is {type(factory).__name__}, not callable; pass {instead}")
    sendable(factory, f"{option} {spec!r}", instead)
    trial = copy.deepcopy(module)
    made = _call_user(f"{option} {spec!r}", lambda: factory(trial.parameters()), "called with the model's parameters")
    if not isinstance(made, torch.optim.Optimizer):
        raise InvalidArgument(f"{option} {spec!r} returned {type(made).__name__}; pass {instead}")
    return cast(Callable[..., torch.optim.Optimizer], factory), spec


def _described(value: Any) -> str:
    """A forward's output or a target, by its shapes: ``tensor 8x7x13``, ``dict(pred=tensor
    8x3, aux=tensor 8x2)``."""
    if isinstance(value, torch.Tensor):
        return f"tensor {'x'.join(map(str, value.shape)) or 'scalar'} ({str(value.dtype).removeprefix('torch.')})"
    if isinstance(value, Mapping):
        return f"{type(value).__name__}({', '.join(f'{k}={_described(v)}' for k, v in value.items())})"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}({', '.join(_described(v) for v in value)})"
    return type(value).__name__


def _try_loss(
    module: nn.Module, batch: Batch, source: str, output_key: str | None, *, inputs_given: bool,
    advice: str | None = None, where: str = "the model",
) -> None:
    """Applies the loss once to a single-device forward on two rows, before any check: a
    loss that cannot be applied to this output and target is the command line's usage error
    (it would fail the single-device step and the parallel one alike), never a check's FAIL.

    Raises:
        InvalidArgument: the loss raises, or does not return a scalar tensor; the message
            names the option to change.
    """
    loss_fn = batch.loss_fn
    if loss_fn is None:
        return
    model = copy.deepcopy(module)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        output = _call_user("the model's forward", lambda: model(*batch.inputs, **batch.kwargs), f"on 2 rows from {source}")
        try:
            loss = loss_fn(output, batch.target)
        except InvalidArgument:
            raise
        except (Exception, SystemExit) as error:
            raise InvalidArgument(
                f"the loss ({batch.loss_name}) cannot be applied to the output of {where}, "
                f"{_described(output)}, and the target, {_described(batch.target)}, on one device "
                f"(nothing parallel ran): {describe_exception(error)}. {advice or _loss_advice(output, output_key, inputs_given)}"
            ) from error
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        raise InvalidArgument(
            f"--loss {batch.loss_name}: returned {_described(loss)} for the forward's output {_described(output)}; "
            "loss(output, target) must return one floating-point value (a mean or a sum)"
        )


def _loss_advice(output: Any, output_key: str | None, inputs_given: bool) -> str:
    """Which option to change, for an output and target the loss cannot take."""
    if output_key is None and isinstance(output, Mapping):
        return (
            f"The forward returns a mapping with keys {list(output)}: pass --output-key KEY to apply the "
            "loss to one of them, or --loss MODULE:FN, a function loss(output, target) that reads the mapping"
        )
    advice = "Pass --loss MODULE:FN, a function loss(output, target) for this output and target"
    if isinstance(output, torch.Tensor) and output.dim() > 2:
        advice += (
            " (for token logits (B, T, V) and labels (B, T): cross-entropy over the flattened tokens, "
            "F.cross_entropy(output.flatten(0, 1), target.flatten()))"
        )
    if isinstance(output, (tuple, list)) and output_key is None:
        advice += "; or --output-key INDEX to apply the loss to another element of the tuple (default: the first)"
    target = "a target of the shape the loss expects" if inputs_given else "the target (without it, a random one shaped like the output is made up)"
    return f"{advice}; or --inputs MODULE:FN returning {target}"


@dataclass(frozen=True)
class RawBatch:
    """What ``--inputs`` (or the first layer) gives for one batch size."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    target: Any


RawBatches = Callable[[int], RawBatch]


_INPUTS_FORMS = (
    "fn(batch_size) must return (inputs, target) with inputs a tensor or a tuple of forward "
    "arguments and target a tensor, or None when the forward returns the loss; or (args, "
    "kwargs) or (args, kwargs, target) with kwargs a dict of keyword arguments; or a dict of "
    "keyword arguments, alone or as (kwargs, target)"
)


def _user_batches(fn: Callable[[int], Any], spec: str, seed: int) -> RawBatches:
    def make(batch_size: int) -> RawBatch:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            result = _call_user(f"--inputs {spec!r}", lambda: fn(batch_size), f"called with batch_size={batch_size}")
        args, kwargs, target = _read_batch(result, spec)
        if target is not None and not isinstance(target, torch.Tensor):
            raise InvalidArgument(f"--inputs {spec!r}: the target is {type(target).__name__}; return a tensor or None")
        if not args and not kwargs:
            raise InvalidArgument(f"--inputs {spec!r} returned no forward arguments; {_INPUTS_FORMS}")
        return RawBatch(args, kwargs, target)

    return make


def _read_batch(result: Any, spec: str) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    """``(args, kwargs, target)`` from any of the forms ``--inputs`` may return."""

    def as_args(value: Any) -> tuple[Any, ...]:
        return value if isinstance(value, tuple) else (value,)

    if isinstance(result, torch.Tensor):
        return (result,), {}, None
    if isinstance(result, Mapping):
        return (), dict(result), None
    if isinstance(result, tuple) and len(result) == 2:
        first, second = result
        if isinstance(first, Mapping):
            return (), dict(first), second
        if isinstance(second, Mapping):
            return as_args(first), dict(second), None
        return as_args(first), {}, second
    if isinstance(result, tuple) and len(result) == 3 and isinstance(result[1], Mapping):
        return as_args(result[0]), dict(result[1]), result[2]
    raise InvalidArgument(f"--inputs {spec!r} returned {type(result).__name__}; {_INPUTS_FORMS}")


def _describe_layer(name: str, layer: nn.Module) -> str:
    return f"{name or 'the model'} ({layer.__class__.__name__}({layer.extra_repr()}))"


def first_layer_batch(module: nn.Module, *, seed: int = 0) -> tuple[RawBatches, str]:
    """Batches shaped for the first layer that fixes the input shape.

    Returns:
        ``make(batch_size)``, a ``RawBatch`` without target, and a description of the
        inferred shape.

    Raises:
        InvalidArgument: the first such layer gives no shape (or scatters along time); the
            message asks for ``--inputs``.
    """
    for name, layer in module.named_modules():
        attention = isinstance(layer, nn.MultiheadAttention)  # a container of Linear layers
        if next(layer.children(), None) is not None and not attention:
            continue
        if isinstance(layer, _SHAPE_KEEPING) or (layer.__class__.__module__ == "torch.nn.modules.activation" and not attention):
            continue
        shape, integer_high = _row_shape(name, layer)
        where = _describe_layer(name, layer)
        text = f"x of shape (B, {', '.join(map(str, shape))}) inferred from {where}"
        if integer_high is not None:
            text = f"token ids of shape (B, {', '.join(map(str, shape))}) in [0, {integer_high}) inferred from {where}"
        return _random_batches(shape, integer_high, seed), text
    raise InvalidArgument(
        "cannot infer a batch: the model has no layer that fixes the input shape; pass "
        "--inputs MODULE:FN where FN(batch_size) returns (inputs, target)"
    )


def _row_shape(name: str, layer: nn.Module) -> tuple[tuple[int, ...], int | None]:
    """The shape of one row for ``layer``, and the exclusive bound of integer inputs."""
    if isinstance(layer, nn.Linear):
        return (layer.in_features,), None
    if isinstance(layer, (nn.Embedding, nn.EmbeddingBag)):
        return (_SEQUENCE,), layer.num_embeddings
    if isinstance(layer, _ConvNd) and len(layer.kernel_size) in _SPATIAL:
        return (layer.in_channels, *_SPATIAL[len(layer.kernel_size)]), None
    if isinstance(layer, (nn.RNNBase, nn.MultiheadAttention)):
        if not layer.batch_first:
            raise InvalidArgument(
                f"cannot infer a batch: {_describe_layer(name, layer)} is not batch_first, and "
                "DataParallel scatters along dim 0; pass --inputs MODULE:FN where FN(batch_size) "
                "returns (inputs, target)"
            )
        width = layer.input_size if isinstance(layer, nn.RNNBase) else layer.embed_dim
        return (_SEQUENCE, width), None
    if isinstance(layer, nn.LayerNorm):
        return tuple(layer.normalized_shape), None
    if isinstance(layer, nn.modules.batchnorm._BatchNorm):
        dims = {nn.BatchNorm1d: 0, nn.BatchNorm2d: 2, nn.BatchNorm3d: 3}.get(type(layer), 0)
        return (layer.num_features, *_SPATIAL.get(dims, ())), None
    raise InvalidArgument(
        f"cannot infer a batch from the first layer, {_describe_layer(name, layer)}; pass "
        "--inputs MODULE:FN where FN(batch_size) returns (inputs, target)"
    )


def _random_batches(shape: tuple[int, ...], integer_high: int | None, seed: int) -> RawBatches:
    def make(batch_size: int) -> RawBatch:
        g = torch.Generator().manual_seed(seed)
        if integer_high is not None:
            return RawBatch((torch.randint(0, integer_high, (batch_size, *shape), generator=g),), {}, None)
        return RawBatch((torch.randn(batch_size, *shape, generator=g),), {}, None)

    return make


def _returns_loss(module: nn.Module, batch: RawBatch, source: str) -> bool:
    """Runs the model once on two rows: does its forward return a scalar loss (a tensor,
    in a tuple, or under a ``loss`` key, as a Hugging Face model given ``labels`` does)?"""
    model = copy.deepcopy(module)
    target = batch.target
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            output = model(*batch.args, **batch.kwargs)  # two rows: enough for BatchNorm in train mode
    except (Exception, SystemExit) as error:
        raise InvalidArgument(
            f"the model's forward failed on a batch of 2 rows from {source}: "
            f"{describe_exception(error)}. Pass --inputs MODULE:FN where FN(batch_size) "
            "returns (inputs, target) matching your forward"
        ) from error
    if target is not None:
        return False
    try:
        return extract_loss(output, -1).dim() == 0
    except InvalidArgument:  # no loss in this output
        return False


def _batch_maker(
    module: nn.Module, raw: RawBatches, loss: str | None, returns_loss: bool, user_loss: LossFn | None = None,
    output_key: str | None = None,
) -> Callable[[int], Batch]:
    def loss_of(name: str) -> LossFn:
        # a built-in loss without --output-key stays the LossSpec itself (equal by value)
        if user_loss is not None:
            return OutputLoss(user_loss, name, output_key)
        spec = LossSpec(name)
        return spec if output_key is None else OutputLoss(spec, name, output_key)

    on = "" if output_key is None else f" on output {output_key!r}"

    def make(batch_size: int) -> Batch:
        made = raw(batch_size)
        inputs, kwargs, target = made.args, made.kwargs, made.target
        if returns_loss and loss is None:
            return Batch(inputs, None, None, "computed in forward (each replica's chunk mean)", kwargs=kwargs)
        if target is None:
            name = loss or "mse"
            target = _made_up_target(module, made, None if user_loss is not None else loss, output_key)
            return Batch(inputs, target, loss_of(name), f"{name}{on} against a fixed random target", kwargs=kwargs)
        name = loss or ("cross_entropy" if not target.is_floating_point() else "mse")
        return Batch(inputs, target, loss_of(name), name + on, kwargs=kwargs)

    return make


def _loss_input(output: Any, output_key: str | None) -> torch.Tensor:
    """The tensor a built-in loss is applied to: the ``--output-key`` entry, or the primary
    output (the tensor, a tuple's first element, a mapping's ``"logits"``).

    Raises:
        InvalidArgument: no such tensor; the message lists the output's keys and names
            ``--output-key``.
    """
    if output_key is not None:
        chosen = select_output(output, output_key)
    elif isinstance(output, Mapping) and "logits" not in output:
        raise InvalidArgument(
            f"the forward returned a mapping with keys {list(output)} and no 'logits'; pass --output-key KEY "
            "to name the output the loss applies to"
        )
    else:
        chosen = primary_output(output)
    if not isinstance(chosen, torch.Tensor):
        where = f"--output-key {output_key!r}" if output_key is not None else "the forward's first output"
        raise InvalidArgument(f"{where} is {_described(chosen)}, not a tensor; pass --output-key KEY naming the tensor the loss applies to")
    return chosen


def _made_up_target(module: nn.Module, made: RawBatch, loss: str | None, output_key: str | None = None) -> torch.Tensor:
    model = copy.deepcopy(module).eval()  # only the output's shape matters
    first = first_batched((made.args, made.kwargs))
    batch = f"{int(first.shape[0])} rows" if first is not None else "a batch"
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        # before any check runs: a forward that fails here is the batch's fault, as in _returns_loss
        output = _call_user("the model's forward", lambda: model(*made.args, **made.kwargs), f"on {batch}, to shape a made-up target")
        logits = _loss_input(output, output_key)
    rows = int(logits.shape[0])
    g = torch.Generator().manual_seed(12345)
    if loss in ("cross_entropy", "nll"):
        return torch.randint(0, int(logits.shape[-1]), (rows,), generator=g)
    if loss == "bce_with_logits":
        return torch.randint(0, 2, tuple(logits.shape), generator=g).to(logits.dtype)
    return torch.randn(tuple(logits.shape), generator=g).to(logits.dtype)
