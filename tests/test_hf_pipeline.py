"""dpverify.hf.pipeline: Hugging Face causal LMs cut by their base_model_pp_plan into a
chain of children that assert_pipeline_grads_match splits into stages. Tiny float64 models
built from configurations (nothing downloaded)."""

from __future__ import annotations

import functools
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from dpverify import (
    InvalidArgument,
    ParallelMismatch,
    assert_pipeline_grads_match,
    assert_pipeline_training_matches,
    sync_tied_grads,
)
from dpverify.ddp.pool import DDPWorkerPool
from dpverify.hf.pipeline import (
    Layer,
    model_names,
    pipeline_module,
    require_same_logits,
    split_points_for,
)

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

#: Each family's published structure at a CPU size: GQA (4 heads, 2 key-value heads),
#: Qwen2's biases, Qwen2.5's tied embeddings, Mistral's sliding window (3, shorter than the
#: sequence of 8), Gemma2's alternating sliding/full layers and soft-capping (untied here:
#: a weight two stages hold fails the gradient check, see the tied tests), Mixtral's experts.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen2.5-tied": ("qwen2", {"tie_word_embeddings": True}),
    "mistral-sliding": ("mistral", {"sliding_window": 3}),
    "gemma2": ("gemma2", {"tie_word_embeddings": False, "sliding_window": 3, "head_dim": 4, "final_logit_softcapping": 5.0, "attn_logit_softcapping": 10.0}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # beyond the families above: rotary embeddings of each layer type's own base (Gemma3),
    # and the scalings their forwards apply outside the layers (Cohere, Granite)
    "gemma3": ("gemma3_text", {"tie_word_embeddings": False, "sliding_window": 3, "sliding_window_pattern": 2, "head_dim": 4}),
    "cohere": ("cohere", {"tie_word_embeddings": False, "logit_scale": 0.25}),
    "granite": ("granite", {"embedding_multiplier": 3.0, "logits_scaling": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.25}),
    # a dropout between the embedding and the layers in the plan, other names for its pieces
    "phi": ("phi", {}),
    "gpt_neox": ("gpt_neox", {"tie_word_embeddings": False}),
}


def build(family: str, layers: int = 2) -> Any:
    """The family's tiny float64 model, seeded (Mixtral's experts in eager mode: the grouped
    matmul kernel takes no float64)."""
    kind, extra = FAMILIES[family]
    config = transformers.CONFIG_MAPPING[kind](
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, **extra,
    )
    config.pad_token_id = 0  # some families' default lies outside the tiny vocabulary
    torch.manual_seed(0)
    options = {"experts_implementation": "eager"} if kind == "mixtral" else {}
    return transformers.AutoModelForCausalLM.from_config(config, **options).double()


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, ignoring -100 (padding)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=-100)


IDS = torch.randint(1, 64, (4, 8), generator=torch.Generator().manual_seed(0))
#: Right padding on rows 1 and 3: both microbatches of 2 rows hold 12 predicted tokens, so
#: the mean of their token means is the batch's token mean.
MASK = torch.ones(4, 8, dtype=torch.long)
MASK[[1, 3], 6:] = 0
LABELS = IDS.masked_fill(MASK == 0, -100)


