"""dpverify.hf: published Hugging Face configurations shrunk to a CPU size with their
structure kept, the shrunk models built and run on a padded token batch, and the refusals.

The configurations under tests/hf_configs are the published config.json files of
Llama-3-8B, Qwen2-7B, Qwen2.5-0.5B, Mistral-7B-v0.1 and Mixtral-8x7B-v0.1.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from dpverify import InvalidArgument  # noqa: E402
from dpverify.hf import (  # noqa: E402
    SEQ_LEN,
    WINDOW,
    build_model,
    dropout_fields,
    lm_loss,
    load_config,
    parameter_count,
    shrink,
    token_batch,
)
from dpverify.hf.base import require_transformers  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "hf_configs"
PUBLISHED = ("Llama-3-8B", "Qwen2-7B", "Qwen2.5-0.5B", "Mistral-7B-v0.1", "Mixtral-8x7B-v0.1")
ROOT = Path(__file__).resolve().parent.parent


def _published(name: str) -> Any:
    return load_config(CONFIGS / f"{name}.json")


# --- the published configurations ----------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "model_type", "fields"),
    [
        ("Llama-3-8B", "llama", {"hidden_size": 4096, "num_key_value_heads": 8, "vocab_size": 128256}),
        ("Qwen2-7B", "qwen2", {"num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944}),
        ("Qwen2.5-0.5B", "qwen2", {"tie_word_embeddings": True, "num_key_value_heads": 2, "vocab_size": 151936}),
        ("Mistral-7B-v0.1", "mistral", {"sliding_window": 4096, "num_hidden_layers": 32}),
        ("Mixtral-8x7B-v0.1", "mixtral", {"num_local_experts": 8, "num_experts_per_tok": 2}),
    ],
)
def test_load_config_reads_the_published_numbers(name: str, model_type: str, fields: dict[str, Any]) -> None:
    config = _published(name)
    assert config.model_type == model_type
    assert {key: getattr(config, key) for key in fields} == fields


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", PUBLISHED)
def test_shrink_keeps_the_structure(name: str, tp: int, pp: int) -> None:
    config = _published(name)
    before = config.to_dict()
    shrunk = shrink(config, tp=tp, pp=pp)

    assert config.to_dict() == before, "shrink changed its argument"
    assert type(shrunk) is type(config)
    assert shrunk is not config
    # grouped-query attention: the same ratio, still grouped, split over tp
    ratio = config.num_attention_heads // config.num_key_value_heads
    assert shrunk.num_attention_heads == ratio * shrunk.num_key_value_heads
    assert shrunk.num_key_value_heads >= 2
    assert shrunk.num_key_value_heads % tp == 0
    assert shrunk.num_attention_heads % tp == 0
    head_dim = getattr(shrunk, "head_dim", None) or shrunk.hidden_size // shrunk.num_attention_heads
    assert head_dim % 2 == 0
    assert shrunk.hidden_size == shrunk.num_attention_heads * head_dim
    assert shrunk.intermediate_size % tp == 0
    assert shrunk.vocab_size % tp == 0
    assert shrunk.hidden_size < config.hidden_size
    assert shrunk.vocab_size < config.vocab_size
    assert shrunk.num_hidden_layers >= max(pp, 2)
    # what is not a width stays
    assert shrunk.tie_word_embeddings == config.tie_word_embeddings
    assert shrunk.rope_parameters == config.rope_parameters
    for bias in ("attention_bias", "mlp_bias"):
        assert getattr(shrunk, bias, None) == getattr(config, bias, None)
    assert shrunk.hidden_act == config.hidden_act
    assert shrunk.rms_norm_eps == config.rms_norm_eps
    for token in ("bos_token_id", "eos_token_id"):
        assert 0 <= getattr(shrunk, token) < shrunk.vocab_size
    assert (shrunk.bos_token_id == shrunk.eos_token_id) == (config.bos_token_id == config.eos_token_id)
    assert parameter_count(shrunk) <= 2_000_000


def test_shrink_keeps_the_sliding_window_shorter_than_the_sequence() -> None:
    config = _published("Mistral-7B-v0.1")
    assert shrink(config).sliding_window == WINDOW < SEQ_LEN
    assert shrink(_published("Mixtral-8x7B-v0.1")).sliding_window is None  # no window stays none


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shrink_keeps_the_experts(tp: int) -> None:
    shrunk = shrink(_published("Mixtral-8x7B-v0.1"), tp=tp, pp=2)
    assert (shrunk.num_local_experts, shrunk.num_experts_per_tok) == (4, 2)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(shrunk)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape[0] == 4
    assert experts.gate_up_proj.shape[1] % tp == 0


def test_shrink_keeps_a_per_layer_pattern_and_its_period() -> None:
    config = load_config("gemma3_text")  # five sliding layers, then a full one, repeated
    assert config.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert shrink(config, pp=2).layer_types == config.layer_types[:6]
    assert shrink(config, pp=8).layer_types == config.layer_types[:6] * 2
    assert shrink(config).sliding_window == WINDOW


def test_shrink_keeps_odd_last_layers_of_a_pattern() -> None:
    """Four periods of five sliding layers and a full one, then three sliding layers and a
    full last one: one period, and the full last layer."""
    config = load_config("gemma3_text")
    sliding, full = "sliding_attention", "full_attention"
    layer_types = [sliding] * 5 + [full]
    forced = type(config).from_dict({**config.to_dict(), "num_hidden_layers": 28, "layer_types": layer_types * 4 + [sliding] * 3 + [full]})
    assert shrink(forced).layer_types == [*layer_types, full]


def test_shrink_keeps_layer_periods_and_offsets() -> None:
    config = load_config("jamba")  # attention every 8 layers from the 4th, experts every 2 from the 1st
    shrunk = shrink(config)
    assert shrunk.num_hidden_layers == 8
    assert (shrunk.attn_layer_period, shrunk.attn_layer_offset) == (config.attn_layer_period, config.attn_layer_offset)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(shrunk)
    kinds = ["Attention" in type(layer).__name__ for layer in model.model.layers]
    assert kinds == [i == 4 for i in range(8)]


def test_shrink_scales_per_layer_overrides() -> None:
    config = load_config("gemma4_text")  # every sixth layer (full attention) has head_dim 512, not 256
    original = config.to_dict()
    shrunk = shrink(config).to_dict()
    assert shrunk["layer_types"] == original["layer_types"][:6]
    assert {int(key): value for key, value in shrunk["per_layer_config"].items()} == {5: {"head_dim": 2 * shrunk["head_dim"]}}


def test_shrink_keeps_dense_layers_before_the_experts() -> None:
    config = load_config("deepseek_v3")  # 3 dense layers, then 58 with 256 routed experts
    shrunk = shrink(config, pp=1)
    assert shrunk.first_k_dense_replace == 3
    assert shrunk.num_hidden_layers == 4
    assert (shrunk.n_routed_experts, shrunk.num_experts_per_tok) == (4, 2)
    assert shrunk.n_shared_experts == config.n_shared_experts
    assert shrunk.topk_group < shrunk.n_group  # group-limited routing stays limited
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(shrunk)
    assert [hasattr(layer.mlp, "experts") for layer in model.model.layers] == [False, False, False, True]


def test_shrink_keeps_a_partial_rotary_factor_even() -> None:
    config = load_config("phi")  # partial_rotary_factor 0.5
    shrunk = shrink(config)
    rotary = int(shrunk.hidden_size // shrunk.num_attention_heads * shrunk.rope_parameters["partial_rotary_factor"])
    assert rotary >= 2
    assert rotary % 2 == 0
    assert shrunk.rope_parameters == config.rope_parameters


# --- the shrunk models run ----------------------------------------------------------------


@pytest.mark.parametrize("name", PUBLISHED)
def test_shrunk_model_runs_and_lm_loss_is_the_loss_transformers_computes(name: str) -> None:
    shrunk = shrink(_published(name), tp=2, pp=2)
    model = build_model(shrunk)
    batch = token_batch(shrunk, batch_size=3)
    output = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels)
    assert model.training
    assert next(model.parameters()).dtype == torch.float64
    assert output.logits.shape == (3, SEQ_LEN, shrunk.vocab_size)
    assert torch.isfinite(output.logits).all()
    # transformers computes its loss in float32 whatever the logits' dtype; ours keeps float64
    loss = lm_loss(output, batch.labels)
    assert loss.dtype == torch.float64
    assert output.loss.dtype == torch.float32
    torch.testing.assert_close(loss.float(), output.loss)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == shrunk.tie_word_embeddings


def test_lm_loss_skips_the_padded_positions() -> None:
    shrunk = shrink(_published("Llama-3-8B"))
    batch = token_batch(shrunk, batch_size=3)
    logits = build_model(shrunk)(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    moved = logits.clone()
    # the logits at a padded label's previous position predict nothing
    padded = (batch.labels[:, 1:] == -100).nonzero()
    moved[padded[:, 0], padded[:, 1], 0] += 5.0
    assert padded.numel() > 0
    torch.testing.assert_close(lm_loss(moved, batch.labels), lm_loss(logits, batch.labels))
    moved[0, 0, 0] += 5.0  # a real position does count
    assert not torch.equal(lm_loss(moved, batch.labels), lm_loss(logits, batch.labels))


def test_the_sliding_window_masks_the_first_token_from_the_last() -> None:
    """Two layers of a 4-token window see 7 tokens back: the 16th token cannot see the first."""
    shrunk = shrink(_published("Mistral-7B-v0.1"))
    assert shrunk.num_hidden_layers == 2
    full = type(shrunk).from_dict({**shrunk.to_dict(), "sliding_window": None})
    batch = token_batch(shrunk, batch_size=1)
    changed = batch.input_ids.clone()
    changed[0, 0] = (changed[0, 0] + 1) % shrunk.vocab_size

    def last_logits(config: Any, ids: torch.Tensor) -> torch.Tensor:
        return build_model(config).eval()(input_ids=ids).logits[0, -1]

    torch.testing.assert_close(last_logits(shrunk, changed), last_logits(shrunk, batch.input_ids), rtol=0, atol=0)
    assert not torch.equal(last_logits(full, changed), last_logits(full, batch.input_ids))


def test_token_batch_pads_rows_of_different_lengths_on_the_right() -> None:
    shrunk = shrink(_published("Qwen2.5-0.5B"))
    batch = token_batch(shrunk, batch_size=4, seq_len=8, seed=3)
    lengths = batch.attention_mask.sum(1).tolist()
    assert lengths == [8, 7, 6, 5]
    for row, length in enumerate(lengths):
        assert batch.attention_mask[row, :length].all()
        assert not batch.attention_mask[row, length:].any()
    assert torch.equal(batch.labels == -100, batch.attention_mask == 0)
    assert torch.equal(batch.labels[batch.attention_mask == 1], batch.input_ids[batch.attention_mask == 1])
    assert int(batch.input_ids.max()) < shrunk.vocab_size
    again, other = token_batch(shrunk, batch_size=4, seq_len=8, seed=3), token_batch(shrunk, batch_size=4, seq_len=8, seed=4)
    assert torch.equal(again.input_ids, batch.input_ids)
    assert not torch.equal(other.input_ids, batch.input_ids)


def test_build_model_is_seeded_and_leaves_the_config_and_global_state_alone() -> None:
    shrunk = shrink(_published("Mixtral-8x7B-v0.1"))
    before, state = shrunk.to_dict(), torch.random.get_rng_state()
    first, second, other = build_model(shrunk, seed=1), build_model(shrunk, seed=1), build_model(shrunk, seed=2)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert shrunk.to_dict() == before
    assert torch.equal(first.lm_head.weight, second.lm_head.weight)
    assert not torch.equal(first.lm_head.weight, other.lm_head.weight)


def test_dropout_fields_names_the_non_zero_probabilities() -> None:
    config = _published("Llama-3-8B")
    assert dropout_fields(config) == {}
    dropped = type(config).from_dict({**config.to_dict(), "attention_dropout": 0.1})
    assert dropout_fields(dropped) == {"attention_dropout": 0.1}


# --- refusals and argument errors -------------------------------------------------------------


def test_shrink_refuses_multi_query_attention_over_tp() -> None:
    config = _published("Llama-3-8B")
    multi_query = type(config).from_dict({**config.to_dict(), "num_key_value_heads": 1})
    with pytest.raises(InvalidArgument, match=r"num_key_value_heads=1 \(multi-query attention\) cannot be divided over tp=2"):
        shrink(multi_query, tp=2)
    kept = shrink(multi_query, tp=1)  # tp=1 keeps it multi-query
    assert kept.num_key_value_heads == 1
    assert kept.num_attention_heads == 32


def test_shrink_refuses_a_model_over_max_params_naming_its_largest_parameters() -> None:
    with pytest.raises(InvalidArgument, match=r"max_params=1,000 \(largest: .*embed_tokens.weight"):
        shrink(_published("Llama-3-8B"), max_params=1000)


def test_shrink_refuses_a_pattern_longer_than_max_layers() -> None:
    config = _published("Llama-3-8B")
    irregular = ["full_attention"] * 31 + ["sliding_attention"]
    irregular[::3] = ["sliding_attention"] * len(irregular[::3])
    irregular[1::7] = ["sliding_attention"] * len(irregular[1::7])
    patterned = type(config).from_dict({**config.to_dict(), "layer_types": irregular})
    with pytest.raises(InvalidArgument, match=r"layer_types=.* has no per-layer pattern .* within MAX_LAYERS=16 layers"):
        shrink(patterned)
    periodic = type(config).from_dict({**config.to_dict(), "layer_types": (["sliding_attention"] * 9 + ["full_attention"]) * 3 + ["sliding_attention"] * 2})
    assert len(shrink(periodic, pp=10).layer_types) == 10
    with pytest.raises(InvalidArgument, match=r"layer_types=.* needs 20 layers to keep its per-layer pattern, more than MAX_LAYERS=16"):
        shrink(periodic, pp=11)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [({"tp": 0}, "tp"), ({"pp": "2"}, "pp"), ({"max_params": 0}, "max_params"), ({"tp": True}, "tp")],
)
def test_shrink_rejects_bad_arguments_by_name(kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(InvalidArgument, match=rf"shrink: {named} must be a positive int"):
        shrink(_published("Llama-3-8B"), **kwargs)


def test_functions_reject_what_is_not_a_configuration() -> None:
    for function in (shrink, build_model, dropout_fields, parameter_count):
        with pytest.raises(InvalidArgument, match="config must be a transformers PretrainedConfig"):
            function({"model_type": "llama"})


@pytest.mark.parametrize(("kwargs", "named"), [({"batch_size": 0}, "batch_size"), ({"batch_size": 2, "seq_len": 1}, "seq_len")])
def test_token_batch_rejects_bad_sizes_by_name(kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(InvalidArgument, match=rf"token_batch: {named} must be an int"):
        token_batch(shrink(_published("Llama-3-8B")), **kwargs)


def test_load_config_names_a_spec_that_is_neither_file_nor_model_type(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match=r"spec='no-such-model' is neither a config.json file nor a model_type"):
        load_config("no-such-model")
    unknown = tmp_path / "config.json"
    unknown.write_text(json.dumps({"model_type": "not-a-model"}))
    with pytest.raises(InvalidArgument, match=r"model_type='not-a-model', which the installed transformers"):
        load_config(unknown)
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(InvalidArgument, match="is not a JSON file"):
        load_config(broken)
    assert type(load_config("llama")).__name__ == "LlamaConfig"


def test_a_missing_transformers_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(InvalidArgument, match=r"shrink needs transformers, which is not installed: pip install 'dpverify\[hf\]'"):
        require_transformers("shrink")


def test_importing_dpverify_hf_does_not_import_transformers() -> None:
    modules = "dpverify, dpverify.hf, dpverify.hf.check, dpverify.hf.plans, dpverify.hf.pipeline, dpverify.cli.hf_view"
    code = f"import sys, {modules}; assert 'transformers' not in sys.modules, 'transformers imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# --- the sweep ----------------------------------------------------------------------------


def _decoders_with_a_tp_plan() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = []
    for model_type in transformers.CONFIG_MAPPING:
        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            continue
        try:
            config = transformers.CONFIG_MAPPING[model_type]()
        # an architecture whose default configuration does not validate has nothing to shrink
        except Exception:
            continue
        if getattr(config, "base_model_tp_plan", None):
            names.append(model_type)
    return names


#: Families the sweep must shrink, whatever else the installed transformers holds.
MUST_SHRINK = {"llama", "qwen2", "mistral", "mixtral", "gemma3_text", "qwen2_moe", "deepseek_v3", "gpt_oss", "phi3", "jamba", "bamba", "nemotron_h", "falcon_h1"}


@pytest.mark.deep
def test_every_shrunk_decoder_runs_and_lm_loss_agrees_with_transformers() -> None:
    """The sweep's shrunk models built for real (float64) and run on a padded batch."""
    ran = []
    for model_type in _decoders_with_a_tp_plan():
        try:
            shrunk = shrink(transformers.CONFIG_MAPPING[model_type](), tp=2, pp=2)
        except InvalidArgument:
            continue
        batch = token_batch(shrunk, batch_size=3)
        output = build_model(shrunk)(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels)
        assert torch.isfinite(output.logits).all(), model_type
        # transformers' loss is float32 (it casts the logits), ours float64
        torch.testing.assert_close(lm_loss(output, batch.labels).float(), output.loss, msg=model_type)
        ran.append(model_type)
    assert set(ran) >= MUST_SHRINK


def test_every_decoder_with_a_tp_plan_shrinks_or_is_refused_by_name() -> None:
    shrunk, refused = {}, {}
    for model_type in _decoders_with_a_tp_plan():
        config = transformers.CONFIG_MAPPING[model_type]()
        before = config.to_dict()
        try:
            result = shrink(config, tp=2, pp=2)
        except InvalidArgument as error:
            refused[model_type] = str(error)
            continue
        finally:
            assert config.to_dict() == before, f"shrink changed the {model_type} configuration it was given"
        shrunk[model_type] = result
        assert type(result) is type(config)
        assert parameter_count(result) <= 2_000_000, model_type
        assert result.num_hidden_layers >= 2, model_type
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size", "moe_intermediate_size"):
            value = getattr(result, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and name in result.to_dict():
                assert value % 2 == 0, f"{model_type}: {name}={value} is not divisible by tp=2"
    assert set(shrunk) >= MUST_SHRINK, MUST_SHRINK - set(shrunk)
    for model_type, message in refused.items():
        assert re.search(rf"^shrink: {re.escape(model_type)}: .*\b[a-z_]+=", message), message
    assert len(shrunk) > 3 * len(refused), sorted(refused)
