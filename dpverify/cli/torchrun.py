"""``dpverify check`` under torchrun: every rank runs the ranked checks in torchrun's
process group, rank 0 prints, and every rank exits with the same status.

    torchrun --nproc-per-node 8 -m dpverify check MODULE:FACTORY --backend fsdp

``dpverify check-data`` runs there the same way (``on_torchrun_ranks``): the user's loader
factory on the group's ranks, rank 0 printing, every rank exiting with the verdict.

What changes under torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` set):

- The default process group is joined (``join_torchrun_group``: nccl when each rank of
  the node has a GPU, else gloo), and every ranked check runs on its ranks, with the
  world size of the group: ``--devices`` may only repeat it.
- The DataParallel checks are refused: DataParallel runs in one process over the devices
  that process sees, so ``torchrun`` adds nothing to them, and eight ranks would each run
  the same checks. ``--backend`` defaults to ``ddp``; ``--backend all`` means every ranked
  backend; ``--backend dp`` is a usage error that says to run without torchrun.
- Rank 0 prints the header, the progress and the verdict; the other ranks print nothing
  but their errors (prefixed with their rank). When every rank finished, the ranks agree
  on the exit status (they all compare the same results with the same single-device
  step): every rank exits with it. A rank that stops early (a usage error, or a rank that
  dies) leaves the ending to torchrun, which stops the other ranks and reports the first
  failure.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import NoReturn

from dpverify.cli.exits import EXIT_FAILED, EXIT_USAGE, usage_error
from dpverify.core.errors import InvalidArgument
from dpverify.core.text import and_list

__all__ = [
    "USAGE_WAIT_S",
    "agreed_exit",
    "check_under_torchrun",
    "leave_rank",
    "on_torchrun_ranks",
    "quiet_usage_exit",
    "rank_zero_prints",
    "torchrun_check_options",
]


#: How long a rank other than 0 waits on a usage error that rank 0 reports (``quiet_usage_exit``).
USAGE_WAIT_S = 30.0


def quiet_usage_exit() -> int:
    """``EXIT_USAGE`` for a rank other than 0 that found, before the group is joined, the
    usage error rank 0 reports. torchrun stops every rank as soon as one leaves, so a rank
    leaving first could stop rank 0 before it printed the message: this rank waits for
    torchrun to stop it once rank 0 has left (at most ``USAGE_WAIT_S``, then it leaves too)."""
    time.sleep(USAGE_WAIT_S)
    return EXIT_USAGE


@contextlib.contextmanager
def rank_zero_prints(rank: int) -> Iterator[None]:
    """Standard output goes nowhere on ranks other than 0 (their errors still reach
    standard error), so that a job of eight ranks prints one report."""
    if rank == 0:
        yield
        return
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        yield


def agreed_exit(code: int, rank: int, world_size: int, *, command: str = "check") -> int:
    """The exit status of every rank: ``code`` when every rank reached it, else
    ``EXIT_FAILED``, which rank 0 explains (each rank's status). A collective: every rank
    calls it, after the same checks. ``command`` names the subcommand in the messages."""
    import torch.distributed as dist

    codes: list[int | None] = [None] * world_size
    try:
        dist.all_gather_object(codes, code)
    except Exception as error:  # a rank left after its checks: it said why on its way out
        print(f"dpverify {command} (rank {rank}): the ranks' statuses could not be gathered ({error}); exiting {EXIT_FAILED}", file=sys.stderr)
        return EXIT_FAILED
    if all(c == code for c in codes):
        return code
    if rank == 0:
        statuses = and_list([f"rank {r} {c}" for r, c in enumerate(codes)])
        print(f"dpverify {command}: the ranks ended with different statuses ({statuses}); exiting {EXIT_FAILED}", file=sys.stderr)
    return EXIT_FAILED


def leave_rank(code: int) -> NoReturn:
    """Ends this rank of torchrun's job with ``code`` at once, its output flushed, without
    the interpreter's teardown: how ``check`` and ``ddp-selftest`` end under torchrun.

    Why not a normal exit: torch 2.13 never frees the default gloo group once DDP has
    built a ``Reducer`` on it (``destroy_process_group`` leaves its two ``pt_gloo_runloop``
    threads running), and a runloop thread drops the last collective's work (our
    ``all_gather_object``, whose tensors Python owns) a moment after the work completes.
    When the main thread reaches ``Py_FinalizeEx`` first, that thread's decref takes the
    GIL during finalisation, Python ends the thread (``pthread_exit``) inside the work's
    ``noexcept`` destructor, and the rank aborts with "terminate called without an active
    exception" (SIGABRT), which torchrun reports as the job's failure. On a busy machine
    this hit 4 of 10 four-rank runs of ``--backend all``; with ``os._exit`` none of 20."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_with_on_sigterm(code: int) -> None:
    """From here on, torchrun's SIGTERM ends this rank with ``code``: the agent stops the
    ranks still running as soon as one exits with a status other than 0, and a rank
    stopped on its way out after the verdict must still exit with the verdict."""
    signal.signal(signal.SIGTERM, lambda _signum, _frame: os._exit(code))


