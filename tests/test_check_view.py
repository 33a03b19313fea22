"""How ``dpverify check`` prints its per-parameter table: one line per parameter at 100
columns, and "no gradient" for a parameter that has none, never an error of 0 of 0."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn

import dpverify
from dpverify.cli.check_view import render_model_check
from dpverify.core.comparison import TensorComparison, TensorId
from dpverify.planner import ModelCheckReport, parameter_errors
from dpverify.registry import CheckResult, Split, Verdict

_LONG = "encoder.layers.11.self_attention.query_key_value_projection"


def _tensor(name: str, shape: tuple[int, ...], ratio: float, **more: object) -> TensorComparison:
    numel = 1
    for size in shape:
        numel *= size
    return TensorComparison(TensorId("grad", name), shape, numel, max_abs=ratio * 1e-6, allowed=1e-6, ratio=ratio, **more)  # type: ignore[arg-type]


def _report(*tensors: TensorComparison, eval_copy: bool = False) -> ModelCheckReport:
    results = tuple(
        CheckResult(check, title, Split(batch, devices), Verdict.PASS, "passed", tensors=tensors, eval_copy=eval_copy)
        for check, title in (("dp-grads", "DP grads match one device"), ("dp-grad-sum", "replica grads sum to full batch"))
        for batch, devices in ((8, 2), (5, 4))
    )
    return ModelCheckReport("models:transformer", "mse", results, ())


def _table_lines(report: ModelCheckReport, width: int) -> list[str]:
    console = Console(width=width, no_color=True, record=True, file=io.StringIO())
    render_model_check(console, report)
    lines = console.export_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Per-parameter"))
    return [line for line in lines[start + 4 :] if line.startswith("│")]


@pytest.mark.parametrize("width", [80, 100, 160])
@pytest.mark.parametrize("eval_copy", [False, True])
def test_every_parameter_takes_one_line(width: int, eval_copy: bool) -> None:
    names = [f"{_LONG}.weight", f"{_LONG}.bias", "head.weight", "embeddings.word_embeddings.weight"]
    shapes = [(3072, 1024), (3072,), (10, 1024), (50_257, 1024)]
    report = _report(*(_tensor(n, s, 0.1 * (i + 1)) for i, (n, s) in enumerate(zip(names, shapes, strict=True))), eval_copy=eval_copy)
    lines = _table_lines(report, width)
    assert len(lines) == len(names)  # no row wraps onto a second line
    assert all(len(line) <= width and line.endswith("│") for line in lines)  # nothing spills past the border
    if width >= 100:
        assert all("dp-grads" in line and "B=8 on 2" in line for line in lines)  # where each came from
        assert all("e-" in line.split("│")[4] for line in lines)  # the numbers whole
    assert "head.weight" in "\n".join(lines)


def test_a_parameter_without_a_gradient_shows_no_gradient() -> None:
    report = _report(_tensor("body.weight", (4, 4), 0.2), _tensor("unused.weight", (4, 4), 0.0, absent=True))
    lines = _table_lines(report, 100)
    unused = next(line for line in lines if "unused.weight" in line)
    assert "no gradient" in unused
    assert " 0 " not in unused  # no error of 0 of an allowed 0
    assert "no gradient" not in next(line for line in lines if "body.weight" in line)


def test_a_gradient_compared_on_one_split_beats_its_absence_on_another() -> None:
    absent = _tensor("w", (3,), 0.0, absent=True)
    compared = _tensor("w", (3,), 0.0)
    results = (
        CheckResult("dp-grads", "DP grads", Split(2, 2), Verdict.PASS, "passed", tensors=(absent,)),
        CheckResult("dp-grads", "DP grads", Split(8, 2), Verdict.PASS, "passed", tensors=(compared,)),
    )
    (error,) = parameter_errors(ModelCheckReport("m", "mse", results, ()))
    assert not error.absent
    assert error.where == "dp-grads, B=8 on 2"


class _Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 3)
        self.unused = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.used(x)
        return out


@pytest.mark.parametrize("ids", [[0], [0, 1]])
def test_a_parameter_no_step_gave_a_gradient_is_absent_not_compared(ids: list[int]) -> None:
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 4, generator=generator), torch.randn(4, 3, generator=generator)
    result = dpverify.assert_dp_grads_match(_Unused(), x, y, loss_fn=F.mse_loss, device_ids=ids)
    rows = {t.name: t for t in result.tensors}
    assert rows["grad 'unused.weight'"].absent
    assert rows["grad 'unused.bias'"].absent
    assert not rows["grad 'used.weight'"].absent
    result_text = "\n".join(line for line in result.message().splitlines() if "unused.weight" in line)
    assert "no gradient in either step" in result_text
