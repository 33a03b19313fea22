"""The ranked checks inside a process group that torchrun started: the Python helpers called
from the user's script, ``torchrun -m dpverify check`` on the user's model, one node and
two, and a rank that dies or raises alone mid-check (reported, no rank left waiting).

The end-to-end tests start real torchrun launchers (gloo, on this machine) on model files
written into ``tmp_path``, as a user writes them.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dpverify
from dpverify.cli.torchrun import torchrun_check_options
from dpverify.core.errors import InvalidArgument
from dpverify.ddp.torchrun import ProcessGroupRunner, group_runner

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
needs_torchrun = pytest.mark.skipif(not Path(TORCHRUN).exists(), reason=f"needs torchrun, not found at {TORCHRUN}")

#: The user's model file: a plain MLP, one whose forward normalises by its own batch (right
#: on one device, wrong on every DDP shard), clip hooks, and a loss that sums.
USER_MODEL = '''
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def deep():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


class Centred(nn.Module):
    """Subtracts the batch mean in forward: each rank centres its own shard."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        hidden = self.inner(x)
        return self.head(torch.tanh(hidden - hidden.mean(0, keepdim=True)))


def centred():
    torch.manual_seed(0)
    return Centred()


class CrashesOnRankOne(nn.Module):
    """Rank 1's training forward on its shard ends its process (HOW=exit) or raises (HOW=raise)."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 3)

    def forward(self, x):
        if os.environ.get("RANK") == "1" and torch.is_grad_enabled() and x.shape[0] == 3:
            if os.environ.get("HOW") == "raise":
                raise RuntimeError("rank 1's forward broke")
            os._exit(7)
        return self.layer(x)


def crashes():
    torch.manual_seed(0)
    return CrashesOnRankOne()


def batch(batch_size):
    generator = torch.Generator().manual_seed(batch_size)
    return torch.randn(batch_size, 4, generator=generator), torch.randn(batch_size, 3, generator=generator)


def summed_mse(output, target):
    return F.mse_loss(output, target, reduction="sum")


def clip(ctx):
    torch.nn.utils.clip_grad_norm_(ctx.module.parameters(), 0.01)


def clip_reduced_twice(ctx):
    grads = [p.grad for p in ctx.module.parameters() if p.grad is not None]
    squares = torch.stack([g.pow(2).sum() for g in grads]).sum()
    dist.all_reduce(squares, group=ctx.group)  # DDP averaged the grads already: this sums W copies
    scale = (0.01 / (squares.sqrt() + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale)
'''

#: The user's training script: three helpers, buggy (a sum loss, a clip norm reduced twice)
#: or fixed; rank 0 prints what was caught, every rank writes its verdicts to a file.
USER_SCRIPT = '''
import functools
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import dpverify
from user_model import batch, clip, clip_reduced_twice, mlp, summed_mse

buggy = sys.argv[1] == "buggy"
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model = mlp()
x, y = batch(2 * world)
batches = [batch(2 * world) for _ in range(3)]
sgd = functools.partial(torch.optim.SGD, lr=0.5)
loss = summed_mse if buggy else F.mse_loss
calls = {
    "ddp-grads": lambda: dpverify.assert_ddp_grads_match(model, x, y, loss_fn=loss, world_size=world),
    "fsdp-training": lambda: dpverify.assert_fsdp_training_matches(model, batches, loss_fn=loss, optimizer=sgd, world_size=world),
    "ddp-training-clip": lambda: dpverify.assert_ddp_training_matches(
        model, batches, loss_fn=F.mse_loss, optimizer=sgd, world_size=world, after_backward=clip_reduced_twice if buggy else clip,
    ),
}
verdicts = open(f"verdicts-{rank}.txt", "w")  # one file per rank: their stdout interleaves
for name, call in calls.items():
    try:
        call()
        verdict = "passed"
    except dpverify.ParallelMismatch as failure:
        verdict = "caught"
        if rank == 0:
            print(f"--- {name}\\n{failure}", flush=True)
    print(f"VERDICT {name} rank {rank}: {verdict}", file=verdicts, flush=True)


def breaks_in_the_reference(ctx):
    if ctx.reference:
        dist.all_reduce(torch.ones(1), group=ctx.group)  # in the subgroup of this rank alone
        if ctx.step_index == 1:
            raise RuntimeError("the reference's clip broke at step 2")
    clip(ctx)


# the single-device run's hook raises mid-way on every rank: its subgroups are destroyed, and
# the next check makes its own, on every rank in the same order
for name, hook in (("reference-raises", breaks_in_the_reference), ("after-it", clip)):
    try:
        dpverify.assert_ddp_training_matches(model, batches, loss_fn=F.mse_loss, optimizer=sgd, world_size=world, after_backward=hook)
        verdict = "passed"
    except RuntimeError:
        verdict = "raised"
    print(f"VERDICT {name} rank {rank}: {verdict}", file=verdicts, flush=True)
try:
    dpverify.assert_ddp_grads_match(model, x, y, loss_fn=F.mse_loss, world_size=world + 1)
except dpverify.InvalidArgument as error:
    print(f"REFUSED rank {rank}: {error}", file=verdicts, flush=True)
torch.manual_seed(rank)  # each rank seeded its own way: a model of other weights on every rank
unseeded = torch.nn.Linear(4, 3)
try:
    dpverify.assert_ddp_grads_match(unseeded, x, y, loss_fn=F.mse_loss, world_size=world)
except dpverify.InvalidArgument as error:
    print(f"DIFFERENT rank {rank}: {error}", file=verdicts, flush=True)
dist.destroy_process_group()
'''


# --------------------------------------------------------------------------- launchers


def _free_port() -> int:
    """A port free now; another process may take it before torchrun binds it (see
    ``_two_nodes``)."""
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return int(sock.getsockname()[1])


def _env(tmp_path: Path, **more: str) -> dict[str, str]:
    # this checkout's dpverify and the user's files; a terminal's width and colours stay out
    keep = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "NO_COLOR", "COLUMNS")}
    return {**keep, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]), "COLUMNS": "200", "NO_COLOR": "1", **more}


@contextmanager
def _launchers(commands: Sequence[Sequence[str]], tmp_path: Path, **env: str) -> Iterator[list[subprocess.Popen[str]]]:
    """torchrun launchers, each in a session of its own, killed with every rank they
    started (their process groups) whatever the test's outcome."""
    (tmp_path / "user_model.py").write_text(USER_MODEL)
    (tmp_path / "user_script.py").write_text(USER_SCRIPT)
    started = [
        subprocess.Popen(
            [TORCHRUN, *command], cwd=tmp_path, env=_env(tmp_path, **env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True,
        )
        for command in commands
    ]
    try:
        yield started
    finally:
        for process in started:
            _kill_with_its_ranks(process)


def _kill_with_its_ranks(launcher: subprocess.Popen[str]) -> None:
    """Kills a launcher and every process under it. torchrun starts each rank in a session
    of its own (torch's ``SubprocessHandler``: ``start_new_session=True``), so killing the
    launcher's process group would leave a hung rank running; each rank's group is killed
    too, found before the launcher dies (the ranks of a dead launcher belong to init)."""
    import psutil

    try:
        under = psutil.Process(launcher.pid).children(recursive=True)
    except psutil.Error:  # the launcher ended: torchrun stopped and reaped its ranks
        under = []
    for pid in (launcher.pid, *(process.pid for process in under)):
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    launcher.wait()
    _gone, alive = psutil.wait_procs(under, timeout=30)
    assert not alive, f"processes of the torchrun job outlived it: {alive}"


def _finish(process: subprocess.Popen[str], timeout: float) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out, err


def _torchrun(arguments: Sequence[str], tmp_path: Path, timeout: float = 100, **env: str) -> tuple[int, str, str]:
    with _launchers([arguments], tmp_path, **env) as (launcher,):
        return _finish(launcher, timeout)


def _rank_exit_codes(stderr: str) -> dict[int, int]:
    """Each failed rank's exit status, from torchrun's summary of the failures."""
    found = re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", stderr)
    return {int(rank): int(code) for rank, code in found}


# --------------------------------------------------------------------------- the group's ranks, in this process


@contextmanager
def _group_of_one() -> Iterator[None]:
    """This process as rank 0 of a one-rank gloo group, as torchrun's scripts initialise theirs."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        dist.destroy_process_group()


def _clip(ctx: object) -> None:
    torch.nn.utils.clip_grad_norm_(ctx.module.parameters(), 0.01)  # type: ignore[attr-defined]


def test_a_helper_inside_a_process_group_runs_on_its_ranks() -> None:
    """pool=None inside an initialised group: the check runs on the group's ranks (here this
    process alone), the training check's single-device hook in a subgroup of its own."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    x, y = torch.randn(4, 4), torch.randn(4, 3)
    with _group_of_one():
        runner = group_runner(1)
        assert isinstance(runner, ProcessGroupRunner)
        assert (runner.rank, runner.world_size, runner.backend) == (0, 1, "gloo")
        result = dpverify.assert_ddp_grads_match(model, x, y, loss_fn=F.mse_loss, world_size=1)
        assert "on 1 ranks (gloo)" in result.scenario or "1 rank" in result.scenario
        sgd = functools.partial(torch.optim.SGD, lr=0.5)
        dpverify.assert_ddp_training_matches(model, [(x, y)] * 2, loss_fn=F.mse_loss, optimizer=sgd, world_size=1, after_backward=_clip)
        assert dist.get_world_size() == 1  # the hook's subgroup is gone, the user's group stays


