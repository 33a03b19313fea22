"""What every sharded rank task shares: device meshes over the ranks' default process
group, made once per rank process, whole tensors rebuilt from the ranks' shards, and quiet
torch logs while a task runs.

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
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from dpverify.ranked.rank import RankInfo, cpu_copy

__all__ = ["device_mesh", "full_grads", "full_params", "gather_full", "quiet"]

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


def _dim0_shard(tensor: DTensor) -> bool:
    """Sharded as FSDP2 shards by default: along dim 0 over a 1-D mesh of every rank, so the
    full tensor is the ranks' local pieces concatenated in rank order. (A 1-D mesh of some
    ranks only, the ``"dp"`` dimension of a 2-D mesh, holds one piece per data-parallel
    group: several ranks hold each piece.)"""
    mesh = tensor.device_mesh
    return mesh.ndim == 1 and mesh.size() == dist.get_world_size() and tuple(tensor.placements) == (Shard(0),)


def gather_full(named: Sequence[tuple[str, torch.Tensor | None]]) -> dict[str, torch.Tensor | None]:
    """CPU copies of whole tensors on every rank, with one collective for all of them.

    Every rank sends what it holds of each tensor (its local shard of a DTensor sharded
    along dim 0, else nothing) in one ``all_gather_object``, and rebuilds each tensor from
    the ranks' pieces: what ``full_tensor()`` gives, without an all-gather per tensor
    (FSDP2's own collectives already cost several milliseconds a step on gloo). A tensor
    not every rank holds so (a plain gradient, another placement) is gathered with
    ``full_tensor()`` when every rank holds a DTensor, else kept as this rank has it: a
    rank without one never leaves the others waiting in a collective.
    """
    mine = [
        cpu_copy(t.to_local()) if isinstance(t, DTensor) and _dim0_shard(t) else (isinstance(t, DTensor) if t is not None else None)
        for _name, t in named
    ]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    full: dict[str, torch.Tensor | None] = {}
    for index, (name, tensor) in enumerate(named):
        pieces = [held[index] for held in every]
        if tensor is None:
            full[name] = None
        elif all(isinstance(piece, torch.Tensor) for piece in pieces):
            full[name] = torch.cat(pieces, dim=0)
        elif isinstance(tensor, DTensor) and all(piece is True or isinstance(piece, torch.Tensor) for piece in pieces):
            full[name] = cpu_copy(tensor.full_tensor())
        else:
            full[name] = cpu_copy(tensor.to_local() if isinstance(tensor, DTensor) else tensor)
    return full


def full_grads(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """Every parameter's whole gradient as a CPU tensor, on every rank (``gather_full``)."""
    return gather_full([(name, p.grad) for name, p in module.named_parameters()])


def full_params(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every whole parameter as a CPU tensor, on every rank (``gather_full``)."""
    full = gather_full([(name, p.detach()) for name, p in module.named_parameters()])
    return {name: tensor for name, tensor in full.items() if tensor is not None}
