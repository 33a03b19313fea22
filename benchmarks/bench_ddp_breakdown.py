"""Where a pooled DDP check's time goes: wall and CPU time per phase, in this process and on the ranks.

The checks are ``bench_ddp_pool``'s (``assert_ddp_grads_match`` on small MLPs, even and uneven
shards) through one pool. This process's phases are timed by wrapping the functions that run
them; the ranks' phases by sending the very tasks the checks sent once more, each after a
barrier, to a task that times their parts on the rank. The CPU time of every process over the
checks is read from /proc. A wrapped phase nests inside the one around it (the task's pickling
inside ``pool.run``).

    python benchmarks/bench_ddp_breakdown.py               # 200 checks, world size 2
    python benchmarks/bench_ddp_breakdown.py --examples 400
"""

from __future__ import annotations

import argparse
import functools
import os
import pickle
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.parallel.distributed as torch_ddp
from bench_ddp_pool import check, scenarios

import dpverify.ddp.checks as ddp_checks
import dpverify.ddp.pool as ddp_pool
import dpverify.ddp.rank as ddp_rank
import dpverify.ranked.check as ranked_check
import dpverify.ranked.rank as ranked_rank
from dpverify.ddp.pool import DDPWorkerPool, RankInfo
from dpverify.ddp.runner import dumps

Times = dict[str, list[float]]  # phase -> [wall seconds, CPU seconds]

#: This process's phases, in the order a check runs them.
PARENT = [
    (ddp_checks.DDPCheck, "of", "validate the scenario (pickles module, batch, loss)"),
    (ddp_checks.DDPCheck, "count_items", "count the items (rows or tokens) of every shard"),
    (ranked_check.RankedCheck, "send", "the ranks: pool.run (pickle, send, wait, load the replies)"),
    (ddp_pool, "pickle_task", "  of which: pickle the task"),
    (ddp_checks.DDPCheck, "replayed_references", "single-device references (float32 step, float64 anchor)"),
    (ranked_check.RankedCheck, "rank_rows", "compare every rank's tensors"),
    (ranked_check.RankedCheck, "outcome", "build the outcome"),
]

#: A rank's phases inside ``run_step_task``.
RANK = [
    (ddp_rank.copy, "deepcopy", "copy the module"),
    (ranked_rank.RankContext, "load", "load the shard"),
    (torch_ddp.DistributedDataParallel, "__init__", "wrap in DistributedDataParallel"),
    (torch_ddp.DistributedDataParallel, "forward", "DDP forward"),
    (torch.Tensor, "backward", "backward, with the all-reduce (and the wait for the other ranks)"),
    (ddp_rank, "grads_of", "read gradients, buffers, outputs"),
    (ddp_rank, "buffers_of", "read gradients, buffers, outputs"),
    (ddp_rank, "outputs_of", "read gradients, buffers, outputs"),
]