class _ClipThatBreaksInTheReference:
    """A clip hook whose single-device run raises at the second step, after an all-reduce
    over its group (the one-rank subgroup ``one_rank_group`` made)."""

    def __init__(self) -> None:
        self.groups: list[object] = []

    def __call__(self, ctx: object) -> None:
        if ctx.reference:  # type: ignore[attr-defined]
            self.groups.append(ctx.group)  # type: ignore[attr-defined]
            dist.all_reduce(torch.ones(1), group=ctx.group)  # type: ignore[attr-defined]
            if ctx.step_index == 1:  # type: ignore[attr-defined]
                raise RuntimeError("the reference's clip broke at step 2")
        _clip(ctx)


def test_the_reference_hooks_subgroup_is_destroyed_when_the_hook_raises_mid_way() -> None:
    """Inside the user's group the reference's hook runs in a subgroup of one rank
    (``new_subgroups``, made on every rank); when the hook raises at step 2 the subgroup
    is destroyed (without waiting on anything), the user's group stays usable, and the
    next check makes a subgroup of its own."""
    from torch.distributed import distributed_c10d as c10d

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    batches = [(torch.randn(4, 4), torch.randn(4, 3)) for _ in range(3)]
    sgd = functools.partial(torch.optim.SGD, lr=0.5)
    hook = _ClipThatBreaksInTheReference()
    with _group_of_one():
        groups_before = set(c10d._world.pg_map)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="the reference's clip broke at step 2"):
            dpverify.assert_ddp_training_matches(model, batches, loss_fn=F.mse_loss, optimizer=sgd, world_size=1, after_backward=hook)
        assert time.monotonic() - started < 30
        assert len(hook.groups) == 2
        assert hook.groups[0] is hook.groups[1]  # one subgroup for the whole reference run
        assert hook.groups[0] is not dist.group.WORLD
        assert set(c10d._world.pg_map) == groups_before  # the subgroup is gone, the user's group stays
        dist.all_reduce(torch.ones(1))  # and is usable
        dpverify.assert_ddp_training_matches(model, batches[:2], loss_fn=F.mse_loss, optimizer=sgd, world_size=1, after_backward=_clip)
        assert set(c10d._world.pg_map) == groups_before


