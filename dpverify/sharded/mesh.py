"""Device meshes over the ranks' default process group, made once per rank process.

``init_device_mesh`` over the whole world reuses the default group, but a mesh of two or
more dimensions makes a sub-group per dimension (``new_group``, a collective every rank
must join). A pooled rank runs many checks: making those groups once per shape and keeping
them is what lets a 2-D check cost milliseconds, and never leaks groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dpverify.ddp.rank import RankInfo

__all__ = ["device_mesh"]

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
