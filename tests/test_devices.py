"""How many CUDA devices dpverify uses, on machines with none, some and too few of them.

A machine's GPUs are simulated by the queries ``dpverify.core.devices`` asks torch (the
seam ``virtual_devices`` itself uses), so these tests hold on any machine.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch.distributed as dist
from hypothesis import find
from hypothesis.errors import NoSuchExample

import dpverify.core.devices as devices
from dpverify import InvalidArgument, strategies
from dpverify.cli import selftest
from dpverify.core.devices import cuda_device_count
from dpverify.ddp.pool import default_backend


@pytest.fixture
def machine_with(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """``machine_with(n)``: dpverify sees ``n`` CUDA devices, capped by nothing."""

    def simulate(gpus: int) -> None:
        monkeypatch.delenv(devices.GPUS_ENV, raising=False)
        monkeypatch.setattr(devices, "_torch_queries", (lambda: gpus > 0, lambda: gpus))

    return simulate


def test_dpverify_gpus_caps_the_devices_used(machine_with: Callable[[int], None], monkeypatch: pytest.MonkeyPatch) -> None:
    machine_with(3)
    assert cuda_device_count() == 3
    for cap, used in (("1", 1), ("0", 0), ("8", 3), (" 2 ", 2)):
        monkeypatch.setenv(devices.GPUS_ENV, cap)
        assert cuda_device_count() == used


@pytest.mark.parametrize("text", ["-1", "two", "1.5"])
def test_a_malformed_dpverify_gpus_names_the_variable(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv(devices.GPUS_ENV, text)
    with pytest.raises(InvalidArgument, match=rf"DPVERIFY_GPUS='{text}': set it to a whole number"):
        cuda_device_count()


def test_the_cpu_tier_of_this_suite_sees_no_cuda() -> None:
    # conftest's autouse fixture: the same assertions on a CPU box and on a GPU machine
    assert cuda_device_count() == 0


def _sparse(ids: tuple[int, ...]) -> bool:
    return sorted(ids) != list(range(len(ids)))


def test_beside_too_few_gpus_device_lists_draw_only_ids_a_check_accepts(machine_with: Callable[[int], None]) -> None:
    """One GPU, lists of two or more: virtual ids, and only 0 .. n - 1, which a check accepts
    there (it refuses ``[0, 2]`` as a likely mistake for real devices); ``dpverify fuzz`` on
    a one-GPU machine failed every example on that refusal."""
    machine_with(1)
    lists = strategies.device_lists(min_devices=2, max_devices=4)
    with pytest.raises(NoSuchExample):
        find(lists, lambda d: _sparse(d.device_ids))
    # still every size and every order
    assert find(lists, lambda d: len(d.device_ids) == 4 and d.device_ids != (0, 1, 2, 3)).device_ids != (0, 1, 2, 3)


def test_without_cuda_device_lists_draw_sparse_virtual_ids(machine_with: Callable[[int], None]) -> None:
    machine_with(0)
    assert _sparse(find(strategies.device_lists(min_devices=2, max_devices=4), lambda d: _sparse(d.device_ids)).device_ids)


@pytest.mark.parametrize("local_rank", ["0", "1"])
def test_torchrun_ranks_on_one_gpu_all_choose_gloo(machine_with: Callable[[int], None], monkeypatch: pytest.MonkeyPatch, local_rank: str) -> None:
    """Two ranks on a one-GPU node: rank 0 chose nccl (it had GPU 0) and rank 1 gloo, and
    ``torchrun --nproc-per-node 2 -m dpverify.cli.selftest`` hung in init_process_group."""
    machine_with(1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert selftest.torchrun_backend() == "gloo"


def test_a_capped_pool_uses_gloo(machine_with: Callable[[int], None], monkeypatch: pytest.MonkeyPatch) -> None:
    machine_with(4)
    monkeypatch.setenv(devices.GPUS_ENV, "0")
    assert default_backend(2) == "gloo"
    monkeypatch.setenv(devices.GPUS_ENV, "4")
    assert default_backend(2) == ("nccl" if dist.is_nccl_available() else "gloo")
