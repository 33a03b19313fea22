"""A Hugging Face model's own tensor-parallel plan, applied by transformers' own code.

transformers (5.x) gives every architecture a tensor-parallel plan: module paths with
``*`` for the layer number, each with a style name (``config.base_model_tp_plan``, and the
head's entries on the model class). ``from_pretrained(tp_plan="auto")`` resolves it for the
model at hand (every layer number, and the parameters each entry shards) and applies each
entry with the style transformers registers under that name (``ALL_PARALLEL_STYLES``:
``"colwise"``, ``"rowwise"``, ``"packed_colwise"``, ``"moe_tp_experts"``, ...). Here each
resolved entry becomes a ``ParallelStyle`` that hands its module to transformers'
``apply_tensor_parallelism``, so that ``parallelize_module`` (what dpverify's
tensor-parallel check runs on every rank) applies exactly what transformers would.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from fnmatch import fnmatch
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from dpverify.core.errors import InvalidArgument
from dpverify.hf.base import require_transformers

__all__ = ["TransformersStyle", "hf_tp_plan", "load_plan_function", "styled"]


class TransformersStyle(ParallelStyle):
    """The entries of a transformers tensor-parallel plan on one module: ``entries`` pairs
    a name relative to the module (``""``: the module itself, whose forward the style
    wraps; ``"weight"``, ``"gate_up_proj"``: one of its own parameters, which the style
    shards) with the name of a style in transformers' ``ALL_PARALLEL_STYLES``, in the
    order transformers applies them."""

    def __init__(self, entries: tuple[tuple[str, str], ...], config: Any = None) -> None:
        super().__init__()
        self.entries = tuple(entries)
        #: the model's text configuration, for a style that reads it from the model
        #: (``"mla_kv_a_proj"`` splits its output by the rotary head width)
        self.config = config
        styles = dict(self.entries)
        own = styles.get("")
        #: how dpverify's messages name it (``style_name``)
        self.label = (
            f"transformers {own!r}" if own is not None and set(styles.values()) == {own}
            else f"transformers {styles}"
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism

        if self.config is not None:
            # transformers gives such a style the model's configuration from the model it
            # applies the plan to; here that is the module itself
            module.config = self.config
        applied: nn.Module = apply_tensor_parallelism(module, device_mesh, dict(self.entries))
        return applied

    def __repr__(self) -> str:
        return self.label

    def __reduce__(self) -> tuple[Any, ...]:
        return (TransformersStyle, (self.entries, self.config))


def hf_tp_plan(model: nn.Module, tp_size: int) -> dict[str, ParallelStyle]:
    """``model``'s own tensor-parallel plan (its configuration's ``base_model_tp_plan`` and
    its head's entries) as transformers resolves it for ``tp_size`` ranks: one
    ``TransformersStyle`` per module it names or whose parameters it names.

    Raises:
        InvalidArgument: ``model`` is not a transformers model, has no plan, or
            transformers refuses the plan for this model (its message names the entry).
    """
    transformers = require_transformers("tp_plan='hf'")
    resolve = getattr(model, "_resolve_parallel_plans", None)
    if not isinstance(model, transformers.PreTrainedModel) or resolve is None:
        raise InvalidArgument(
            f"tp_plan='hf' takes the plan of a transformers model (5.x), not {type(model).__name__}; "
            "pass tp_plan='MODULE:FN' with FN(model) returning a plan for parallelize_module"
        )
    from transformers.distributed.configuration_utils import DistributedConfig

    try:
        resolved, _experts, _fsdp = resolve(DistributedConfig(tp_size=tp_size))
    except ValueError as error:
        raise InvalidArgument(f"transformers refuses {type(model).__name__}'s tensor-parallel plan: {error}") from None
    if not resolved:
        raise InvalidArgument(
            f"{type(model).__name__} has no tensor-parallel plan (its configuration's base_model_tp_plan "
            "is empty); pass tp_plan='MODULE:FN' with a plan of your own"
        )
    return _grouped(resolved, model)


def _grouped(resolved: Mapping[str, str], model: nn.Module) -> dict[str, ParallelStyle]:
    """A resolved plan (full module and parameter names to style names) as one
    ``TransformersStyle`` per module: its parameters' entries first, then its own."""
    modules = dict(model.named_modules())
    owned: dict[str, list[tuple[str, str]]] = {}
    for name, style in resolved.items():
        owner, relative = (name, "") if name in modules else name.rpartition(".")[::2]
        if owner not in modules:
            raise InvalidArgument(f"the tensor-parallel plan names {name!r}, which {type(model).__name__} does not have")
        owned.setdefault(owner, []).append((relative, style))
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    return {
        owner: TransformersStyle(
            tuple(sorted(entries, key=lambda entry: entry[0] == "")),
            text if any(style in _READS_CONFIG for _name, style in entries) else None,
        )
        for owner, entries in owned.items()
    }


#: transformers' styles that read the model's configuration when applied
_READS_CONFIG = frozenset({"mla_kv_a_proj"})


def load_plan_function(spec: str) -> Callable[[nn.Module], Mapping[str, Any]]:
    """``FN`` of ``"MODULE:FN"``: a function of the model that returns a plan for
    ``parallelize_module`` (its values torch's styles, or names of transformers' styles).

    Raises:
        InvalidArgument: ``spec`` is not ``MODULE:FN``, or names nothing callable.
    """
    from dpverify.cli.user_model import load_object

    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise InvalidArgument(f"tp_plan={spec!r}: pass 'hf' (the model's own plan) or 'MODULE:FN', FN(model) returning a plan")
    try:
        # as --inputs and --loss are: the current directory importable, a module that
        # raises while it is imported reported with its error
        found = load_object(spec, "tp_plan")
    except InvalidArgument as error:
        reason = str(error).removeprefix(f"tp_plan {spec!r}: ")
        raise InvalidArgument(f"tp_plan={spec!r}: cannot import it ({reason})") from error.__cause__
    if not callable(found):
        raise InvalidArgument(f"tp_plan={spec!r} is {type(found).__name__}, not a function FN(model) returning a plan")
    function: Callable[[nn.Module], Mapping[str, Any]] = found
    return function


def styled(plan: Mapping[str, Any], model: nn.Module) -> dict[str, Any]:
    """``plan`` with every style given by name (a transformers style, e.g. ``"rowwise"``),
    as in a transformers plan: on a module, that style on it and on its own parameters;
    on a parameter, that style on the parameter. Other styles are kept."""
    named = {key: style for key, style in plan.items() if isinstance(style, str)}
    if not named:
        return dict(plan)
    modules = dict(model.named_modules())
    names = [*modules, *(name for name, _ in model.named_parameters())]
    resolved: dict[str, str] = {}
    for key, style in named.items():
        matched = [name for name in names if _matches(name, key)]
        if not matched:
            raise InvalidArgument(f"tp_plan names {key!r}, which matches no module or parameter of {type(model).__name__}")
        for name in matched:
            if name in modules:
                resolved.update({f"{name}.{param}": style for param, _ in modules[name].named_parameters(recurse=False)})
            resolved[name] = style
    return {**{key: style for key, style in plan.items() if not isinstance(style, str)}, **_grouped(resolved, model)}


def _matches(name: str, pattern: str) -> bool:
    """Whether dotted ``name`` matches ``pattern`` atom by atom (``*``: any one atom), as
    plan keys match."""
    atoms, parts = name.split("."), pattern.split(".")
    return len(atoms) == len(parts) and all(fnmatch(atom, part) for atom, part in zip(atoms, parts, strict=True))
