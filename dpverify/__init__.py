"""dpverify: a correctness harness for PyTorch data parallelism.

DataParallel (real, or virtual on any machine), DistributedDataParallel, FSDP2, tensor and
pipeline parallelism checked against the single-device step, by execution, with
float64-anchored tolerances and messages in the style of ``torch.testing.assert_close``.

The names in ``__all__`` are the public API, together with the modules
``dpverify.strategies`` (Hypothesis strategies) and ``dpverify.mutants`` (deliberately broken
steps); everything else is internal and may move. Each name is imported from its module on
first use (a module ``__getattr__``, PEP 562), so ``import dpverify`` loads none of the
backends: the DDP pool, FSDP2, tensor and pipeline parallelism, and Hypothesis load with the
first name that needs them. ``__all__`` is written out; a test holds it, ``_EXPORTS`` and the
imports for type checkers below to the same names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Where each public name lives.
_EXPORTS: dict[str, str] = {
    "CHECKS": "dpverify.registry",
    "Case": "dpverify.registry",
    "CheckResult": "dpverify.registry",
    "CheckSpec": "dpverify.registry",
    "DDPWorkerPool": "dpverify.ddp.pool",
    "DivergenceSource": "dpverify.core.divergence",
    "DroppedRowsWarning": "dpverify.core.errors",
    "FSDPContext": "dpverify.sharded.fsdp",
    "InvalidArgument": "dpverify.core.errors",
    "LossAverageReport": "dpverify.checks.loss_average",
    "MicroBatch": "dpverify.ranked.rank",
    "NonFiniteReference": "dpverify.core.errors",
    "ParallelError": "dpverify.ddp.pool",
    "ParallelMismatch": "dpverify.core.errors",
    "RankInfo": "dpverify.ranked.rank",
    "ScatterPlan": "dpverify.core.scatter",
    "ShardContext": "dpverify.ddp.rank",
    "Split": "dpverify.registry",
    "StepComparison": "dpverify.core.comparison",
    "TPContext": "dpverify.sharded.tensor_parallel",
    "Target": "dpverify.registry",
    "TensorComparison": "dpverify.core.comparison",
    "Tolerance": "dpverify.core.comparison",
    "Verdict": "dpverify.registry",
    "VirtualDataParallel": "dpverify.core.virtual",
    "assert_ddp_accumulation_matches": "dpverify.ddp.checks",
    "assert_ddp_buffers_match": "dpverify.ddp.checks",
    "assert_ddp_data_matches": "dpverify.data.path",
    "assert_ddp_metric_matches": "dpverify.data.metrics",
    "assert_dp_metric_matches": "dpverify.data.metrics",
    "DataReport": "dpverify.data.path",
    "MetricReport": "dpverify.data.metrics",
    "assert_ddp_grads_match": "dpverify.ddp.checks",
    "assert_ddp_sync_batchnorm_matches": "dpverify.ddp.checks",
    "assert_ddp_training_matches": "dpverify.ddp.checks",
    "assert_dp_buffers_match": "dpverify.checks.buffers",
    "assert_dp_ddp_agree": "dpverify.ddp.checks",
    "assert_dp_grads_match": "dpverify.checks.dp",
    "assert_dp_training_matches": "dpverify.checks.training",
    "assert_fsdp_grads_match": "dpverify.sharded.fsdp",
    "assert_fsdp_training_matches": "dpverify.sharded.fsdp",
    "assert_grad_sum_equals_mean_loss_grad": "dpverify.checks.dp",
    "assert_loss_reduction_matches_full_batch": "dpverify.checks.loss_average",
    "assert_pipeline_grads_match": "dpverify.sharded.pipeline",
    "assert_pipeline_training_matches": "dpverify.sharded.pipeline",
    "PipelineContext": "dpverify.sharded.pipeline",
    "sync_tied_grads": "dpverify.sharded.pipeline",
    "assert_tensor_parallel_grads_match": "dpverify.sharded.tensor_parallel",
    "assert_tensor_parallel_training_matches": "dpverify.sharded.tensor_parallel",
    "check_forward_loss_average": "dpverify.checks.loss_average",
    "chunk_sizes": "dpverify.core.scatter",
    "chunk_weighted_loss": "dpverify.checks.loss_average",
    "current_virtual_device": "dpverify.core.virtual",
    "data_parallel": "dpverify.core.virtual",
    "ddp_step": "dpverify.ddp.rank",
    "divergence_sources": "dpverify.core.divergence",
    "fsdp_step": "dpverify.sharded.fsdp",
    "no_sync_accumulation_step": "dpverify.ddp.rank",
    "plan_scatter": "dpverify.core.scatter",
    "tp_step": "dpverify.sharded.tensor_parallel",
    "virtual_devices": "dpverify.core.virtual",
    "weighted_ddp_step": "dpverify.ddp.rank",
    "weighted_fsdp_step": "dpverify.sharded.fsdp",
    "weighted_tp_step": "dpverify.sharded.tensor_parallel",
    "HFCheckReport": "dpverify.hf.check",
    "check_hf_config": "dpverify.hf.check",
    "shrink": "dpverify.hf.shrink",
}

__all__ = [
    "CHECKS",
    "Case",
    "CheckResult",
    "CheckSpec",
    "DDPWorkerPool",
    "DataReport",
    "DivergenceSource",
    "DroppedRowsWarning",
    "FSDPContext",
    "HFCheckReport",
    "InvalidArgument",
    "LossAverageReport",
    "MetricReport",
    "MicroBatch",
    "NonFiniteReference",
    "ParallelError",
    "ParallelMismatch",
    "PipelineContext",
    "RankInfo",
    "ScatterPlan",
    "ShardContext",
    "Split",
    "StepComparison",
    "TPContext",
    "Target",
    "TensorComparison",
    "Tolerance",
    "Verdict",
    "VirtualDataParallel",
    "assert_ddp_accumulation_matches",
    "assert_ddp_buffers_match",
    "assert_ddp_data_matches",
    "assert_ddp_grads_match",
    "assert_ddp_metric_matches",
    "assert_ddp_sync_batchnorm_matches",
    "assert_ddp_training_matches",
    "assert_dp_buffers_match",
    "assert_dp_ddp_agree",
    "assert_dp_grads_match",
    "assert_dp_metric_matches",
    "assert_dp_training_matches",
    "assert_fsdp_grads_match",
    "assert_fsdp_training_matches",
    "assert_grad_sum_equals_mean_loss_grad",
    "assert_loss_reduction_matches_full_batch",
    "assert_pipeline_grads_match",
    "assert_pipeline_training_matches",
    "assert_tensor_parallel_grads_match",
    "assert_tensor_parallel_training_matches",
    "check_forward_loss_average",
    "check_hf_config",
    "chunk_sizes",
    "chunk_weighted_loss",
    "current_virtual_device",
    "data_parallel",
    "ddp_step",
    "divergence_sources",
    "fsdp_step",
    "no_sync_accumulation_step",
    "plan_scatter",
    "shrink",
    "sync_tied_grads",
    "tp_step",
    "virtual_devices",
    "weighted_ddp_step",
    "weighted_fsdp_step",
    "weighted_tp_step",
]



def __getattr__(name: str) -> Any:
    """Imports a public name from its module on first use and keeps it here; a subpackage
    (``dpverify.strategies``) is imported as such."""
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    if not name.startswith("_"):
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:
    from dpverify.checks.buffers import assert_dp_buffers_match as assert_dp_buffers_match
    from dpverify.checks.dp import assert_dp_grads_match as assert_dp_grads_match
    from dpverify.checks.dp import (
        assert_grad_sum_equals_mean_loss_grad as assert_grad_sum_equals_mean_loss_grad,
    )
    from dpverify.checks.loss_average import LossAverageReport as LossAverageReport
    from dpverify.checks.loss_average import (
        assert_loss_reduction_matches_full_batch as assert_loss_reduction_matches_full_batch,
    )
    from dpverify.checks.loss_average import (
        check_forward_loss_average as check_forward_loss_average,
    )
    from dpverify.checks.loss_average import chunk_weighted_loss as chunk_weighted_loss
    from dpverify.checks.training import assert_dp_training_matches as assert_dp_training_matches
    from dpverify.core.comparison import StepComparison as StepComparison
    from dpverify.core.comparison import TensorComparison as TensorComparison
    from dpverify.core.comparison import Tolerance as Tolerance
    from dpverify.core.divergence import DivergenceSource as DivergenceSource
    from dpverify.core.divergence import divergence_sources as divergence_sources
    from dpverify.core.errors import DroppedRowsWarning as DroppedRowsWarning
    from dpverify.core.errors import InvalidArgument as InvalidArgument
    from dpverify.core.errors import NonFiniteReference as NonFiniteReference
    from dpverify.core.errors import ParallelMismatch as ParallelMismatch
    from dpverify.core.scatter import ScatterPlan as ScatterPlan
    from dpverify.core.scatter import chunk_sizes as chunk_sizes
    from dpverify.core.scatter import plan_scatter as plan_scatter
    from dpverify.core.virtual import VirtualDataParallel as VirtualDataParallel
    from dpverify.core.virtual import current_virtual_device as current_virtual_device
    from dpverify.core.virtual import data_parallel as data_parallel
    from dpverify.core.virtual import virtual_devices as virtual_devices
    from dpverify.data.metrics import MetricReport as MetricReport
    from dpverify.data.metrics import assert_ddp_metric_matches as assert_ddp_metric_matches
    from dpverify.data.metrics import assert_dp_metric_matches as assert_dp_metric_matches
    from dpverify.data.path import DataReport as DataReport
    from dpverify.data.path import assert_ddp_data_matches as assert_ddp_data_matches
    from dpverify.ddp.checks import (
        assert_ddp_accumulation_matches as assert_ddp_accumulation_matches,
    )
    from dpverify.ddp.checks import assert_ddp_buffers_match as assert_ddp_buffers_match
    from dpverify.ddp.checks import assert_ddp_grads_match as assert_ddp_grads_match
    from dpverify.ddp.checks import (
        assert_ddp_sync_batchnorm_matches as assert_ddp_sync_batchnorm_matches,
    )
    from dpverify.ddp.checks import assert_ddp_training_matches as assert_ddp_training_matches
    from dpverify.ddp.checks import assert_dp_ddp_agree as assert_dp_ddp_agree
    from dpverify.ddp.pool import DDPWorkerPool as DDPWorkerPool
    from dpverify.ddp.pool import ParallelError as ParallelError
    from dpverify.ddp.rank import ShardContext as ShardContext
    from dpverify.ddp.rank import ddp_step as ddp_step
    from dpverify.ddp.rank import no_sync_accumulation_step as no_sync_accumulation_step
    from dpverify.ddp.rank import weighted_ddp_step as weighted_ddp_step
    from dpverify.hf.check import HFCheckReport as HFCheckReport
    from dpverify.hf.check import check_hf_config as check_hf_config
    from dpverify.hf.shrink import shrink as shrink
    from dpverify.ranked.rank import MicroBatch as MicroBatch
    from dpverify.ranked.rank import RankInfo as RankInfo
    from dpverify.registry import CHECKS as CHECKS
    from dpverify.registry import Case as Case
    from dpverify.registry import CheckResult as CheckResult
    from dpverify.registry import CheckSpec as CheckSpec
    from dpverify.registry import Split as Split
    from dpverify.registry import Target as Target
    from dpverify.registry import Verdict as Verdict
    from dpverify.sharded.fsdp import FSDPContext as FSDPContext
    from dpverify.sharded.fsdp import assert_fsdp_grads_match as assert_fsdp_grads_match
    from dpverify.sharded.fsdp import assert_fsdp_training_matches as assert_fsdp_training_matches
    from dpverify.sharded.fsdp import fsdp_step as fsdp_step
    from dpverify.sharded.fsdp import weighted_fsdp_step as weighted_fsdp_step
    from dpverify.sharded.pipeline import PipelineContext as PipelineContext
    from dpverify.sharded.pipeline import assert_pipeline_grads_match as assert_pipeline_grads_match
    from dpverify.sharded.pipeline import (
        assert_pipeline_training_matches as assert_pipeline_training_matches,
    )
    from dpverify.sharded.pipeline import sync_tied_grads as sync_tied_grads
    from dpverify.sharded.tensor_parallel import TPContext as TPContext
    from dpverify.sharded.tensor_parallel import (
        assert_tensor_parallel_grads_match as assert_tensor_parallel_grads_match,
    )
    from dpverify.sharded.tensor_parallel import (
        assert_tensor_parallel_training_matches as assert_tensor_parallel_training_matches,
    )
    from dpverify.sharded.tensor_parallel import tp_step as tp_step
    from dpverify.sharded.tensor_parallel import weighted_tp_step as weighted_tp_step
