"""The DDP worker pool: ``world_size`` long-lived rank processes in one process group.

Starting a process group is the expensive part of testing DistributedDataParallel (6 to 10
s per group on a 2-core machine with the ``spawn`` start method, once every rank has paid
for importing torch); one DDP step of a small model costs milliseconds. The pool therefore starts its ranks once and
sends them any number of tasks: a task is a picklable function ``fn(rank_info, *args)``
that every rank runs, and ``run`` returns what each rank returned, in rank order.

Ranks are started through the ``forkserver`` start method where the platform has it, with
torch preloaded in the fork server, so a restart after a fault costs well under a second;
elsewhere through ``spawn``. Rendezvous goes through a ``FileStore`` in a private temporary
directory (no port is fixed, so pools in several processes or pytest-xdist workers never
collide), and gloo is pinned to the loopback interface.

Faults never leave the pool unusable: an exception on any rank, a rank killed by a signal,
or a rank that does not answer within the timeout (a hang, typically a collective the other
ranks never joined) raise ``ParallelError`` with every rank's story (traceback, signal, or
the Python stack where it hung); the ranks are then killed and the pool starts fresh ones
for the next task. No rank outlives the pool: ranks are stopped by ``close()``, by a
finalizer when the pool is garbage collected or the interpreter exits, and a watchdog thread
in every rank ends it when the parent process dies. A Ctrl-C in the terminal is the parent's
alone: the fork server and the ranks are out of its reach (``forkserver.ctrl_c_held``).

Around the pool: ``runner`` (the ``RankRunner`` protocol, task pickling, ``RankFailure``),
``forkserver`` (the fork server's start, stop and start-up failures), ``advice`` (the cause
and fix when the ranks cannot import the main module) and ``torchrun``
(``ProcessGroupRunner``, the runner under torchrun).
"""

from __future__ import annotations

import contextlib
import faulthandler
import itertools
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

from dpverify.core.errors import InvalidArgument
from dpverify.core.validation import require_int_at_least
from dpverify.ddp.advice import importing_main_again, main_module_advice
from dpverify.ddp.forkserver import RANK_NAME, ctrl_c_held, start_fork_server
from dpverify.ddp.runner import (
    PICKLE_PROTOCOL,
    RankFailure,
    RankRunner,
    describe_exception,
    dumps,
    pickle_task,
    raised_failure,
    require_picklable,
    summarize,
)
from dpverify.ranked.rank import RankInfo

__all__ = [
    "DDPWorkerPool",
    "ParallelError",
    "PoolRegistry",
    "RankFailure",
    "RankInfo",
    "RankRunner",
    "require_picklable",
    "shared_pool",
    "shared_pools",
]

T = TypeVar("T")

#: After one rank raises, how long the other ranks get to answer before they are presumed
#: blocked in a collective that the failed rank will never join, and are killed. Only the
#: report depends on it (every rank is restarted after a failed task either way).
FAILURE_GRACE_S = 1.0

#: The same after a rank died: the group is broken, so only answers already sent count.
DEATH_GRACE_S = 0.25

#: How long ``close()`` waits for ranks to leave their loop before killing them.
CLOSE_GRACE_S = 5.0

#: What a failed start of the ranks is called in its ParallelError.
_START = "process group start"

#: Default per-task timeout of a pool, in seconds.
DEFAULT_TIMEOUT_S = 60.0

#: Imported once by the fork server, so that a rank starts (and restarts) in well under a
#: second: torch, DDP, and torch._dynamo, which torch.manual_seed imports on first use
#: (about 3 s per fresh rank on a 2-core machine otherwise).
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "dpverify.ddp.pool", "dpverify.ddp.rank"]

_STACK_SIGNAL = getattr(signal, "SIGUSR1", None)


class ParallelError(RuntimeError):
    """A task failed on one or more ranks: it raised, a rank died, or a rank hung.

    Attributes:
        rank: the rank at the root of the failure: one killed by a signal (the others'
            errors follow from its death), else the first that raised, else the first that
            did not answer; None only when no rank is to blame.
        traceback: that rank's traceback, or the Python stack it was stopped in.
        failures: every failed rank's story, in the order above.
    """

    def __init__(self, message: str, failures: Sequence[RankFailure] = ()) -> None:
        super().__init__(message)
        self.failures: tuple[RankFailure, ...] = tuple(failures)
        primary = self.failures[0] if self.failures else None
        self.rank: int | None = primary.rank if primary is not None else None
        self.traceback: str = primary.traceback if primary is not None else ""


