"""Hugging Face configurations cut to a CPU size, keeping what a parallel plan depends on.

A parallel plan's correctness depends on the model's structure, not its width: which
projections are split over the ranks, how query heads share key-value heads, which layers
slide a window, whether the embedding is tied, how tokens are routed to experts. ``shrink``
cuts the widths, the depth and the vocabulary and keeps that structure; what it cannot keep
it refuses, naming the field.

The shrunk sizes assume the token batches of ``dpverify.hf.token_batch``: sequences of
``SEQ_LEN`` (16) tokens, so a sliding window of ``WINDOW`` (4) tokens is shorter than the
sequence and masks something.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dpverify.core.errors import InvalidArgument
from dpverify.hf.base import require_config, require_transformers

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = [
    "HEAD_DIM",
    "MAX_LAYERS",
    "SEQ_LEN",
    "VOCAB",
    "WINDOW",
    "parameter_count",
    "shrink",
]

#: The sequence length the checks' token batches use; a sliding window must be shorter.
SEQ_LEN = 16
#: A sliding window (or attention chunk) after shrinking: shorter than SEQ_LEN, so it masks.
WINDOW = 4
#: The head dimension after shrinking, or the smallest even one above it that a partial
#: rotary factor turns into an even rotary dimension.
HEAD_DIM = 8
#: The vocabulary after shrinking (rounded up to a multiple of tp).
VOCAB = 256
#: The most layers a shrunk configuration may have (a per-layer pattern longer than this
#: is refused).
MAX_LAYERS = 16
#: The fewest query heads a shrunk attention keeps (key-value heads grow to reach it).
MIN_HEADS = 4
#: The smallest hidden size when it is not heads x head dimension.
MIN_HIDDEN = 32

#: Widths scaled with the hidden size (feed-forward sizes, dense and expert).
FEED_FORWARD = (
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "shared_experts_intermediate_size",
    "moe_shared_expert_intermediate_size",
    "shared_intermediate_size",
    "dense_intermediate_size",
    "intermediate_size_mlp",
    "ffn_hidden_size",
    "expert_ffn_hidden_size",
    "n_inner",
)
#: Small widths of other kinds (low ranks, state sizes, secondary head dimensions), set to
#: this value or left at their own when smaller.
SMALL_WIDTHS = {
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "o_lora_rank": 16,
    "qk_nope_head_dim": 4,
    "v_head_dim": 8,
    "index_head_dim": 8,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_head_dim": 8,
    "mamba_d_head": 8,
    "mamba_head_dim": 8,
    "mamba_d_state": 8,
    "ssm_state_size": 8,
    "swa_head_dim": 8,
    "laurel_rank": 8,
    "hidden_size_per_layer_input": 8,
    "gated_norm_rank": 8,
    "loop_gate_rank": 8,
    "ple_embed_dim": 8,
}
#: Secondary groups of heads: (query-like heads, key-value-like heads or None).
HEAD_GROUPS = (
    ("linear_num_value_heads", "linear_num_key_heads"),
    ("linear_num_heads", None),
    ("mamba_n_heads", None),
    ("mamba_num_heads", None),
    ("index_n_heads", None),
    ("swa_num_attention_heads", "swa_num_key_value_heads"),
)
EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
EXPERTS_PER_TOKEN = ("num_experts_per_tok", "moe_k", "moe_topk")
SHARED_EXPERTS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
WINDOWS = ("sliding_window", "sliding_window_size", "attention_chunk_size")
VOCABULARIES = ("vocab_size", "vocab_size_per_layer_input", "unpadded_vocab_size")
#: Per-layer index fields: the layers a property applies to, by number.
LAYER_INDICES = ("mlp_only_layers", "moe_layers", "full_attn_idxs")
#: Lists whose length is the number of layers, in configurations with no count of them
#: (Nemotron-H's ``layers_block_type``).
LAYER_LISTS = ("layers_block_type",)
#: Counts of leading layers of another kind (DeepSeek's dense layers before the experts).
LEADING_LAYERS = ("first_k_dense_replace",)
#: Per-layer overrides of a heterogeneous configuration, keyed by layer index.
PER_LAYER_CONFIG = "per_layer_config"


@dataclass
class _Shrinking:
    """One ``shrink`` in progress: the original fields and the changes made so far."""

    config: PretrainedConfig
    tp: int
    fields: dict[str, Any]
    changes: dict[str, Any] = field(default_factory=dict)

    @property
    def model_type(self) -> str:
        return str(getattr(self.config, "model_type", "") or type(self.config).__name__)

    def name(self, alias: str) -> str | None:
        """The field an alias stands for (``n_embd`` for ``hidden_size`` in GPT-J), or None
        when the configuration has neither."""
        canonical = self.config.attribute_map.get(alias, alias)
        return canonical if canonical in self.fields else None

    def get(self, alias: str) -> Any:
        """A field's original value, None when absent."""
        canonical = self.name(alias)
        return None if canonical is None else self.fields[canonical]

    def count(self, alias: str) -> int | None:
        """A field's original value when it is a positive int (not a bool), else None."""
        value = self.get(alias)
        return value if _is_int(value) and value > 0 else None

    def set(self, alias: str, value: Any) -> None:
        canonical = self.name(alias)
        if canonical is not None:
            self.changes[canonical] = value

    def refuse(self, alias: str, why: str) -> InvalidArgument:
        value = repr(self.get(alias))
        value = value if len(value) <= 80 else f"{value[:60]}... ({len(self.get(alias))} items)"
        return InvalidArgument(f"shrink: {self.model_type}: {alias}={value} {why}")


