"""Checks inside a process group that torchrun started: ``ProcessGroupRunner`` runs a
check's task on the ranks of the current default group, ``group_runner`` finds that group
for a check given ``pool=None``, and ``join_torchrun_group`` starts it for the command line.

Under torchrun every rank is the parent of its own check: each validates the arguments,
runs the task on its own shard, receives every rank's result (``all_gather_object``) and
compares them with the single-device step it computes itself, from the same module and
batch, so every rank reaches the same verdict and raises the same way.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import pickle
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from dpverify.core.devices import cuda_device_count
from dpverify.core.errors import InvalidArgument
from dpverify.ddp.pool import ParallelError
from dpverify.ddp.runner import (
    PICKLE_PROTOCOL,
    describe_exception,
    pickle_task,
    raised_failure,
    summarize,
)
from dpverify.ranked.rank import RankInfo

__all__ = [
    "FAILURE_GRACE_S",
    "TORCHRUN_VARIABLES",
    "ProcessGroupRunner",
    "broken_group",
    "group_runner",
    "join_torchrun_group",
    "torchrun_backend",
    "under_torchrun",
]

T = TypeVar("T")

#: What torchrun sets in every rank's environment (one node or many).
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def under_torchrun() -> bool:
    """Whether this process is a rank that torchrun (or a launcher like it) started."""
    return all(name in os.environ for name in TORCHRUN_VARIABLES)


def _rank_device(backend: str) -> tuple[str, str]:
    """``(backend, device)`` of this rank in a group of ``backend`` (torch's name, e.g.
    ``"gloo"``, ``"nccl"`` or ``"cpu:gloo,cuda:nccl"``): nccl computes on
    ``cuda:LOCAL_RANK``, made the current device (``all_gather_object`` sends through it),
    gloo on the CPU.

    Raises:
        InvalidArgument: a backend that is neither (mpi, ucc, a custom one).
    """
    import torch

    names = {part.rpartition(":")[2] for part in backend.split(",")}
    if "nccl" in names and torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
        if torch.cuda.current_device() != local:
            torch.cuda.set_device(local)
        return "nccl", f"cuda:{local}"
    if "gloo" in names:
        return "gloo", "cpu"
    raise InvalidArgument(
        f"the process group's backend is {backend!r}; the ranked checks run on gloo (CPU) or nccl "
        "(one GPU per rank): pass backend='gloo' or 'nccl' to torch.distributed.init_process_group"
    )


class ProcessGroupRunner:
    """Runs tasks in the current default process group (started by torchrun) instead of a pool.

    Every rank calls ``run`` with the same task; each runs it locally, and the results (or
    tracebacks) are all-gathered so that every rank gets every rank's result and all ranks
    take the same path afterwards. A hang cannot be detected here: the process group's
    own timeout applies, and a rank that dies ends the job through torchrun (which stops
    the other ranks).

    Raises:
        InvalidArgument: no process group is initialised, or its backend is neither gloo
            nor nccl.
    """

    def __init__(self) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise InvalidArgument(
                "ProcessGroupRunner needs an initialised process group; run under torchrun "
                "and call torch.distributed.init_process_group() first"
            )
        backend, device = _rank_device(str(dist.get_backend()))
        self._info = RankInfo(dist.get_rank(), dist.get_world_size(), backend, device)
        if backend == "gloo":
            _settle_gloo_threads_at_exit()

    @property
    def world_size(self) -> int:
        return self._info.world_size

    @property
    def backend(self) -> str:
        return self._info.backend

    @property
    def rank(self) -> int:
        return self._info.rank

    def __repr__(self) -> str:
        return f"ProcessGroupRunner(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r})"

    def run(self, fn: Callable[..., T], /, *args: Any, timeout: float | None = None) -> tuple[T, ...]:
        """Runs ``fn(rank_info, *args)`` here and gathers every rank's result.

        Raises:
            ParallelError: a rank raised (every rank raises it alike when every rank
                reported), or the group broke: a rank died, or raised while the others
                waited in a collective it never joined (``_Arrivals``). A broken group
                refuses every later task, so that no rank waits on it.
        """
        import torch.distributed as dist

        del timeout  # the process group's timeout governs collectives under torchrun
        broken = _BROKEN.get(_group_key())
        if broken is not None:
            raise ParallelError(f"the process group of torchrun broke in an earlier check; nothing more can run on it.\n\n{broken}")
        pickle_task(fn, args)
        weights = _weights_digest(args)
        try:
            reply: tuple[bool, Any] = (True, pickle.dumps(fn(self._info, *args), protocol=PICKLE_PROTOCOL))
        except BaseException as error:
            reply = (False, (summarize(error), describe_exception(error)))
        arrivals = _Arrivals.next(self.rank, self.world_size)
        if arrivals is not None and not arrivals.every_rank_arrived(None if reply[0] else reply[1][0]):
            raise self._broke(reply, arrivals)
        gathered: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(gathered, (reply, weights))
        except Exception as error:  # a peer died during the gather
            raise self._broke(reply, arrivals, error) from error
        _require_same_weights([w for _reply, w in gathered])
        gathered = [r for r, _weights in gathered]
        failures = [raised_failure(rank, body) for rank, (ok, body) in enumerate(gathered) if not ok]
        if failures:
            head = "; ".join(f"rank {f.rank} {f.summary}" for f in failures)
            detail = "\n".join(f.describe() for f in failures)
            raise ParallelError(f"DDP task failed under torchrun: {head}.\n\n{detail}", failures)
        return tuple(pickle.loads(body) for _ok, body in gathered)

    def _broke(self, reply: tuple[bool, Any], arrivals: _Arrivals | None, error: BaseException | None = None) -> ParallelError:
        """The error of a task after which the group cannot be used (remembered, so that
        later tasks are refused): what this rank knows, what the others reported through
        the store, and who did not report."""
        failures = [raised_failure(self.rank, reply[1])] if not reply[0] else []
        if error is not None:
            failures.append(raised_failure(self.rank, (summarize(error), describe_exception(error))))
        reports = arrivals.reports() if arrivals is not None else {}
        missing = [r for r in range(self.world_size) if r not in reports]
        away = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} never reported" if missing else "the ranks did not all meet to gather them"
        others = "".join(
            f" Rank {r} reported: {summary}." for r, summary in reports.items() if r != self.rank and summary is not None
        )
        message = (
            f"the ranks' results could not be gathered under torchrun: {away}; a rank died, or raised while the "
            "others waited in a collective it never joined, and the process group cannot be used any more "
            "(torchrun's summary names a rank that died, with its exit status)."
            f"{others} Rank {self.rank}: " + ("; ".join(f.summary for f in failures) or "its task finished") + "."
        )
        detail = "\n".join(f.describe() for f in failures)
        text = f"{message}\n\n{detail}" if detail else message
        _BROKEN[_group_key()] = text
        return ParallelError(text, failures)


#: Whether ``_settle_gloo_threads`` runs at this process's exit.
_SETTLE_REGISTERED: list[bool] = []


def _settle_gloo_threads_at_exit() -> None:
    """Lets gloo's worker threads finish with the last collectives before the interpreter
    is torn down (``atexit``, once per process), for a script that torchrun started and
    that exits as scripts do.

    torch 2.13 never frees the default gloo group once DDP has built a ``Reducer`` on it:
    ``destroy_process_group`` leaves its ``pt_gloo_runloop`` threads running. Such a thread
    drops a finished collective's work (the runner's ``all_gather_object``, whose tensors
    Python owns) a moment after the work completes; if the interpreter is finalising by
    then, taking the GIL for that decref ends the thread inside the work's ``noexcept``
    destructor and the rank aborts ("terminate called without an active exception"),
    which torchrun reports as the job's failure although every check finished.
    """
    if not _SETTLE_REGISTERED:
        _SETTLE_REGISTERED.append(True)
        atexit.register(_settle_gloo_threads)


def _settle_gloo_threads(limit_s: float = 2.0) -> None:
    """Waits, with the GIL released, until no gloo worker thread of this process is
    running (two samples in a row, 5 ms apart; at most ``limit_s``). Linux only (the
    threads' states in ``/proc``); elsewhere it returns at once."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return
    deadline = time.monotonic() + limit_s
    settled_before = False
    while time.monotonic() < deadline:
        time.sleep(0.005)  # a thread waiting for the GIL takes it meanwhile
        settled = not any(_running_gloo_thread(task) for task in tasks.iterdir())
        if settled and settled_before:
            return
        settled_before = settled


def _running_gloo_thread(task: Path) -> bool:
    try:
        name = (task / "comm").read_text().strip()
        stat = (task / "stat").read_text()
    except OSError:  # the thread ended
        return False
    # the state follows the name, which is in parentheses and may hold spaces (proc(5))
    return name == "pt_gloo_runloop" and stat.rpartition(")")[2].split()[0] == "R"


def _weights_digest(args: tuple[Any, ...]) -> str | None:
    """A digest of the weights of the task's module (its ``module`` field), None without
    one: every rank compares its ranks' tensors with the single-device step it computes
    itself, which holds only if every rank was given the same model."""
    import torch

    module = getattr(args[0], "module", None) if args else None
    if not isinstance(module, torch.nn.Module):
        return None
    digest = hashlib.sha256()
    for name, value in module.state_dict().items():
        digest.update(name.encode())
        if isinstance(value, torch.Tensor) and value.layout == torch.strided:
            flat = value.detach().cpu().contiguous().reshape(-1)
            digest.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return digest.hexdigest()


def _require_same_weights(digests: list[str | None]) -> None:
    """Every rank checked the same model.

    Raises:
        InvalidArgument: on every rank alike, naming the ranks whose weights differ from
            rank 0's.
    """
    others = [rank for rank, digest in enumerate(digests) if digest != digests[0]]
    if others:
        raise InvalidArgument(
            f"the module's weights on rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} differ from "
            "rank 0's: under torchrun every rank must call the check with the same model and batch (each compares "
            "the ranks with the single-device step it computes itself); build them after the same "
            "torch.manual_seed on every rank, or load the same checkpoint"
        )


#: The groups that broke (by ``_group_key``), with what broke them.
_BROKEN: dict[int, str] = {}

#: How long a rank whose task raised waits for the others to report theirs (every rank may
#: have raised alike) before it concludes they are blocked in a collective.
FAILURE_GRACE_S = 5.0


def _group_key() -> int:
    import torch.distributed as dist

    return id(dist.group.WORLD)


def broken_group() -> str | None:
    """Why the current default process group cannot be used any more (a rank died or
    raised alone in an earlier task), or None."""
    import torch.distributed as dist

    return _BROKEN.get(_group_key()) if dist.is_initialized() else None


class _Arrivals:
    """Who finished a task, told through the process group's store, which needs no
    collective: a rank whose task raised while the others wait in a collective it never
    joins (DDP's all-reduce) would otherwise wait with them in the gather of the results,
    each in another collective, until the group's timeout (half an hour on gloo).

    Every rank marks its arrival; once all have, the first to see it decides that the
    results are gathered. A rank whose task raised waits ``FAILURE_GRACE_S`` for the
    others, then decides that they are blocked, unless the gather was decided first (the
    decision is one ``compare_set``, so no rank gathers alone). Every task has its own
    keys: every rank runs the same tasks in the same order.
    """

    _counts: ClassVar[dict[int, int]] = {}

    def __init__(self, store: Any, prefix: str, rank: int, world_size: int) -> None:
        self.store, self.prefix, self.rank, self.world_size = store, prefix, rank, world_size

    @classmethod
    def next(cls, rank: int, world_size: int) -> _Arrivals | None:
        """The arrivals of the next task on the default group; None where its store
        cannot be had (the gather then goes ahead unguarded)."""
        import torch.distributed as dist

        # torch keeps the default group's store here (distributed_c10d.py); it outlives a
        # dead rank under torchrun, whose agent hosts it.
        get_store = getattr(dist.distributed_c10d, "_get_default_store", None)
        try:
            store = get_store() if get_store is not None else None
        except Exception:
            store = None
        if store is None:
            return None
        key = _group_key()
        cls._counts[key] = index = cls._counts.get(key, 0) + 1
        return cls(store, f"dpverify/task/{index}", rank, world_size)

    def _arrived(self) -> bool:
        return bool(self.store.check([f"{self.prefix}/rank/{r}" for r in range(self.world_size)]))

    def reports(self) -> dict[int, str | None]:
        """What every rank that arrived reported: None for a task that finished, else the
        one line of what it raised."""
        found: dict[int, str | None] = {}
        for r in range(self.world_size):
            key = f"{self.prefix}/rank/{r}"
            if self.store.check([key]):
                text = bytes(self.store.get(key)).decode()
                found[r] = None if text == "ok" else text.removeprefix("failed: ")
        return found

    def _decide(self, choice: str) -> bool:
        decided = self.store.compare_set(f"{self.prefix}/decision", "", choice)
        return bytes(decided).decode() == "gather"

    def every_rank_arrived(self, failure: str | None) -> bool:
        """Marks this rank's arrival, with the line of what its task raised (``failure``)
        if it did, and waits for the decision: True when every rank arrived (gather the
        results), False when they are presumed blocked."""
        failed = failure is not None
        self.store.set(f"{self.prefix}/rank/{self.rank}", "ok" if failure is None else f"failed: {failure}")
        decision = f"{self.prefix}/decision"
        started = time.monotonic()
        pause = 0.002
        while True:
            if self._arrived():
                return self._decide("gather")
            if self.store.check([decision]):
                return bytes(self.store.get(decision)).decode() == "gather"
            if failed and time.monotonic() - started > FAILURE_GRACE_S:
                return self._decide("abandon")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)