# A death comes first: the other ranks' errors ("Connection closed by peer") follow from it.
_KIND_ORDER = {"signal": 0, "exited": 1, "raised": 2, "hung": 3, "blocked": 4}


def default_backend(world_size: int) -> str:
    """nccl when CUDA, NCCL and one GPU per rank are there (``DPVERIFY_GPUS`` caps the
    GPUs counted); gloo otherwise."""
    import torch.distributed as dist

    from dpverify.core.devices import cuda_device_count

    if cuda_device_count() >= world_size and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def _validate_backend(backend: str | None, world_size: int) -> str:
    import torch.distributed as dist

    from dpverify.core.devices import cuda_device_count

    if not dist.is_available():
        raise InvalidArgument("this torch build has no torch.distributed; DDP cannot run here")
    if backend is None:
        return default_backend(world_size)
    if backend not in ("gloo", "nccl"):
        raise InvalidArgument(f"backend={backend!r}: pass 'gloo', 'nccl', or None to choose")
    if backend == "nccl":
        gpus = cuda_device_count()
        if gpus < world_size or not dist.is_nccl_available():
            raise InvalidArgument(
                f"backend='nccl' needs one CUDA device per rank: world_size={world_size}, "
                f"found {gpus} devices{'' if dist.is_nccl_available() else ' and no NCCL'}; "
                "pass backend='gloo' or None"
            )
    elif not dist.is_gloo_available():
        raise InvalidArgument("backend='gloo' is not available in this torch build")
    return backend


def _loopback_env() -> dict[str, str]:
    # gloo resolves the hostname to pick its interface unless told otherwise; the pool's
    # ranks only ever talk to each other on this machine.
    if "GLOO_SOCKET_IFNAME" in os.environ or not hasattr(socket, "if_nameindex"):
        return {}
    with contextlib.suppress(OSError):
        for _index, name in socket.if_nameindex():
            if name == "lo" or name.startswith("lo0"):
                return {"GLOO_SOCKET_IFNAME": name}
    return {}


def _start_method(requested: str | None) -> str:
    available = multiprocessing.get_all_start_methods()
    if requested is None:
        return "forkserver" if "forkserver" in available else "spawn"
    if requested not in ("forkserver", "spawn") or requested not in available:
        choices = [m for m in ("forkserver", "spawn") if m in available]
        raise InvalidArgument(
            f"start_method={requested!r}: pass one of {choices}; fork is unsafe once torch "
            "has started threads"
        )
    return requested


# --------------------------------------------------------------------------- rank side


@dataclass(frozen=True)
class _WorkerSpec:
    rank: int
    world_size: int
    backend: str
    store_path: str
    stack_path: str
    threads: int
    env: tuple[tuple[str, str], ...]
    pg_timeout_s: float


def _watch_parent(alive: Connection) -> None:
    # The parent holds the only write end: EOF means it is gone, even if it was SIGKILLed,
    # and even while this rank's main thread is blocked in a collective.
    with contextlib.suppress(BaseException):
        alive.recv_bytes()
    os._exit(0)


def _init_rank(spec: _WorkerSpec) -> RankInfo:
    os.environ.update(dict(spec.env))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(spec.threads)
    device = "cpu"
    if spec.backend == "nccl":
        torch.cuda.set_device(spec.rank)
        device = f"cuda:{spec.rank}"
    store = dist.FileStore(spec.store_path, spec.world_size)  # type: ignore[attr-defined,unused-ignore]
    dist.init_process_group(
        spec.backend,
        store=store,
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=spec.pg_timeout_s),
    )
    return RankInfo(spec.rank, spec.world_size, spec.backend, device)


def _extend_sys_path(paths: Sequence[str]) -> None:
    # Test modules and scripts become importable in the parent after the ranks started.
    for path in reversed(paths):
        if path not in sys.path:
            sys.path.insert(0, path)


def _serve(conn: Connection, info: RankInfo) -> None:
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return
        message = pickle.loads(data)
        if message is None:
            return
        task_id, sys_path, payload = message
        _extend_sys_path(sys_path)
        reply: tuple[int, bool, bytes | tuple[str, str]]
        try:
            fn, args = pickle.loads(payload)
            reply = (task_id, True, dumps(fn(info, *args)))
        except BaseException as error:  # a rank reports everything, SystemExit included
            reply = (task_id, False, (summarize(error), describe_exception(error)))
        conn.send_bytes(pickle.dumps(reply, protocol=PICKLE_PROTOCOL))