def test_a_helper_inside_a_process_group_of_another_size_says_which_world_size() -> None:
    model = nn.Linear(4, 3)
    with _group_of_one(), pytest.raises(InvalidArgument) as caught:
        dpverify.assert_ddp_grads_match(model, torch.randn(4, 4), torch.randn(4, 3), loss_fn=F.mse_loss, world_size=2)
    message = str(caught.value)
    assert "world_size=2" in message
    assert "process group of 1 ranks" in message
    assert "pass world_size=1" in message
    assert "pool=DDPWorkerPool(2)" in message


def _check_args(**given: object) -> argparse.Namespace:
    defaults: dict[str, object] = {"backend": None, "devices": None, "checks": ["ddp-grads"], "parallel": None, "parallel_loss": None}
    return argparse.Namespace(**{**defaults, **given})


def _ranked(names: list[str]) -> list[str]:
    return [name for name in names if not name.startswith("dp-")]


def test_check_options_under_torchrun_fit_the_group() -> None:
    args = _check_args()
    torchrun_check_options(args, 4, _ranked)
    assert (args.backend, args.devices) == ("ddp", [4])
    args = _check_args(backend="all", devices=[4], checks=["dp-grads", "ddp-grads", "fsdp-grads"])
    torchrun_check_options(args, 4, _ranked)
    assert args.checks == ["ddp-grads", "fsdp-grads"]


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ({"backend": "dp"}, ["--backend dp under torchrun", "pass --backend ddp, fsdp, tp, pp or all", "without torchrun"]),
        ({"devices": [2, 4]}, ["--devices 2 4 under torchrun", "the 4 ranks of torchrun's process group", "leave --devices out"]),
        ({"backend": "ddp", "parallel": "mine:Wrapper"}, ["--parallel is a DataParallel wrapper", "without torchrun"]),
        ({"backend": "all", "checks": ["dp-grads"]}, ["--checks dp-grads are DataParallel checks"]),
    ],
)
def test_check_options_under_torchrun_refuse_what_one_process_runs(given: dict[str, object], says: list[str]) -> None:
    with pytest.raises(InvalidArgument) as caught:
        torchrun_check_options(_check_args(**given), 4, _ranked)
    for words in says:
        assert words in str(caught.value)


