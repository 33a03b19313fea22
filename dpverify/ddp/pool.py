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
alone: the fork server and the ranks are out of its reach (``_ctrl_c_held``).
"""

from __future__ import annotations

import atexit
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
import stat
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Protocol, TypeVar

from dpverify.core.errors import InvalidArgument
from dpverify.ranked.rank import RankInfo

__all__ = [
    "DDPWorkerPool",
    "ParallelError",
    "PoolRegistry",
    "ProcessGroupRunner",
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

#: Every rank process's name starts so: how a fork server's child knows it is a rank.
_RANK_NAME = "dpverify-ddp-rank"

#: In the error a rank raises when it finds itself re-running the main module.
_RERUN_MARKER = "re-ran the main module"

_STACK_SIGNAL = getattr(signal, "SIGUSR1", None)
_PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL


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


@dataclass(frozen=True)
class RankFailure:
    """What went wrong on one rank.

    Attributes:
        rank: the rank.
        kind: ``"raised"``, ``"signal"`` (killed by a signal), ``"exited"`` (left with an
            exit code), ``"hung"`` (no answer within the timeout) or ``"blocked"`` (no
            answer after another rank had failed).
        summary: one line, e.g. ``"raised ZeroDivisionError: division by zero"``.
        traceback: the traceback of the exception, or the rank's Python stack when it was
            stopped (empty when unavailable).
    """

    rank: int
    kind: str
    summary: str
    traceback: str = ""

    def describe(self) -> str:
        text = f"rank {self.rank} {self.summary}"
        if not self.traceback:
            return text
        label = "traceback" if self.kind == "raised" else "stack when stopped"
        body = "\n".join("    " + line for line in self.traceback.rstrip().splitlines())
        return f"{text}\n  rank {self.rank} {label}:\n{body}"


# A death comes first: the other ranks' errors ("Connection closed by peer") follow from it.
_KIND_ORDER = {"signal": 0, "exited": 1, "raised": 2, "hung": 3, "blocked": 4}


class RankRunner(Protocol):
    """Runs a task on every rank of a process group: ``DDPWorkerPool`` or, under torchrun,
    ``ProcessGroupRunner``."""

    @property
    def world_size(self) -> int: ...

    @property
    def backend(self) -> str: ...

    def run(self, fn: Callable[..., T], /, *args: Any, timeout: float | None = None) -> tuple[T, ...]: ...


def require_picklable(value: Any, argument: str) -> None:
    """Fails early, naming ``argument``, when ``value`` cannot be sent to the ranks.

    Raises:
        InvalidArgument: pickling ``value`` failed (a lambda, a closure, a local class).
    """
    try:
        pickle.dumps(value, protocol=_PICKLE_PROTOCOL)
    except Exception as error:
        raise InvalidArgument(
            f"{argument}={value!r} cannot be pickled to send it to the DDP ranks "
            f"({type(error).__name__}: {error}); pass a function or class defined at the top "
            "level of an importable module (torch.nn.functional.mse_loss, or a "
            "functools.partial of one), not a lambda, closure or locally defined class"
        ) from None


def _pickle_task(fn: Callable[..., Any], args: tuple[Any, ...]) -> bytes:
    if not callable(fn):
        raise InvalidArgument(f"fn={fn!r} is not callable; pass fn(rank_info, *args)")
    require_picklable(fn, "fn")
    for index, arg in enumerate(args):
        require_picklable(arg, f"args[{index}]")
    return pickle.dumps((fn, args), protocol=_PICKLE_PROTOCOL)


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


# --------------------------------------------------------------------------- fork server


def _in_fork_server() -> bool:
    """Whether this module is being preloaded by multiprocessing's fork server."""
    from multiprocessing import forkserver

    frame: Any = sys._getframe()
    while frame is not None:
        if frame.f_code is forkserver.main.__code__:
            return True
        frame = frame.f_back
    return False


