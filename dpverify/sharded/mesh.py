"""What every sharded rank task shares: device meshes over the ranks' default process
group, made once per rank process, and quiet torch logs while a task runs.

``init_device_mesh`` over the whole world reuses the default group, but a mesh of two or
more dimensions makes a sub-group per dimension (``new_group``, a collective every rank
must join). A pooled rank runs many checks: making those groups once per shape and keeping
them is what lets a 2-D check cost milliseconds, and never leaks groups.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator, Sequence

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dpverify.ddp.rank import RankInfo

__all__ = ["device_mesh", "quiet"]

_MESHES: dict[tuple[int, str, tuple[int, ...], tuple[str, ...]], DeviceMesh] = {}


def device_mesh(info: RankInfo, shape: Sequence[int], names: Sequence[str]) -> DeviceMesh:
    """The mesh of ``shape`` (named ``names``) over every rank, made on first use by every
    rank (all must ask for it in the same task) and reused afterwards.

    The key includes the default group's identity, so a pool that restarted its ranks
    (a fresh group) never reuses a mesh of the dead one.
    """
    shape, names = tuple(shape), tuple(names)
    key = (id(dist.group.WORLD), info.device.split(":")[0], shape, names)
    mesh = _MESHES.get(key)
    if mesh is None:
        mesh = init_device_mesh(info.device.split(":")[0], shape, mesh_dim_names=names)
        _MESHES[key] = mesh
    return mesh


#: The loggers a sharded task silences: DTensor's redistribution lines, FSDP2's and
#: pipelining's, and the fake-tensor errors sharding propagation logs before it raises.
_NOISY = ("torch.distributed", "torch._subclasses.fake_tensor")


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Hide torch's per-rank warnings (FSDP2's view outputs, deprecations) and log lines
    while a rank runs a task: they are noise to someone checking a model, and whatever goes
    wrong is reported by the check itself (an error still raises)."""
    loggers = [logging.getLogger(name) for name in _NOISY]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
