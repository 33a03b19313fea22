"""A seeded DataParallel fuzz session in worker processes against the same session in one.

Runs ``dpverify fuzz --max-examples N --seed S`` as a user does (a fresh process each, in an
empty directory), with ``--workers 1`` and with each of ``--workers`` (default 2), one after
the other, ``--repeats`` times, and prints each run's examples per second by the session's
own count, its wall time and the CPU seconds of its processes. Every run must pass: a
failure stops the benchmark with the session's last lines. A seeded session of W workers
runs seeds S to S+W-1, so the sessions compared draw different examples (each is
repeatable): compare the rates of one run, not the outcomes.

    python benchmarks/bench_fuzz.py
    python benchmarks/bench_fuzz.py --examples 300 --seed 1 --repeats 3 --workers 2 3
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

#: The session's own count, from its summary: ``examples   300 in 12.3 s (24.4/s)``.
_COUNT = re.compile(r"^\s*examples\s+(\d+) in ([\d.]+) s \(([\d.]+)/s\)", re.MULTILINE)


@dataclass(frozen=True)
class Run:
    """One session: its workers, examples, its own rate, wall and CPU seconds (the session's
    processes, imports included), and the load average when it started."""

    workers: int
    examples: int
    rate: float
    wall: float
    cpu: float
    load: float


def session(examples: int, seed: int, workers: int) -> Run:
    """One ``dpverify fuzz`` session in a fresh process and an empty directory.

    Raises:
        RuntimeError: the session did not pass; the message has its last lines.
    """
    command = [sys.executable, "-m", "dpverify", "fuzz", "--max-examples", str(examples), "--seed", str(seed)]
    command += ["--workers", str(workers), "--no-color"]
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as where:
        done = subprocess.run(command, capture_output=True, text=True, cwd=where, check=False)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    count = _COUNT.search(done.stdout)
    if done.returncode != 0 or count is None:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}:\n{(done.stdout + done.stderr)[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Run(workers, int(count.group(1)), float(count.group(3)), wall, cpu, load)


def main(argv: Sequence[str] | None = None) -> list[Run]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=300, help="examples per session (default 300)")
    parser.add_argument("--seed", type=int, default=1, help="the sessions' seed (default 1)")
    parser.add_argument("--workers", type=int, nargs="+", default=[2], help="worker counts to compare with one process (default 2)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of every session (default 2)")
    args = parser.parse_args(argv)
    counts = [1, *(w for w in args.workers if w != 1)]
    print(f"dpverify fuzz --max-examples {args.examples} --seed {args.seed}, {os.cpu_count()} CPUs\n")
    print("| workers | examples/s (its own count) | wall (s) | CPU (s) | load average at start |")
    print("|---:|---:|---:|---:|---:|")
    runs = []
    for _ in range(args.repeats):
        for workers in counts:
            run = session(args.examples, args.seed, workers)
            runs.append(run)
            print(f"| {run.workers} | {run.rate:.1f} | {run.wall:.1f} | {run.cpu:.1f} | {run.load:.1f} |", flush=True)
    return runs


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