def _leave_terminal_group() -> None:
    """Moves this rank into a process group of its own, which the pool kills whole
    (DataLoader workers too) and a Ctrl-C in the parent's terminal does not reach, then
    takes SIGINT again: the rank started with it blocked (``ctrl_c_held``), and a Ctrl-C
    that came before it left the parent's group was the parent's and is dropped."""
    if hasattr(os, "setpgrp"):
        os.setpgrp()
    if hasattr(signal, "pthread_sigmask"):
        handler = signal.signal(signal.SIGINT, signal.SIG_IGN)  # drops a pending SIGINT
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        if handler is not None:
            signal.signal(signal.SIGINT, handler)


def _rank_main(spec: _WorkerSpec, conn: Connection, alive: Connection) -> None:
    """Entry point of a rank process: join the group, then serve tasks until told to stop."""
    _leave_terminal_group()
    threading.Thread(target=_watch_parent, args=(alive,), daemon=True, name="dpverify-watchdog").start()
    if _STACK_SIGNAL is not None:
        stack_file = open(spec.stack_path, "w")  # noqa: SIM115 - lives as long as the rank
        faulthandler.register(_STACK_SIGNAL, file=stack_file, all_threads=True, chain=False)
    try:
        info = _init_rank(spec)
    except BaseException as error:
        failure = (summarize(error), describe_exception(error, skip_caller=False))
        conn.send_bytes(pickle.dumps((0, False, failure), protocol=PICKLE_PROTOCOL))
        return
    conn.send_bytes(pickle.dumps((0, True, b""), protocol=PICKLE_PROTOCOL))
    try:
        _serve(conn, info)
    finally:
        import torch.distributed as dist

        with contextlib.suppress(Exception):
            dist.destroy_process_group()


# --------------------------------------------------------------------------- parent side


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(code).name
    except ValueError:
        return f"signal {code}"


def _exit_failure(rank: int, exitcode: int | None) -> RankFailure:
    if exitcode is not None and exitcode < 0:
        name = _signal_name(-exitcode)
        return RankFailure(rank, "signal", f"was killed by {name} (exit code {exitcode})")
    return RankFailure(rank, "exited", f"exited with code {exitcode} without answering")


def _last_dump(text: str) -> str:
    # faulthandler writes one block per thread, most recent call first; the watchdog thread
    # and the frames below the task (this module, multiprocessing) are the pool's own.
    own = os.path.basename(__file__)
    kept = []
    for block in text.strip().split("\n\n"):
        if "_watch_parent" in block:
            continue
        lines = block.splitlines()
        cut = next((i for i, line in enumerate(lines) if own in line), len(lines))
        kept.append("\n".join(lines[:cut]))
    return "\n\n".join(kept)