# --------------------------------------------------------------------------- the module


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("masked", [False, True], ids=["no mask", "right padding"])
def test_the_pipeline_module_gives_the_model_s_logits(family: str, masked: bool) -> None:
    model = build(family, layers=4)
    module = pipeline_module(model)
    inputs = (IDS, MASK) if masked else (IDS,)
    with torch.no_grad():
        want = model(input_ids=IDS, attention_mask=MASK if masked else None).logits
        assert torch.equal(module(*inputs), want)
    assert [name for name, _child in module.named_children()] == ["embed", "layers_0", "layers_1", "layers_2", "layers_3", "head"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_children_hold_the_model_s_own_parameters_under_names_that_map_back(family: str) -> None:
    model = build(family)
    module = pipeline_module(model)
    theirs = dict(model.named_parameters(remove_duplicate=False))
    mapped = model_names(module)
    assert sorted(mapped.values()) == sorted(theirs)
    for mine, param in module.named_parameters(remove_duplicate=False):
        assert param is theirs[mapped[mine]], mine
    assert mapped["head.lm_head.weight"] == "lm_head.weight"
    tied = module.head.lm_head.weight is module.embed.embed_tokens.weight
    assert tied == (family == "qwen2.5-tied")


def test_the_names_follow_the_base_model_prefix_and_the_plan() -> None:
    llama = model_names(pipeline_module(build("llama")))
    assert llama["layers_1.layer.self_attn.q_proj.weight"] == "model.layers.1.self_attn.q_proj.weight"
    assert llama["head.norm.weight"] == "model.norm.weight"
    neox = model_names(pipeline_module(build("gpt_neox")))
    assert neox["embed.embed_tokens.weight"] == "gpt_neox.embed_in.weight"
    assert neox["head.norm.weight"] == "gpt_neox.final_layer_norm.weight"
    assert neox["head.lm_head.weight"] == "lm_head.weight"


def test_a_sliding_window_layer_gets_the_sliding_mask_and_a_full_layer_the_full_one() -> None:
    module = pipeline_module(build("gemma2", layers=4))
    _hidden, *context = module.embed(IDS)
    assert module.embed.kinds == ("sliding_attention", "full_attention")
    assert [layer.kind for layer in (module.layers_0, module.layers_1, module.layers_2, module.layers_3)] == [0, 1, 0, 1]
    assert len(context) == 6  # (cos, sin, mask) of each kind
    assert all(tensor.size(0) == IDS.size(0) for tensor in context)
    masks = context[2::3]
    # eager masks are additive: 0 where a query sees a key. Query 7 sees key 0 with full
    # attention only (the window is 3)
    sliding, full = masks
    assert sliding[0, 0, 7, 0] < 0
    assert full[0, 0, 7, 0] == 0
    assert sliding[0, 0, 7, 6] == 0


def test_gemma3_s_sliding_and_full_layers_get_their_own_rotary_embeddings() -> None:
    module = pipeline_module(build("gemma3"))
    _hidden, sliding_cos, _sin, _mask, full_cos, *_rest = module.embed(IDS)
    assert module.embed.kinds == ("sliding_attention", "full_attention")
    assert not torch.allclose(sliding_cos, full_cos)


def test_mistral_s_window_shorter_than_the_sequence_changes_the_logits() -> None:
    # the check would not see a lost sliding window if the window changed nothing here
    model = build("mistral-sliding")
    with torch.no_grad():
        windowed = pipeline_module(model)(IDS)
        model.config.sliding_window = None
        full = pipeline_module(model)(IDS)
    assert not torch.allclose(windowed, full)


def test_require_same_logits_refuses_a_module_that_lost_the_soft_capping() -> None:
    model = build("gemma2")
    module = pipeline_module(model)
    require_same_logits(model, module, IDS, MASK)
    module.head.softcap = None
    with pytest.raises(InvalidArgument, match=r"pipeline_module\(Gemma2ForCausalLM\) does not give the model's logits .* largest difference"):
        require_same_logits(model, module, IDS, MASK)


def test_require_same_logits_refuses_a_module_that_fails_where_the_model_runs() -> None:
    model = build("llama")
    module = pipeline_module(model)
    module.layers_0.kind = 1  # no such kind of attention: the layer's context is out of range
    with pytest.raises(InvalidArgument, match=r"pipeline_module\(LlamaForCausalLM\) fails where the model runs: ValueError"):
        require_same_logits(model, module, IDS)


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("family", "field", "value", "message"),
    [
        ("llama", "base_model_pp_plan", None, r"LlamaConfig has no base_model_pp_plan"),
        (
            "llama", "base_model_pp_plan", {"embed_tokens": (["input_ids"], ["inputs_embeds"]), "layers": (["hidden_states"], ["hidden_states"])},
            r"has the pieces \['embed_tokens', 'layers'\]; dpverify splits the layout embedding, \(pieces",
        ),
        (
            "llama", "base_model_pp_plan", {"embed_tokens": ([], []), "layers": ([], []), "norm": ([], []), "rotary_emb": ([], [])},
            r"model\.norm is LlamaRMSNorm, not a non-empty ModuleList of decoder layers",
        ),
        (
            "llama", "base_model_pp_plan", {"embed_tokens": ([], []), "blocks": ([], []), "norm": ([], [])},
            r"its base model LlamaModel has no module 'blocks' \(the decoder layers",
        ),
        ("llama", "_attn_implementation", "flex_attention", r"attn_implementation='flex_attention'.* model\.set_attn_implementation\('sdpa'\)"),
        ("gemma3", "use_bidirectional_attention", True, r"model=Gemma3ForCausalLM has use_bidirectional_attention set"),
        ("qwen2", "layer_types", ["full_attention", "chunked_attention"], r"not of \['chunked_attention'\]"),
    ],
    ids=["no-pp-plan", "other-pieces", "layers-not-second-to-last", "missing-module", "flex-attention", "bidirectional", "chunked-attention"],
)
def test_a_configuration_the_cut_cannot_follow_is_refused_naming_what(family: str, field: str, value: Any, message: str) -> None:
    model = build(family)
    setattr(model.config, field, value)
    with pytest.raises(InvalidArgument, match=message):
        pipeline_module(model)


