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
    "assert_dp_grads_match": "dpverify.checks.dp",
    "assert_grad_sum_equals_mean_loss_grad": "dpverify.checks.dp",
    "assert_dp_buffers_match": "dpverify.checks.buffers",
    "assert_ddp_accumulation_matches": "dpverify.ddp.checks",
    "assert_ddp_buffers_match": "dpverify.ddp.checks",
    "assert_ddp_grads_match": "dpverify.ddp.checks",
    "assert_ddp_sync_batchnorm_matches": "dpverify.ddp.checks",
    "assert_ddp_training_matches": "dpverify.ddp.checks",
    "assert_dp_ddp_agree": "dpverify.ddp.checks",
    "DDPWorkerPool": "dpverify.ddp.pool",
    "ParallelError": "dpverify.ddp.pool",
    "ShardContext": "dpverify.ddp.rank",
    "ddp_step": "dpverify.ddp.rank",
    "no_sync_accumulation_step": "dpverify.ddp.rank",
    "weighted_ddp_step": "dpverify.ddp.rank",
    "StepComparison": "dpverify.core.comparison",
    "TensorComparison": "dpverify.core.comparison",
    "Tolerance": "dpverify.core.comparison",
    "DivergenceSource": "dpverify.core.divergence",
    "divergence_sources": "dpverify.core.divergence",
    "DroppedRowsWarning": "dpverify.core.errors",
    "InvalidArgument": "dpverify.core.errors",
    "NonFiniteReference": "dpverify.core.errors",
    "ParallelMismatch": "dpverify.core.errors",
    "LossAverageReport": "dpverify.checks.loss_average",
    "assert_loss_reduction_matches_full_batch": "dpverify.checks.loss_average",
    "check_forward_loss_average": "dpverify.checks.loss_average",
    "ScatterPlan": "dpverify.core.scatter",
    "chunk_sizes": "dpverify.core.scatter",
    "plan_scatter": "dpverify.core.scatter",
    "VirtualDataParallel": "dpverify.core.virtual",
    "current_virtual_device": "dpverify.core.virtual",
    "data_parallel": "dpverify.core.virtual",
}

if TYPE_CHECKING:
    from dpverify.checks.buffers import assert_dp_buffers_match
    from dpverify.checks.dp import assert_dp_grads_match, assert_grad_sum_equals_mean_loss_grad
    from dpverify.checks.loss_average import (
        LossAverageReport,
        assert_loss_reduction_matches_full_batch,
        check_forward_loss_average,
    )
    from dpverify.core.comparison import StepComparison, TensorComparison, Tolerance
    from dpverify.core.divergence import DivergenceSource, divergence_sources
    from dpverify.core.errors import (
        DroppedRowsWarning,
        InvalidArgument,
        NonFiniteReference,
        ParallelMismatch,
    )
    from dpverify.core.scatter import ScatterPlan, chunk_sizes, plan_scatter
    from dpverify.core.virtual import VirtualDataParallel, current_virtual_device, data_parallel
    from dpverify.ddp.checks import (
        assert_ddp_accumulation_matches,
        assert_ddp_buffers_match,
        assert_ddp_grads_match,
        assert_ddp_sync_batchnorm_matches,
        assert_ddp_training_matches,
        assert_dp_ddp_agree,
    )
    from dpverify.ddp.pool import DDPWorkerPool, ParallelError
    from dpverify.ddp.rank import (
        ShardContext,
        ddp_step,
        no_sync_accumulation_step,
        weighted_ddp_step,
    )


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
