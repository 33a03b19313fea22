"""The data path and the evaluation metric from the command line: ``check-data MODULE:DATASET
--loader MODULE:FACTORY`` and ``check --eval MODULE:FN``, on a user's module written as users
write theirs. A padded DistributedSampler fails with the repeated ids, a loader that
partitions the dataset passes, ``--allow padding`` passes with the cost said, a shuffle
without ``set_epoch`` fails naming it; an evaluation that sums over the padded sampler fails
naming the samples counted twice, one that de-duplicates passes; whatever cannot be used is
a usage error naming the option, never a traceback.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dpverify.cli.data import allow_text, eval_dataset_size
from dpverify.cli.main import EXIT_FAILED, EXIT_NOTHING_CHECKED, EXIT_OK, EXIT_USAGE, main

ROOT = Path(__file__).resolve().parents[1]

USER_CODE = textwrap.dedent(
    '''
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, Subset, TensorDataset

    NOT_CALLABLE = 3


    def ten():
        return TensorDataset(torch.arange(10, dtype=torch.float32).unsqueeze(1), torch.arange(10))


    TWELVE = TensorDataset(torch.arange(12, dtype=torch.float32).unsqueeze(1), torch.arange(12))


    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))


    def stream():
        return Stream()


    def padded(dataset, rank, world_size, epoch):
        sampler = DistributedSampler(dataset, shuffle=False)
        return DataLoader(dataset, batch_size=2, sampler=sampler)


    def shuffled(dataset, rank, world_size, epoch):
        sampler = DistributedSampler(dataset, shuffle=True, seed=0)
        sampler.set_epoch(epoch)
        return DataLoader(dataset, batch_size=2, sampler=sampler)


    def no_set_epoch(dataset, rank, world_size, epoch):
        return DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, shuffle=True, seed=0))


    def strided(dataset, rank, world_size, epoch):
        return DataLoader(Subset(dataset, list(range(rank, len(dataset), world_size))), batch_size=2)


    def two_arguments(dataset, rank):
        return DataLoader(dataset)


    def raising(dataset, rank, world_size, epoch):
        if rank == 1:
            raise RuntimeError("rank 1 cannot build its loader")
        return DataLoader(dataset)


    def make_model():
        return nn.Linear(4, 3)


    def batches(batch_size):
        return torch.randn(batch_size, 4), torch.randint(0, 3, (batch_size,))


    def keyword_batches(batch_size):
        return {"input": torch.randn(batch_size, 4)}, torch.randint(0, 3, (batch_size,))


    def loss_batches(batch_size):
        return (torch.randn(batch_size, 4), torch.randint(0, 3, (batch_size,))), None


    def padded_sum(model, loader):
        total = torch.zeros(2, dtype=torch.float64)
        with torch.no_grad():
            for x, y in loader:
                total[0] += F.cross_entropy(model(x), y, reduction="sum").double()
                total[1] += len(y)
        dist.all_reduce(total)
        return (total[0] / total[1]).item()


    def gathered(model, loader):
        losses = []
        with torch.no_grad():
            for x, y in loader:
                losses.append(F.cross_entropy(model(x), y, reduction="none"))
        mine = torch.cat(losses)
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, mine)
        return torch.stack(parts, dim=1).reshape(-1)[: len(loader.dataset)].double().mean().item()


    def local(model, loader):
        total, count = 0.0, 0
        with torch.no_grad():
            for x, y in loader:
                total += F.cross_entropy(model(x), y, reduction="sum").item()
                count += len(y)
        return total / count


    class MeanLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x, y):
            return F.cross_entropy(self.lin(x), y)


    def mean_loss():
        return MeanLoss()


    def mean_of_replica_means(model, loader):
        total, count = 0.0, 0
        with torch.no_grad():
            for x, y in loader:
                total += model(x, y).mean().item() * len(y)
                count += len(y)
        return total / count


    def one_argument(model):
        return 0.0
    '''
)
MODULE = "cli_data_user_code"
DATA = ["check-data", "--no-color", "--world-size", "4"]
EVAL = ["check", f"{MODULE}:make_model", "--inputs", f"{MODULE}:batches", "--batch-sizes", "8", "--no-color"]


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("user")
    (folder / f"{MODULE}.py").write_text(USER_CODE)
    return folder


@pytest.fixture(autouse=True)
def _in_user_dir(user_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the command line imports MODULE:NAME from the current directory, as a user runs it
    monkeypatch.chdir(user_dir)
    monkeypatch.syspath_prepend(str(user_dir))
    monkeypatch.setenv("COLUMNS", "200")  # the reports' lines unwrapped


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


# --------------------------------------------------------------------------- check-data


def test_a_padded_distributed_sampler_fails_with_the_repeated_ids(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run([*DATA, f"{MODULE}:ten", "--loader", f"{MODULE}:padded"], capsys)
    assert code == EXIT_FAILED, out
    # 10 samples on 4 ranks in order: padded to 12 with the first two of the order
    assert "Samples seen twice: [0, 1]" in out
    assert "12 of 10" in out
    assert "FAILED: 2 epochs on 4 ranks" in out


def test_a_loader_that_partitions_the_dataset_passes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run([*DATA, f"{MODULE}:ten", "--loader", f"{MODULE}:strided", "--epochs", "3"], capsys)
    assert code == EXIT_OK, out
    assert out.count("10 of 10") == 3
    assert "OK: 3 epochs on 4 ranks: 3 passed, 0 failed, 0 allowed" in out
    assert "FAIL" not in out


def test_allowed_padding_passes_and_says_the_cost(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run([*DATA, f"{MODULE}:ten", "--loader", f"{MODULE}:shuffled", "--allow", "padding"], capsys)
    assert code == EXIT_OK, out
    assert "allowed: padding" in out  # the header
    assert out.count("padding (allowed)") == 2  # both epochs pad
    assert "double weight" in out
    assert "OK: 2 epochs on 4 ranks: 0 passed, 0 failed, 2 allowed" in out


def test_a_shuffle_without_set_epoch_fails_naming_set_epoch(capsys: pytest.CaptureFixture[str]) -> None:
    # 12 samples on 4 ranks: no padding, so the repeated order is the only finding
    code, out, _ = _run([*DATA, f"{MODULE}:TWELVE", "--loader", f"{MODULE}:no_set_epoch", "--epochs", "2"], capsys)
    assert code == EXIT_FAILED, out
    assert "repeated-order" in out
    assert "set_epoch(epoch)" in out
    assert "FAILED: 2 epochs on 4 ranks: 1 passed, 1 failed" in out


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ([f"{MODULE}:missing", "--loader", f"{MODULE}:padded"], ["MODULE:DATASET", "has no attribute 'missing'"]),
        (["no_such_module_here:ten", "--loader", f"{MODULE}:padded"], ["MODULE:DATASET", "cannot import"]),
        ([f"{MODULE}:stream", "--loader", f"{MODULE}:padded"], ["MODULE:DATASET", "IterableDataset", "map-style"]),
        ([f"{MODULE}:NOT_CALLABLE", "--loader", f"{MODULE}:padded"], ["MODULE:DATASET", "int has no __len__"]),
        ([f"{MODULE}:padded", "--loader", f"{MODULE}:padded"], ["MODULE:DATASET", "takes (dataset, rank, world_size, epoch)"]),
        ([f"{MODULE}:ten", "--loader", f"{MODULE}:two_arguments"], ["--loader", "takes (dataset, rank)", "loader_factory(dataset, rank, world_size, epoch)"]),
        ([f"{MODULE}:ten", "--loader", f"{MODULE}:NOT_CALLABLE"], ["--loader", "not callable"]),
        ([f"{MODULE}:ten", "--loader", "nocolon"], ["--loader", "module:attribute"]),
    ],
)
def test_check_data_refuses_what_it_cannot_use_naming_the_option(args: list[str], says: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run([*DATA, *args], capsys)
    assert code == EXIT_USAGE
    assert err.startswith("dpverify check-data: ")
    assert "Traceback" not in err
    for text in says:
        assert text in err
    assert out == ""  # refused before any output


def test_check_data_needs_a_world_size_and_known_costs(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(["check-data", f"{MODULE}:ten", "--loader", f"{MODULE}:padded"], capsys)
    assert code == EXIT_USAGE
    assert "--world-size N is needed" in err
    with pytest.raises(SystemExit) as parsed:
        main([*DATA, f"{MODULE}:ten", "--loader", f"{MODULE}:padded", "--allow", "padding,dupes"])
    assert parsed.value.code == EXIT_USAGE
    assert "--allow 'padding,dupes': choose among padding, dropped" in capsys.readouterr().err


def test_a_loader_factory_that_raises_on_a_rank_fails_with_its_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(["check-data", "--no-color", "--world-size", "2", f"{MODULE}:ten", "--loader", f"{MODULE}:raising"], capsys)
    assert code == EXIT_FAILED, out + err
    assert "FAIL: the loader factory raised" in out
    assert "rank 1 cannot build its loader" in out
    assert out.rstrip().splitlines()[-1].startswith("FAILED: ")


def test_allow_text_reads_a_comma_list() -> None:
    assert allow_text("padding, dropped,padding") == ("padding", "dropped")


@pytest.mark.parametrize(("devices", "batch"), [((2, 4), 8), ((2,), 1), ((3, 8), 5), ((6,), 20)])
def test_the_default_evaluation_set_is_padded_on_every_device_count(devices: tuple[int, ...], batch: int) -> None:
    rows = eval_dataset_size(devices, batch)
    assert rows > batch
    assert rows > 2 * max(devices)
    assert all(rows % d for d in range(2, rows))  # a prime: no world size above 1 divides it


# --------------------------------------------------------------------------- check --eval


def test_an_evaluation_summed_over_the_padded_sampler_fails_naming_the_duplicates(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run([*EVAL, "--backend", "ddp", "--devices", "4", "--checks", "ddp-grads", "--eval", f"{MODULE}:padded_sum"], capsys)
    assert code == EXIT_FAILED, out
    assert "evaluation: cli_data_user_code:padded_sum over 11 rows of the example batch" in out
    assert "FAIL  DDP eval metric = one device, B=8 on 4" in out  # its progress line
    assert "FAIL: DDP eval metric = one device, B=8 on 4" in out  # its panel
    # 11 rows on 4 ranks: DistributedSampler repeats the first sample of the order
    assert "samples [0] were counted twice" in out
    assert "PASS  DDP grads match one device, B=8 on 4" in out  # the other rows are there too
    assert "FAILED: 1 passed, 1 failed" in out


def test_an_evaluation_that_trims_the_padding_passes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run([*EVAL, "--backend", "ddp", "--devices", "4", "--checks", "ddp-grads", "--eval", f"{MODULE}:gathered"], capsys)
    assert code == EXIT_OK, out
    assert "PASS  DDP eval metric = one device, B=8 on 4" in out
    assert "OK: 2 passed, 0 failed" in out


def test_dataparallel_metric_rows_follow_check_devices(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run([*EVAL, "--devices", "2", "4", "--checks", "dp-grads", "--eval", f"{MODULE}:local"], capsys)
    assert code == EXIT_OK, out
    for devices in (2, 4):
        assert f"PASS  DP eval metric = one device, B=8 on {devices}" in out
    assert "DDP eval metric" not in out  # --backend dp: no ranks


class _CudaSeen:
    """``torch`` as ``dpverify.data.metrics`` sees it on a machine with a GPU: CUDA is
    available, everything else is torch's."""

    class _Cuda:
        def __getattr__(self, name: str) -> object:
            return getattr(torch.cuda, name)

        @staticmethod
        def is_available() -> bool:
            return True

    cuda = _Cuda()

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)


