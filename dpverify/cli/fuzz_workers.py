"""``dpverify fuzz`` in worker processes: a session's examples checked side by side.

Hypothesis runs one example at a time, and a DataParallel example is a few milliseconds of
Python on one core. ``fuzz_in_workers`` forks ``FuzzConfig.workers`` processes (this
process's imports and the code under test come with the fork), each a Hypothesis session
of its own (``fuzz``) over its share of the examples, with its own seed, shrinking
its own failures and saving them to the example database, whose saved examples every
worker replays first (so a saved failure is found again at once, whichever worker reports
first). This process counts what the workers send, example by example, for the live
display and the report, and stops the other workers when one finds a failure: the report
is that worker's, its failure shrunk there with its repro script, and counts the examples
run up to that failure (what the others finish meanwhile is not counted, as a session in
one process would not have run it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import signal
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from dpverify.cli.fuzz import (
    FuzzConfig,
    FuzzReport,
    Outcome,
    Tally,
    _CheckFailed,
    _ctrl_c_noted,
    fuzz,
)

__all__ = ["fuzz_in_workers", "worker_configs"]

#: Seconds this process waits for the workers to finish the example they are on once the
#: session is over (Ctrl-C, another worker's failure); then they are terminated.
_STOP_WAIT_S = 30.0


@dataclass(frozen=True)
class _Run:
    """One run of a worker's session: an example, or an attempt to shrink its failure.

    Attributes:
        outcome: the example's outcome; None for a failure.
        worst_ratio: its greatest error/allowed, or None.
        shrinking: an attempt to shrink the worker's failure, not an example.
    """

    outcome: Outcome | None
    worst_ratio: float | None
    shrinking: bool


@dataclass(frozen=True)
class _Done:
    """A worker's session ended: its report, or what it raised (the exception itself where
    it pickles, so that the caller sees what a session in one process raises) and its
    traceback."""

    report: FuzzReport | None
    error: str | None = None
    raised: BaseException | None = None


def worker_configs(config: FuzzConfig) -> list[FuzzConfig]:
    """Each worker's session: an equal share of the examples (the first workers one more
    where they do not divide), no more workers than examples; a seeded session's worker
    ``i`` has seed ``seed + i``, so a seeded session is repeatable for a given number of
    workers. The examples are ``--max-examples``, else the profile's; a time budget alone
    sets none, and every worker runs until it."""
    total = config.examples
    count = max(1, min(config.workers, total))
    shares = [total // count + (1 if i < total % count else 0) for i in range(count)]
    until_the_budget = config.max_examples is None and config.profile is None and config.time_budget is not None
    return [
        dataclasses.replace(
            config, workers=1, max_examples=None if until_the_budget else share,
            seed=None if config.seed is None else config.seed + i,
        )
        for i, share in enumerate(shares)
    ]


def _fresh_hypothesis_random() -> None:
    """A forked worker's own Hypothesis randomness: Hypothesis draws an unseeded test's
    seed from a generator it makes once per thread (``hypothesis.core.threadlocal``); one
    made before the fork would give every worker the same examples."""
    with contextlib.suppress(ImportError, AttributeError):
        from hypothesis.core import threadlocal

        threadlocal._hypothesis_global_random = None


def _work(config: FuzzConfig, stop: Any, out: Connection) -> None:
    """A worker: its session, each run sent as it ends, then its report. Ctrl-C reaches
    it only inside the session (``fuzz`` stops there, as on its own); before and
    after, this process's stop event ends it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _fresh_hypothesis_random()
    try:
        def sent(outcome: Outcome | _CheckFailed, shrinking: bool) -> None:
            failed = isinstance(outcome, _CheckFailed)
            out.send(_Run(None if failed else outcome, outcome.worst_ratio, shrinking))  # type: ignore[arg-type]

        report = fuzz(config, on_run=sent, stop=stop.is_set)
        out.send(_Done(report))
    except BaseException as error:
        trace = traceback.format_exc()
        try:
            out.send(_Done(None, trace, error))
        except Exception:  # an exception that does not pickle: its traceback alone
            out.send(_Done(None, trace))
    finally:
        out.close()


@dataclass
class _Merge:
    """This process's count of the workers' runs."""

    tally: Tally
    stop: Any
    failing: int | None = None
    interrupted: bool = False

    def take(self, worker: int, message: _Run) -> None:
        if self.failing is not None and worker != self.failing:
            return  # run after the session's failure was found: not part of the session
        if message.shrinking:
            self.tally.shrink_runs += 1
            return
        self.tally.count(message.outcome, message.worst_ratio)
        if message.outcome is None and self.failing is None:
            self.failing = worker
            self.stop.set()  # the others finish their example and stop


