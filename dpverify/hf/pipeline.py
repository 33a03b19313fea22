"""A Hugging Face decoder-only causal LM as a chain of pipeline stages, cut where its
configuration's ``base_model_pp_plan`` says.

``pipeline_module(model)`` returns an ``nn.Module`` whose top-level children are what
``dpverify.assert_pipeline_grads_match`` cuts into stages:

- ``embed``: ``(input_ids[, attention_mask])`` -> ``(hidden_states, *context)``: the
  model's embedding, and for each kind of attention its layers use (full, sliding window)
  the rotary position embeddings ``cos, sin`` and the attention mask, built as the base
  model builds them;
- ``layers_0`` .. ``layers_{L-1}``: the model's own decoder layers, each taking and
  returning that tuple (it replaces ``hidden_states`` and passes the context on);
- ``head``: the final norm and ``lm_head`` (and the logits' scalings where the model has
  them: Gemma2's soft-capping, Cohere's and Granite's scales) -> the logits.

The children hold the model's own modules, so a parameter is the model's own object, under
a name the ``names`` attribute maps back (``model_names``). For Llama and most others
``embed.embed_tokens.*`` is ``model.embed_tokens.*``, ``layers_{i}.layer.*`` is
``model.layers.{i}.*``, ``head.norm.*`` is ``model.norm.*`` and ``head.lm_head.*`` is
``lm_head.*``; in general ``model`` is the model's ``base_model_prefix`` and
``embed_tokens``, ``layers`` and ``norm`` the names in its ``base_model_pp_plan`` (pieces
the plan puts between the embedding and the layers, such as Phi's ``embed_dropout``, are
``embed.after.<name>``). With tied embeddings ``head.lm_head.weight`` is
``embed.embed_tokens.weight``, one parameter that the first and the last stage both hold.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

import torch
from torch import nn

from dpverify.core.errors import InvalidArgument
from dpverify.models.layouts import even_split_points

__all__ = [
    "ATTENTION_KINDS",
    "Embed",
    "HFPipeline",
    "Head",
    "Layer",
    "model_names",
    "pipeline_module",
    "require_same_logits",
    "split_points_for",
]

#: The ``config.layer_types`` entries a stage can build the attention mask of, and the
#: function of ``transformers.masking_utils`` that builds it.
ATTENTION_KINDS: dict[str, str] = {
    "full_attention": "create_causal_mask",
    "sliding_attention": "create_sliding_window_causal_mask",
}

#: Attention implementations whose masks are tensors (a pipeline stage sends tensors).
_TENSOR_MASKS = ("eager", "sdpa")


def _transformers(module: str = "transformers") -> ModuleType:
    """``module`` of transformers, or InvalidArgument saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise InvalidArgument(
            f"dpverify.hf needs transformers ({module} could not be imported: {error}); pip install 'dpverify[hf]'"
        ) from error


# --------------------------------------------------------------------------- the stages