def shrink(
    config: PretrainedConfig,
    *,
    tp: int = 1,
    pp: int = 1,
    max_params: int = 2_000_000,
) -> PretrainedConfig:
    """A new configuration of the same class, cut to a CPU size with the same structure.

    Widths, depth and vocabulary are cut; kept are:

    - attention: the query/key-value head ratio (grouped-query attention stays grouped: at
      least 2 key-value heads when the original has 2 or more; multi-query keeps 1), a head
      dimension of ``HEAD_DIM`` (even, and even after a partial rotary factor), an explicit
      ``head_dim`` field and a hidden size that differs from heads x head_dim in proportion;
    - divisibility by ``tp`` of the query and key-value heads, every feed-forward width
      (dense and expert) and the vocabulary. The key-value heads are the smallest multiple
      of ``tp`` from 2 up, which may be more than the original has (Qwen2.5-0.5B's 2 under
      ``tp=4`` become 4, with 28 query heads): the shrunk model stands for the plan's
      layout, not for a sharding the original could use;
    - depth: at least ``pp`` layers and 2, and each per-layer pattern (``layer_types``,
      ``mlp_layer_types``, layer index lists, ``*_layer_period``/``*_layer_offset``) as a
      prefix, one whole period or more and up to 2 odd last layers: Gemma 3's five sliding
      layers and one full one keep 6 layers, DeepSeek-style dense layers before the experts
      keep their prefix (``first_k_dense_replace`` too), a last layer forced to full
      attention stays last. Patterns are kept each on its own (how two of them line up
      may change);
    - a sliding window (or attention chunk) of ``WINDOW`` tokens, shorter than the
      ``SEQ_LEN`` tokens of the checks' batches, so that it masks;
    - experts: ``num_experts_per_tok`` at 2 when it was 2 or more, and twice that many
      experts (at least 4; Mixtral's 8 with 2 per token become 4 with 2), groups of experts
      and shared experts;
    - the vocabulary at ``VOCAB`` rounded up to a multiple of ``tp``; special token ids the
      smaller vocabulary leaves out are moved to its last ids, distinct ids kept distinct;
    - everything else as it was: tied embeddings, biases, rope settings (lists that follow
      the rotary dimension, such as long-rope factors and multimodal rope sections, are cut
      with it), activations, norms, dropout.

    The parameters are counted exactly, on the meta device (``parameter_count``).

    Args:
        config: a transformers configuration; it is not changed.
        tp: the tensor-parallel degree every split width must divide by.
        pp: the pipeline degree: the fewest layers to keep.
        max_params: the most parameters the shrunk model may have.

    Returns:
        A new configuration of ``type(config)``.

    Raises:
        InvalidArgument: an argument is not valid, or the structure cannot be kept: a
            multi-query attention (one key-value head) under ``tp > 1``, heads that do not
            group, a per-layer pattern longer than ``MAX_LAYERS``, a shrunk configuration
            that transformers rejects or that has more than ``max_params`` parameters. The
            message names the field and why.
    """
    config = require_config(config, "shrink")
    for argument, value in (("tp", tp), ("pp", pp), ("max_params", max_params)):
        if not _is_int(value) or value < 1:
            raise InvalidArgument(f"shrink: {argument} must be a positive int, got {value!r}")
    state = _Shrinking(config, tp, config.to_dict())
    for step in _STEPS:
        step(state)
    _layers(state, pp)
    shrunk = _rebuilt(state)
    _within_budget(state, shrunk, max_params)
    return shrunk


