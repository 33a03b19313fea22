"""DistributedDataParallel on real torch.distributed ranks: the worker pool (``pool``, with
``runner``, ``forkserver``, ``advice`` and ``torchrun`` around it), the per-rank steps,
SyncBatchNorm's CPU stand-in, and the DDP checks."""

from __future__ import annotations

from types import ModuleType

__all__ = ["checks_if_available"]


def checks_if_available() -> ModuleType | None:
    """The DDP checks module, or None when this build of torch has no distributed backend."""
    try:
        from dpverify.ddp import checks
    except ImportError:
        return None
    return checks
