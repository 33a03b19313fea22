"""The public surface: what ``dpverify/__init__.py`` imports, and what docs/api.md documents."""

from __future__ import annotations

import re
from pathlib import Path

import dpverify

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
API_PAGE = ROOT / "docs" / "api.md"

#: The public names. A name added to or dropped from the API changes this list on purpose.
PUBLIC = [
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


def _documented() -> set[str]:
    text = API_PAGE.read_text()
    section = text.split("# API\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `(?:dpverify\.)?(\w+)", section, flags=re.MULTILINE))


def test_all_is_the_public_api() -> None:
    assert dpverify.__all__ == PUBLIC


def test_the_api_page_documents_only_public_names() -> None:
    assert _documented() <= set(dpverify.__all__)


def test_the_api_page_documents_every_public_name() -> None:
    assert set(dpverify.__all__) == _documented()


def test_every_public_name_exists_and_has_a_docstring() -> None:
    for name in dpverify.__all__:
        obj = getattr(dpverify, name)
        assert (obj.__doc__ or "").strip(), name


def test_readme_first_example_runs() -> None:
    block = README.read_text().split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(block, "README.md", "exec"), {})


def test_every_public_name_is_exported_from_its_module_and_typed() -> None:
    """``__all__``, the lazy ``_EXPORTS`` table and the imports type checkers read name the
    same things, and each name is the object its module defines."""
    import ast
    import importlib

    exports: dict[str, str] = dpverify._EXPORTS  # type: ignore[attr-defined]
    assert sorted(exports) == dpverify.__all__
    for name, module in exports.items():
        assert getattr(dpverify, name) is getattr(importlib.import_module(module), name)
    tree = ast.parse(Path(dpverify.__file__).read_text())
    typed = {
        (node.module, alias.name)
        for block in tree.body if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
        for node in block.body if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert typed == {(module, name) for name, module in exports.items()}
    assert set(dpverify.__all__) <= set(dir(dpverify))


def test_an_unknown_name_is_an_attribute_error() -> None:
    import pytest

    with pytest.raises(AttributeError, match="module 'dpverify' has no attribute 'assert_everything'"):
        dpverify.assert_everything  # noqa: B018


def test_importing_dpverify_loads_no_backend() -> None:
    """``import dpverify`` costs what its own few lines cost: the DDP pool, FSDP2, tensor and
    pipeline parallelism, Hypothesis and torch itself load with the first name that needs
    them."""
    import subprocess
    import sys

    heavy = ["torch", "hypothesis", "torch.distributed.fsdp", "dpverify.ddp.pool", "dpverify.sharded.fsdp", "dpverify.checks.dp"]
    code = f"import sys, dpverify; print([m for m in {heavy!r} if m in sys.modules])"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"
    code = "import sys, dpverify; dpverify.assert_dp_grads_match; print('dpverify.checks.dp' in sys.modules, 'torch.distributed.fsdp' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split() == ["True", "False"]