def fuzz_in_workers(config: FuzzConfig, *, on_example: Callable[[Tally], None] | None = None) -> FuzzReport:
    """``fuzz`` in ``config.workers`` forked processes (``worker_configs``); with one worker,
    ``fuzz`` in this process. ``on_example`` sees the tally after every example.

    Returns:
        The session's report, counted over every worker; its failure is the first worker's
        to find one, shrunk there, with its repro script.

    Raises:
        RuntimeError: a worker raised outside its checks, or died; the message has its
            traceback.
    """
    if config.workers <= 1:
        return fuzz(config, on_example=on_example)
    # torch's optimizers import torch._dynamo on first use, a second of CPU: once, here,
    # rather than in every worker
    import torch._dynamo  # noqa: F401

    context = multiprocessing.get_context("fork")
    stop = context.Event()
    merge = _Merge(Tally(), stop)
    readers: dict[Connection, int] = {}
    processes = []
    for index, worker in enumerate(worker_configs(config)):
        reader, writer = context.Pipe(duplex=False)
        process = context.Process(target=_work, args=(worker, stop, writer), name=f"dpverify-fuzz-{index}", daemon=True)
        process.start()
        writer.close()  # the worker's end: a dead worker's reader then reads end of file
        readers[reader] = index
        processes.append(process)
    reports: dict[int, _Done] = {}
    came: list[bool] = []
    try:
        with _ctrl_c_noted(came):
            _gather(readers, merge, reports, on_example, came=came)
    except KeyboardInterrupt:
        merge.interrupted = True
    finally:
        stop.set()
        with _sigint_ignored():
            _gather(readers, merge, reports, on_example, timeout=_STOP_WAIT_S)
            for process in processes:
                process.join(timeout=_STOP_WAIT_S)
                if process.is_alive():
                    process.terminate()
                    process.join()
    return _report(merge, reports, len(processes))


def _gather(
    readers: dict[Connection, int], merge: _Merge, reports: dict[int, _Done],
    on_example: Callable[[Tally], None] | None, *, timeout: float | None = None, came: list[bool] | None = None,
) -> None:
    """Takes the workers' messages until every one has sent its report or died (or
    ``timeout`` seconds without a message).

    Raises:
        KeyboardInterrupt: a Ctrl-C noted in ``came`` whose KeyboardInterrupt was lost
            (``_ctrl_c_noted``).
    """
    while readers:
        if came:
            raise KeyboardInterrupt
        ready = wait(list(readers), timeout=timeout if timeout is not None else 1.0)
        if not ready and timeout is None:
            continue
        if not ready:
            return
        for reader in ready:
            assert isinstance(reader, Connection)
            worker = readers[reader]
            try:
                message = reader.recv()
            except EOFError:
                del readers[reader]
                reports.setdefault(worker, _Done(None, f"worker {worker} ended without a report (killed?)"))
                continue
            if isinstance(message, _Done):
                reports[worker] = message
                del readers[reader]
                continue
            merge.take(worker, message)
            if on_example is not None:
                on_example(merge.tally)


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """No second Ctrl-C while the workers finish: the session is already stopping."""
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: no handler to change
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _report(merge: _Merge, reports: dict[int, _Done], workers: int) -> FuzzReport:
    """The session's report from the count and the workers' own reports.

    Raises:
        BaseException: what a worker's session raised (an ``InvalidArgument`` naming the
            argument, say), as a session in one process raises it.
        RuntimeError: a worker died, or raised what does not pickle; with its traceback.
    """
    errors = [(i, done) for i, done in sorted(reports.items()) if done.error is not None]
    if errors and not merge.interrupted:
        first = errors[0][1]
        if first.raised is not None:
            raise first.raised
        raise RuntimeError("\n".join(f"fuzz worker {i}:\n{done.error}" for i, done in errors))
    tally = merge.tally
    done = {i: d.report for i, d in reports.items() if d.report is not None}
    failure = None
    found = done[merge.failing].failure if merge.failing in done else None
    if found is not None and tally.first_failure_at is not None:
        # the example's number in the whole session, not in its worker's
        failure = dataclasses.replace(found, first_found_at=tally.first_failure_at)
    for worker, report in done.items():
        # another worker's failure, found after the session's: its repro script is not the session's
        other = report.failure.repro if worker != merge.failing and report.failure is not None else None
        if other is not None and (failure is None or other != failure.repro):
            other.unlink(missing_ok=True)
    stopped = {report.stopped_by for report in done.values()}
    if failure is not None:
        stopped_by = "failure"
    elif merge.interrupted or "interrupt" in stopped or len(done) < workers:
        stopped_by = "interrupt"
    elif "time-budget" in stopped:
        stopped_by = "time-budget"
    else:
        stopped_by = "max-examples"
    return FuzzReport(
        examples=tally.run, passed=tally.passed, serial=tally.serial, diverged=tuple(sorted(tally.diverged.items())),
        failure=failure, elapsed=tally.elapsed, stopped_by=stopped_by, history=tuple(tally.history),
    )
