"""``dpverify check MODULE:FACTORY``: every applicable check on a user's model."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dpverify.cli.main import main
from dpverify.cli.user_model import first_layer_batch, user_model
from dpverify.core.errors import InvalidArgument
from dpverify.models.user import builtin_model
from dpverify.planner import Verdict, check_model, parameter_errors

MODELS = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from torch import nn


    class Regularised(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(6, 8)
            self.norm = nn.BatchNorm1d(8)
            self.drop = nn.Dropout(0.3)
            self.out = nn.Linear(8, 3)

        def forward(self, x):
            return self.out(self.drop(F.relu(self.norm(self.inp(x)))))


    class Centred(nn.Module):
        \"\"\"Subtracts the batch mean by hand: batch-dependent, and no BatchNorm to blame.\"\"\"

        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(4, 2)

        def forward(self, x):
            h = self.inp(x)
            return h - h.mean(0)


    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(4, 1)

        def forward(self, x, y):
            prediction = self.body(x).squeeze(-1)
            return prediction, F.mse_loss(prediction, y)


    def regularised():
        return Regularised()


    def centred():
        return Centred()


    def head():
        return Head()


    def head_batch(rows):
        g = torch.Generator().manual_seed(rows)
        return (torch.randn(rows, 4, generator=g), torch.randn(rows, generator=g)), None


    def not_a_model():
        return 3


    def recurrent():
        return nn.Sequential(nn.LSTM(3, 4))
    """
)


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "user_models.py").write_text(MODELS)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.timeout(120)
def test_batchnorm_and_dropout_are_explained_not_failed(models: Path) -> None:
    env = {**os.environ, "COLUMNS": "140"}
    result = subprocess.run(
        [sys.executable, "-m", "dpverify", "check", "user_models:regularised", "--batch-sizes", "8", "5", "--no-color"],
        capture_output=True, text=True, timeout=120, check=False, cwd=models, env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert out.startswith("dpverify check: user_models:regularised")
    assert "x of shape (B, 6) inferred from inp (Linear(in_features=6" in out
    assert "EXPLAINED" in out
    assert "DP grads match one device (eval mode)" in out
    assert "'norm' (batch statistics)" in out
    assert "SyncBatchNorm under DistributedDataParallel" in out
    assert "'drop' (randomness)" in out
    assert "Per-parameter gradient error" in out
    assert "norm.weight" in out
    assert out.splitlines()[-1] == "OK: 12 passed, 0 failed, 12 explained"


def test_a_batch_dependent_model_fails_with_the_report(models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["check", "user_models:centred", "--batch-sizes", "4", "--devices", "2", "--no-color"])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL: DP grads match one device, B=4 on 2" in out
    assert "tensors are not close!" in out
    assert out.splitlines()[-1].startswith("FAILED: ")


def test_a_model_returning_its_loss_gets_the_averaging_checks(models: Path) -> None:
    model = user_model("user_models:head", inputs_spec="user_models:head_batch")
    report = check_model(model, batch_sizes=(4, 5), device_counts=(2,))
    verdicts = {(r.check, r.split.batch_size): r.verdict for r in report.results}
    assert report.results[0].title == "loss.mean() of replica losses"
    assert verdicts[("dp-loss-average", 4)] == Verdict.PASS  # equal chunks
    assert verdicts[("dp-loss-average", 5)] == Verdict.WARN  # [3, 2]: biased
    assert verdicts[("dp-weighted-loss", 5)] == Verdict.PASS
    assert {e.name for e in parameter_errors(report)} == {"body.weight", "body.bias"}


def test_builtin_model_and_ddp_skip_for_tiny_batches(capsys: pytest.CaptureFixture[str]) -> None:
    report = check_model(builtin_model("conv"), batch_sizes=(3,), device_counts=(2,))
    assert [r.verdict for r in report.results] == [Verdict.PASS] * 3
    # no rank starts: a rank without rows, or a forward that returns its loss, is skipped
    ddp = check_model(builtin_model("mlp"), batch_sizes=(1,), device_counts=(2,), backend="ddp")
    assert [(r.verdict, r.summary) for r in ddp.results] == [(Verdict.SKIP, "fewer rows than ranks (1 < 2)")] * 2
    head = check_model(builtin_model("loss-in-forward"), batch_sizes=(4,), device_counts=(2,), backend="ddp")
    assert head.results[0].verdict == Verdict.SKIP
    assert main(["check", "--model", "mlp", "--batch-sizes", "2", "--devices", "2", "--no-color"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "OK: 3 passed, 0 failed"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["user_models:not_a_model"], "returned int; it must return a torch.nn.Module"),
        (["user_models:recurrent"], "is not batch_first, and DataParallel scatters along dim 0; pass --inputs"),
        (["user_models:head", "--inputs", "user_models:missing"], "--inputs 'user_models:missing': 'user_models' has no attribute 'missing'"),
        (["user_models:centred", "--loss", "hinge"], "--loss 'hinge' is not one of"),
        ([], "give MODULE:FACTORY"),
    ],
)
def test_usage_errors_exit_two(models: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", *args]) == 2
    assert message in capsys.readouterr().err


def test_first_layer_inference() -> None:
    from torch import nn

    make, text = first_layer_batch(nn.Sequential(nn.Dropout(), nn.Embedding(10, 3), nn.Linear(3, 1)))
    batch = make(4)
    (tokens,) = batch.args
    assert tokens.shape == (4, 6)
    assert int(tokens.max()) < 10
    assert batch.target is None
    assert batch.kwargs == {}
    assert text.startswith("token ids of shape (B, 6) in [0, 10) inferred from 1 (Embedding(10, 3))")
    make, _ = first_layer_batch(nn.Sequential(nn.Conv2d(3, 2, 3)))
    assert make(2).args[0].shape == (2, 3, 8, 8)
    with pytest.raises(InvalidArgument, match="pass --inputs MODULE:FN"):
        first_layer_batch(nn.Sequential(nn.ReLU()))


def test_attention_first_gives_sequences() -> None:
    from torch import nn

    make, text = first_layer_batch(nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True))
    assert make(3).args[0].shape == (3, 6, 8)
    assert "MultiheadAttention" in text