@dataclass
class _Generation:
    """One set of running ranks: processes, their task pipes, the parent-alive pipe."""

    processes: list[BaseProcess]
    conns: list[Connection]
    alive: Connection
    stack_paths: list[str]

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(p.pid for p in self.processes if p.pid is not None)

    def idle_and_alive(self) -> bool:
        """Every rank runs and waits for a task. A rank's end of its pipe closes the moment
        it dies, before the fork server has reaped it and ``is_alive()`` can tell."""
        try:
            return all(p.is_alive() for p in self.processes) and not any(c.poll(0) for c in self.conns)
        except (OSError, ValueError):
            return False

    def stacks(self, ranks: Sequence[int]) -> dict[int, str]:
        """The Python stack of each of ``ranks``, dumped by faulthandler on request."""
        if _STACK_SIGNAL is None or not ranks:
            return {}
        sizes: dict[int, int] = {}
        for rank in ranks:
            path, proc = self.stack_paths[rank], self.processes[rank]
            sizes[rank] = os.path.getsize(path) if os.path.exists(path) else 0
            if proc.pid is not None and proc.is_alive():
                with contextlib.suppress(OSError):
                    os.kill(proc.pid, _STACK_SIGNAL)
        time.sleep(0.3)
        stacks: dict[int, str] = {}
        for rank in ranks:
            with contextlib.suppress(OSError), open(self.stack_paths[rank]) as handle:
                handle.seek(sizes[rank])
                stacks[rank] = _last_dump(handle.read())
        return stacks

    def kill(self) -> None:
        for proc in self.processes:
            if proc.pid is None or proc.exitcode is not None:
                continue
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # type: ignore[attr-defined,unused-ignore]
            except (AttributeError, OSError):
                with contextlib.suppress(OSError):
                    proc.kill()
        self._reap(timeout=10.0)

    def stop(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send_bytes(pickle.dumps(None))
        deadline = time.monotonic() + CLOSE_GRACE_S
        for proc in self.processes:
            proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def _reap(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for proc in self.processes:
            proc.join(max(0.0, deadline - time.monotonic()))
        for conn in [*self.conns, self.alive]:
            with contextlib.suppress(OSError):
                conn.close()
        for proc in self.processes:
            with contextlib.suppress(ValueError):
                proc.close()


@dataclass
class _Outcome:
    values: dict[int, bytes] = field(default_factory=dict)
    failures: dict[int, RankFailure] = field(default_factory=dict)
    pending: set[int] = field(default_factory=set)


class _PoolState:
    """Everything the finalizer needs, without a reference back to the pool."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.generation: _Generation | None = None

    def stop(self, *, kill: bool) -> None:
        generation, self.generation = self.generation, None
        if generation is None:
            return
        if kill:
            generation.kill()
        else:
            generation.stop()

    def shutdown(self) -> None:
        self.stop(kill=False)
        shutil.rmtree(self.directory, ignore_errors=True)


class DDPWorkerPool:
    """``world_size`` rank processes in one process group, reused for any number of tasks.

    Example::

        with DDPWorkerPool(2) as pool:
            ranks = pool.run(my_task, scenario)   # my_task(rank_info, scenario) on each rank

    Args:
        world_size: number of ranks (at least 1).
        backend: ``"gloo"``, ``"nccl"``, or None: nccl when every rank can have its own
            CUDA device, gloo otherwise.
        timeout: seconds a task may take before its unanswering ranks count as hung.
        start_timeout: seconds the ranks may take to start and join the group.
        start_method: ``"forkserver"`` (default where available: torch is imported once, in
            the fork server, so restarts are cheap) or ``"spawn"`` (a fresh interpreter per
            rank, as ``MultiProcessTestCase`` does).

    Raises:
        InvalidArgument: a bad argument; nccl without a GPU per rank.
    """

    def __init__(
        self,
        world_size: int,
        backend: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        start_timeout: float = 120.0,
        start_method: str | None = None,
    ) -> None:
        refusal = importing_main_again()
        if refusal:
            raise ParallelError(refusal)
        self._world_size = require_int_at_least(world_size, "world_size", 1)
        for name, value in (("timeout", timeout), ("start_timeout", start_timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise InvalidArgument(f"{name}={value!r} must be a positive number of seconds")
        self._backend = _validate_backend(backend, world_size)
        self._timeout = float(timeout)
        self._start_timeout = float(start_timeout)
        self._method = _start_method(start_method)
        self._state = _PoolState(tempfile.mkdtemp(prefix="dpverify-ddp-"))
        self._starts = 0
        self._task_ids = itertools.count(1)
        self._lock = threading.Lock()
        # Runs on close(), on garbage collection, and at interpreter exit before
        # multiprocessing joins its children (exitpriority >= 0 runs first there).
        self._finalizer = multiprocessing.util.Finalize(self, self._state.shutdown, exitpriority=10)

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def backend(self) -> str:
        return self._backend

    @property
    def timeout(self) -> float:
        return self._timeout

    @property
    def start_method(self) -> str:
        return self._method

    @property
    def closed(self) -> bool:
        return not self._finalizer.still_active()

    @property
    def pids(self) -> tuple[int, ...]:
        """Process ids of the running ranks (empty before the first task or after close)."""
        generation = self._state.generation
        return generation.pids if generation is not None else ()

    @property
    def restarts(self) -> int:
        """How many times the ranks were started again after a fault."""
        return max(0, self._starts - 1)

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("running" if self._state.generation else "idle")
        return (
            f"DDPWorkerPool(world_size={self._world_size}, backend={self._backend!r}, "
            f"timeout={self._timeout:g}, start_method={self._method!r}) [{state}, "
            f"{self.restarts} restarts]"
        )

    def __enter__(self) -> DDPWorkerPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stops every rank (politely, then by SIGKILL) and removes the rendezvous files."""
        self._finalizer()

    def start(self) -> None:
        """Starts the ranks now instead of at the first task."""
        with self._lock:
            self._ensure_started()

    def run(self, fn: Callable[..., T], /, *args: Any, timeout: float | None = None) -> tuple[T, ...]:
        """Runs ``fn(rank_info, *args)`` on every rank; returns the values in rank order.

        ``fn`` and ``args`` are pickled once here and unpickled by each rank, so they must be
        importable by name (top-level functions, module-level classes, tensors, specs).

        Args:
            fn: the task; its first argument is the rank's ``RankInfo``.
            args: further arguments, the same for every rank.
            timeout: seconds before unanswering ranks count as hung (default: the pool's).

        Raises:
            ParallelError: a rank raised, died, or did not answer in time; the pool has
                stopped its ranks and starts new ones for the next task.
            InvalidArgument: ``fn`` or an argument cannot be pickled; the pool is closed.
        """
        payload = pickle_task(fn, args)
        limit = self._timeout if timeout is None else float(timeout)
        if not limit > 0:
            raise InvalidArgument(f"timeout={timeout!r} must be a positive number of seconds")
        with self._lock:
            generation = self._ensure_started()
            task_id = next(self._task_ids)
            message = pickle.dumps((task_id, list(sys.path), payload), protocol=PICKLE_PROTOCOL)
            outcome = _Outcome(pending=set(range(self._world_size)))
            for rank, conn in enumerate(generation.conns):
                try:
                    conn.send_bytes(message)
                except OSError:
                    outcome.pending.discard(rank)
                    outcome.failures[rank] = _exit_failure(rank, generation.processes[rank].exitcode)
            self._collect(generation, task_id, outcome, limit)
            if outcome.failures or outcome.pending:
                raise self._fail(generation, outcome, limit, getattr(fn, "__qualname__", repr(fn)))
        return tuple(pickle.loads(outcome.values[rank]) for rank in range(self._world_size))

    # ------------------------------------------------------------------ internals

    def _ensure_started(self) -> _Generation:
        if self.closed:
            raise InvalidArgument(f"{self!r} is closed; create a new DDPWorkerPool")
        generation = self._state.generation
        if generation is not None and generation.idle_and_alive():
            return generation
        # A rank that died between tasks (the OOM killer, a stray signal) failed no task:
        # start a fresh group silently.
        self._state.stop(kill=True)
        return self._launch()

    def _launch(self) -> _Generation:
        import torch

        context = multiprocessing.get_context(self._method)
        if self._method == "forkserver":
            start_fork_server(_PRELOAD)
        self._starts += 1
        directory = self._state.directory
        store_path = os.path.join(directory, f"store-{self._starts}")
        env = tuple(_loopback_env().items()) if self._backend == "gloo" else ()
        threads = max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // self._world_size))
        alive_r, alive_w = context.Pipe(duplex=False)
        processes: list[BaseProcess] = []
        conns: list[Connection] = []
        stack_paths = [os.path.join(directory, f"stack-{self._starts}-{r}.txt") for r in range(self._world_size)]
        generation = _Generation(processes, conns, alive_w, stack_paths)
        self._state.generation = generation
        for rank in range(self._world_size):
            spec = _WorkerSpec(
                rank=rank,
                world_size=self._world_size,
                backend=self._backend,
                store_path=store_path,
                stack_path=stack_paths[rank],
                threads=threads,
                env=env,
                pg_timeout_s=max(1800.0, 4 * self._timeout),
            )
            parent_end, child_end = context.Pipe()
            proc = context.Process(  # type: ignore[attr-defined]
                target=_rank_main,
                args=(spec, child_end, alive_r),
                name=f"{RANK_NAME}{rank}",
                daemon=False,  # a daemon may not start children (DataLoader workers)
            )
            # a fork server's child inherits its mask; a spawned rank is started from here
            with ctrl_c_held() if self._method == "spawn" else contextlib.nullcontext():
                proc.start()
            child_end.close()
            processes.append(proc)
            conns.append(parent_end)
        alive_r.close()
        outcome = _Outcome(pending=set(range(self._world_size)))
        self._collect(generation, 0, outcome, self._start_timeout)
        if outcome.failures or outcome.pending:
            raise self._fail(generation, outcome, self._start_timeout, _START)
        return generation

    def _collect(self, generation: _Generation, task_id: int, outcome: _Outcome, limit: float) -> None:
        """Waits for every pending rank's answer, a death, or the deadline."""
        deadline = time.monotonic() + limit
        grace_end: float | None = None
        by_conn = {id(conn): rank for rank, conn in enumerate(generation.conns)}
        by_sentinel = {p.sentinel: rank for rank, p in enumerate(generation.processes)}
        while outcome.pending:
            end = deadline if grace_end is None else min(deadline, grace_end)
            remaining = end - time.monotonic()
            if remaining <= 0:
                return
            waiting: list[Any] = [generation.conns[r] for r in sorted(outcome.pending)]
            waiting += [generation.processes[r].sentinel for r in sorted(outcome.pending)]
            ready = multiprocessing.connection.wait(waiting, timeout=remaining)
            # Answers first: a rank may answer and exit in the same instant.
            for item in sorted(ready, key=lambda obj: not isinstance(obj, Connection)):
                if isinstance(item, Connection):
                    self._receive(generation, by_conn[id(item)], item, task_id, outcome)
                elif isinstance(item, int):
                    rank = by_sentinel[item]
                    if rank in outcome.pending:
                        generation.processes[rank].join(1.0)
                        outcome.pending.discard(rank)
                        outcome.failures[rank] = _exit_failure(rank, generation.processes[rank].exitcode)
            if outcome.failures and grace_end is None:
                died = any(f.kind != "raised" for f in outcome.failures.values())
                grace_end = time.monotonic() + (DEATH_GRACE_S if died else FAILURE_GRACE_S)

    @staticmethod
    def _receive(generation: _Generation, rank: int, conn: Connection, task_id: int, outcome: _Outcome) -> None:
        try:
            answer_id, ok, body = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            generation.processes[rank].join(1.0)
            outcome.pending.discard(rank)
            outcome.failures[rank] = _exit_failure(rank, generation.processes[rank].exitcode)
            return
        if answer_id != task_id:
            return  # stale answer of an earlier task; cannot happen after a restart
        outcome.pending.discard(rank)
        if ok:
            outcome.values[rank] = body
        else:
            outcome.failures[rank] = raised_failure(rank, body)

    def _fail(self, generation: _Generation, outcome: _Outcome, limit: float, what: str) -> ParallelError:
        """Turns a failed outcome into a ParallelError and stops every rank."""
        someone_failed = bool(outcome.failures)
        stacks = generation.stacks(sorted(outcome.pending))
        for rank in sorted(outcome.pending):
            if someone_failed:
                failed = ", ".join(str(r) for r in sorted(outcome.failures))
                summary = (
                    f"had not answered when rank {failed} failed (most likely blocked in a "
                    "collective that rank never joined)"
                )
                outcome.failures[rank] = RankFailure(rank, "blocked", summary, stacks.get(rank, ""))
            else:
                summary = (
                    f"did not answer within the {limit:g} s timeout (hung: for example in a "
                    "collective that the other ranks never joined)"
                )
                outcome.failures[rank] = RankFailure(rank, "hung", summary, stacks.get(rank, ""))
        self._state.stop(kill=True)
        failures = sorted(outcome.failures.values(), key=lambda f: (_KIND_ORDER[f.kind], f.rank))
        head = f"DDP task {what} failed on {len(failures)} of {self._world_size} ranks ({self._backend}): "
        head += "; ".join(f"rank {f.rank} {f.summary.splitlines()[0]}" for f in failures) + "."
        lines = [head, ""]
        advice = main_module_advice(failures, starting=what == _START)
        if advice:
            lines += [advice, ""]
        lines += [f.describe() + "\n" for f in failures]
        lines.append(
            f"Every rank was stopped; the pool starts {self._world_size} new ranks for the "
            "next task."
        )
        return ParallelError("\n".join(lines), failures)


# --------------------------------------------------------------------------- shared pools


class PoolRegistry:
    """One pool per world size, created on first use and closed together.

    Backs ``shared_pool`` (what the checks use when no pool is passed) and the pytest
    ``ddp_pool`` fixture, so that a test session starts each world size once.
    """

    def __init__(self) -> None:
        self._pools: dict[int, DDPWorkerPool] = {}
        self._lock = threading.Lock()

    def get(self, world_size: int) -> DDPWorkerPool:
        with self._lock:
            pool = self._pools.get(world_size)
            if pool is None or pool.closed:
                pool = DDPWorkerPool(world_size)
                self._pools[world_size] = pool
            return pool

    def close(self) -> None:
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()


_SHARED = PoolRegistry()


def shared_pools() -> PoolRegistry:
    """The process-wide registry behind ``shared_pool``."""
    return _SHARED


def shared_pool(world_size: int) -> DDPWorkerPool:
    """The process-wide pool for ``world_size`` ranks, started on first use."""
    return _SHARED.get(world_size)