def _summary(error: BaseException) -> str:
    """``Type: first line of the message``, at most 240 characters: a rank's one-line story."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = type(error).__name__ + (f": {lines[0]}" if lines else "")
    return text if len(text) <= 240 else text[:237] + "..."


def _send_bootstrap_failure(error: BaseException) -> bool:
    """From a rank that failed before ``_rank_main`` ran, the failure to the parent.

    That happens while multiprocessing prepares the new process, typically re-importing the
    main module; the rank's task pipe is then already open (a socket among the descriptors
    the fork server handed over), and the parent reads the failure as the start-up answer.
    """
    from multiprocessing import forkserver

    if not multiprocessing.current_process().name.startswith(_RANK_NAME):
        return False  # another library's process, started through the same fork server
    server = getattr(forkserver, "_forkserver", None)
    for fd in getattr(server, "_inherited_fds", None) or ():
        # The rank's arguments are (spec, task pipe, parent-alive pipe): the first socket.
        if stat.S_ISSOCK(os.fstat(fd).st_mode):
            conn = Connection(os.dup(fd))
            try:
                text = _describe_exception(error, skip_caller=False)
                conn.send_bytes(pickle.dumps((0, False, (_summary(error), text)), protocol=_PICKLE_PROTOCOL))
            finally:
                conn.close()
            return True
    return False


def _report_bootstrap_failure(kind: type[BaseException], value: BaseException, tb: Any) -> None:
    """``sys.excepthook`` in the fork server, so in every process it starts: the fork server
    calls it when preparing a child fails. A rank tells its parent, which shows the failure
    in its ParallelError; anything else prints as usual."""
    sent = False
    with contextlib.suppress(BaseException):
        sent = _send_bootstrap_failure(value)
    if not sent:
        _DEFAULT_EXCEPTHOOK(kind, value, tb)


_DEFAULT_EXCEPTHOOK = sys.excepthook

if _in_fork_server():
    # The fork server leaves (SystemExit) when its last client has gone; tearing torch down
    # would keep it alive for another second after the program that used it.
    atexit.register(os._exit, 0)
    # A rank that fails before its entry point (re-importing the main module) would
    # otherwise only print to the terminal, and the parent would see a silent exit.
    sys.excepthook = _report_bootstrap_failure

_FORK_SERVER_STOP: multiprocessing.util.Finalize | None = None


def _stop_fork_server() -> None:
    """At interpreter exit, after every pool has closed: stop the fork server at once.

    It would stop by itself when this process is gone. Killing it is safe only when no
    other process started through it is still running (its exit status comes from there).
    """
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if server is None or pid is None or not hasattr(server, "_stop"):
        return
    for child in multiprocessing.active_children():
        if not child.name.startswith(_RANK_NAME):
            return
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        server._stop()


@contextlib.contextmanager
def _ctrl_c_held() -> Iterator[None]:
    """Holds SIGINT back from this thread while it starts a process, which inherits the
    mask: multiprocessing starts its resource tracker so (resource_tracker.py,
    ``ensure_running``). A Ctrl-C in the terminal reaches the whole foreground process
    group, and a fork server preloading torch, or a spawned rank importing it before it
    leaves the group (``_leave_terminal_group``), would die of it with a KeyboardInterrupt
    traceback. A Ctrl-C meanwhile is delivered to this process when the block ends."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    from multiprocessing import resource_tracker

    # It unblocks SIGINT after starting itself: started first, it does not start inside.
    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _start_fork_server() -> None:
    """Starts this process's fork server, if it has none, out of Ctrl-C's reach: it keeps
    SIGINT blocked while it preloads, then ignores it (forkserver.py, ``main``)."""
    from multiprocessing import forkserver

    with _ctrl_c_held():
        forkserver.ensure_running()


def _arrange_fork_server_stop() -> None:
    global _FORK_SERVER_STOP
    if _FORK_SERVER_STOP is None:
        # Pools finalize at exitpriority 10: this runs after them, and before
        # multiprocessing joins the remaining children.
        _FORK_SERVER_STOP = multiprocessing.util.Finalize(None, _stop_fork_server, exitpriority=1)


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


def _describe_exception(error: BaseException, *, skip_caller: bool = True) -> str:
    # The first frame is the pool's own call of the task; the user's code starts below it.
    tb = error.__traceback__
    if skip_caller and tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(error), error, tb))
    if isinstance(error, (ModuleNotFoundError, AttributeError)) and "pickle" in text:
        text += (
            "\ndpverify: the rank could not unpickle the task; modules, functions and classes "
            "sent to the ranks must be importable by name from a fresh process (defined in a "
            "module, not in an interactive session).\n"
        )
    return text


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
            reply = (task_id, True, pickle.dumps(fn(info, *args), protocol=_PICKLE_PROTOCOL))
        except BaseException as error:  # a rank reports everything, SystemExit included
            reply = (task_id, False, (_summary(error), _describe_exception(error)))
        conn.send_bytes(pickle.dumps(reply, protocol=_PICKLE_PROTOCOL))