#: A model whose forward, on the batch of 5 rows with gradients on (the B=5 checks), waits
#: until the test creates the file ``go``: the checks of B=8 are over by then, and their
#: lines must already be out.
GATED = textwrap.dedent(
    """
    import os
    import time

    import torch
    from torch import nn


    class Gated(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x):
            if torch.is_grad_enabled() and x.shape[0] == 5:
                deadline = time.monotonic() + 60
                while not os.path.exists("go") and time.monotonic() < deadline:
                    time.sleep(0.05)
            return self.lin(x)


    def gated():
        return Gated()
    """
)


@pytest.mark.timeout(150)
@pytest.mark.deep
def test_piped_check_prints_a_line_per_check_as_it_finishes(tmp_path: Path) -> None:
    import queue
    import threading
    import time

    (tmp_path / "gated_model.py").write_text(GATED)
    env = {key: value for key, value in os.environ.items() if key != "COLUMNS"}
    process = subprocess.Popen(
        [sys.executable, "-m", "dpverify", "check", "gated_model:gated", "--batch-sizes", "8", "5", "--devices", "2", "--checks", "dp-grads", "dp-grad-sum", "--no-color"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path, env=env,
    )
    assert process.stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line.rstrip("\n")) for line in process.stdout], daemon=True)  # type: ignore[union-attr]
    reader.start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 45
        while not any(line.startswith("[1/4] ") for line in seen):
            seen.append(lines.get(timeout=max(deadline - time.monotonic(), 0.01)))
        # the first check's line came while the B=5 checks were still waiting: it was flushed
        assert process.poll() is None, seen
    except queue.Empty:
        pytest.fail(f"no line for the first check within 45 s; got {seen}")
    finally:
        (tmp_path / "go").touch()
    assert process.wait(timeout=120) == 0
    reader.join(timeout=10)
    while not lines.empty():
        seen.append(lines.get())
    assert seen[0] == "dpverify check: gated_model:gated"
    progress = [line for line in seen if re.match(r"\[\d/4\] ", line)]
    assert [line[:6] for line in progress] == ["[1/4] ", "[2/4] ", "[3/4] ", "[4/4] "]
    assert progress[0].startswith("[1/4] PASS  DP grads match one device, B=8 on 2: worst at ")
    assert progress[3].startswith("[4/4] PASS  replica grads sum to full batch, B=5 on 2: ")
    # every check line comes before the tables and the verdict
    assert seen.index(progress[-1]) < seen.index(next(line for line in seen if line.startswith("Verdict per check")))
    assert seen[-1] == "OK: 4 passed, 0 failed"