def test_a_base_model_without_its_lm_head_is_refused() -> None:
    base = build("llama").model
    with pytest.raises(InvalidArgument, match=r"model=LlamaModel has no base model under base_model_prefix='model'"):
        pipeline_module(base)


def test_without_transformers_the_refusal_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build("llama")
    monkeypatch.setitem(sys.modules, "transformers", None)  # what an absent package imports as
    with pytest.raises(InvalidArgument, match=r"pip install 'dpverify\[hf\]'"):
        pipeline_module(model)


def test_something_that_is_not_a_transformers_model_is_refused() -> None:
    with pytest.raises(InvalidArgument, match=r"model=Linear is not a transformers PreTrainedModel"):
        pipeline_module(torch.nn.Linear(2, 2))


@pytest.mark.parametrize(("layers", "pp", "points"), [(4, 2, ["layers_2"]), (4, 3, ["layers_2", "layers_3"]), (3, 2, ["layers_2"]), (2, 2, ["layers_1"])])
def test_split_points_spread_the_layers_evenly_with_embedding_first_and_head_last(layers: int, pp: int, points: list[str]) -> None:
    assert split_points_for(pipeline_module(build("llama", layers=layers)), pp) == points


@pytest.mark.parametrize(("pp", "message"), [(3, r"pp=3 stages for a model of 2 decoder layers"), (1, r"pp=1: pass the number of pipeline stages")])
def test_split_points_refuse_more_stages_than_layers_or_fewer_than_two(pp: int, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        split_points_for(pipeline_module(build("llama")), pp)


# --------------------------------------------------------------------------- on ranks


def check(module: Any, pp: int = 2, **options: Any) -> Any:
    return assert_pipeline_grads_match(
        module, (IDS, MASK), LABELS, loss_fn=lm_loss, world_size=pp, n_microbatches=2,
        split_points=split_points_for(module, pp), **options,
    )


def test_a_llama_split_by_its_pp_plan_matches_one_device_with_padding(ddp_pool: DDPWorkerPool) -> None:
    module = pipeline_module(build("llama"))
    result = check(module, pool=ddp_pool)
    assert "stage 0 children ['embed', 'layers_0']; stage 1 children ['layers_1', 'head']" in result.scenario
    compared = {row.id.name for row in result.tensors if row.id.kind == "grad"}
    assert compared == {name for name, _param in module.named_parameters()}


class DropsTheMaskAtAStageStart(Layer):
    """A stage that receives only the hidden states' worth of what it needs: at a stage's
    start (the tensors come as arguments) it runs its layer without the padding mask."""

    def forward(self, *args: Any) -> tuple[torch.Tensor, ...]:
        if len(args) == 1:
            return super().forward(*args)
        hidden, *context = args
        cos, sin, _mask = context[3 * self.kind : 3 * self.kind + 3]
        output = self.layer(hidden, attention_mask=None, position_embeddings=(cos, sin), cache=None, use_cache=False)
        return (output, *context)


class SkipsItsLayerAtAStageStart(Layer):
    """A stage whose first layer is left out: at a stage's start it passes its inputs on."""

    def forward(self, *args: Any) -> tuple[torch.Tensor, ...]:
        return super().forward(*args) if len(args) == 1 else tuple(args)


def failing(mismatch: pytest.ExceptionInfo[ParallelMismatch]) -> set[str]:
    """The compared tensors that did not match, as ``kind name`` (``output`` for the logits)."""
    return {f"{row.id.kind} {row.id.name}".strip() for row in mismatch.value.report.tensors if not row.ok}


@pytest.mark.deep
def test_a_stage_that_drops_the_padding_mask_is_caught_on_the_padded_positions_logits(ddp_pool: DDPWorkerPool) -> None:
    module = pipeline_module(build("llama"))
    module.layers_1 = DropsTheMaskAtAStageStart(module.layers_1.layer, module.layers_1.kind)
    with pytest.raises(ParallelMismatch) as mismatch:
        check(module, pool=ddp_pool)
    # right padding: only the padded positions' logits change, and their loss is ignored
    assert failing(mismatch) == {"output output"}


@pytest.mark.parametrize(("family", "mutant"), [
    ("mistral-sliding", DropsTheMaskAtAStageStart),  # the sliding window lost: later positions attend too far back
    pytest.param("llama", SkipsItsLayerAtAStageStart, marks=pytest.mark.deep),
])
def test_a_stage_that_loses_the_window_or_its_layer_is_caught_on_the_gradients(ddp_pool: DDPWorkerPool, family: str, mutant: type[Layer]) -> None:
    module = pipeline_module(build(family))
    module.layers_1 = mutant(module.layers_1.layer, module.layers_1.kind)
    with pytest.raises(ParallelMismatch) as mismatch:
        check(module, pool=ddp_pool)
    assert {"grad layers_1.layer.self_attn.v_proj.weight", "grad embed.embed_tokens.weight", "output output"} <= failing(mismatch)


def test_tied_embeddings_on_the_first_and_last_stage_are_named(ddp_pool: DDPWorkerPool) -> None:
    # Qwen2.5's lm_head weight is its embedding: each stage holds a copy and gets part of the gradient
    with pytest.raises(ParallelMismatch, match=r"'embed.embed_tokens.weight' by stages \[0, 1\]"):
        check(pipeline_module(build("qwen2.5-tied")), pool=ddp_pool)


@pytest.mark.deep
@pytest.mark.parametrize("family", ["qwen2", "mistral-sliding", "gemma2", "mixtral", "gemma3", "granite", "phi"])
def test_each_family_split_by_its_pp_plan_matches_one_device(ddp_pool: DDPWorkerPool, family: str) -> None:
    model = build(family, layers=4)
    check(pipeline_module(model), pool=ddp_pool)


@pytest.mark.deep
@pytest.mark.parametrize("ddp_pool", [4], indirect=True)
def test_four_stages_of_one_layer_each_match_one_device(ddp_pool: DDPWorkerPool) -> None:
    module = pipeline_module(build("gemma2", layers=4))
    result = check(module, pp=4, pool=ddp_pool)
    assert "stage 0 children ['embed', 'layers_0']; stage 1 children ['layers_1']; stage 2 children ['layers_2']; stage 3 children ['layers_3', 'head']" in result.scenario


@pytest.mark.deep
def test_tied_embeddings_train_like_one_device_when_the_stages_sum_their_gradients(ddp_pool: DDPWorkerPool) -> None:
    module = pipeline_module(build("qwen2.5-tied"))
    assert_pipeline_training_matches(
        module, [((IDS, MASK), LABELS)] * 2, loss_fn=lm_loss, optimizer=functools.partial(torch.optim.SGD, lr=0.1), world_size=2, n_microbatches=2,
        split_points=split_points_for(module, 2), after_backward=sync_tied_grads, pool=ddp_pool,
    )