# --------------------------------------------------------------------------- torchrun, the command line


def _standalone(ranks: int, *arguments: str) -> list[str]:
    return ["--standalone", "--nproc-per-node", str(ranks), "-m", "dpverify", "check", *arguments]


@pytest.mark.timeout(120)
@needs_torchrun
def test_check_under_torchrun_prints_one_verdict_and_every_rank_exits_with_it(tmp_path: Path) -> None:
    code, out, err = _torchrun(_standalone(2, "user_model:mlp", "--backend", "ddp", "--batch-sizes", "6"), tmp_path)
    assert code == 0, out + err
    assert out.count("dpverify check: torchrun process group, 2 gloo ranks") == 1
    assert out.count("PASS  DDP grads match one device, B=6 on 2") == 1
    assert out.count("PASS  training, 3 optimizer steps, B=6 on 2") == 1  # the default checks train too
    assert out.count("OK: 2 passed, 0 failed") == 1


@pytest.mark.timeout(120)
@needs_torchrun
@pytest.mark.deep
def test_check_under_torchrun_fails_a_model_that_centres_each_shard_on_every_rank(tmp_path: Path) -> None:
    code, out, err = _torchrun(_standalone(2, "user_model:centred", "--backend", "fsdp", "--batch-sizes", "6", "--checks", "fsdp-grads"), tmp_path)
    assert code == 1, out + err
    assert out.count("FAILED: 0 passed, 1 failed") == 1
    assert "FAIL  FSDP2 grads match one device, B=6 on 2" in out
    assert _rank_exit_codes(err) == {0: 1, 1: 1}, err


@pytest.mark.timeout(240)
@needs_torchrun
@pytest.mark.deep
def test_check_under_torchrun_on_four_ranks_runs_every_ranked_backend(tmp_path: Path) -> None:
    checks = ["ddp-grads", "ddp-training", "fsdp-grads", "fsdp-training", "tp-grads", "pp-grads", "dp-grads"]
    code, out, err = _torchrun(_standalone(4, "user_model:deep", "--backend", "all", "--batch-sizes", "8", "--checks", *checks), tmp_path, timeout=220)
    assert code == 0, out + err
    assert out.count("dpverify check: torchrun process group, 4 gloo ranks") == 1
    for title in ("DDP grads", "training, 3 optimizer steps", "FSDP2 grads", "FSDP2 training", "TP grads", "pipeline grads"):
        assert re.search(rf"PASS  {title}.*B=8 on 4", out), (title, out)
    assert "DataParallel" not in out  # left to a run without torchrun
    assert out.count("OK: 6 passed, 0 failed") == 1


