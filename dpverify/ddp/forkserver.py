"""The pool's use of multiprocessing's fork server: started with torch preloaded and out of
Ctrl-C's reach, stopped at exit, and, inside the fork server, a hook that sends a rank's
start-up failure to its parent."""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.util
import os
import pickle
import signal
import stat
import sys
import traceback
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection
from typing import Any

from dpverify.ddp.runner import PICKLE_PROTOCOL, describe_exception, summarize

__all__ = ["RANK_NAME", "ctrl_c_held", "start_fork_server"]

#: Every rank process's name starts so: how a fork server's child knows it is a rank.
RANK_NAME = "dpverify-ddp-rank"


def _in_fork_server() -> bool:
    """Whether this module is being preloaded by multiprocessing's fork server."""
    from multiprocessing import forkserver

    return any(frame.f_code is forkserver.main.__code__ for frame, _ in traceback.walk_stack(None))


def _send_bootstrap_failure(error: BaseException) -> bool:
    """From a rank that failed before ``_rank_main`` ran, the failure to the parent.

    That happens while multiprocessing prepares the new process, typically re-importing the
    main module; the rank's task pipe is then already open (a socket among the descriptors
    the fork server handed over), and the parent reads the failure as the start-up answer.
    """
    from multiprocessing import forkserver

    if not multiprocessing.current_process().name.startswith(RANK_NAME):
        return False  # another library's process, started through the same fork server
    for fd in forkserver.get_inherited_fds() or ():
        # The rank's arguments are (spec, task pipe, parent-alive pipe): the first socket.
        if stat.S_ISSOCK(os.fstat(fd).st_mode):
            conn = Connection(os.dup(fd))
            try:
                text = describe_exception(error, skip_caller=False)
                conn.send_bytes(pickle.dumps((0, False, (summarize(error), text)), protocol=PICKLE_PROTOCOL))
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
    multiprocessing has no public way to stop its fork server or learn its pid, so this
    reads ``forkserver._forkserver`` and calls its ``_stop`` (what CPython's tests use).
    """
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if server is None or pid is None or not hasattr(server, "_stop"):
        return
    for child in multiprocessing.active_children():
        if not child.name.startswith(RANK_NAME):
            return
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        server._stop()


@contextlib.contextmanager
def ctrl_c_held() -> Iterator[None]:
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


def start_fork_server(preload: Sequence[str]) -> None:
    """Starts this process's fork server, if it has none, importing ``preload`` there, out
    of Ctrl-C's reach: it keeps SIGINT blocked while it preloads, then ignores it
    (forkserver.py, ``main``). It is stopped at exit, after every pool."""
    global _FORK_SERVER_STOP
    from multiprocessing import forkserver

    forkserver.set_forkserver_preload(list(preload))  # only if none is running yet
    if _FORK_SERVER_STOP is None:
        # Pools finalize at exitpriority 10: this runs after them, and before
        # multiprocessing joins the remaining children.
        _FORK_SERVER_STOP = multiprocessing.util.Finalize(None, _stop_fork_server, exitpriority=1)
    with ctrl_c_held():
        forkserver.ensure_running()