def test_a_wrapper_of_a_host_module_runs_on_virtual_devices_where_cuda_is_seen(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # on a machine with a GPU, a user's wrapper of a module on the host still runs on virtual
    # devices (as in the DataParallel checks), not on real devices that do not hold the module
    import dpverify.data.metrics

    monkeypatch.setattr(dpverify.data.metrics, "torch", _CudaSeen())
    args = ["--devices", "2", "--checks", "dp-grads", "--parallel", "torch.nn:DataParallel", "--eval", f"{MODULE}:local"]
    code, out, _ = _run([*EVAL, *args], capsys)
    assert code == EXIT_OK, out
    assert "PASS  DP eval metric = one device, B=8 on 2" in out


def test_a_forward_returning_its_mean_fails_through_dataparallel(capsys: pytest.CaptureFixture[str]) -> None:
    # 11 rows in batches of 8 and 3: the 8 split 3, 3, 2 over the devices, whose means weigh alike
    args = ["check", f"{MODULE}:mean_loss", "--inputs", f"{MODULE}:loss_batches", "--batch-sizes", "8", "--devices", "3", "--no-color"]
    code, out, _ = _run([*args, "--checks", "dp-weighted-loss", "--eval", f"{MODULE}:mean_of_replica_means"], capsys)
    assert code == EXIT_FAILED, out
    assert "FAIL: DP eval metric = one device, B=8 on 3" in out
    assert "returns a reduced value" in out


def test_metric_rows_on_one_device_are_skipped_and_check_says_nothing_was_checked(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run([*EVAL, "--devices", "1", "--checks", "dp-grads", "--eval", f"{MODULE}:local"], capsys)
    assert code == EXIT_NOTHING_CHECKED, out
    assert "SKIP  DP eval metric = one device, B=8 on 1: one rank or device: nothing ran in parallel" in out


def test_without_eval_check_has_no_metric_rows(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run([*EVAL, "--devices", "2", "--checks", "dp-grads"], capsys)
    assert code == EXIT_OK, out
    assert "eval metric" not in out
    assert "evaluation:" not in out
    assert "OK: 1 passed, 0 failed" in out


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--eval", f"{MODULE}:one_argument"], ["--eval", "takes (model)", "eval_fn(model, loader)"]),
        (["--eval", f"{MODULE}:missing"], ["--eval", "has no attribute 'missing'"]),
        (["--eval", f"{MODULE}:local", "--dataset", f"{MODULE}:stream"], ["--dataset", "IterableDataset"]),
        (["--eval", f"{MODULE}:local", "--loader", f"{MODULE}:two_arguments"], ["--loader", "takes (dataset, rank)"]),
        (["--dataset", f"{MODULE}:ten"], ["--dataset goes to the metric checks of --eval"]),
        (["--eval", f"{MODULE}:local", "--backend", "fsdp", "--checks", "fsdp-grads"], ["--eval runs the metric checks with --backend dp", "fsdp"]),
    ],
)
def test_check_eval_refuses_what_it_cannot_use_naming_the_option(args: list[str], says: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run([*EVAL, "--devices", "2", "--checks", "dp-grads", *args], capsys)
    assert code == EXIT_USAGE
    assert "Traceback" not in err
    for text in says:
        assert text in err
    assert out == ""


def test_a_keyword_batch_needs_a_dataset(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["check", f"{MODULE}:make_model", "--inputs", f"{MODULE}:keyword_batches", "--devices", "2", "--checks", "dp-grads"]
    code, _, err = _run([*args, "--eval", f"{MODULE}:local"], capsys)
    assert code == EXIT_USAGE
    assert "keyword arguments (input)" in err
    assert "pass --dataset MODULE:DATASET" in err


# --------------------------------------------------------------------------- torchrun

TORCHRUN = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))


def _torchrun(args: list[str], user_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "COLUMNS")}
    env.update(PYTHONPATH=os.pathsep.join([str(user_dir), str(ROOT)]), NO_COLOR="1", COLUMNS="200")
    return subprocess.run(
        [TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "dpverify", *args],
        cwd=user_dir, env=env, capture_output=True, text=True, timeout=120, check=False,
    )