def _two_nodes(arguments: Sequence[str], tmp_path: Path, timeout: float) -> list[tuple[int, str, str]]:
    """Two launchers of one node each, rendezvousing on localhost; node 0 hosts the store
    (``is_host``), on a port picked just before. Only when node 0 says that port was taken
    meanwhile (``EADDRINUSE``, the one failure that is the port's) is the job started once
    more, on another port."""
    for attempt in range(2):
        port = _free_port()
        nodes = [
            ["--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-id",
             f"dpverify-test-{attempt}", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-conf", f"is_host={int(node == 0)}", *arguments]
            for node in (0, 1)
        ]
        with _launchers(nodes, tmp_path) as (host, guest):
            first = _finish(host, timeout)
            if attempt == 0 and first[0] != 0 and "name: EADDRINUSE" in first[2]:
                continue  # the guest, waiting for a store that never came, is killed on the way out
            return [first, _finish(guest, timeout)]
    raise AssertionError("unreachable: the second attempt returns")


@pytest.mark.timeout(240)
@needs_torchrun
@pytest.mark.deep
def test_check_over_a_two_node_rendezvous(tmp_path: Path) -> None:
    arguments = ["-m", "dpverify", "check", "user_model:mlp", "--backend", "fsdp", "--batch-sizes", "6", "--checks", "fsdp-grads"]
    done = _two_nodes(arguments, tmp_path, 100)
    assert [code for code, _out, _err in done] == [0, 0], done
    printed = "".join(out for _code, out, _err in done)
    assert printed.count("dpverify check: torchrun process group, 2 gloo ranks on 2 nodes") == 1
    assert printed.count("OK: 1 passed, 0 failed") == 1


@pytest.mark.timeout(120)
@needs_torchrun
@pytest.mark.deep
def test_a_rank_that_dies_mid_check_ends_the_job(tmp_path: Path) -> None:
    started = time.monotonic()
    code, out, err = _torchrun(_standalone(2, "user_model:crashes", "--backend", "ddp", "--batch-sizes", "6"), tmp_path, timeout=90, HOW="exit")
    assert code != 0
    assert _rank_exit_codes(err).get(1) == 7, err  # torchrun names the rank that died, and how
    assert "OK:" not in out
    assert time.monotonic() - started < 60


@pytest.mark.timeout(120)
@needs_torchrun
@pytest.mark.deep
def test_a_rank_that_raises_while_the_others_wait_in_a_collective_is_reported(tmp_path: Path) -> None:
    """Rank 1 raises in its forward while rank 0 waits in DDP's all-reduce: without the
    store's word, both would wait, each in another collective, for the group's half hour."""
    started = time.monotonic()
    code, out, err = _torchrun(_standalone(2, "user_model:crashes", "--backend", "ddp", "--batch-sizes", "6"), tmp_path, timeout=90, HOW="raise")
    assert code == 1, out + err
    assert "dpverify check (rank 1): the ranks' results could not be gathered under torchrun: rank 0 never reported" in err
    assert "RuntimeError: rank 1's forward broke" in err
    # Rank 0 reports too once rank 1's exit breaks its collective, unless torchrun, which
    # stops every rank when one exits with an error, stops it first (it did in about one run
    # in five under load): when it printed its verdict, the verdict names rank 1's error
    if "FAIL  DDP grads match one device" in out:
        assert "FAIL  DDP grads match one device, B=6 on 2" in out
        assert "Rank 1 reported: RuntimeError: rank 1's forward broke" in out
    assert "OK:" not in out
    assert time.monotonic() - started < 60


# --------------------------------------------------------------------------- torchrun, the Python helpers


def _reference_hook_raising_mid_way(world: int) -> dict[tuple[str, int], str]:
    """What the script's two last training checks give: the first raises on every rank (the
    hook of its single-device run raised at step 2, in a subgroup of one rank), the next
    passes on every rank."""
    return {**{("reference-raises", rank): "raised" for rank in range(world)}, **{("after-it", rank): "passed" for rank in range(world)}}


def _verdicts(tmp_path: Path) -> tuple[dict[tuple[str, int], str], str]:
    """Every rank's verdicts, and everything the ranks wrote to their files."""
    text = "".join(path.read_text() for path in sorted(tmp_path.glob("verdicts-*.txt")))
    return {(name, int(rank)): verdict for name, rank, verdict in re.findall(r"VERDICT (\S+) rank (\d+): (\w+)", text)}, text


@pytest.mark.timeout(120)
@needs_torchrun
@pytest.mark.deep
def test_helpers_in_a_torchrun_script_catch_the_bugs_on_every_rank(tmp_path: Path) -> None:
    code, out, err = _torchrun(["--standalone", "--nproc-per-node", "2", "user_script.py", "buggy"], tmp_path)
    assert code == 0, out + err
    names = ("ddp-grads", "fsdp-training", "ddp-training-clip")
    verdicts, written = _verdicts(tmp_path)
    assert verdicts == {
        **{(name, rank): "caught" for name in names for rank in (0, 1)},
        **_reference_hook_raising_mid_way(2),
    }
    assert out.count("--- ") == 3  # rank 0 alone prints what was caught
    assert "loss_fn is a sum-reduction loss" in out
    assert "clip_reduced_twice(ctx) ran after every backward, on every rank and in the single-device run" in out
    assert written.count("REFUSED rank") == 2
    assert "world_size=3 but this process is rank 1 of an initialised process group of 2 ranks" in written
    assert written.count("DIFFERENT rank") == 2
    assert "the module's weights on rank 1 differ from rank 0's" in written


@pytest.mark.timeout(120)
@needs_torchrun
@pytest.mark.deep
def test_helpers_in_a_torchrun_script_pass_the_fixed_code_on_four_ranks(tmp_path: Path) -> None:
    code, out, err = _torchrun(["--standalone", "--nproc-per-node", "4", "user_script.py", "fixed"], tmp_path)
    assert code == 0, out + err
    names = ("ddp-grads", "fsdp-training", "ddp-training-clip")
    assert _verdicts(tmp_path)[0] == {
        **{(name, rank): "passed" for name in names for rank in range(4)},
        **_reference_hook_raising_mid_way(4),
    }
    assert "--- " not in out