#: Four BatchNorm layers: one explanation, naming all four.
NORMS = textwrap.dedent(
    """
    import torch
    from torch import nn


    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.dense = nn.Linear(6, 6)
            self.norm = nn.BatchNorm1d(6)

        def forward(self, x):
            return torch.relu(self.norm(self.dense(x)))


    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(5, 6)
            self.layer = nn.ModuleList(Block() for _ in range(4))
            self.out = nn.Linear(6, 3)

        def forward(self, x):
            x = self.inp(x)
            for block in self.layer:
                x = block(x)
            return self.out(x)


    def stack():
        return Stack()
    """
)


def test_a_repeated_explanation_is_printed_once_with_its_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "norm_stack.py").write_text(NORMS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("COLUMNS", raising=False)
    assert main(["check", "norm_stack:stack", "--batch-sizes", "4", "--devices", "2", "--no-color"]) == 0
    out = capsys.readouterr().out
    assert out.count("in train mode normalises each replica's chunk") == 1, out
    panel = " ".join(out.split("Expected divergence (train mode)")[1].split("checks differ for this reason")[0].replace("│", " ").split())
    assert "'layer.0.norm', 'layer.1.norm', 'layer.2.norm' and 'layer.3.norm' (batch statistics, 4 modules): BatchNorm1d" in panel
    report = check_model(user_model("norm_stack:stack"), batch_sizes=(4,), device_counts=(2,))
    explained = [r for r in report.results if r.verdict == Verdict.EXPLAINED]
    assert explained
    assert all(r.summary == "differs because of 4 BatchNorm1d modules (batch statistics)" for r in explained)
    assert all(r.detail.count("Fix: ") == 1 for r in explained)


def test_long_parameter_names_are_shortened_in_the_middle(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["check", "hf_like_models:plain", "--batch-sizes", "4", "--devices", "2", "--no-color"]) == 0
    out = capsys.readouterr().out
    table = out.split("Per-parameter gradient error")[1]
    cells = [line.split("│")[1].strip() for line in table.splitlines() if line.startswith("│") and "│" in line[1:]]
    names = [f"bert.encoder.layer.{i}.attention.self.key.{leaf}" for i in range(3) for leaf in ("weight", "bias")]
    shown = [cell for cell in cells if cell]
    assert len(shown) == len(names) == len(set(shown)), shown
    matched = set()
    for cell in shown:
        head, _, tail = cell.partition("…")
        assert head, cell
        assert tail, cell  # never cut off at the end
        (name,) = [n for n in names if n.startswith(head) and n.endswith(tail)]
        assert name.split(".")[3] in re.split(r"[.…]", cell)  # the layer number tells rows apart
        matched.add(name)
    assert matched == set(names)


@pytest.mark.timeout(180)
def test_the_header_says_what_ran(capsys: pytest.CaptureFixture[str]) -> None:
    from dpverify.core.devices import cuda_device_count

    if cuda_device_count():
        pytest.skip("the wording below is that of a machine without CUDA")
    # DDP runs as real processes, one per rank, in a gloo process group: nothing virtual
    assert main(["check", "--model", "mlp", "--backend", "ddp", "--batch-sizes", "4", "--devices", "2", "--no-color"]) == 0
    ddp = " ".join(capsys.readouterr().out.split())
    assert "real DDP on gloo ranks (2 processes)" in ddp
    assert "virtual" not in ddp
    assert main(["check", "--model", "mlp", "--backend", "all", "--batch-sizes", "1", "--devices", "2", "4", "--no-color"]) == 0
    both = " ".join(capsys.readouterr().out.split())
    assert (
        "DataParallel on virtual devices (no CUDA here), real DDP on gloo ranks (2 and 4 processes) and FSDP2 "
        "(fully_shard), tensor parallelism (parallelize_module) and pipeline parallelism "
        "(torch.distributed.pipelining) on the same gloo ranks"
    ) in both
    assert main(["check", "--model", "mlp", "--backend", "pp", "--batch-sizes", "4", "--devices", "2", "--no-color"]) == 0
    pipeline = " ".join(capsys.readouterr().out.split())
    assert "pipeline parallelism (torch.distributed.pipelining) on gloo ranks (2 processes)" in pipeline
    assert "virtual" not in pipeline


def test_checks_option_runs_the_named_registry_checks(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["check", "--model", "mlp", "--batch-sizes", "8", "--devices", "2", "--no-color"]
    assert main([*args, "--checks", "dp-grad-sum"]) == 0
    out = capsys.readouterr().out
    assert "replica grads sum to full batch" in out
    assert "DP grads match one device" not in out
    assert out.splitlines()[-1] == "OK: 1 passed, 0 failed"


def test_checks_that_do_not_apply_are_a_usage_error_naming_those_that_do(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--model", "loss-in-forward", "--checks", "dp-grads"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dpverify check: --checks dp-grads --backend dp: none of these applies to this model;")
    assert err.rstrip().endswith("these do: dp-loss-average, dp-weighted-loss")


def test_buffers_check_on_request_skips_a_one_row_batchnorm_chunk(models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = user_model("user_models:regularised")
    report = check_model(model, batch_sizes=(8, 5), device_counts=(4,), checks=["dp-buffers"])
    verdicts = {r.split.batch_size: r for r in report.results if not r.title.endswith("(eval mode)")}
    assert set(verdicts) == {8, 5}
    assert verdicts[8].verdict == Verdict.PASS  # BatchNorm's running statistics are replica 0's
    # in eval mode no chunk is normalised by its own statistics: every split runs, and passes
    assert [r.verdict for r in report.results if r.title.endswith("(eval mode)")] == [Verdict.PASS] * 2
    assert verdicts[5].verdict == Verdict.SKIP
    assert verdicts[5].summary == "BatchNorm in train mode cannot normalise a one-row chunk (chunks [2, 2, 1])"


def test_check_parallel_checks_your_wrapper(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["check", "--model", "mlp", "--batch-sizes", "5", "--devices", "4", "--no-color"]
    assert main([*args, "--parallel", "dpverify.mutants:AveragingDataParallel"]) == 1
    out = capsys.readouterr().out
    words = " ".join(out.split())  # the header and panels wrap at the console's width
    assert "dpverify.mutants:AveragingDataParallel on virtual devices" in words
    assert "the replica gradients were averaged" in words
    assert out.splitlines()[-1] == "FAILED: 0 passed, 3 failed"
    assert main([*args, "--parallel", "dpverify.mutants:ScratchDataParallel"]) == 0
    assert main([*args, "--parallel", "no_such_module:X"]) == 2


@pytest.mark.parametrize("name", ["mlp", "loss-in-forward"])
def test_a_split_that_ran_one_replica_is_no_pass(name: str) -> None:
    # one device, and one row on two devices, run one replica: nothing ran in parallel
    report = check_model(builtin_model(name, seed=0), splits=[(4, 1), (1, 2), (4, 2)], checks=("dp-grads", "dp-grad-sum", "dp-loss-average", "dp-weighted-loss", "dp-buffers", "dp-state"))
    serial = [r for r in report.results if r.split.devices == 1 or r.split.batch_size == 1]
    parallel = [r for r in report.results if r not in serial]
    assert serial
    assert parallel
    for result in serial:
        assert result.serial, result
        assert result.replicas == 1
        assert "1 replica forward ran" in result.summary
        assert "nothing ran in parallel" in result.summary
    assert all(r.verdict in (Verdict.PASS, Verdict.WARN) and not r.serial for r in parallel)
    # some splits ran in parallel: the run checked something
    assert not report.checked_nothing


def test_a_run_where_only_one_replica_ran_checked_nothing() -> None:
    report = check_model(builtin_model("mlp", seed=0), splits=[(5, 1), (1, 4)])
    assert report.results
    assert report.checked_nothing
    assert all(r.serial for r in report.results)


@pytest.mark.parametrize(("devices", "code"), [(["1"], 3), (["1", "2"], 0)])
def test_check_on_one_device_says_nothing_ran_in_parallel(devices: list[str], code: int, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--model", "mlp", "--batch-sizes", "5", "--devices", *devices, "--no-color"]) == code
    out = capsys.readouterr().out
    assert "DP grads match one device, B=5 on 1: 1 replica forward ran (chunks [5]): nothing ran in" in " ".join(out.split())
    if code == 3:
        assert "Nothing ran in parallel: every check ran one replica" in out
        assert out.splitlines()[-1] == "NOTHING CHECKED: 0 passed, 0 failed, 3 skipped"
    else:
        assert "Skipped: 3 checks, 3 of them ran one replica (nothing in parallel)" in out
        assert out.splitlines()[-1] == "OK: 3 passed, 0 failed, 3 skipped"


@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
def test_one_rank_runs_nothing_in_parallel(backend: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--model", "mlp", "--backend", backend, "--batch-sizes", "4", "--devices", "1", "--no-color"]) == 3
    assert "nothing runs in parallel on one rank" in capsys.readouterr().out


def test_sync_batchnorm_check_is_not_planned_for_the_eval_mode_copy(models: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SyncBatchNorm synchronises only in train mode: the eval-mode copy a train-mode
    BatchNorm model is checked again on has nothing for ddp-sync-batchnorm to check (it
    raised 'module is in eval mode' there, and `check --checks ddp-sync-batchnorm` exited 2)."""
    (models / "bn_models.py").write_text(
        "from torch import nn\n\n\ndef make():\n    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))\n"
    )
    monkeypatch.syspath_prepend(str(models))
    report = check_model(user_model("bn_models:make"), batch_sizes=(8,), device_counts=(2,), backend="ddp", checks=("ddp-sync-batchnorm",))
    assert [(r.check, r.eval_copy, r.verdict) for r in report.results] == [("ddp-sync-batchnorm", False, Verdict.PASS)]


def test_check_releases_a_batchs_shared_steps_after_its_last_check() -> None:
    from dpverify.planner import plan_checks

    model = builtin_model("mlp", seed=0)
    plan = plan_checks(model, batch_sizes=(4, 5), device_counts=(2, 3))
    shared = {id(p.case.steps): p.case.steps for p in plan if p.case.steps is not None}
    assert len(shared) == 2  # one per batch, shared by both device counts
    held: list[int] = []
    first = check_model(model, plan=plan, on_result=lambda _: held.append(sum(len(s.steps) for s in shared.values())))
    assert max(held) > 0  # the checks did share steps while they ran
    assert all(not s.steps and not s.picked and s.left is None and not s.replays for s in shared.values())
    # released steps are fresh ones: the same plan checks the same way again
    again = check_model(model, plan=plan)
    assert [(r.check, r.split, r.verdict) for r in again.results] == [(r.check, r.split, r.verdict) for r in first.results]