def _leave_terminal_group() -> None:
    """Moves this rank into a process group of its own, which the pool kills whole
    (DataLoader workers too) and a Ctrl-C in the parent's terminal does not reach, then
    takes SIGINT again: the rank started with it blocked (``_ctrl_c_held``), and a Ctrl-C
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
        failure = (_summary(error), _describe_exception(error, skip_caller=False))
        conn.send_bytes(pickle.dumps((0, False, failure), protocol=_PICKLE_PROTOCOL))
        return
    conn.send_bytes(pickle.dumps((0, True, b""), protocol=_PICKLE_PROTOCOL))
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


def _raised(rank: int, body: tuple[str, str] | str) -> RankFailure:
    """A rank's exception: its (summary, traceback), or a bare traceback."""
    if isinstance(body, tuple):
        summary, text = body
    else:
        text = body
        summary = body.rstrip().splitlines()[-1] if body.strip() else "an exception"
    return RankFailure(rank, "raised", f"raised {summary}", text)


def _main_module() -> tuple[str, str]:
    """How a new process (forkserver, spawn) finds this process's main module: ``(kind,
    where)`` with kind ``"module"`` (``python -m``, run again by name), ``"script"`` (run
    again from its file), ``"nofile"`` (``<stdin>``: multiprocessing tries a file of that
    name), ``"none"`` (``python -c``, a REPL, a notebook: not imported at all) or
    ``"package"`` (a package's ``__main__``, which multiprocessing leaves alone)."""
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if isinstance(name, str):
        return ("package" if name == "__main__" or name.endswith(".__main__") else "module"), name
    path = getattr(main, "__file__", None)
    if not isinstance(path, str):
        return "none", ""
    origin = multiprocessing.process.ORIGINAL_DIR or os.getcwd()  # type: ignore[attr-defined]
    full = path if os.path.isabs(path) else os.path.join(origin, path)
    return ("script", full) if os.path.isfile(full) else ("nofile", path)


_GUARD = "`if __name__ == '__main__':`"
_IMPORTABLE = (
    "define models, loss functions and steps in an importable module (a .py file on "
    "sys.path) and import them"
)


def _main_module_advice(failures: Sequence[RankFailure], starting: bool) -> str:
    """The likely cause and the fix when the ranks could not import the main module, or what
    it defines; empty otherwise. Every rank is a new process that imports the main module
    again (forkserver and spawn start methods), so its top-level code runs in every rank."""
    text = "\n".join(f.traceback for f in failures)
    kind, where = _main_module()
    anew = (
        "Every DDP rank is a new process that imports the main module again "
        "(multiprocessing's forkserver and spawn start methods run it as '__mp_main__')"
    )
    again = f"{anew}, so its top-level code runs in every rank."
    if _RERUN_MARKER in text:
        script = f"the script {where}" if kind == "script" else f"the main module {where or '__main__'}"
        return (
            f"dpverify: likely cause: {script} has no {_GUARD} guard. {again} The ranks re-ran "
            "the code that calls dpverify and tried to start ranks of their own. Fix: put the "
            f"code that calls dpverify under {_GUARD}, keeping models, loss functions and steps "
            "defined at the top level, where the ranks import them from."
        )
    reimport = "_fixup_main_from_path" in text or "_fixup_main_from_name" in text
    silent = starting and bool(failures) and all(f.kind == "exited" for f in failures)
    if kind == "nofile" and (reimport or silent):
        return (
            f"dpverify: likely cause: the main module is {where!r}, code fed on standard input "
            f"(python - < script.py). {anew}, and code read from standard input has no file to "
            "import it from. Fix: save the "
            f"code as a script and run it as a file, with the code that calls dpverify under "
            f"{_GUARD}; for stdin and notebooks, {_IMPORTABLE}."
        )
    if reimport:
        return (
            f"dpverify: the ranks failed while importing the main module {where} again. {again} "
            f"Fix: keep only definitions at its top level and put the rest, including the code "
            f"that calls dpverify, under {_GUARD}."
        )
    if "on <module '__main__'" in text or "on <module '__mp_main__'" in text:
        if kind in ("none", "nofile"):
            return (
                "dpverify: likely cause: the main module has no file (python -c, an interactive "
                "session, a notebook or standard input), so the ranks cannot import the classes "
                f"and functions defined in it. Fix: {_IMPORTABLE}; or run a script file with "
                f"the code that calls dpverify under {_GUARD}."
            )
        return (
            f"dpverify: likely cause: a class or function sent to the ranks is defined under "
            f"{_GUARD} or inside a function of the main module {where}; the ranks import the "
            "main module without running that block. Fix: define it at the top level of the "
            f"script, or {_IMPORTABLE}."
        )
    if silent and kind in ("script", "module"):
        return (
            "dpverify: the ranks exited while starting, before they could report anything; "
            f"their error is on this process's standard error. {again} If that error shows the "
            f"main module {where} being imported again, put the code that calls dpverify under "
            f"{_GUARD}."
        )
    return ""


