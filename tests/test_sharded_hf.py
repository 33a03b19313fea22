"""The sharded checks on models nobody here designed: tiny Hugging Face models built from
configs (nothing downloaded), with their own module trees, keyword-only calls and tied
weights."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from dpverify import (
    InvalidArgument,
    assert_fsdp_grads_match,
    assert_pipeline_grads_match,
    assert_tensor_parallel_grads_match,
)
from dpverify.ddp.pool import DDPWorkerPool

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32,
    )
    model: torch.nn.Module = transformers.LlamaForCausalLM(config).eval().double()
    return model


def lm_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    logits = output.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))


IDS = torch.randint(1, 64, (4, 8), generator=torch.Generator().manual_seed(0))

#: Megatron's MLP split of every Llama layer: gate and up projections colwise, down rowwise.
MLP_PLAN = {
    "model.layers.*.mlp.gate_proj": ColwiseParallel(),
    "model.layers.*.mlp.up_proj": ColwiseParallel(),
    "model.layers.*.mlp.down_proj": RowwiseParallel(),
}


def test_a_tiny_llama_s_mlp_plan_matches_one_device(ddp_pool: DDPWorkerPool) -> None:
    result = assert_tensor_parallel_grads_match(llama(), (), IDS, loss_fn=lm_loss, world_size=2, plan=MLP_PLAN, forward_kwargs={"input_ids": IDS}, pool=ddp_pool)
    assert "model.layers.0.mlp.gate_proj.weight: Shard(0)" in result.scenario
    assert "model.layers.1.mlp.down_proj.weight: Shard(1)" in result.scenario


def test_a_tiny_llama_under_fsdp2_matches_one_device(ddp_pool: DDPWorkerPool) -> None:
    result = assert_fsdp_grads_match(llama(), (), IDS, loss_fn=lm_loss, world_size=2, forward_kwargs={"input_ids": IDS}, pool=ddp_pool)
    assert "'model'" in result.scenario or "'model.layers.0'" in result.scenario


def test_a_model_that_is_not_a_chain_of_children_is_refused_by_the_pipeline_check() -> None:
    # LlamaForCausalLM's children are model and lm_head, and lm_head does not take model's output
    with pytest.raises(InvalidArgument, match=r"module=LlamaForCausalLM is not the chain of its top-level children: running \['model', 'lm_head'\] in order, .* raised TypeError") as refused:
        assert_pipeline_grads_match(llama(), IDS, IDS, loss_fn=lm_loss, world_size=2, n_microbatches=2)
    assert isinstance(refused.value.__cause__, TypeError)