@pytest.mark.deep
@pytest.mark.timeout(150)
def test_check_data_under_torchrun_prints_once_and_every_rank_exits_with_the_verdict(user_dir: Path) -> None:
    if not Path(TORCHRUN).exists():
        pytest.fail(f"torchrun is not installed next to {sys.executable}")
    done = _torchrun(["check-data", f"{MODULE}:ten", "--loader", f"{MODULE}:no_set_epoch"], user_dir)
    assert done.returncode == EXIT_FAILED, done.stdout + done.stderr
    assert done.stdout.count("dpverify check-data: torchrun process group, 2 gloo ranks") == 1
    assert done.stdout.count("set_epoch(epoch)") == 1
    assert done.stdout.count("FAILED: 2 epochs on 2 ranks: 1 passed, 1 failed") == 1
    # both ranks exit with the verdict: torchrun names every failed rank with its status
    assert "exitcode  : 1" in done.stderr
    done = _torchrun(["check-data", f"{MODULE}:ten", "--loader", f"{MODULE}:strided", "--world-size", "3"], user_dir)
    assert done.returncode != EXIT_OK  # torchrun's own status is 1 whatever its ranks' were
    assert "exitcode  : 2" in done.stderr  # rank 0's: the usage error
    assert done.stderr.count("--world-size 3 under torchrun") == 1  # rank 0 says it, before the group
    done = _torchrun(["check-data", f"{MODULE}:ten", "--loader", f"{MODULE}:strided"], user_dir)
    assert done.returncode == EXIT_OK, done.stdout + done.stderr
    assert "OK: 2 epochs on 2 ranks: 2 passed, 0 failed, 0 allowed" in done.stdout


@pytest.mark.deep
@pytest.mark.timeout(150)
def test_check_eval_under_torchrun_runs_the_metric_on_the_jobs_ranks(user_dir: Path) -> None:
    if not Path(TORCHRUN).exists():
        pytest.fail(f"torchrun is not installed next to {sys.executable}")
    done = _torchrun([*EVAL[:-1], "--checks", "ddp-grads", "--eval", f"{MODULE}:padded_sum"], user_dir)
    assert done.returncode == EXIT_FAILED, done.stdout + done.stderr
    assert done.stdout.count("FAIL: DDP eval metric = one device, B=8 on 2") == 1  # rank 0's report only
    assert "samples [0] were counted twice" in done.stdout
    assert "DP eval metric" not in done.stdout.replace("DDP eval metric", "")  # no DataParallel under torchrun
