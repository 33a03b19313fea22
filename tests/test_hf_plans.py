"""A model family's own tensor-parallel plan, as transformers resolves and applies it, under
dpverify's tensor-parallel check: the plans pass, a plan with one entry wrong fails (with
the module), and the plans users write in transformers' vocabulary are read alike."""

from __future__ import annotations

import pickle
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpverify import InvalidArgument, ParallelMismatch, assert_tensor_parallel_grads_match
from dpverify.ddp.pool import DDPWorkerPool
from dpverify.hf.plans import TransformersStyle, hf_tp_plan, load_plan_function, styled

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

IDS = torch.randint(1, 64, (4, 8), generator=torch.Generator().manual_seed(0))
SMALL = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32}


def lm_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    logits = output.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))


def _model(config_class: Any, **extra: Any) -> nn.Module:
    torch.manual_seed(0)
    options = {"experts_implementation": "eager"} if "num_local_experts" in extra or "num_experts" in extra else {}
    model: nn.Module = transformers.AutoModelForCausalLM.from_config(config_class(**SMALL, **extra), **options)
    return model


def _check(model: nn.Module, plan: dict[str, Any], pool: DDPWorkerPool) -> Any:
    return assert_tensor_parallel_grads_match(
        model, (), IDS, loss_fn=lm_loss, world_size=2, plan=plan, forward_kwargs={"input_ids": IDS, "use_cache": False}, pool=pool,
    )


def test_llama_s_own_plan_is_resolved_per_layer_and_passes(ddp_pool: DDPWorkerPool) -> None:
    model = _model(transformers.LlamaConfig)
    plan = hf_tp_plan(model, 2)
    assert plan["model.layers.1.self_attn.o_proj"].entries == (("weight", "rowwise"), ("", "rowwise"))
    assert plan["lm_head"].entries == (("weight", "colwise_gather_output"), ("", "colwise_gather_output"))
    result = _check(model, plan, ddp_pool)
    assert "'model.layers.0.mlp.down_proj': transformers 'rowwise'" in result.scenario


def test_mixtral_s_experts_are_sharded_by_their_own_entries_and_pass(ddp_pool: DDPWorkerPool) -> None:
    model = _model(transformers.MixtralConfig, num_local_experts=4, num_experts_per_tok=2)
    plan = hf_tp_plan(model, 2)
    # the experts module's own style wraps its forward; its packed parameters have theirs
    assert plan["model.layers.0.mlp.experts"].entries == (
        ("gate_up_proj", "packed_colwise"), ("down_proj", "rowwise"), ("", "moe_tp_experts"),
    )
    _check(model, plan, ddp_pool)


def test_a_plan_with_one_entry_wrong_is_caught(ddp_pool: DDPWorkerPool) -> None:
    model = _model(transformers.LlamaConfig)
    plan = hf_tp_plan(model, 2)
    plan["lm_head"] = TransformersStyle((("weight", "colwise"), ("", "colwise")))  # logits left sharded
    with pytest.raises(ParallelMismatch) as caught:
        _check(model, plan, ddp_pool)
    assert "[4, 8, 32] where one device gives [4, 8, 64]: module 'lm_head' (transformers 'colwise') handed on [4, 8, 32]" in str(caught.value)


def test_a_norm_left_out_of_the_gradient_all_reduce_fails_on_its_weight(ddp_pool: DDPWorkerPool) -> None:
    # Qwen3 normalises each head's query; with the heads sharded, each rank's gradient of the
    # norm's weight sums its own heads only, which transformers all-reduces
    # ('replicated_with_grad_allreduce'). Without that entry the gradients are partial.
    model = _model(transformers.Qwen3Config, head_dim=4)
    plan = hf_tp_plan(model, 2)
    _check(model, plan, ddp_pool)  # the whole plan passes
    del plan["model.layers.0.self_attn.q_norm"]
    with pytest.raises(ParallelMismatch) as caught:
        _check(model, plan, ddp_pool)
    failed = {row.name for row in caught.value.report.tensors if not row.ok}
    assert "grad 'model.layers.0.self_attn.q_norm.weight'" in " ".join(failed)
    assert not any("layers.1" in name for name in failed if "q_norm" in name)


def test_a_plan_written_with_transformers_style_names_is_read_as_transformers_reads_it() -> None:
    model = _model(transformers.LlamaConfig)
    plan = styled({"model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise"}, model)
    assert sorted(plan) == [
        "model.layers.0.mlp.down_proj", "model.layers.0.mlp.gate_proj", "model.layers.1.mlp.down_proj", "model.layers.1.mlp.gate_proj",
    ]
    assert plan["model.layers.1.mlp.down_proj"].entries == (("weight", "rowwise"), ("", "rowwise"))
    assert pickle.loads(pickle.dumps(plan["model.layers.1.mlp.down_proj"])).entries == plan["model.layers.1.mlp.down_proj"].entries
    with pytest.raises(InvalidArgument, match=re.escape("'model.layers.*.mlp.fc1', which matches no module or parameter of LlamaForCausalLM")):
        styled({"model.layers.*.mlp.fc1": "colwise"}, model)


def test_a_plan_is_refused_with_what_to_pass_instead() -> None:
    with pytest.raises(InvalidArgument, match="takes the plan of a transformers model"):
        hf_tp_plan(nn.Linear(2, 2), 2)
    with pytest.raises(InvalidArgument, match=r"pass 'hf' .* or 'MODULE:FN'"):
        load_plan_function("no_colon")
    with pytest.raises(InvalidArgument, match="cannot import it"):
        load_plan_function("dpverify_no_such_module:plan")
    with pytest.raises(InvalidArgument, match="not a function"):
        load_plan_function("dpverify.hf.plans:__all__")


def test_a_plan_function_is_found_in_the_current_directory_and_its_import_errors_named(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # as `dpverify check --tp-plan my_plans:fn` finds it when run from the user's project,
    # whatever sys.path the installed console script starts with
    (tmp_path / "my_plans_here.py").write_text("def plan(model):\n    return {}\n")
    (tmp_path / "my_plans_broken.py").write_text("raise RuntimeError('not at import time')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", str(tmp_path))])
    assert load_plan_function("my_plans_here:plan").__name__ == "plan"
    with pytest.raises(InvalidArgument, match=r"cannot import it \(importing 'my_plans_broken' raised RuntimeError"):
        load_plan_function("my_plans_broken:plan")
