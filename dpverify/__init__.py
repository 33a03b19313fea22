"""dpverify: a correctness harness for PyTorch data parallelism.

DataParallel (real, or virtual on any machine) checked against the single-device step, by
execution, with float64-anchored tolerances and messages in the style of
``torch.testing.assert_close``.
"""

from __future__ import annotations

from dpverify._assertions import assert_dp_grads_match, assert_grad_sum_equals_mean_loss_grad
from dpverify._comparison import StepComparison, TensorComparison, Tolerance
from dpverify._divergence import DivergenceSource, divergence_sources
from dpverify._errors import DroppedRowsWarning, InvalidArgument, ParallelMismatch
from dpverify._loss_average import (
    LossAverageReport,
    assert_loss_reduction_matches_full_batch,
    check_forward_loss_average,
)
from dpverify._scatter import ScatterPlan, chunk_sizes, plan_scatter
from dpverify._virtual import VirtualDataParallel, current_virtual_device, data_parallel

__version__ = "0.1.0"

__all__ = [
    "DivergenceSource",
    "DroppedRowsWarning",
    "InvalidArgument",
    "LossAverageReport",
    "ParallelMismatch",
    "ScatterPlan",
    "StepComparison",
    "TensorComparison",
    "Tolerance",
    "VirtualDataParallel",
    "assert_dp_grads_match",
    "assert_grad_sum_equals_mean_loss_grad",
    "assert_loss_reduction_matches_full_batch",
    "check_forward_loss_average",
    "chunk_sizes",
    "current_virtual_device",
    "data_parallel",
    "divergence_sources",
    "plan_scatter",
]
