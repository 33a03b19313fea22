"""Processes a command started, and stopping it with Ctrl-C as a terminal does: for the tests
that check no process outlives a fuzzing session (``psutil``, imported when first used)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterable
from contextlib import suppress
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import psutil  # type: ignore[import-untyped]


def alive(processes: Iterable[psutil.Process]) -> list[psutil.Process]:
    """The processes still running (a zombie has ended: only its parent has yet to reap it)."""
    import psutil

    running = []
    for process in processes:
        with suppress(psutil.Error):
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                running.append(process)
    return running


def ctrl_c_and_reap(
    session: subprocess.Popen[Any], started: Iterable[psutil.Process], deadline_s: float
) -> tuple[float, list[psutil.Process]]:
    """Sends SIGINT to ``session``'s process group (started with ``start_new_session``), as a
    terminal's Ctrl-C does, and waits ``deadline_s`` for it to exit, then as long again for
    every process of ``started`` to end.

    Returns:
        Seconds the session took to exit (``inf`` if it did not within the deadline: it is
        then killed), and the processes of ``started`` that outlived it (killed too, and
        returned so that the test fails on them).
    """
    import psutil

    started = list(started)
    sent = time.monotonic()
    with suppress(ProcessLookupError):
        os.killpg(session.pid, signal.SIGINT)
    try:
        session.wait(timeout=deadline_s)
        took = time.monotonic() - sent
    except subprocess.TimeoutExpired:
        session.kill()
        session.wait()
        took = float("inf")
    deadline = time.monotonic() + deadline_s
    while alive(started) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = alive(started)
    for process in left:
        with suppress(psutil.Error):
            process.kill()
    return took, left