def _state(args: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
    """The tuple a stage passes on: dpverify's chain hands a child the previous child's
    tuple as one argument, torch's ``PipelineStage`` the received tensors as arguments."""
    if len(args) == 1 and isinstance(args[0], tuple):
        return tuple(args[0])
    return tuple(args)


def _positions(hidden: torch.Tensor) -> torch.Tensor:
    """The position ids the base model uses when it is given none: ``arange`` of the sequence."""
    return torch.arange(hidden.size(1), device=hidden.device).unsqueeze(0)


def _rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` (one row, or ``rows``) with ``rows`` rows: a stage sends each microbatch's own."""
    return tensor.expand(rows, *tensor.shape[1:]).contiguous()


class Embed(nn.Module):
    """The first stage's child: token embeddings, rotary position embeddings and the masks.

    ``forward(input_ids, attention_mask=None)`` returns ``(hidden_states, *context)``, where
    ``context`` holds ``(cos, sin, mask)`` for each entry of ``kinds`` (the kinds of attention
    the layers use, e.g. full and sliding window): the rotary embeddings of that kind (the
    same for every kind unless the rotary embedding takes a ``layer_type``) and the 4D mask
    ``transformers.masking_utils`` builds for it as the base model does, but always
    materialised (``allow_is_causal_skip=False``: a stage sends tensors, not None). Every
    tensor has the batch's rows along dim 0, so each microbatch's stage sends its own.
    ``multiplier``: the base model's ``embedding_multiplier`` (Granite), or None; ``after``:
    the plan's pieces between the embedding and the layers (Phi's ``embed_dropout``), applied
    in order to the embeddings.
    """

    def __init__(
        self, embed_tokens: nn.Module, rotary_emb: nn.Module, config: Any, kinds: Sequence[str], multiplier: float | None = None,
        after: Sequence[tuple[str, nn.Module]] = (),
    ) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.after = nn.ModuleDict(dict(after))
        self.rotary_emb = rotary_emb
        self.config = config
        self.kinds = tuple(kinds)
        self.multiplier = multiplier
        self.typed = "layer_type" in inspect.signature(rotary_emb.forward).parameters

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        masking = _transformers("transformers.masking_utils")
        hidden = self.embed_tokens(input_ids)
        if self.multiplier is not None:
            hidden = hidden * self.multiplier
        for piece in self.after.values():
            hidden = piece(hidden)
        positions = _positions(hidden)
        rows = hidden.size(0)
        context: list[torch.Tensor] = []
        for kind in self.kinds:
            cos, sin = self.rotary_emb(hidden, positions, kind) if self.typed else self.rotary_emb(hidden, positions)
            build: Callable[..., Any] = getattr(masking, ATTENTION_KINDS[kind])
            mask = build(
                config=self.config, inputs_embeds=hidden, attention_mask=attention_mask, cache=None,
                position_ids=positions, allow_is_causal_skip=False,
            )
            context += [_rows(cos, rows), _rows(sin, rows), _rows(mask, rows)]
        return (hidden, *context)


class Layer(nn.Module):
    """One decoder layer as a stage's child: ``(hidden_states, *context)`` in (see
    ``Embed``), the layer's output hidden states and the same context out. ``kind`` is the
    index in ``Embed.kinds`` of this layer's kind of attention, whose ``(cos, sin, mask)``
    it runs with."""

    def __init__(self, layer: nn.Module, kind: int) -> None:
        super().__init__()
        self.layer = layer
        self.kind = kind

    def forward(self, *args: Any) -> tuple[torch.Tensor, ...]:
        hidden, *context = _state(args)
        cos, sin, mask = context[3 * self.kind : 3 * self.kind + 3]
        output = self.layer(
            hidden, attention_mask=mask, position_embeddings=(cos, sin), position_ids=_positions(hidden), cache=None, use_cache=False,
        )
        if isinstance(output, tuple):  # layers of older families return (hidden_states, ...)
            output = output[0]
        return (output, *context)


class Head(nn.Module):
    """The last stage's child: the final norm, ``lm_head``, then the logits' scalings where
    the model has them: times ``scale`` (Cohere's ``logit_scale``), divided by ``divisor``
    (Granite's ``logits_scaling``), and the final soft-capping ``tanh(logits / cap) * cap``
    (Gemma2's ``final_logit_softcapping``)."""

    def __init__(
        self, norm: nn.Module, lm_head: nn.Module, softcap: float | None, *, scale: float | None = None, divisor: float | None = None,
    ) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head
        self.softcap = softcap
        self.scale = scale
        self.divisor = divisor

    def forward(self, *args: Any) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(self.norm(_state(args)[0]))
        if self.scale is not None:
            logits = logits * self.scale
        if self.divisor is not None:
            logits = logits / self.divisor
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class HFPipeline(nn.Module):
    """A causal LM as the chain of its top-level children (``embed``, ``layers_*``,
    ``head``; see the module's docstring). ``forward(input_ids[, attention_mask])`` returns
    the logits; ``names`` maps each child's submodule to the model's (``model_names``)."""

    def __init__(self, children: Sequence[tuple[str, nn.Module]], names: Mapping[str, str]) -> None:
        super().__init__()
        for name, child in children:
            self.add_module(name, child)
        self.names = dict(names)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        # as a pipeline stage runs its children (StageModule): the first on the inputs,
        # each next one on the previous one's output as one argument
        first, *rest = self.children()
        value = first(*inputs)
        for child in rest:
            value = child(value)
        return value  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- building


def _config(model: nn.Module) -> Any:
    transformers = _transformers()
    config = getattr(model, "config", None)
    if not isinstance(model, transformers.PreTrainedModel) or config is None:
        raise InvalidArgument(
            f"model={type(model).__name__} is not a transformers PreTrainedModel with a config; pass a decoder-only "
            "causal LM built with from_config, e.g. LlamaForCausalLM"
        )
    return config


def _plan(model: nn.Module, config: Any) -> tuple[str, tuple[str, ...], str, str]:
    """The names (in the base model) of the embedding, the pieces between it and the layers
    (e.g. Phi's ``embed_dropout``), the layers and the final norm, in ``base_model_pp_plan``'s
    order."""
    plan = getattr(config, "base_model_pp_plan", None)
    name = type(config).__name__
    if not plan:
        raise InvalidArgument(
            f"model={type(model).__name__}: {name} has no base_model_pp_plan, so dpverify does not know where the "
            "model's pipeline stages begin; pass a model whose configuration has one (Llama, Qwen2, Mistral, Mixtral, "
            "Gemma2, ...), or cut the model into children yourself for assert_pipeline_grads_match"
        )
    pieces = list(plan)
    if len(pieces) < 3:
        raise InvalidArgument(
            f"model={type(model).__name__}: {name}.base_model_pp_plan has the pieces {pieces}; dpverify splits the "
            "layout embedding, (pieces applied to the embeddings, e.g. a dropout), layers, norm, e.g. "
            "['embed_tokens', 'layers', 'norm'], and no other"
        )
    return pieces[0], tuple(pieces[1:-2]), pieces[-2], pieces[-1]


def _piece(owner: nn.Module, name: str, model: nn.Module, what: str) -> nn.Module:
    """``owner``'s child ``name`` (``what`` the model's pipeline plan calls it), or InvalidArgument."""
    piece = getattr(owner, name, None)
    if not isinstance(piece, nn.Module):
        where = "it" if owner is model else f"its base model {type(owner).__name__}"
        raise InvalidArgument(
            f"model={type(model).__name__}: {where} has no module {name!r} ({what}); dpverify cannot split it"
        )
    return piece


def _head_name(model: nn.Module) -> str:
    """The name of the LM head: the key of the class's ``_pp_plan``, else the output embeddings'."""
    plan = getattr(model, "_pp_plan", None) or {}
    if len(plan) == 1:
        return str(next(iter(plan)))
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    for name, module in model.named_children():
        if module is head:
            return name
    raise InvalidArgument(
        f"model={type(model).__name__} has no LM head (no _pp_plan entry, no output embeddings among its children); "
        "pass a causal LM (e.g. LlamaForCausalLM), not its base model"
    )


def _scalar(owner: Any, name: str) -> float | None:
    """``owner.name`` when it is a number (a model's fixed scaling), else None."""
    value = getattr(owner, name, None)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _kinds(model: nn.Module, config: Any, layers: int) -> list[str]:
    """Each layer's kind of attention: ``config.layer_types`` where there are some, else
    sliding-window attention everywhere when ``config.sliding_window`` is set (Mistral,
    Mixtral), else full attention."""
    types = getattr(config, "layer_types", None)
    if types is None:
        return ["sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"] * layers
    types = list(types)[:layers]
    unknown = sorted({kind for kind in types if kind not in ATTENTION_KINDS})
    if unknown or len(types) != layers:
        raise InvalidArgument(
            f"model={type(model).__name__}: config.layer_types={types} for {layers} layers; dpverify builds the masks of "
            f"{sorted(ATTENTION_KINDS)} only, one type per layer" + (f", not of {unknown}" if unknown else "")
        )
    return types


def pipeline_module(model: nn.Module) -> HFPipeline:
    """``model`` as a chain of pipeline children, cut by its ``base_model_pp_plan``.

    The children (see the module's docstring) hold ``model``'s own modules: training the
    result trains ``model``. Its forward over a batch gives ``model``'s logits (to rounding:
    the masks are always materialised, where sdpa may use ``is_causal`` instead;
    ``require_same_logits`` checks it on a batch).

    Args:
        model: a transformers decoder-only causal LM (``...ForCausalLM``) whose
            configuration has a ``base_model_pp_plan`` of embedding, layers and norm, and
            ``eager`` or ``sdpa`` causal attention.

    Raises:
        InvalidArgument: transformers is not installed; ``model`` has no
            ``base_model_pp_plan``, a plan of other pieces, no rotary embedding, no LM
            head, layer types, bidirectional attention or an attention implementation
            whose masks a stage cannot send.
    """
    config = _config(model)
    embed_name, between, layers_name, norm_name = _plan(model, config)
    prefix = str(getattr(model, "base_model_prefix", "") or "")
    base = getattr(model, prefix, None) if prefix else None
    if not isinstance(base, nn.Module):
        raise InvalidArgument(
            f"model={type(model).__name__} has no base model under base_model_prefix={prefix!r}; pass a causal LM "
            "built with from_config (e.g. LlamaForCausalLM), whose base model holds the base_model_pp_plan's pieces"
        )
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in _TENSOR_MASKS:
        raise InvalidArgument(
            f"model={type(model).__name__} uses attn_implementation={implementation!r}, whose attention masks are not "
            f"tensors a pipeline stage can send; build it with attn_implementation in {list(_TENSOR_MASKS)} "
            "(from_config(config, attn_implementation='sdpa'), or model.set_attn_implementation('sdpa'))"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise InvalidArgument(
            f"model={type(model).__name__} has use_bidirectional_attention set, whose masks dpverify does not build; "
            "pass a model with causal attention (use_bidirectional_attention=False)"
        )
    layers = _piece(base, layers_name, model, "the decoder layers, by its base_model_pp_plan")
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise InvalidArgument(
            f"model={type(model).__name__}: {prefix}.{layers_name} is {type(layers).__name__}, not a non-empty "
            "ModuleList of decoder layers; dpverify cannot split it into one child per layer"
        )
    rotary = _piece(base, "rotary_emb", model, "the rotary position embeddings every layer takes")
    head = _head_name(model)
    kinds = _kinds(model, config, len(layers))
    used = list(dict.fromkeys(kinds))
    embed = _piece(base, embed_name, model, "the embedding, by its base_model_pp_plan")
    after = [(name, _piece(base, name, model, "applied to the embeddings, by its base_model_pp_plan")) for name in between]
    children: list[tuple[str, nn.Module]] = [("embed", Embed(embed, rotary, config, used, _scalar(base, "embedding_multiplier"), after))]
    names = {"embed.embed_tokens": f"{prefix}.{embed_name}", "embed.rotary_emb": f"{prefix}.rotary_emb"}
    names.update({f"embed.after.{name}": f"{prefix}.{name}" for name in between})
    for index, layer in enumerate(layers):
        children.append((f"layers_{index}", Layer(layer, used.index(kinds[index]))))
        names[f"layers_{index}.layer"] = f"{prefix}.{layers_name}.{index}"
    norm = _piece(base, norm_name, model, "the final norm, by its base_model_pp_plan")
    children.append(("head", Head(
        norm, _piece(model, head, model, "the LM head"), _scalar(config, "final_logit_softcapping"),
        scale=_scalar(model, "logit_scale"), divisor=_scalar(config, "logits_scaling"),
    )))
    names.update({"head.norm": f"{prefix}.{norm_name}", "head.lm_head": head})
    return HFPipeline(children, names)


def model_names(module: HFPipeline) -> dict[str, str]:
    """Every parameter's name in ``module`` (a ``pipeline_module``), mapped to its name in
    the model it was built from (a tied weight under each of its names)."""
    mapped = {}
    for name, _param in module.named_parameters(remove_duplicate=False):
        for mine, theirs in module.names.items():
            if name.startswith(mine + "."):
                mapped[name] = theirs + name[len(mine):]
                break
    return mapped


def split_points_for(module: HFPipeline, pp: int) -> list[str]:
    """``split_points`` for ``assert_pipeline_grads_match``: the decoder layers as even as
    possible over ``pp`` stages (the first stages one layer more), the embedding with the
    first stage and the norm and head with the last; each point names the child its stage
    begins with.

    Raises:
        InvalidArgument: ``pp`` below 2, or more stages than decoder layers.
    """
    layers = [name for name, _child in module.named_children() if name.startswith("layers_")]
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 2:
        raise InvalidArgument(f"pp={pp!r}: pass the number of pipeline stages, an int of at least 2")
    if pp > len(layers):
        raise InvalidArgument(
            f"pp={pp} stages for a model of {len(layers)} decoder layers: every stage needs one; pass pp <= {len(layers)}"
        )
    return [layers[start] for start in even_split_points(len(layers), pp)]


def require_same_logits(model: nn.Module, module: nn.Module, *inputs: torch.Tensor) -> None:
    """Refuses ``module`` (a ``pipeline_module(model)``) when its logits on ``inputs``
    (``input_ids[, attention_mask]``) are not ``model``'s, to a few hundred units of rounding
    of their dtype: a family whose forward does more than the pieces the pipeline runs (a
    scaling between them, another head) would otherwise be checked as a different model.

    Raises:
        InvalidArgument: the logits differ (the message gives the largest difference), or
            ``module`` raises where ``model`` runs.
    """
    keywords = {"input_ids": inputs[0], **({"attention_mask": inputs[1]} if len(inputs) > 1 else {})}
    with torch.no_grad():
        want = model(**keywords, use_cache=False).logits
        try:
            got = module(*inputs)
        except Exception as error:  # the model ran: what fails is the split, e.g. a layer's other arguments
            raise InvalidArgument(
                f"pipeline_module({type(model).__name__}) fails where the model runs: {type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else ''}. Its layers or rotary embedding take arguments "
                "the base_model_pp_plan pieces do not give them; dpverify does not know how to split it"
            ) from error
    eps = torch.finfo(want.dtype).eps
    scale = float(want.abs().max()) if want.numel() else 1.0
    if got.shape != want.shape or not torch.allclose(got, want, rtol=256 * eps, atol=256 * eps * max(scale, 1.0)):
        gap = float((got - want).abs().max()) if got.shape == want.shape else float("nan")
        raise InvalidArgument(
            f"pipeline_module({type(model).__name__}) does not give the model's logits (shapes {tuple(got.shape)} and "
            f"{tuple(want.shape)}, largest difference {gap:.3g}): the model's forward does something its "
            "base_model_pp_plan pieces do not, which dpverify does not know how to split"
        )