@contextmanager
def timing(sites: Sequence[tuple[Any, str, str]], times: Times) -> Iterator[None]:
    """Wraps every ``(owner, attribute, phase)`` so that its calls add their wall and CPU
    (this thread's) time to ``times[phase]``; restores them afterwards."""
    saved = []
    for owner, name, phase in sites:
        original = vars(owner).get(name, getattr(owner, name)) if isinstance(owner, type) else getattr(owner, name)
        method = isinstance(original, classmethod)
        fn = original.__func__ if method else original

        def timed(*args: Any, _fn: Callable[..., Any] = fn, _phase: str = phase, **kwargs: Any) -> Any:
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return _fn(*args, **kwargs)
            finally:
                spent = times.setdefault(_phase, [0.0, 0.0])
                spent[0] += time.perf_counter() - wall
                spent[1] += time.thread_time() - cpu

        functools.update_wrapper(timed, fn)
        setattr(owner, name, classmethod(timed) if method else timed)
        saved.append((owner, name, original))
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def process_cpu(pid: int) -> float:
    """Seconds of CPU (user and system) process ``pid`` has used."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def replay(info: RankInfo, payloads: Sequence[bytes]) -> Times:
    """Runs each pickled task after a barrier, timing its unpickling, its run, the reply's
    pickling, and the ``RANK`` phases inside (a task for ``pool.run``)."""
    times: Times = {}
    with timing(RANK, times):
        for payload in payloads:
            dist.barrier()
            marks = (time.perf_counter(), time.thread_time())
            fn, args = pickle.loads(payload)
            add(times, "load the task", marks)
            marks = (time.perf_counter(), time.thread_time())
            result = fn(info, *args)
            add(times, "the task (all of the below)", marks)
            marks = (time.perf_counter(), time.thread_time())
            dumps(result)
            add(times, "pickle the reply", marks)
    return times


def add(times: Times, phase: str, since: tuple[float, float]) -> None:
    spent = times.setdefault(phase, [0.0, 0.0])
    spent[0] += time.perf_counter() - since[0]
    spent[1] += time.thread_time() - since[1]


def breakdown(count: int, world_size: int = 2) -> tuple[list[float], Times, list[float], list[Times], int]:
    """(each check's wall seconds, this process's phases, CPU seconds of this process and of
    every rank over the checks, every rank's phases, DDP steps the ranks ran)."""
    examples = scenarios(count, world_size)
    parent: Times = {}
    tasks: list[Any] = []
    step_task = ddp_checks.DDPCheck.step_task

    def keeping(self: Any, *args: Any, **kwargs: Any) -> Any:
        tasks.append(step_task(self, *args, **kwargs))
        return tasks[-1]

    with DDPWorkerPool(world_size) as pool:
        pool.start()
        check(examples[0], world_size, pool)  # warm-up: first DDP construction, imports
        walls = []
        before = [time.process_time()] + [process_cpu(pid) for pid in pool.pids]
        with timing(PARENT, parent):
            ddp_checks.DDPCheck.step_task = keeping  # type: ignore[method-assign]
            try:
                for scenario in examples:
                    began = time.perf_counter()
                    check(scenario, world_size, pool)
                    walls.append(time.perf_counter() - began)
            finally:
                ddp_checks.DDPCheck.step_task = step_task  # type: ignore[method-assign]
        after = [time.process_time()] + [process_cpu(pid) for pid in pool.pids]
        payloads = [dumps((ddp_rank.run_step_task, (task,))) for task in tasks]
        ranks = list(pool.run(replay, payloads))
    return walls, parent, [b - a for a, b in zip(before, after, strict=True)], ranks, sum(len(t.steps) for t in tasks)


def table(title: str, times: Times, count: int, order: Sequence[str]) -> list[str]:
    """``times`` per check, phases in ``order`` (those it names), then the rest."""
    phases = sorted(times, key=lambda p: order.index(p) if p in order else len(order))
    lines = [f"| {title} | wall (ms) | CPU (ms) |", "|---|---:|---:|"]
    return lines + [f"| {p} | {1000 * times[p][0] / count:.2f} | {1000 * times[p][1] / count:.2f} |" for p in phases]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=200, help="checks (default 200)")
    args = parser.parse_args(argv)
    walls, parent, cpu, ranks, steps = breakdown(args.examples)
    count = len(walls)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, world size 2, gloo on CPU, {os.cpu_count()} CPUs")
    print(
        f"{count} checks ({steps} DDP steps on each rank): {1000 * statistics.mean(walls):.2f} ms a check (median "
        f"{1000 * statistics.median(walls):.2f}); CPU a check: this process {1000 * cpu[0] / count:.2f} ms, ranks "
        + ", ".join(f"{1000 * c / count:.2f}" for c in cpu[1:]) + " ms\n"
    )
    print("\n".join(table("this process, per check", parent, count, [phase for _o, _n, phase in PARENT])) + "\n")
    order = ["load the task", "the task (all of the below)", *[phase for _o, _n, phase in RANK], "pickle the reply"]
    for rank, times in enumerate(ranks):
        print("\n".join(table(f"rank {rank}, per check (its tasks again, each after a barrier)", times, count, order)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
