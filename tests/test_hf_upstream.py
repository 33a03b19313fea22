"""Model families whose own tensor-parallel plan (transformers 5.24's) does not train as
one device does: each a minimal reproduction for the family's maintainers, shrunk from the
family's default configuration and checked with ``check_hf_config(model_type,
backend="tp")``, which applies the plan with transformers' own code.

Each test asserts how the plan still fails, precisely (the tensors, or the module and the
error), so that it fails itself once transformers fixes the plan: then move the family to
the passing ones of the sweep (docs/hf.md)."""

from __future__ import annotations

import pytest

from dpverify import Verdict
from dpverify.hf import load_config, shrink
from dpverify.hf.check import check_hf_config

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

pytestmark = [pytest.mark.upstream, pytest.mark.filterwarnings("ignore")]


def _failing_tensors(model_type: str) -> set[str]:
    outcome = check_hf_config(model_type, backend="tp").outcome("tp")
    assert outcome.verdict is Verdict.FAIL
    assert outcome.report is not None, outcome.detail
    return {row.name for row in outcome.report.tensors if not row.ok}


def _unreduced(names: list[str], layers: int = 2, ranks: int = 2) -> set[str]:
    return {f"rank {r} grad 'model.layers.{i}.{name}'" for r in range(ranks) for i in range(layers) for name in names}


@pytest.mark.parametrize("model_type", ["apertus", "apertus1p5_text"])
def test_apertus_xielu_parameters_get_each_rank_s_share_of_their_gradient(model_type: str) -> None:
    # The MLP's xIELU activation has learnable scalars. With up_proj colwise each rank
    # applies it to its half of the features, so each rank's gradient of alpha_p and alpha_n
    # sums half of the terms, and the plan has no entry that all-reduces them
    # ('replicated_with_grad_allreduce', as q_norm/k_norm get in Qwen3): the ranks' copies
    # drift apart from the first optimizer step. Every other tensor matches.
    assert _failing_tensors(model_type) == _unreduced(["mlp.act_fn.alpha_p", "mlp.act_fn.alpha_n"])


def test_sarvam_moe_query_and_key_norms_are_not_all_reduced() -> None:
    # Per-head RMSNorms over sharded heads, without the all-reduce of their gradients that
    # Qwen3's plan gives the same norms.
    assert _failing_tensors("sarvam_moe") == _unreduced(["self_attn.q_norm.weight", "self_attn.k_norm.weight"])


@pytest.mark.deep
def test_gemma3n_activation_sparsity_thresholds_each_rank_s_half_of_the_features() -> None:
    # Gemma 3n keeps the activations above mean + k * std of the intermediate features
    # (activation_sparsity_pattern). With gate_proj colwise each rank computes that
    # threshold over its own half, so the forward differs from one device: the loss and the
    # logits fail, not only gradients. The same configuration without sparsity passes.
    failing = _failing_tensors("gemma3n_text")
    assert "rank 0 loss" in failing
    config = shrink(load_config("gemma3n_text"), tp=2, pp=2)
    config.activation_sparsity_pattern = [0.0] * config.num_hidden_layers
    assert check_hf_config(config, backend="tp", shrunk=False).ok


@pytest.mark.parametrize(
    ("model_type", "module", "error"),
    [
        # the dynamic mask's per-head parameter is not sharded with the heads
        ("doge", "module 'model.layers.0.self_attn' (no style of the plan) raised", "The size of tensor a (2) must match the size of tensor b (4)"),
        # the embedding's norm receives the row-sharded embedding's pending sum
        pytest.param(
            "inkling_text", "module 'model.embed_tokens.embed_norm' (no style of the plan) raised", "It received DTensor Partial(sum)",
            marks=pytest.mark.deep,
        ),
        # an in-place update of a DTensor's local view: raises with gradients on (training)
        pytest.param(
            "llama4_text", "module 'model.layers.0.feed_forward' (no style of the plan) raised", "is a view and is being modified inplace",
            marks=pytest.mark.deep,
        ),
    ],
)
def test_a_plan_that_does_not_fit_the_family_raises_in_the_named_module(model_type: str, module: str, error: str) -> None:
    outcome = check_hf_config(model_type, backend="tp").outcome("tp")
    assert outcome.verdict is Verdict.FAIL
    assert module in outcome.detail
    assert error in outcome.detail