def group_runner(world_size: int) -> ProcessGroupRunner | None:
    """The ranks of the initialised default process group (a script that torchrun started
    and that called ``init_process_group``), checked to number ``world_size``; None when no
    group is initialised (the check starts a pool of its own).

    Raises:
        InvalidArgument: the group has another number of ranks.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = ProcessGroupRunner()
    if group.world_size != world_size:
        raise InvalidArgument(
            f"world_size={world_size} but this process is rank {group.rank} of an initialised process group of "
            f"{group.world_size} ranks (torchrun's), where the check runs when pool is None; pass "
            f"world_size={group.world_size} (torch.distributed.get_world_size()), or pass "
            f"pool=DDPWorkerPool({world_size}) to check on a local pool of ranks instead"
        )
    return group


def torchrun_backend() -> str:
    """The backend every rank of this node chooses alike: nccl only when each of the node's
    ``LOCAL_WORLD_SIZE`` ranks has a CUDA device of its own (``DPVERIFY_GPUS`` caps the count),
    else gloo. A choice by the rank's own index would split the group (two ranks on one GPU:
    rank 0 on nccl, rank 1 on gloo) and hang ``init_process_group``.
    """
    import torch.distributed as dist

    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return "nccl" if cuda_device_count() >= local_ranks and dist.is_nccl_available() else "gloo"


def join_torchrun_group(backend: str | None = None, timeout: float | None = None) -> ProcessGroupRunner:
    """The ranks of torchrun's job as a runner: the default process group, initialised
    here (``backend``, else ``torchrun_backend()``; nccl on ``cuda:LOCAL_RANK``) unless the
    caller did it, with ``timeout`` seconds for every collective when given (torch's
    default otherwise: a rank that waits on one that raised alone waits that long)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        chosen = backend or torchrun_backend()
        if chosen == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(chosen, timeout=None if timeout is None else timedelta(seconds=timeout))
    return ProcessGroupRunner()
