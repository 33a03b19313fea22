"""dpverify: a correctness harness for PyTorch data parallelism.

DataParallel (real, or virtual on any machine), DistributedDataParallel, FSDP2, tensor and
pipeline parallelism checked against the single-device step, by execution, with
float64-anchored tolerances and messages in the style of ``torch.testing.assert_close``.

The names imported below are the public API, together with the modules
``dpverify.strategies`` (Hypothesis strategies) and ``dpverify.mutants`` (deliberately broken
steps); everything else is internal and may move. ``__all__`` is read off these imports, so
a public name is listed once. Importing dpverify imports torch: the pytest plugin, which
pytest imports in every session, is the separate module ``pytest_dpverify`` for that reason.
"""

from types import ModuleType as _ModuleType

from dpverify.checks.buffers import assert_dp_buffers_match as assert_dp_buffers_match
from dpverify.checks.dp import assert_dp_grads_match as assert_dp_grads_match
from dpverify.checks.dp import (
    assert_grad_sum_equals_mean_loss_grad as assert_grad_sum_equals_mean_loss_grad,
)
from dpverify.checks.loss_average import LossAverageReport as LossAverageReport
from dpverify.checks.loss_average import (
    assert_loss_reduction_matches_full_batch as assert_loss_reduction_matches_full_batch,
)
from dpverify.checks.loss_average import check_forward_loss_average as check_forward_loss_average
from dpverify.checks.loss_average import chunk_weighted_loss as chunk_weighted_loss
from dpverify.checks.registry import CHECKS as CHECKS
from dpverify.checks.registry import Case as Case
from dpverify.checks.registry import CheckResult as CheckResult
from dpverify.checks.registry import CheckSpec as CheckSpec
from dpverify.checks.registry import Split as Split
from dpverify.checks.registry import Target as Target
from dpverify.checks.registry import Verdict as Verdict
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
from dpverify.ddp.checks import assert_ddp_accumulation_matches as assert_ddp_accumulation_matches
from dpverify.ddp.checks import assert_ddp_buffers_match as assert_ddp_buffers_match
from dpverify.ddp.checks import assert_ddp_grads_match as assert_ddp_grads_match
from dpverify.ddp.checks import (
    assert_ddp_sync_batchnorm_matches as assert_ddp_sync_batchnorm_matches,
)
from dpverify.ddp.checks import assert_ddp_training_matches as assert_ddp_training_matches
from dpverify.ddp.checks import assert_dp_ddp_agree as assert_dp_ddp_agree
from dpverify.ddp.pool import DDPWorkerPool as DDPWorkerPool
from dpverify.ddp.pool import ParallelError as ParallelError
from dpverify.ddp.rank import MicroBatch as MicroBatch
from dpverify.ddp.rank import RankInfo as RankInfo
from dpverify.ddp.rank import ShardContext as ShardContext
from dpverify.ddp.rank import ddp_step as ddp_step
from dpverify.ddp.rank import no_sync_accumulation_step as no_sync_accumulation_step
from dpverify.ddp.rank import weighted_ddp_step as weighted_ddp_step
from dpverify.sharded.fsdp import FSDPContext as FSDPContext
from dpverify.sharded.fsdp import assert_fsdp_grads_match as assert_fsdp_grads_match
from dpverify.sharded.fsdp import assert_fsdp_training_matches as assert_fsdp_training_matches
from dpverify.sharded.fsdp import fsdp_step as fsdp_step
from dpverify.sharded.fsdp import weighted_fsdp_step as weighted_fsdp_step
from dpverify.sharded.pipeline import assert_pipeline_grads_match as assert_pipeline_grads_match
from dpverify.sharded.tensor_parallel import TPContext as TPContext
from dpverify.sharded.tensor_parallel import (
    assert_tensor_parallel_grads_match as assert_tensor_parallel_grads_match,
)
from dpverify.sharded.tensor_parallel import tp_step as tp_step
from dpverify.sharded.tensor_parallel import weighted_tp_step as weighted_tp_step

__version__ = "0.1.0"

# Every public name imported above, and nothing else (not the subpackages the imports bind).
__all__ = sorted(
    name
    for name, value in globals().items()
    if not name.startswith("_") and not isinstance(value, _ModuleType)
)
