"""The public surface: what ``dpverify/__init__.py`` imports, and what the README documents."""

from __future__ import annotations

import re
from pathlib import Path

import dpverify

README = Path(__file__).resolve().parent.parent / "README.md"

#: The public names. A name added to or dropped from the API changes this list on purpose.
PUBLIC = [
    "CHECKS",
    "Case",
    "CheckResult",
    "CheckSpec",
    "DDPWorkerPool",
    "DivergenceSource",
    "DroppedRowsWarning",
    "FSDPContext",
    "InvalidArgument",
    "LossAverageReport",
    "MicroBatch",
    "NonFiniteReference",
    "ParallelError",
    "ParallelMismatch",
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
    "assert_ddp_grads_match",
    "assert_ddp_sync_batchnorm_matches",
    "assert_ddp_training_matches",
    "assert_dp_buffers_match",
    "assert_dp_ddp_agree",
    "assert_dp_grads_match",
    "assert_fsdp_grads_match",
    "assert_fsdp_training_matches",
    "assert_grad_sum_equals_mean_loss_grad",
    "assert_loss_reduction_matches_full_batch",
    "assert_pipeline_grads_match",
    "assert_tensor_parallel_grads_match",
    "check_forward_loss_average",
    "chunk_sizes",
    "chunk_weighted_loss",
    "current_virtual_device",
    "data_parallel",
    "ddp_step",
    "divergence_sources",
    "fsdp_step",
    "no_sync_accumulation_step",
    "plan_scatter",
    "tp_step",
    "virtual_devices",
    "weighted_ddp_step",
    "weighted_fsdp_step",
    "weighted_tp_step",
]


def _documented() -> set[str]:
    text = README.read_text()
    section = text.split("\n## API\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `(?:dpverify\.)?(\w+)", section, flags=re.MULTILINE))


def test_all_is_the_public_api() -> None:
    assert dpverify.__all__ == PUBLIC


def test_the_readme_api_table_documents_only_public_names() -> None:
    assert _documented() <= set(dpverify.__all__)


def test_the_readme_api_table_documents_every_public_name() -> None:
    assert set(dpverify.__all__) == _documented()


def test_every_public_name_exists_and_has_a_docstring() -> None:
    for name in dpverify.__all__:
        obj = getattr(dpverify, name)
        assert (obj.__doc__ or "").strip(), name


def test_readme_first_example_runs() -> None:
    block = README.read_text().split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(block, "README.md", "exec"), {})
