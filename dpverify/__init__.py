"""dpverify: a correctness harness for PyTorch data parallelism.

DataParallel (real, or virtual on any machine) checked against the single-device step, by
execution, with float64-anchored tolerances and messages in the style of
``torch.testing.assert_close``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# Public names load on first use (PEP 562): ``import dpverify.pytest_plugin``, which pytest
# does at start-up, must not import torch or initialise CUDA.
_EXPORTS = {
    "assert_dp_grads_match": "dpverify._assertions",
    "assert_grad_sum_equals_mean_loss_grad": "dpverify._assertions",
    "assert_dp_buffers_match": "dpverify._replica_state",
    "assert_ddp_accumulation_matches": "dpverify._ddp_checks",
    "assert_ddp_buffers_match": "dpverify._ddp_checks",
    "assert_ddp_grads_match": "dpverify._ddp_checks",
    "assert_ddp_sync_batchnorm_matches": "dpverify._ddp_checks",
    "assert_ddp_training_matches": "dpverify._ddp_checks",
    "assert_dp_ddp_agree": "dpverify._ddp_checks",
    "DDPWorkerPool": "dpverify._ddp_pool",
    "ParallelError": "dpverify._ddp_pool",
    "ShardContext": "dpverify._ddp_rank",
    "ddp_step": "dpverify._ddp_rank",
    "no_sync_accumulation_step": "dpverify._ddp_rank",
    "weighted_ddp_step": "dpverify._ddp_rank",
    "StepComparison": "dpverify._comparison",
    "TensorComparison": "dpverify._comparison",
    "Tolerance": "dpverify._comparison",
    "DivergenceSource": "dpverify._divergence",
    "divergence_sources": "dpverify._divergence",
    "DroppedRowsWarning": "dpverify._errors",
    "InvalidArgument": "dpverify._errors",
    "NonFiniteReference": "dpverify._errors",
    "ParallelMismatch": "dpverify._errors",
    "LossAverageReport": "dpverify._loss_average",
    "assert_loss_reduction_matches_full_batch": "dpverify._loss_average",
    "check_forward_loss_average": "dpverify._loss_average",
    "ScatterPlan": "dpverify._scatter",
    "chunk_sizes": "dpverify._scatter",
    "plan_scatter": "dpverify._scatter",
    "VirtualDataParallel": "dpverify._virtual",
    "current_virtual_device": "dpverify._virtual",
    "data_parallel": "dpverify._virtual",
}

if TYPE_CHECKING:
    from dpverify._assertions import assert_dp_grads_match, assert_grad_sum_equals_mean_loss_grad
    from dpverify._comparison import StepComparison, TensorComparison, Tolerance
    from dpverify._ddp_checks import (
        assert_ddp_accumulation_matches,
        assert_ddp_buffers_match,
        assert_ddp_grads_match,
        assert_ddp_sync_batchnorm_matches,
        assert_ddp_training_matches,
        assert_dp_ddp_agree,
    )
    from dpverify._ddp_pool import DDPWorkerPool, ParallelError
    from dpverify._ddp_rank import (
        ShardContext,
        ddp_step,
        no_sync_accumulation_step,
        weighted_ddp_step,
    )
    from dpverify._divergence import DivergenceSource, divergence_sources
    from dpverify._errors import (
        DroppedRowsWarning,
        InvalidArgument,
        NonFiniteReference,
        ParallelMismatch,
    )
    from dpverify._loss_average import (
        LossAverageReport,
        assert_loss_reduction_matches_full_batch,
        check_forward_loss_average,
    )
    from dpverify._replica_state import assert_dp_buffers_match
    from dpverify._scatter import ScatterPlan, chunk_sizes, plan_scatter
    from dpverify._virtual import VirtualDataParallel, current_virtual_device, data_parallel


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dpverify' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__version__ = "0.1.0"

__all__ = [
    "DDPWorkerPool",
    "DivergenceSource",
    "DroppedRowsWarning",
    "InvalidArgument",
    "LossAverageReport",
    "NonFiniteReference",
    "ParallelError",
    "ParallelMismatch",
    "ScatterPlan",
    "ShardContext",
    "StepComparison",
    "TensorComparison",
    "Tolerance",
    "VirtualDataParallel",
    "assert_ddp_accumulation_matches",
    "assert_ddp_buffers_match",
    "assert_ddp_grads_match",
    "assert_ddp_sync_batchnorm_matches",
    "assert_ddp_training_matches",
    "assert_dp_buffers_match",
    "assert_dp_ddp_agree",
    "assert_dp_grads_match",
    "assert_grad_sum_equals_mean_loss_grad",
    "assert_loss_reduction_matches_full_batch",
    "check_forward_loss_average",
    "chunk_sizes",
    "current_virtual_device",
    "data_parallel",
    "ddp_step",
    "divergence_sources",
    "no_sync_accumulation_step",
    "plan_scatter",
    "weighted_ddp_step",
]