def torchrun_check_options(args: argparse.Namespace, world_size: int, ranked_checks: Callable[[list[str]], list[str]]) -> None:
    """Fits ``check``'s options to the process group of ``world_size`` ranks, in place:
    ``--devices`` becomes the world size, ``--backend`` defaults to ``ddp``, and ``all``
    keeps the ranked checks (``ranked_checks``: the names it is given that are not
    DataParallel's).

    Raises:
        InvalidArgument: ``--backend dp``, DataParallel-only options, or ``--devices`` other
            than the world size.
    """
    rerun = "run `dpverify check` without torchrun for the DataParallel checks"
    if args.backend == "dp":
        raise InvalidArgument(
            f"--backend dp under torchrun: DataParallel runs in one process over the devices it sees, so the "
            f"{world_size} ranks would each run the same checks; pass --backend ddp, fsdp, tp, pp or all (the ranked "
            f"checks, on the {world_size} ranks of this process group), or {rerun}"
        )
    for option, value in (("--parallel", args.parallel), ("--parallel-loss", args.parallel_loss)):
        if value:
            raise InvalidArgument(f"{option} is a DataParallel wrapper, which runs in one process: {rerun}")
    if args.devices is not None and list(args.devices) != [world_size]:
        raise InvalidArgument(
            f"--devices {' '.join(map(str, args.devices))} under torchrun: the ranked checks run on the "
            f"{world_size} ranks of torchrun's process group (WORLD_SIZE={world_size}); leave --devices out, or "
            f"start torchrun with the ranks you mean (--nproc-per-node, --nnodes)"
        )
    args.devices = [world_size]
    args.backend = args.backend or "ddp"
    if args.backend == "all":
        ranked = ranked_checks(list(args.checks))
        if not ranked:
            raise InvalidArgument(f"--checks {' '.join(args.checks)} are DataParallel checks: under torchrun pass ranked ones, or {rerun}")
        args.checks = ranked


def check_under_torchrun(
    args: argparse.Namespace, run_check: Callable[[argparse.Namespace], int], ranked_checks: Callable[[list[str]], list[str]],
) -> int:
    """``dpverify check`` on the ranks of torchrun's process group (see the module's
    docstring): ``run_check(args)`` on every rank, with the options fitted to the group
    (``torchrun_check_options``). Once the group is joined, every rank ends its process
    (``leave_rank``): with the status the ranks agreed on when every rank finished, else with
    its own (``EXIT_USAGE`` for an unusable model, printed on every rank, prefixed with the
    rank but on rank 0; ``EXIT_FAILED`` when the group broke).

    Raises:
        InvalidArgument: on rank 0, an unusable option (before the group is joined). The
            other ranks leave silently (``quiet_usage_exit``): the options are the same on
            every rank.
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        torchrun_check_options(args, world, ranked_checks)
    except InvalidArgument:
        # the same options on every rank: rank 0 says it once
        if rank == 0:
            raise
        return quiet_usage_exit()
    on_torchrun_ranks("check", lambda: run_check(args), rank, world)


def on_torchrun_ranks(command: str, run: Callable[[], int], rank: int, world: int) -> NoReturn:
    """Joins torchrun's process group and runs ``run()`` on this rank, printing on rank 0
    only; then ends the process (``leave_rank``) with the status the ranks agreed on when
    every rank finished, else with its own (``EXIT_USAGE`` for an unusable argument, printed
    on every rank, prefixed with the rank but on rank 0; ``EXIT_FAILED`` when the group
    broke). ``command`` names the subcommand in what it prints (``check``, ``check-data``)."""
    import torch.distributed as dist

    from dpverify.ddp.torchrun import broken_group, join_torchrun_group

    group = join_torchrun_group()
    # from here on every rank ends through leave_rank, whatever the outcome (see there)
    try:
        code = _run_on_ranks(command, run, rank, world, group.backend)
    except Exception:  # dpverify's own error: said, and the rank fails without the teardown
        print(f"dpverify {command} (rank {rank}): an internal error ended the command", file=sys.stderr)
        traceback.print_exc()
        leave_rank(EXIT_FAILED)
    broken = broken_group()
    if broken is not None:
        # the other ranks may wait in a collective for good: this rank's exit lets
        # torchrun stop them, and its summary names the rank that died
        print(f"dpverify {command} (rank {rank}): {broken}", file=sys.stderr)
        leave_rank(EXIT_FAILED)
    if code == EXIT_USAGE:
        leave_rank(code)  # each rank said why; they may not have reached the same point
    agreed = agreed_exit(code, rank, world, command=command)
    _exit_with_on_sigterm(agreed)
    dist.destroy_process_group()
    leave_rank(agreed)


def _run_on_ranks(command: str, run: Callable[[], int], rank: int, world: int, backend: str) -> int:
    """``run()`` on this rank, printing on rank 0 only; a usage error is printed (on every
    rank, prefixed with its rank but on rank 0) and gives ``EXIT_USAGE``."""
    with rank_zero_prints(rank):
        nodes = os.environ.get("GROUP_WORLD_SIZE")
        where = f" on {nodes} nodes" if nodes and nodes != "1" else ""
        print(f"dpverify {command}: torchrun process group, {world} {backend} ranks{where}; rank 0 prints the verdict", flush=True)
        try:
            return run()
        except InvalidArgument as error:
            return usage_error(command if rank == 0 else f"{command} (rank {rank})", error)
