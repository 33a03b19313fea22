"""FSDP2, tensor-parallel and pipeline checks on nccl ranks, one CUDA device each
(``pytest -m multigpu``; skipped where fewer GPUs are visible).

The pool gives each rank ``cuda:<rank>`` and an nccl group when every rank has a GPU
(``dpverify.ddp.pool.default_backend``); the sharded tasks build their device mesh on
``cuda`` there and move their copy of the module to the rank's device. The properties are
the CPU suite's, on the same drawn scenarios, so a difference is nccl's or the GPU's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from torch import nn

from dpverify.ddp.pool import shared_pool
from dpverify.models.layouts import ShardedScenario
from dpverify.registry import CHECKS, Case
from dpverify.strategies import sharded_scenarios

pytestmark = pytest.mark.multigpu(2)

FEW = settings(max_examples=10, deadline=None)


@pytest.mark.parametrize(("backend", "check"), [("fsdp", "fsdp-grads"), ("tp", "tp-grads"), ("pp", "pp-grads")])
def test_sharded_checks_pass_torchs_own_code_on_nccl_ranks(backend: str, check: str) -> None:
    assert shared_pool(2).backend == "nccl"

    @FEW
    @given(sharded_scenarios(backend, world_sizes=(2,)))
    def run(scenario: ShardedScenario) -> None:
        CHECKS[check].check(Case.from_scenario(scenario))

    run()


@pytest.mark.multigpu(4)
def test_tensor_parallel_with_fsdp_on_a_2x2_mesh_of_gpus() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from dpverify.sharded.tensor_parallel import assert_tensor_parallel_grads_match

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(6, 6), torch.randn(6, 3)
    assert_tensor_parallel_grads_match(
        model, x, y, loss_fn=F.mse_loss, world_size=4, data_parallel=2,
        plan={"0": ColwiseParallel(), "2": RowwiseParallel()},
    )