def parameter_count(config: PretrainedConfig) -> int:
    """The parameters of ``AutoModelForCausalLM.from_config(config)``, tied ones once.

    The model is built on the meta device: no memory is allocated and nothing is initialised.
    """
    config = require_config(config, "parameter_count")
    return sum(tensor.numel() for _, tensor in _meta_parameters(config))


def _meta_parameters(config: PretrainedConfig) -> list[tuple[str, Any]]:
    import torch

    transformers = require_transformers("parameter_count")
    with torch.device("meta"):
        # a copy: from_config writes the dtype and the implementations into its config
        model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config))
    return list(model.named_parameters())


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _round_up(value: int, multiple: int) -> int:
    return max(multiple, -(-value // multiple) * multiple)


def _scaled(value: int, scale: float, multiple: int) -> int:
    """``value * scale`` to the nearest multiple of ``multiple``, at least ``multiple``."""
    return max(multiple, round(value * scale / multiple) * multiple)


# --- attention ---------------------------------------------------------------------------


def _rope(state: _Shrinking) -> dict[str, Any]:
    """The rope settings of the default layer type (the first of per-layer-type ones)."""
    rope = state.get("rope_parameters") or state.get("rope_scaling") or {}
    if isinstance(rope, dict) and rope and all(isinstance(value, dict) for value in rope.values()):
        rope = next(iter(rope.values()))
    return rope if isinstance(rope, dict) else {}


def _rotary_fraction(state: _Shrinking, head_dim: int) -> float:
    """The part of a head that rotary embedding turns."""
    rotary_dim = state.count("rotary_dim")
    if rotary_dim is not None and head_dim:
        return min(1.0, rotary_dim / head_dim)
    for source in (_rope(state), state.fields):
        for key in ("partial_rotary_factor", "rotary_pct"):
            value = source.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= 1:
                return float(value)
    return 1.0


def _head_dim(state: _Shrinking, fraction: float) -> int:
    """The smallest even head dimension from ``HEAD_DIM`` whose rotary part is even and
    holds every multimodal rope section."""
    sections = _rope(state).get("mrope_section") or []
    head_dim = HEAD_DIM
    while True:
        rotary = int(head_dim * fraction)
        if rotary >= 2 and rotary % 2 == 0 and rotary // 2 >= len(sections):
            return head_dim
        head_dim += 2


def _key_value_heads(state: _Shrinking, heads_field: str, kv_field: str | None) -> tuple[int, int]:
    """(query heads, key-value heads) after shrinking, the ratio kept."""
    heads = state.count(heads_field)
    assert heads is not None
    kv = state.count(kv_field) if kv_field is not None else None
    kv = heads if kv is None else kv
    if heads % kv:
        raise state.refuse(heads_field, f"is not a multiple of {kv_field}={kv}: the query heads do not group over the key-value heads")
    ratio = heads // kv
    if kv == 1:
        if state.tp > 1:
            raise state.refuse(
                kv_field or heads_field,
                f"(multi-query attention) cannot be divided over tp={state.tp}: one key-value head has no "
                "share for each rank, and more would no longer be multi-query; use tp=1",
            )
        return ratio, 1
    kv_new = _round_up(max(2, -(-MIN_HEADS // ratio)), state.tp)
    return kv_new * ratio, kv_new


def _attention(state: _Shrinking) -> None:
    """Heads, head dimension and hidden size."""
    heads = state.count("num_attention_heads")
    hidden = state.count("hidden_size")
    if heads is None or hidden is None:
        raise state.refuse("num_attention_heads" if heads is None else "hidden_size", "is not a positive int: shrink needs attention heads and a hidden size")
    head_dim = state.count("head_dim") or hidden // heads
    fraction = _rotary_fraction(state, head_dim)
    heads_new, kv_new = _key_value_heads(state, "num_attention_heads", "num_key_value_heads")
    head_dim_new = _head_dim(state, fraction)
    state.set("num_attention_heads", heads_new)
    if state.count("num_key_value_heads") is not None:
        state.set("num_key_value_heads", kv_new)
    if state.count("head_dim") is not None:
        state.set("head_dim", head_dim_new)
    if hidden == heads * head_dim:
        state.set("hidden_size", heads_new * head_dim_new)
    else:  # an explicit head_dim: keep hidden / (heads x head_dim), within 4x of the heads
        ratio = min(4.0, max(0.25, hidden / (heads * head_dim)))
        state.set("hidden_size", max(_scaled(heads_new * head_dim_new, ratio, 2 * state.tp), _round_up(MIN_HIDDEN, 2 * state.tp)))
    if state.count("rotary_dim") is not None:
        state.set("rotary_dim", int(head_dim_new * fraction))
    _multi_latent(state, head_dim_new)
    _rope_lists(state, head_dim, head_dim_new, fraction)


def _multi_latent(state: _Shrinking, head_dim: int) -> None:
    """Multi-head latent attention (DeepSeek): the rotary and non-rotary query-key parts."""
    if state.count("qk_rope_head_dim") is None:
        return
    rope = head_dim // 2 if head_dim // 2 % 2 == 0 else head_dim // 2 + 1
    nope = SMALL_WIDTHS["qk_nope_head_dim"] if state.count("qk_nope_head_dim") else 0
    state.set("qk_rope_head_dim", rope)
    if state.count("qk_head_dim") is not None:
        state.set("qk_head_dim", rope + nope)
    if state.get("head_dim") == state.get("qk_rope_head_dim"):
        state.set("head_dim", rope)


def _rope_lists(state: _Shrinking, head_dim: int, head_dim_new: int, fraction: float) -> None:
    """Cuts the rope lists that follow the rotary dimension (long-rope factors, mrope
    sections) to the new one."""
    key = "rope_parameters" if state.name("rope_parameters") else "rope_scaling"
    rope = state.get(key)
    if not isinstance(rope, dict) or not rope:
        return
    half, half_new = int(head_dim * fraction) // 2, int(head_dim_new * fraction) // 2
    nested = all(isinstance(value, dict) for value in rope.values())
    layers = rope if nested else {None: rope}
    cut = {name: _cut_rope(dict(values), half, half_new) for name, values in layers.items()}
    if cut != layers:
        state.set(key, cut if nested else cut[None])


def _cut_rope(rope: dict[str, Any], half: int, half_new: int) -> dict[str, Any]:
    for key, value in rope.items():
        if key == "mrope_section" and isinstance(value, list) and value:
            rope[key] = _sections(value, half_new)
        elif isinstance(value, list) and len(value) == half and half:
            rope[key] = value[:half_new]
    return rope


def _sections(sections: Sequence[int], total: int) -> list[int]:
    """``sections`` scaled to sum to ``total``, each at least 1 (largest remainders)."""
    whole = sum(sections)
    shares = [max(1, section * total // whole) for section in sections]
    order = sorted(range(len(sections)), key=lambda i: -(sections[i] * total / whole - shares[i]))
    for i in order[: max(0, total - sum(shares))]:
        shares[i] += 1
    while sum(shares) > total:
        shares[shares.index(max(shares))] -= 1
    return shares


def _secondary_heads(state: _Shrinking) -> None:
    """Linear-attention, state-space and indexer heads: the same rule as attention's."""
    for heads_field, kv_field in HEAD_GROUPS:
        if state.count(heads_field) is None:
            continue
        heads_new, kv_new = _key_value_heads(state, heads_field, kv_field)
        state.set(heads_field, heads_new)
        if kv_field is not None and state.count(kv_field) is not None:
            state.set(kv_field, kv_new)
    for name, width in SMALL_WIDTHS.items():
        value = state.count(name)
        if value is not None and name not in state.changes:
            state.set(name, min(value, width))
    _derived_widths(state)


#: State-space widths tied together: (heads, head dimension, expansion) with heads x head
#: dimension = expansion x hidden size (Bamba, Nemotron-H), and the field (if any) holding
#: heads x head dimension (Falcon-H1's ``mamba_d_ssm``).
STATE_SPACE = (
    ("mamba_n_heads", "mamba_d_head", "mamba_expand", "mamba_d_ssm"),
    ("mamba_num_heads", "mamba_head_dim", "expand", None),
)


def _derived_widths(state: _Shrinking) -> None:
    """Widths defined by others stay so: the state-space heads x head dimension (see
    ``STATE_SPACE``), and the groups of state-space heads (``n_groups``) dividing the heads."""
    for heads_field, dim_field, expand_field, inner_field in STATE_SPACE:
        heads, dim = state.count(heads_field), state.count(dim_field)
        if not (heads and dim):
            continue
        heads_new, dim_new = state.changes[heads_field], state.changes[dim_field]
        expand, hidden = state.count(expand_field), state.count("hidden_size")
        if expand and hidden and heads * dim == expand * hidden:
            inner = expand * state.changes[state.name("hidden_size") or "hidden_size"]
            if inner % heads_new:
                raise state.refuse(heads_field, f"cannot keep {heads_field} x {dim_field} = {expand_field} x hidden_size with {heads_new} heads")
            dim_new = inner // heads_new
            state.set(dim_field, dim_new)
        if inner_field is not None and state.count(inner_field) == heads * dim:
            state.set(inner_field, heads_new * dim_new)
        groups = state.count("n_groups")
        if groups is not None and heads % groups == 0:
            state.set("n_groups", math.gcd(groups, heads_new))


# --- widths, vocabulary, windows, experts --------------------------------------------------


def _feed_forward(state: _Shrinking) -> None:
    """Feed-forward widths, scaled with the hidden size to multiples of 2 x tp."""
    hidden = state.count("hidden_size")
    assert hidden is not None
    scale = state.changes[state.name("hidden_size") or "hidden_size"] / hidden
    for name in FEED_FORWARD:
        value = state.get(name)
        if _is_int(value) and value > 0:
            state.set(name, _scaled(value, scale, 2 * state.tp))
        elif isinstance(value, list) and value and all(_is_int(width) for width in value):
            state.set(name, [_scaled(width, scale, 2 * state.tp) for width in value])


def _vocabulary(state: _Shrinking) -> None:
    """The vocabulary, and the special token ids it no longer holds."""
    vocab = _round_up(VOCAB, state.tp)
    for name in VOCABULARIES:
        value = state.count(name)
        if value is not None:
            state.set(name, min(value, vocab) if value % state.tp == 0 else vocab)
    size = state.changes.get(state.name("vocab_size") or "vocab_size", vocab)
    outside = sorted(
        {token for name, value in state.fields.items() if name.endswith("_token_id") for token in _ids(value) if token >= size}
    )
    moved = {token: size - 1 - i for i, token in enumerate(outside)}
    for name, value in state.fields.items():
        if name.endswith("_token_id") and any(token in moved for token in _ids(value)):
            state.changes[name] = [moved.get(t, t) for t in value] if isinstance(value, list) else moved[value]


def _ids(value: object) -> list[int]:
    if _is_int(value):
        return [value]  # type: ignore[list-item]
    return [token for token in value if _is_int(token)] if isinstance(value, list) else []


def _windows(state: _Shrinking) -> None:
    for name in WINDOWS:
        value = state.count(name)
        if value is not None:
            state.set(name, min(value, WINDOW))


def _experts(state: _Shrinking) -> None:
    """Routed experts (2 per token when there were 2 or more), groups, shared experts."""
    experts_field = next((name for name in EXPERTS if state.count(name) is not None), None)
    if experts_field is None:
        return
    experts = state.count(experts_field)
    assert experts is not None
    per_token_field = next((name for name in EXPERTS_PER_TOKEN if state.count(name) is not None), None)
    per_token = state.count(per_token_field) if per_token_field else None
    unset = next((name for name in EXPERTS_PER_TOKEN if state.name(name) and state.get(name) is None), None)
    if per_token is None and unset is not None and experts > 1:
        raise state.refuse(unset, f"leaves the {experts_field}={experts} experts without a number of experts per token; set it in the configuration")
    if per_token is not None and per_token > experts:
        raise state.refuse(per_token_field or "", f"routes each token to more experts than {experts_field}={experts}")
    per_token_new = min(per_token or 1, 2)
    experts_new = min(experts, max(4, 2 * per_token_new))
    groups = state.count("n_group")
    if groups is not None and groups > 1:
        groups_new = 2 if experts_new % 2 == 0 else 1
        state.set("n_group", groups_new)
        chosen = state.count("topk_group")
        if chosen is not None:
            state.set("topk_group", groups_new if chosen >= groups else max(1, groups_new - 1))
    state.set(experts_field, experts_new)
    if per_token_field is not None:
        state.set(per_token_field, per_token_new)
    for name in SHARED_EXPERTS:
        shared = state.count(name)
        if shared is not None:
            state.set(name, min(shared, 2))


# --- layers --------------------------------------------------------------------------------


def _per_layer_fields(state: _Shrinking, layers: int) -> list[str]:
    """The fields holding one value per layer (``layer_types``, ``mlp_layer_types``...)."""
    current = {**state.fields, **state.changes}
    return [
        name
        for name, value in current.items()
        if isinstance(value, list) and len(value) == layers and name not in LAYER_INDICES
    ]


def _index_fields(state: _Shrinking) -> list[str]:
    """The fields listing layers by index (``mlp_only_layers``...)."""
    return [
        name
        for name in LAYER_INDICES
        if isinstance(state.get(name), list) and all(_is_int(index) for index in state.get(name))
    ]


@dataclass(frozen=True)
class _Pattern:
    """One per-layer field as a prefix, a repeated period and a suffix of odd last layers:
    DeepSeek's ``mlp_layer_types`` (3 dense layers, then experts) is prefix 3, period 1;
    a sliding-window pattern of 5 + 1 whose last layer is forced to full attention is
    period 6, suffix 1."""

    values: Sequence[Any]
    prefix: int
    period: int
    suffix: int

    def length(self, least: int) -> int:
        """The fewest layers holding the prefix, whole periods and the suffix, ``least`` or more."""
        middle = max(least - self.prefix - self.suffix, self.period)
        return self.prefix + self.period * -(-middle // self.period) + self.suffix

    def cut(self, count: int) -> list[Any]:
        """The pattern over ``count`` layers: the prefix, the period repeated, the suffix."""
        body = count - self.suffix
        head = [self.values[i if i < self.prefix else self.prefix + (i - self.prefix) % self.period] for i in range(body)]
        return head + list(self.values[len(self.values) - self.suffix :])


#: The most last layers a pattern may end with that differ from its period.
MAX_SUFFIX = 2


def _pattern(values: Sequence[Any]) -> _Pattern | None:
    """The shortest description of ``values`` within ``MAX_LAYERS``, None when there is none."""
    layers = len(values)
    for length in range(1, min(layers, MAX_LAYERS) + 1):
        for suffix in range(min(MAX_SUFFIX, length - 1) + 1):
            for prefix in range(length - suffix):
                period = length - suffix - prefix
                if all(values[i] == values[i - period] for i in range(prefix + period, layers - suffix)):
                    return _Pattern(values, prefix, period, suffix)
    return None


def _columns(state: _Shrinking, layers: int) -> dict[str, list[Any]]:
    """Each per-layer property as one value per layer: the per-layer lists, the layer index
    lists as membership, and the ``*_layer_period``/``*_layer_offset`` pairs (Jamba's
    attention every 8 layers from the 4th) as whether each layer is one."""
    current = {**state.fields, **state.changes}
    columns = {name: list(current[name]) for name in _per_layer_fields(state, layers)}
    for name in _index_fields(state):
        columns[name] = [i in state.get(name) for i in range(layers)]
    for name in state.fields:
        if name.endswith("_layer_period") and (period := state.count(name)):
            offset = state.get(name.replace("_period", "_offset"))
            offset = offset if _is_int(offset) else 0
            columns[name] = [i % period == offset for i in range(layers)]
    for name in LEADING_LAYERS:
        if (leading := state.count(name)) is not None:
            columns[name] = [i < leading for i in range(layers)]
    overrides = state.get(PER_LAYER_CONFIG)
    if isinstance(overrides, dict) and overrides:
        by_layer = {int(key): value for key, value in overrides.items()}
        columns[PER_LAYER_CONFIG] = [by_layer.get(i, {}) for i in range(layers)]
    return columns


def _depth(state: _Shrinking) -> tuple[str | None, int]:
    """(the field counting the layers, or None where a list's length does, the count)."""
    for name in ("num_hidden_layers", "num_layers"):
        if (layers := state.count(name)) is not None:
            return name, layers
    for name in LAYER_LISTS:
        if isinstance(blocks := state.get(name), list) and blocks:
            return None, len(blocks)
    raise state.refuse("num_hidden_layers", "is not a positive int: shrink needs the number of layers")


def _layers(state: _Shrinking, pp: int) -> None:
    """The depth: at least ``pp`` layers and 2, and each per-layer pattern's prefix, one
    whole period or more, and its suffix."""
    if _layer_stacks(state, pp):
        return
    layers_field, layers = _depth(state)
    # two layers at least: a stack of layers (what FSDP wraps, what a pipeline splits)
    least = max(pp, 2, state.count("decoder_sparse_step") or 1)
    patterns = {}
    for name, values in _columns(state, layers).items():
        pattern = _pattern(values)
        if pattern is None:
            raise state.refuse(name, f"has no per-layer pattern (a prefix, a repeated period, up to {MAX_SUFFIX} odd last layers) within MAX_LAYERS={MAX_LAYERS} layers")
        patterns[name] = pattern
    count = max([least, *(pattern.length(least) for pattern in patterns.values())])
    if count > MAX_LAYERS:
        name = max(patterns, key=lambda key: patterns[key].length(least))
        raise state.refuse(name, f"needs {count} layers to keep its per-layer pattern, more than MAX_LAYERS={MAX_LAYERS}")
    if layers_field is not None:
        state.set(layers_field, count)
    for name, pattern in patterns.items():
        values = pattern.cut(count)
        if name in LAYER_INDICES:
            state.changes[name] = [i for i, member in enumerate(values) if member]
        elif name in LEADING_LAYERS:
            state.set(name, sum(values))
        elif name == PER_LAYER_CONFIG:
            state.set(name, _overrides(state, values))
        elif not name.endswith("_layer_period"):  # the period and offset stay as they are
            state.changes[name] = values
    _layer_counts(state, layers, count)
    _shared_key_values(state, layers, count)


def _shared_key_values(state: _Shrinking, layers: int, count: int) -> None:
    """The last layers that reuse earlier layers' keys and values (Gemma 3n's
    ``num_kv_shared_layers``): the same share of the layers, after at least one layer of
    each attention type that computes its own."""
    shared = state.count("num_kv_shared_layers")
    if shared is None:
        return
    types = state.changes.get("layer_types") or [None] * count
    own = 1 + max(types.index(kind) for kind in set(types))
    if count - own < 1:
        raise state.refuse("num_kv_shared_layers", f"leaves no layer to share in {count} layers whose first {own} compute their own keys and values")
    state.set("num_kv_shared_layers", max(1, min(round(shared * count / layers), count - own)))


def _overrides(state: _Shrinking, layers: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per-layer overrides (heterogeneous configurations' ``per_layer_config``) for the new
    layers, each width scaled as shrink scaled the same field of the whole configuration
    (Gemma 4's full-attention layers' head_dim 512 against 256 keep twice the head_dim)."""
    width = len(next(iter(state.get(PER_LAYER_CONFIG))))
    shrunk = {}
    for index, override in enumerate(layers):
        if override:
            shrunk[str(index).zfill(width)] = {key: _override(state, key, value) for key, value in override.items()}
    return shrunk


def _override(state: _Shrinking, key: str, value: Any) -> Any:
    original, new = state.get(key), state.changes.get(state.name(key) or key)
    if not (_is_int(value) and _is_int(original) and _is_int(new) and original):
        return value
    multiple = 2 if key.endswith(("head_dim", "_rank")) else 1
    scaled = _scaled(value, new / original, multiple)
    return _round_up(scaled, state.tp) if key.endswith("heads") else scaled


def _layer_stacks(state: _Shrinking, pp: int) -> bool:
    """Layers run in cycles over one stack (HRM: ``num_hidden_layers`` counts the stack's
    layers times its cycles): the stack shrinks, the cycles stay. Whether it applied."""
    stack, high, low, layers = (state.count(name) for name in ("num_layers_per_stack", "H_cycles", "L_cycles", "num_hidden_layers"))
    if not (stack and high and low and layers == stack * high * (low + 1)):
        return False
    stack_new = min(stack, max(pp, 2))
    state.set("num_layers_per_stack", stack_new)
    state.set("num_hidden_layers", stack_new * high * (low + 1))
    return True


def _layer_counts(state: _Shrinking, layers: int, count: int) -> None:
    """Fields that count or index layers, kept within the new depth."""
    window_layers = state.count("max_window_layers")
    if window_layers is not None:
        state.set("max_window_layers", min(window_layers, count) if window_layers < layers else count)


# --- the result ----------------------------------------------------------------------------


_STEPS: tuple[Callable[[_Shrinking], None], ...] = (_attention, _secondary_heads, _feed_forward, _vocabulary, _windows, _experts)


def _changed(state: _Shrinking) -> str:
    """The fields shrink changed, for a refusal (lists and dicts by name only)."""
    return ", ".join(
        name if isinstance(value, list | dict) else f"{name}={value!r}" for name, value in sorted(state.changes.items())
    )


def _rebuilt(state: _Shrinking) -> PretrainedConfig:
    """The configuration with the changes, built and checked by transformers itself."""
    try:
        return type(state.config).from_dict({**state.fields, **state.changes})
    # transformers validates a configuration with many exception types (ValueError,
    # StrictDataclassClassValidationError, AssertionError...): each is a refusal to report.
    except Exception as error:
        raise InvalidArgument(f"shrink: {state.model_type}: transformers rejects the shrunk configuration ({_changed(state)}): {type(error).__name__}: {error}") from error


def _original_builds(config: PretrainedConfig) -> str:
    """What building the original configuration (on the meta device) says, for a refusal:
    a default configuration that does not build is the architecture's problem, not shrink's."""
    try:
        _meta_parameters(config)
    # as in _within_budget: the architecture's own code, whatever it raises
    except Exception as error:
        return f" (the original configuration does not build either: {type(error).__name__}: {error})"
    return " (the original configuration builds)"


def _within_budget(state: _Shrinking, shrunk: PretrainedConfig, max_params: int) -> None:
    """Builds the shrunk model on the meta device and counts its parameters."""
    try:
        parameters = _meta_parameters(shrunk)
    # Building runs the architecture's own code on the shrunk sizes; whatever it raises
    # means the structure was not kept in a form the architecture accepts.
    except Exception as error:
        raise InvalidArgument(
            f"shrink: {state.model_type}: the shrunk configuration ({_changed(state)}) does not build: {type(error).__name__}: "
            f"{error}{_original_builds(state.config)}"
        ) from error
    total = sum(tensor.numel() for _, tensor in parameters)
    if total > max_params:
        largest = sorted(parameters, key=lambda item: -item[1].numel())[:3]
        named = ", ".join(f"{name} {tuple(tensor.shape)}" for name, tensor in largest)
        raise InvalidArgument(
            f"shrink: {state.model_type}: the shrunk model still has {total:,} parameters, over "
            f"max_params={max_params:,} (largest: {named}); a field shrink does not cut keeps "
            "it large: pass a larger max_params"
        )
