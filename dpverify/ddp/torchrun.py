"""Tasks under torchrun: ``ProcessGroupRunner`` runs them in the current process group."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, TypeVar

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

__all__ = ["ProcessGroupRunner"]

T = TypeVar("T")


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
        backend = str(dist.get_backend())
        device = f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu"
        self._info = RankInfo(dist.get_rank(), dist.get_world_size(), backend, device)

    @property
    def world_size(self) -> int:
        return self._info.world_size

    @property
    def backend(self) -> str:
        return self._info.backend

    @property
    def rank(self) -> int:
        return self._info.rank

    def run(self, fn: Callable[..., T], /, *args: Any, timeout: float | None = None) -> tuple[T, ...]:
        """Runs ``fn(rank_info, *args)`` here and gathers every rank's result."""
        import torch.distributed as dist

        del timeout  # the process group's timeout governs collectives under torchrun
        pickle_task(fn, args)
        try:
            reply: tuple[bool, Any] = (True, pickle.dumps(fn(self._info, *args), protocol=PICKLE_PROTOCOL))
        except BaseException as error:
            reply = (False, (summarize(error), describe_exception(error)))
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, reply)
        failures = [raised_failure(rank, body) for rank, (ok, body) in enumerate(gathered) if not ok]
        if failures:
            head = "; ".join(f"rank {f.rank} {f.summary}" for f in failures)
            detail = "\n".join(f.describe() for f in failures)
            raise ParallelError(f"DDP task failed under torchrun: {head}.\n\n{detail}", failures)
        return tuple(pickle.loads(body) for _ok, body in gathered)

