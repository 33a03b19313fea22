"""virtual_devices(n): torch's DataParallel, its subclasses and third-party look-alikes on
virtual devices, with torch's primitives switched in place and restored afterwards."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dp_lookalikes import (
    BalancedDataParallel,
    CriterionParallel,
    DeviceLoopDataParallel,
    FunctionsDataParallel,
    OutputsPerDevice,
    ReduceAddBroadcast,
    ReduceAddCommBroadcast,
)
from torch import nn
from torch.nn.parallel import _functions as torch_functions
from torch.nn.parallel import comm, scatter_gather
from torch.nn.parallel.data_parallel import data_parallel as torch_data_parallel
from torch.nn.parallel.parallel_apply import parallel_apply as torch_parallel_apply
from torch.nn.parallel.replicate import replicate as torch_replicate

import dpverify.core.patching as patching
from dpverify import InvalidArgument, VirtualDataParallel, current_virtual_device
from dpverify.core.patching import virtual_devices

# torch's objects the block switches (and a few it must leave alone), as they are before
# any block opens.
_FUNCTIONS: tuple[Callable[..., Any], ...] = (
    comm.broadcast,
    comm.broadcast_coalesced,
    comm.scatter,
    comm.gather,
    comm.reduce_add,
    comm.reduce_add_coalesced,
    torch_parallel_apply,
    torch_replicate,
    torch_data_parallel,
    scatter_gather.scatter,
    scatter_gather.scatter_kwargs,
    scatter_gather.gather,
    torch.cuda.is_available,
    torch.cuda.device_count,
    torch.cuda.current_device,
    torch.cuda.set_device,
    torch.cuda.get_device_properties,
)
_CLASSES: tuple[type, ...] = (
    torch_functions.Scatter,
    torch_functions.Gather,
    torch_functions.Broadcast,
    torch_functions.ReduceAddCoalesced,
    torch.cuda.device,
    torch.cuda.device_of,
    nn.DataParallel,
)
_ORIGINAL_CODES = {f: f.__code__ for f in _FUNCTIONS}
_ORIGINAL_CLASS_DICTS = {cls: dict(vars(cls)) for cls in _CLASSES}
_DEVICES_BEFORE = torch.cuda.device_count()


def _assert_torch_restored() -> None:
    for function, code in _ORIGINAL_CODES.items():
        assert function.__code__ is code, function.__qualname__
    for cls, namespace in _ORIGINAL_CLASS_DICTS.items():
        now = dict(vars(cls))
        assert now.keys() == namespace.keys(), cls.__qualname__
        for name, value in namespace.items():
            assert now[name] is value, f"{cls.__qualname__}.{name}"
    assert patching._users == 0
    assert patching._process_depth == 0
    assert torch.cuda.device_count() == _DEVICES_BEFORE
    if not torch.cuda.is_available():
        assert nn.DataParallel(nn.Linear(2, 2)).device_ids == []


@pytest.fixture(autouse=True)
def _restored() -> Iterator[None]:
    _assert_torch_restored()
    yield
    _assert_torch_restored()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)).double()


def _data(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 3, generator=generator, dtype=torch.float64)
    y = torch.randn(rows, 2, generator=generator, dtype=torch.float64)
    return x, y


def _single_device_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    reference = copy.deepcopy(model)
    F.mse_loss(reference(x), y).backward()
    return [p.grad for p in reference.parameters()]  # type: ignore[misc]


def _assert_grads(model: nn.Module, expected: list[torch.Tensor]) -> None:
    got = [p.grad for p in model.parameters()]
    assert all(g is not None for g in got)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)


def _record_replicas(module: nn.Module) -> list[tuple[int | None, int]]:
    """(virtual device, rows) of every forward of ``module`` and of its replicas."""
    calls: list[tuple[int | None, int]] = []
    module.register_forward_pre_hook(lambda _, args: calls.append((current_virtual_device(), args[0].shape[0])))
    return calls


# --- 1. torch's own DataParallel ------------------------------------------------------------


def test_stock_data_parallel_runs_replicas_on_virtual_devices() -> None:
    model = _model()
    x, y = _data(5)
    expected = _single_device_grads(model, x, y)
    calls = _record_replicas(model)
    with virtual_devices(4):
        assert torch.cuda.is_available()
        assert torch.cuda.device_count() == 4
        dp = nn.DataParallel(model)
        assert dp.device_ids == [0, 1, 2, 3]
        assert dp.output_device == 0
        assert dp.src_device_obj == torch.device("cpu")
        F.mse_loss(dp(x), y).backward()
    assert sorted(calls) == [(0, 2), (1, 2), (2, 1)]  # chunks [2, 2, 1]: three replicas
    _assert_grads(model, expected)


def test_backward_after_the_block_closes() -> None:
    # The graph's nodes are dpverify's Functions, whose backward needs no switch.
    model = _model()
    x, y = _data(6)
    expected = _single_device_grads(model, x, y)
    with virtual_devices(3):
        loss = F.mse_loss(nn.DataParallel(model)(x), y)
    _assert_torch_restored()
    loss.backward()
    _assert_grads(model, expected)


def test_explicit_device_ids_one_device_and_functional_data_parallel() -> None:
    model = _model()
    x, y = _data(6)
    expected = _single_device_grads(model, x, y)
    calls = _record_replicas(model)
    with virtual_devices(4):
        dp = nn.DataParallel(model, device_ids=[2, 3], output_device=3)
        assert (dp.device_ids, dp.output_device) == ([2, 3], 3)
        F.mse_loss(dp(x), y).backward()
        assert sorted(calls) == [(2, 3), (3, 3)]
        _assert_grads(model, expected)
        calls.clear()
        nn.DataParallel(model, device_ids=[1])(x)  # one device: the module itself
        assert calls == [(None, 6)]
        calls.clear()
        out = torch.nn.parallel.data_parallel(model, x, [0, 1, 2])
        assert sorted(calls) == [(0, 2), (1, 2), (2, 2)]
        torch.testing.assert_close(out, model(x))


def test_virtual_data_parallel_still_works_inside_the_block() -> None:
    model = _model()
    x, y = _data(5)
    expected = _single_device_grads(model, x, y)
    with virtual_devices(2):
        F.mse_loss(VirtualDataParallel(model, [0, 1, 2])(x), y).backward()
    _assert_grads(model, expected)


def test_data_parallel_built_outside_the_block_keeps_its_device_ids() -> None:
    model = _model()
    calls = _record_replicas(model)
    dp = nn.DataParallel(model)
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine builds a real DataParallel")
    with virtual_devices(4):
        dp(_data(4)[0])
    assert calls == [(None, 4)]  # device_ids == []: the module itself


# --- 2-5. look-alikes of third-party wrappers -----------------------------------------------


def test_balanced_first_chunk() -> None:
    model = _model()
    x, y = _data(7)
    expected = _single_device_grads(model, x, y)
    calls = _record_replicas(model)
    with virtual_devices(3):
        dp = BalancedDataParallel(1, model)
        F.mse_loss(dp(x), y).backward()
    assert sorted(calls) == [(0, 1), (1, 3), (2, 3)]
    _assert_grads(model, expected)


@pytest.mark.parametrize("reducer", [ReduceAddBroadcast, ReduceAddCommBroadcast])
def test_criterion_parallel_reduces_per_device_losses(reducer: type[torch.autograd.Function]) -> None:
    model = _model()
    x, y = _data(8)  # equal chunks: the mean of the per-device mean losses is the mean loss
    expected = _single_device_grads(model, x, y)
    calls = _record_replicas(model)
    criterion = nn.MSELoss()
    loss_calls = _record_replicas(criterion)
    with virtual_devices(4):
        outputs = OutputsPerDevice(model)(x)
        assert isinstance(outputs, list)
        assert len(outputs) == 4
        loss = CriterionParallel(criterion, reducer)(outputs, y)
        loss.backward()  # Broadcast / comm.broadcast run in the custom Function's backward
    assert sorted(calls) == [(d, 2) for d in range(4)]
    assert sorted(loss_calls) == [(d, 2) for d in range(4)]
    torch.testing.assert_close(loss, F.mse_loss(model(x), y))
    _assert_grads(model, expected)


def test_a_loop_over_torch_cuda_device() -> None:
    model = _model()
    x, y = _data(6)
    expected = _single_device_grads(model, x, y)
    selected: list[tuple[int | None, int]] = []
    model.register_forward_pre_hook(lambda *_: selected.append((current_virtual_device(), torch.cuda.current_device())))
    with virtual_devices(3):
        F.mse_loss(DeviceLoopDataParallel(model)(x), y).backward()
        assert current_virtual_device() is None  # each `with` gave the device back
        assert torch.cuda.current_device() == 0
    assert selected == [(0, 0), (1, 1), (2, 2)]
    _assert_grads(model, expected)


def test_scatter_and_gather_functions_called_directly() -> None:
    model = _model()
    x, y = _data(5)
    expected = _single_device_grads(model, x, y)
    calls = _record_replicas(model)
    with virtual_devices(2):
        F.mse_loss(FunctionsDataParallel(model)(x), y).backward()
    assert sorted(calls) == [(0, 3), (1, 2)]
    _assert_grads(model, expected)


# --- the devices ----------------------------------------------------------------------------


def test_torch_cuda_device_selects_a_virtual_device() -> None:
    with virtual_devices(3):
        with torch.cuda.device(2):
            assert current_virtual_device() == 2
            with torch.cuda.device(torch.device("cuda:1")):
                assert torch.cuda.current_device() == 1
            assert torch.cuda.current_device() == 2
            with torch.cuda.device(-1):  # a no-op, as in torch
                assert torch.cuda.current_device() == 2
            with torch.cuda.device_of(torch.ones(1)):  # a host tensor: a no-op too
                assert torch.cuda.current_device() == 2
        assert current_virtual_device() is None
        torch.cuda.set_device(1)
        assert torch.cuda.current_device() == 1
        props = torch.cuda.get_device_properties(0)
        assert props.total_memory == torch.cuda.get_device_properties(2).total_memory
        with pytest.raises(InvalidArgument, match=r"device 3 is not a virtual device: virtual_devices\(3\)"):
            torch.cuda.device(3).__enter__()
        with pytest.raises(InvalidArgument, match="device 5 is not a virtual device"):
            torch.cuda.get_device_properties(5)
    assert current_virtual_device() is None  # set_device does not outlive the block


@pytest.mark.parametrize("n", [0, -1, True, 2.0, "2"])
def test_bad_device_counts(n: Any) -> None:
    with pytest.raises(InvalidArgument, match="pass the number of virtual devices"), virtual_devices(n):
        pass


def test_comm_functions_called_directly() -> None:
    x = torch.arange(10.0).reshape(5, 2)
    with virtual_devices(3):
        parts = comm.scatter(x, [0, 1, 2])
        assert [p.shape[0] for p in parts] == [2, 2, 1]
        assert parts[0].data_ptr() == x.data_ptr()  # the first device's chunk is a view
        assert parts[1].data_ptr() != x[2:].data_ptr()
        torch.testing.assert_close(comm.gather(parts, 0, 0), x)
        out = torch.empty(5, 2)
        assert comm.gather(parts, out=out) is out
        torch.testing.assert_close(out, x)
        sized = comm.scatter(x, [0, 1], chunk_sizes=[1, 4])
        assert [p.shape[0] for p in sized] == [1, 4]
        copies = comm.broadcast(x, [0, 1, 2])
        assert copies[0] is x
        assert all(torch.equal(c, x) and c.data_ptr() != x.data_ptr() for c in copies[1:])
        torch.testing.assert_close(comm.reduce_add([x, 2 * x, 3 * x]), 6 * x)
        torch.testing.assert_close(comm.reduce_add([x, x], destination=1), 2 * x)
        with pytest.raises(ValueError, match="input 1 has invalid size: got 2x2, but expected 5x2"):
            comm.reduce_add([x, x[:2]])
        summed = comm.reduce_add_coalesced([[x, x[0]], [x, x[0]]])  # torch's own, over reduce_add
        torch.testing.assert_close(summed[0], 2 * x)
        torch.testing.assert_close(summed[1], 2 * x[0])


def test_names_imported_before_the_block_are_switched_in_place() -> None:
    from torch.cuda.comm import reduce_add
    from torch.nn.parallel import parallel_apply

    with virtual_devices(2):
        assert reduce_add.__code__ is not _ORIGINAL_CODES[comm.reduce_add]
        torch.testing.assert_close(reduce_add([torch.ones(2), torch.ones(2)]), torch.full((2,), 2.0))
        seen: list[int | None] = []

        class Where(nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                seen.append(current_virtual_device())
                return x

        parallel_apply([Where(), Where()], [torch.ones(1), torch.ones(1)], None, [0, 1])
        assert sorted(seen) == [0, 1]  # type: ignore[type-var]


def test_dpverify_finds_the_machines_devices_and_checks_a_wrapper_in_the_block() -> None:
    from dpverify import assert_dp_grads_match
    from dpverify.core.devices import cuda_device_count

    machine = cuda_device_count()
    model = _model()
    x, y = _data(7)
    with virtual_devices(3):
        assert torch.cuda.device_count() == 3
        assert cuda_device_count() == machine  # dpverify still sees the machine
        if machine:
            pytest.skip("dpverify would run the check on this machine's GPUs")
        assert_dp_grads_match(
            model, x, y, loss_fn=F.mse_loss, device_ids=[0, 1, 2],
            parallel=lambda module, device_ids, output_device: BalancedDataParallel(1, module, device_ids, output_device),
        )


# --- 6. restoration, nesting, threads -------------------------------------------------------


def test_restored_after_an_error_in_the_block() -> None:
    with pytest.raises(RuntimeError, match="boom"), virtual_devices(2):
        raise RuntimeError("boom")


def test_nested_blocks() -> None:
    with virtual_devices(4):
        assert nn.DataParallel(nn.Linear(2, 2)).device_ids == [0, 1, 2, 3]
        with virtual_devices(2):
            assert torch.cuda.device_count() == 2
            inner = nn.DataParallel(nn.Linear(2, 2).double())
            assert inner.device_ids == [0, 1]
            inner(torch.ones(4, 2, dtype=torch.float64))
        assert torch.cuda.is_available()
        assert torch.cuda.device_count() == 4
        assert nn.DataParallel(nn.Linear(2, 2)).device_ids == [0, 1, 2, 3]
        assert torch_functions.Scatter.__dict__.get("apply") is not None
    _assert_torch_restored()


def test_a_thread_without_a_block_is_virtualized_too() -> None:
    # Documented consequence: the switch is process-wide while any block is open.
    seen: list[int] = []
    with virtual_devices(3):
        other = threading.Thread(target=lambda: seen.append(torch.cuda.device_count()))
        other.start()
        other.join()
    assert seen == [3]


def test_two_threads_enter_and_exit_concurrently() -> None:
    start = threading.Barrier(2)
    first_left = threading.Event()
    errors: list[BaseException] = []
    counts: dict[int, list[int]] = {}

    def run(n: int, leave_first: bool) -> None:
        try:
            with virtual_devices(n):
                start.wait(timeout=30)
                model = _model()
                x, y = _data(2 * n)
                expected = _single_device_grads(model, x, y)
                calls = _record_replicas(model)
                dp = nn.DataParallel(model)
                F.mse_loss(dp(x), y).backward()
                _assert_grads(model, expected)
                counts[n] = [torch.cuda.device_count(), len(dp.device_ids), len(calls)]
                if not leave_first:
                    assert first_left.wait(timeout=30)
                    assert torch.cuda.device_count() == n  # still open here
            if leave_first:
                first_left.set()
        except BaseException as error:  # re-raised in the test's thread
            errors.append(error)
            first_left.set()

    threads = [threading.Thread(target=run, args=(2, True)), threading.Thread(target=run, args=(3, False))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    if errors:
        raise errors[0]
    assert counts == {2: [2, 2, 2], 3: [3, 3, 3]}
    _assert_torch_restored()


@pytest.mark.parametrize("seed", [torch.manual_seed, torch.cuda.manual_seed_all])
def test_seeding_in_a_block_seeds_the_machines_cuda_generators_only(monkeypatch: pytest.MonkeyPatch, seed: Any) -> None:
    # On a GPU machine CUDA is initialized, and torch.manual_seed seeds one CUDA generator
    # per device_count() (or the current device's): with 3 virtual devices beside fewer
    # GPUs it indexed generators that do not exist. Here: initialized CUDA with none.
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "default_generators", ())
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)
    if torch.cuda.device_count():
        pytest.skip("simulates a machine whose CUDA has no generators")
    with virtual_devices(3):
        assert torch.cuda.device_count() == 3
        seed(0)  # IndexError: tuple index out of range, when it saw 3 devices
        assert torch.cuda.device_count() == 3  # the block's devices again after the call
