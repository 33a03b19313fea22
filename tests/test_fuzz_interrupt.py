"""Ctrl-C stops ``dpverify fuzz``, the fuzzing path the README recommends, as a user expects:
at once, with its summary and exit code 130, no traceback from any process, and no process
left behind (DDP ranks and the fork server included)."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from process_tree import ctrl_c_and_reap

if TYPE_CHECKING:
    import psutil  # type: ignore[import-untyped]

    from dpverify.ddp.pool import DDPWorkerPool

pytestmark = pytest.mark.deep

ROOT = Path(__file__).resolve().parent.parent
#: Seconds a session may take to show its first examples: importing torch, then starting
#: the fork server and two ranks. About ten on a loaded 2-core machine.
PROGRESS_DEADLINE_S = 90
#: Seconds from Ctrl-C to the end of the session, and again to the end of every process it
#: started; it takes two to four on a loaded 2-core machine.
STOP_DEADLINE_S = 10
#: The live bar's count of examples, on a terminal.
PROGRESS = re.compile(rb"(\d+) examples, budget")

psutil = pytest.importorskip("psutil")


def _env() -> dict[str, str]:
    """This checkout's dpverify, a wide terminal, no pytest options from outside."""
    env = {k: v for k, v in os.environ.items() if k not in ("HYPOTHESIS_PROFILE", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.update(COLUMNS="160", LINES="40", TERM="xterm-256color")
    return env


def _descendants(pid: int, seen: dict[int, psutil.Process]) -> None:
    """Adds the processes under ``pid`` to ``seen`` (ranks are the fork server's children)."""
    with suppress(psutil.Error):
        for child in psutil.Process(pid).children(recursive=True):
            seen.setdefault(child.pid, child)


def _fork_server_processes(seen: dict[int, psutil.Process]) -> int:
    """How many of ``seen`` run the fork server's code: the server, and the ranks it forked."""
    count = 0
    for process in seen.values():
        with suppress(psutil.Error):
            count += "multiprocessing.forkserver" in " ".join(process.cmdline())
    return count


def _ctrl_c(
    session: subprocess.Popen[bytes], started: dict[int, psutil.Process]
) -> tuple[float, list[psutil.Process]]:
    """Ctrl-C to the session's process group, after a last look at what it started."""
    _descendants(session.pid, started)
    return ctrl_c_and_reap(session, started.values(), STOP_DEADLINE_S)


def _read(fd: int, into: bytearray, timeout: float) -> bool:
    """Appends what the terminal shows within ``timeout`` seconds; False once it is closed."""
    ready, _, _ = select.select([fd], [], [], timeout)
    if not ready:
        return True
    try:
        chunk = os.read(fd, 65536)
    except OSError:  # EIO: every process holding the terminal has closed it
        return False
    into.extend(chunk)
    return bool(chunk)


@dataclass
class _Interrupted:
    """A session Ctrl-C stopped on a terminal: what the terminal showed, the examples
    counted before Ctrl-C, the processes it had started by then and how many of them ran
    the fork server's code (read while they lived), the seconds it took to stop, the
    processes that outlived it and its exit status."""

    text: str
    examples: int
    started: dict[int, psutil.Process]
    forked: int
    took: float
    left: list[psutil.Process]
    returncode: int | None


def _interrupt_on_a_terminal(tmp_path: Path, command: list[str], examples_first: int) -> _Interrupted:
    """Runs ``command`` on a pseudo-terminal as a user would, and sends Ctrl-C once the
    live bar counts ``examples_first`` examples (or at the progress deadline)."""
    import pty

    controller, terminal = pty.openpty()
    try:
        session = subprocess.Popen(
            command, stdin=terminal, stdout=terminal, stderr=terminal,
            cwd=tmp_path, env=_env(), start_new_session=True,
        )  # fmt: skip
    finally:
        os.close(terminal)
    shown = bytearray()
    started: dict[int, psutil.Process] = {}
    try:
        deadline = time.monotonic() + PROGRESS_DEADLINE_S
        examples = 0
        while examples < examples_first and time.monotonic() < deadline and session.poll() is None:
            _read(controller, shown, 0.2)
            _descendants(session.pid, started)
            examples = max((int(n) for n in PROGRESS.findall(bytes(shown))), default=0)
        before, forked = dict(started), _fork_server_processes(started)
        took, left = _ctrl_c(session, started)
        while _read(controller, shown, 0.2):
            pass
    finally:
        os.close(controller)
        if session.poll() is None:
            session.kill()
            session.wait()
    return _Interrupted(shown.decode(errors="replace"), examples, before, forked, took, left, session.returncode)


def _assert_stopped_cleanly(run: _Interrupted) -> None:
    text = run.text[-3000:]
    assert run.examples, f"no example counted within {PROGRESS_DEADLINE_S}s:\n{text}"
    assert run.took <= STOP_DEADLINE_S, f"still running {STOP_DEADLINE_S}s after Ctrl-C:\n{text}"
    assert run.returncode == 130, text
    assert re.search(r"INTERRUPTED after \d+ examples?, no failure so far", run.text), text
    assert "Traceback" not in run.text, text
    assert "KeyboardInterrupt" not in run.text, text
    assert not run.left, f"processes outlived the session by {STOP_DEADLINE_S}s: {run.left}"


@pytest.mark.timeout(PROGRESS_DEADLINE_S + 4 * STOP_DEADLINE_S)
@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_ctrl_c_stops_a_fuzz_session_on_a_terminal_with_its_ranks(tmp_path: Path) -> None:
    # What a user types, on a terminal: the live bar shows progress from the first example.
    command = [
        sys.executable, "-m", "dpverify",
        "fuzz", "--backend", "ddp", "--devices", "2", "--time-budget", "10m", "--seed", "0",
    ]  # fmt: skip
    run = _interrupt_on_a_terminal(tmp_path, command, examples_first=1)
    _assert_stopped_cleanly(run)
    assert run.forked == 3, f"the fork server and its two ranks ran: {run.started}"


@pytest.mark.timeout(PROGRESS_DEADLINE_S + 4 * STOP_DEADLINE_S)
@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_ctrl_c_stops_a_dataparallel_session_and_its_worker_processes(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "dpverify", "fuzz", "--workers", "2", "--time-budget", "10m", "--seed", "0"]
    run = _interrupt_on_a_terminal(tmp_path, command, examples_first=10)
    _assert_stopped_cleanly(run)
    assert len(run.started) == 2, f"the session's two workers ran: {run.started}"


#: Starts a pool and, when Ctrl-C comes, waits long enough for every process it started to
#: print whatever it would print, then closes the pool as a program leaving would.
POOL_SCRIPT = """
import time
from dpverify.ddp.pool import DDPWorkerPool

pool = DDPWorkerPool(2)
try:
    pool.start()
    time.sleep(60)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    time.sleep(3)
pool.close()
"""


@pytest.mark.timeout(PROGRESS_DEADLINE_S + 4 * STOP_DEADLINE_S)
@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="POSIX signal masks")
def test_ctrl_c_while_the_fork_server_preloads_torch_kills_no_process(tmp_path: Path) -> None:
    # The moment a Ctrl-C used to kill the fork server with a KeyboardInterrupt traceback
    # (it imports torch for seconds, in the terminal's process group).
    script = tmp_path / "pool_script.py"
    script.write_text(POOL_SCRIPT)
    log = tmp_path / "out.log"
    with log.open("wb") as out:
        session = subprocess.Popen(
            [sys.executable, str(script)], stdout=out, stderr=subprocess.STDOUT,
            cwd=tmp_path, env=_env(), start_new_session=True,
        )  # fmt: skip
    started: dict[int, psutil.Process] = {}
    try:
        deadline = time.monotonic() + PROGRESS_DEADLINE_S
        server = False
        while not server and time.monotonic() < deadline and session.poll() is None:
            _descendants(session.pid, started)
            server = _fork_server_processes(started) > 0
            time.sleep(0.02)
        took, left = _ctrl_c(session, started)
    finally:
        if session.poll() is None:
            session.kill()
            session.wait()
    text = log.read_text(errors="replace")
    assert server, f"no fork server started within {PROGRESS_DEADLINE_S}s:\n{text[-3000:]}"
    assert "interrupted" in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert "KeyboardInterrupt" not in text, text[-3000:]
    assert took <= STOP_DEADLINE_S + 3, text[-3000:]  # the script waits 3 s on purpose
    assert not left, f"processes outlived the pool by {STOP_DEADLINE_S}s: {left}"


def _sigint_blocked(info: object) -> bool:
    """On a rank: whether SIGINT is blocked there."""
    return signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, set())


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="POSIX signal masks")
def test_ranks_take_sigint_though_the_fork_server_holds_it_back(ddp_pool: DDPWorkerPool) -> None:
    # The fork server keeps SIGINT blocked, and its children inherit the mask; a rank, out
    # of the terminal's process group, unblocks it for the code it runs.
    assert ddp_pool.run(_sigint_blocked) == (False, False)