def _refuse_while_importing_main() -> None:
    """Raises in a new process that is still importing the main module: the main module
    starts DDP ranks at its top level, and this process is one of those ranks (or any other
    process that multiprocessing started), re-running it.

    Raises:
        ParallelError: with the cause and the fix; the pool's parent shows it.
    """
    process = multiprocessing.current_process()
    if not getattr(process, "_inheriting", False):  # set by multiprocessing while it prepares a child
        return
    # multiprocessing runs the main script as '__mp_main__'; '__main__' is still the fork
    # server's own until that run ends.
    rerun = sys.modules.get("__mp_main__")
    where = getattr(rerun, "__file__", None) or getattr(getattr(rerun, "__spec__", None), "name", None)
    raise ParallelError(
        f"{process.name} {_RERUN_MARKER} {where or '__main__'}, which starts DDP ranks at its "
        f"top level (no {_GUARD} guard)\nThe ranks are new processes that import the main "
        f"module again; put the code that calls dpverify under {_GUARD}."
    )


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
        _refuse_while_importing_main()
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise InvalidArgument(f"world_size={world_size!r} must be an int >= 1")
        for name, value in (("timeout", timeout), ("start_timeout", start_timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise InvalidArgument(f"{name}={value!r} must be a positive number of seconds")
        self._world_size = world_size
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
        payload = _pickle_task(fn, args)
        limit = self._timeout if timeout is None else float(timeout)
        if not limit > 0:
            raise InvalidArgument(f"timeout={timeout!r} must be a positive number of seconds")
        with self._lock:
            generation = self._ensure_started()
            task_id = next(self._task_ids)
            message = pickle.dumps((task_id, list(sys.path), payload), protocol=_PICKLE_PROTOCOL)
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
            # Only takes effect if this process has not started its fork server yet.
            context.set_forkserver_preload(_PRELOAD)
            _arrange_fork_server_stop()
            _start_fork_server()
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
                name=f"{_RANK_NAME}{rank}",
                daemon=False,  # a daemon may not start children (DataLoader workers)
            )
            # a fork server's child inherits its mask; a spawned rank is started from here
            with _ctrl_c_held() if self._method == "spawn" else contextlib.nullcontext():
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
            outcome.failures[rank] = _raised(rank, body)

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
        advice = _main_module_advice(failures, starting=what == _START)
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

    def __init__(self, *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self._timeout = timeout
        self._pools: dict[int, DDPWorkerPool] = {}
        self._lock = threading.Lock()

    def get(self, world_size: int) -> DDPWorkerPool:
        with self._lock:
            pool = self._pools.get(world_size)
            if pool is None or pool.closed:
                pool = DDPWorkerPool(world_size, timeout=self._timeout)
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


# --------------------------------------------------------------------------- torchrun


class ProcessGroupRunner:
    """Runs tasks in the current process group (started by torchrun) instead of a pool.

    Every rank calls ``run`` with the same task; each runs it locally, and the results (or
    tracebacks) are all-gathered so that every rank gets every rank's result and all ranks
    take the same path afterwards. A hang cannot be detected here: the process group's
    own timeout applies.

    Raises:
        InvalidArgument: no process group is initialised.
    """

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise InvalidArgument(
                "ProcessGroupRunner needs an initialised process group; run under torchrun "
                "and call torch.distributed.init_process_group() first"
            )
        self._backend = str(dist.get_backend())
        device = "cpu"
        if self._backend == "nccl":
            device = f"cuda:{torch.cuda.current_device()}"
        self._info = RankInfo(dist.get_rank(), dist.get_world_size(), self._backend, device)

    @property
    def world_size(self) -> int:
        return self._info.world_size

    @property
    def backend(self) -> str:
        return self._backend

    @property
    def rank(self) -> int:
        return self._info.rank

    def run(self, fn: Callable[..., T], /, *args: Any, timeout: float | None = None) -> tuple[T, ...]:
        """Runs ``fn(rank_info, *args)`` here and gathers every rank's result."""
        import torch.distributed as dist

        del timeout  # the process group's timeout governs collectives under torchrun
        _pickle_task(fn, args)
        try:
            reply: tuple[bool, Any] = (True, pickle.dumps(fn(self._info, *args), protocol=_PICKLE_PROTOCOL))
        except BaseException as error:
            reply = (False, (_summary(error), _describe_exception(error)))
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, reply)
        failures = [_raised(rank, body) for rank, (ok, body) in enumerate(gathered) if not ok]
        if failures:
            head = "; ".join(f"rank {f.rank} {f.summary}" for f in failures)
            detail = "\n".join(f.describe() for f in failures)
            raise ParallelError(f"DDP task failed under torchrun: {head}.\n\n{detail}", failures)
        return tuple(pickle.loads(body) for _ok, body in gathered)

