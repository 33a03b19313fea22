"""VirtualDataParallel reproduces torch.nn.DataParallel's behaviour (docs/semantics.md, sections 1-8)."""

from __future__ import annotations

import threading
import warnings
from collections import namedtuple
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import scatter_gather

import dpverify
from dpverify import InvalidArgument, VirtualDataParallel, current_virtual_device

Pair = namedtuple("Pair", ["left", "right"])


class Recorder(nn.Module):
    """Linear layer that records, per call, what its replica saw."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)
        self.calls: list[dict[str, Any]] = []  # a shared list: replicas append to it too

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(
            {
                "device": current_virtual_device(),
                "rows": x.shape[0],
                "x_ptr": x.data_ptr(),
                "weight_ptr": self.linear.weight.data_ptr(),
                "self": id(self),
                "thread": threading.current_thread().name,
                "weight_requires_grad": self.linear.weight.requires_grad,
            }
        )
        return self.linear(x)


def _by_device(calls: list[dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    return {c["device"]: c for c in calls}


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch's DataParallel on a machine without CUDA")
def test_cpu_data_parallel_tests_nothing() -> None:
    # docs/semantics.md section 1: without CUDA torch's DataParallel keeps device_ids=[] and
    # calls the module.
    module = Recorder()
    real = nn.DataParallel(module, device_ids=[0, 1])
    assert real.device_ids == []
    real(torch.randn(4, 3))
    assert [c["rows"] for c in module.calls] == [4]


def test_runs_torch_own_forward() -> None:
    assert VirtualDataParallel.forward is nn.DataParallel.forward
    assert isinstance(VirtualDataParallel(nn.Linear(2, 2), [0, 1]), nn.DataParallel)


@pytest.mark.parametrize(
    ("batch", "n_devices", "rows"),
    [(5, 4, [2, 2, 1]), (6, 4, [2, 2, 2]), (9, 4, [3, 3, 3]), (2, 4, [1, 1]), (8, 2, [4, 4])],
)
def test_fewer_replicas_than_devices(batch: int, n_devices: int, rows: list[int]) -> None:
    module = Recorder()
    ids = list(range(10, 10 + n_devices))
    out = VirtualDataParallel(module, ids)(torch.randn(batch, 3))
    calls = _by_device(module.calls)
    assert sorted(calls) == ids[: len(rows)]  # only the first len(chunks) devices run
    assert [calls[d]["rows"] for d in ids[: len(rows)]] == rows
    assert out.shape == (batch, 2)


def test_single_device_runs_module_itself() -> None:
    module = Recorder()
    VirtualDataParallel(module, [3])(torch.randn(4, 3))
    (call,) = module.calls
    assert call["self"] == id(module)
    assert call["device"] is None  # no replica, no parallel_apply


def test_replicas_run_in_their_own_threads() -> None:
    module = Recorder()
    VirtualDataParallel(module, [0, 1, 2])(torch.randn(6, 3))
    assert len({c["thread"] for c in module.calls}) == 3


def test_replica_zero_shares_storage_and_chunk_zero_is_a_view() -> None:
    module = Recorder()
    x = torch.randn(6, 3)
    VirtualDataParallel(module, [0, 1, 2])(x)
    calls = _by_device(module.calls)
    weight_ptr = module.linear.weight.data_ptr()
    assert calls[0]["weight_ptr"] == weight_ptr
    assert calls[1]["weight_ptr"] != weight_ptr
    assert calls[2]["weight_ptr"] != weight_ptr
    assert calls[0]["x_ptr"] == x.data_ptr()  # chunk 0 is a view of the batch
    assert calls[1]["x_ptr"] != x[2:].data_ptr()  # other chunks are copies


class Stateful(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.register_buffer("rows_seen", torch.zeros(()))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rows_seen.add_(x.shape[0])
        self.calls += 1
        return self.linear(x)


def test_inplace_buffer_updates_survive_from_replica_zero_only() -> None:
    module = Stateful()
    VirtualDataParallel(module, [0, 1, 2])(torch.randn(7, 3))  # chunks [3, 3, 1]
    assert float(module.rows_seen) == 3.0


def test_batchnorm_running_stats_come_from_replica_zero() -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 4) * 3 + 1
    bn = nn.BatchNorm1d(4)
    VirtualDataParallel(bn, [0, 1])(x)
    expected = nn.BatchNorm1d(4)
    expected(x[:4])
    torch.testing.assert_close(bn.running_mean, expected.running_mean)
    torch.testing.assert_close(bn.running_var, expected.running_var)
    assert int(bn.num_batches_tracked) == 1


def test_attributes_set_in_forward_are_lost_on_replicas() -> None:
    module = Stateful()
    VirtualDataParallel(module, [0, 1])(torch.randn(4, 3))
    assert module.calls == 0
    VirtualDataParallel(module, [0])(torch.randn(4, 3))  # single device: the module itself
    assert module.calls == 1


def test_replicas_are_detached_under_no_grad() -> None:
    module = Recorder()
    with torch.no_grad():
        out = VirtualDataParallel(module, [0, 1, 2])(torch.randn(6, 3))
    assert not out.requires_grad
    calls = _by_device(module.calls)
    assert not calls[1]["weight_requires_grad"]
    assert not calls[2]["weight_requires_grad"]


def test_grad_mode_and_autocast_reach_replicas() -> None:
    module = nn.Linear(3, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = VirtualDataParallel(module, [0, 1])(torch.randn(4, 3))
    assert out.dtype == torch.bfloat16
    assert out.requires_grad


class Structured(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.seen_tags: list[int] = []

    def forward(self, pair: Pair, extras: dict[str, torch.Tensor], tag: object, *, scale: torch.Tensor) -> dict[str, Any]:
        self.seen_tags.append(id(tag))
        left = self.linear(pair.left) * scale
        return {"sum": left + extras["bias"], "pair": Pair(left, pair.right * 2), "list": [left.sum(1, keepdim=True)]}


def test_recursive_scatter_and_gather_of_structures_and_kwargs() -> None:
    torch.manual_seed(0)
    module = Structured()
    x, y, b, s = torch.randn(5, 3), torch.randn(5, 2), torch.randn(5, 3), torch.rand(5, 1)
    tag = object()
    out = VirtualDataParallel(module, [0, 1, 2])(Pair(x, y), {"bias": b}, tag, scale=s)
    expected = module(Pair(x, y), {"bias": b}, tag, scale=s)
    assert isinstance(out, dict)
    assert isinstance(out["pair"], Pair)
    assert isinstance(out["list"], list)
    for got, want in [(out["sum"], expected["sum"]), (out["pair"].right, expected["pair"].right), (out["list"][0], expected["list"][0])]:
        torch.testing.assert_close(got, want)
    # a non-tensor argument reaches every replica by reference
    assert set(module.seen_tags) == {id(tag)}
    assert len(module.seen_tags) == 4  # 3 replicas + the direct call


def test_mismatched_batch_sizes_silently_drop_rows() -> None:
    # docs/semantics.md section 3 / pytorch issue 7358: 8 rows and 2 rows on 4 devices -> 2 replicas.
    class Two(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return x + y.sum()

    x, y = torch.arange(8.0).unsqueeze(1), torch.ones(2, 1)
    out = VirtualDataParallel(Two(), [0, 1, 2, 3])(x, y)
    assert out.shape == (4, 1)  # rows 4-7 of x never seen
    torch.testing.assert_close(out, x[:4] + 1)
    with pytest.warns(dpverify.DroppedRowsWarning, match=r"inputs\[0\] loses 4 rows"):
        plan = dpverify.plan_scatter((x, y), None, [0, 1, 2, 3])
    assert plan.n_replicas == 2
    assert plan.dropped == (("inputs[0]", 4),)


def test_scalar_outputs_gather_into_one_entry_per_replica_used() -> None:
    class MeanLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x).pow(2).mean()

    with pytest.warns(UserWarning, match="all input tensors were scalars; will instead unsqueeze"):
        out = VirtualDataParallel(MeanLoss(), [0, 1, 2, 3])(torch.randn(5, 3))
    assert out.shape == (3,)  # 3 replicas used, not 4 devices
    out.sum().backward()  # backward through the unsqueezed gather works


@pytest.mark.parametrize("output_device", [1, -1, torch.device("cuda", 2)])
def test_output_device(output_device: Any) -> None:
    torch.manual_seed(0)
    module = nn.Linear(3, 2)
    x = torch.randn(6, 3)
    dp = VirtualDataParallel(module, [0, 1, 2], output_device=output_device)
    assert dp.output_device == (-1 if output_device == -1 else (1 if output_device == 1 else 2))
    out = dp(x)
    torch.testing.assert_close(out, module(x))
    out.sum().backward()
    grad = module.weight.grad.clone()
    module.zero_grad()
    module(x).sum().backward()
    torch.testing.assert_close(grad, module.weight.grad)


def test_output_device_cpu_is_rejected_like_torch() -> None:
    # output_device is often said to accept 'cpu'; torch's DataParallel.__init__
    # rejects it (torch._utils._get_device_index(..., allow_cpu=False)); -1 means the host
    # (docs/semantics.md section 7).
    from torch._utils import _get_device_index

    with pytest.raises(ValueError, match="Expected a non cpu device"):
        _get_device_index("cpu", True)
    with pytest.raises(InvalidArgument, match=r"output_device='cpu'.*pass -1"):
        VirtualDataParallel(nn.Linear(2, 2), [0, 1], output_device="cpu")  # type: ignore[arg-type]


def test_scatter_and_gather_along_another_dim() -> None:
    class Seq(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[int] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.rows.append(x.shape[1])
            return x * 2

    module = Seq()
    x = torch.randn(2, 5, 3)
    out = VirtualDataParallel(module, [0, 1], dim=1)(x)
    assert sorted(module.rows) == [2, 3]
    torch.testing.assert_close(out, x * 2)


def test_gradients_are_summed_into_the_parameters() -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    x, y = torch.randn(7, 3), torch.randn(7, 1)
    F.mse_loss(VirtualDataParallel(module, [0, 1, 2])(x), y).backward()
    grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    F.mse_loss(module(x), y).backward()
    for got, want in zip(grads, [p.grad for p in module.parameters()], strict=True):
        torch.testing.assert_close(got, want)


def test_unused_parameter_gets_zero_gradient_not_none() -> None:
    # Broadcast's backward materialises zeros for replica parameters that got no gradient.
    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.unused = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    module = Unused()
    VirtualDataParallel(module, [0, 1])(torch.randn(4, 2)).sum().backward()
    assert module.unused.weight.grad is not None
    assert not module.unused.weight.grad.any()


def test_replica_exception_names_the_replica() -> None:
    class Fails(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if current_virtual_device() == 1:
                raise RuntimeError("boom")
            return x

    with pytest.raises(RuntimeError, match=r"(?s)in replica 1 on device 1.*boom"):
        VirtualDataParallel(Fails(), [0, 1])(torch.randn(4, 2))


def test_virtual_primitives_are_per_thread_and_leave_torch_as_it_was() -> None:
    from torch.autograd import Function

    from dpverify.core.patching import _primitives_active

    def torch_own() -> bool:
        return "apply" not in scatter_gather.Scatter.__dict__

    VirtualDataParallel(nn.Linear(2, 2), [0, 1])(torch.randn(4, 2))
    assert torch_own()  # nothing stays switched after a forward
    devices = torch.cuda.device_count()
    device_count_code = torch.cuda.device_count.__code__
    with dpverify.core.patching.virtual_primitives():
        assert not torch_own()
        assert _primitives_active()
        seen: list[bool] = []
        other = threading.Thread(target=lambda: seen.append(_primitives_active()))
        other.start()
        other.join()
        assert seen == [False]  # another thread keeps torch's own
        assert torch.cuda.device_count() == devices  # the devices are virtual_devices' business
        assert torch.cuda.device_count.__code__ is device_count_code  # not even switched
    assert torch_own()
    assert scatter_gather.Scatter.apply.__func__ is Function.apply.__func__  # type: ignore[attr-defined]


def test_complex_buffers_are_copied_to_replicas() -> None:
    # replicate() copies buffers with comm.broadcast_coalesced, which hands complex tensors
    # back as real views (torch's _handle_complex) for replicate to view as complex again.
    class Rotate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("phase", torch.randn(1, 3, dtype=torch.cfloat))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.phase

    module = Rotate()
    x = torch.randn(4, 3, dtype=torch.cfloat)
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            torch.testing.assert_close(VirtualDataParallel(module, [0, 1])(x), module(x))


@pytest.mark.parametrize(
    ("device_ids", "match"),
    [
        ([0, 0], r"device_ids=\[0, 0\] repeats device 0; DataParallel needs distinct devices"),
        ([0, -1], r"device_ids=\[0, -1\] contains -1"),
        ([], r"device_ids=\[\] is empty"),
        (3, r"device_ids=3: pass a list"),
        ([0, "x"], r"device_ids='x' is not a device"),
        ([True], r"is a bool"),
    ],
)
def test_bad_device_ids(device_ids: Any, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        VirtualDataParallel(nn.Linear(2, 2), device_ids)


def test_bad_output_device_and_dim() -> None:
    with pytest.raises(InvalidArgument, match="output_device=-2"):
        VirtualDataParallel(nn.Linear(2, 2), [0, 1], output_device=-2)
    with pytest.raises(InvalidArgument, match=r"dim=0\.5 must be an int"):
        VirtualDataParallel(nn.Linear(2, 2), [0, 1], dim=0.5)  # type: ignore[arg-type]


def test_module_not_on_host_is_rejected() -> None:
    module = nn.Linear(2, 2, device="meta")
    with pytest.raises(InvalidArgument, match=r"module has 'weight' on meta.*module.cpu\(\)"):
        VirtualDataParallel(module, [0, 1])


def test_data_parallel_falls_back_to_virtual_without_cuda() -> None:
    dp = dpverify.data_parallel(nn.Linear(2, 2), [0, 1], output_device=1)
    if torch.cuda.device_count() < 2:
        assert isinstance(dp, VirtualDataParallel)
        assert dp.device_ids == [0, 1]
        assert dp.output_device == 1


def test_no_warnings_on_plain_use() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        VirtualDataParallel(nn.Linear(3, 3), [0, 1])(torch.randn(4, 3)).sum().backward()


def test_replicas_draw_their_own_random_numbers_deterministically() -> None:
    class Noise(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.rand_like(x)

    x = torch.zeros(4, 3)
    torch.manual_seed(0)
    first = VirtualDataParallel(Noise(), [0, 1])(x)
    torch.manual_seed(0)
    second = VirtualDataParallel(Noise(), [0, 1])(x)
    torch.manual_seed(0)
    single = Noise()(x)
    torch.testing.assert_close(first, second)  # deterministic
    torch.testing.assert_close(first[:2], single[:2])  # device_ids[0] continues the caller's stream
    assert not torch.allclose(first[2:], single[2:])  # device 1 has its own generator


def test_current_virtual_device_is_none_after_a_one_replica_forward() -> None:
    VirtualDataParallel(Recorder(), [0, 1])(torch.randn(1, 3))  # one chunk: one replica, this thread
    assert current_virtual_device() is None


# --- torch's parallel_apply semantics (kwargs None, error text, autocast, threads, RNG) ---


def test_parallel_apply_accepts_none_kwargs_like_torch() -> None:
    # torch.nn.parallel.parallel_apply turns kwargs_tup=None into one empty dict per module.
    torch.manual_seed(0)
    first, second = nn.Linear(3, 2), nn.Linear(3, 2)
    x0, x1 = torch.randn(2, 3), torch.randn(2, 3)
    dp = VirtualDataParallel(first, [0, 1])
    outputs = dp.parallel_apply([first, second], [(x0,), x1], None)
    torch.testing.assert_close(outputs[0], first(x0))
    torch.testing.assert_close(outputs[1], second(x1))


def test_replica_exception_text_is_torch_own() -> None:
    # torch: ExceptionWrapper(where=f"in replica {i} on device {device}"), device an int index.
    class Fails(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if current_virtual_device() == 3:
                raise KeyError("wonderful")
            return x

    with pytest.raises(KeyError, match=r"Caught KeyError in replica 1 on device 3\.\nOriginal Traceback") as caught:
        VirtualDataParallel(Fails(), [2, 3])(torch.randn(4, 2))
    assert "virtual device" not in str(caught.value)


@pytest.mark.parametrize(
    "device_ids", [[torch.device("cuda:0"), torch.device("cuda:1")], ["cuda:0", "cuda:1"], [0, 1]]
)
def test_scatter_accepts_device_objects_and_strings(device_ids: list[Any]) -> None:
    x = torch.arange(8.0).reshape(4, 2)
    dp = VirtualDataParallel(nn.Linear(2, 2), [0, 1])
    inputs, kwargs = dp.scatter((x,), {"y": x * 2}, device_ids)
    assert len(inputs) == 2
    torch.testing.assert_close(inputs[0][0], x[:2])
    torch.testing.assert_close(inputs[1][0], x[2:])
    torch.testing.assert_close(kwargs[1]["y"], x[2:] * 2)


@pytest.mark.parametrize("output_device", [torch.device("cuda:1"), "cuda:1", 1, -1, "cpu"])
def test_gather_accepts_device_objects_and_strings(output_device: Any) -> None:
    parts = [torch.randn(2, 3, requires_grad=True), torch.randn(1, 3, requires_grad=True)]
    dp = VirtualDataParallel(nn.Linear(3, 3), [0, 1])
    out = dp.gather(parts, output_device)
    torch.testing.assert_close(out, torch.cat(parts))
    out.backward(torch.arange(9.0).reshape(3, 3))
    torch.testing.assert_close(parts[1].grad, torch.arange(6.0, 9.0).reshape(1, 3))


def test_gather_rejects_a_cpu_device_object_like_torch() -> None:
    # torch's Gather special-cases the string "cpu" only; torch.device("cpu") goes through
    # _get_device_index(..., allow_cpu=False) and raises a ValueError.
    dp = VirtualDataParallel(nn.Linear(3, 3), [0, 1])
    with pytest.raises(ValueError, match="cpu"):
        dp.gather([torch.randn(1, 3), torch.randn(1, 3)], torch.device("cpu"))


class Noise(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.rand_like(x)


def test_replica_generators_advance_across_forwards() -> None:
    # On GPUs every device's generator moves on with each draw: replica 1 gets a new
    # dropout mask at every step, never the one of the step before.
    x = torch.zeros(4, 3)
    dp = VirtualDataParallel(Noise(), [0, 1])
    torch.manual_seed(0)
    first, second = dp(x), dp(x)
    assert not torch.allclose(first[2:], second[2:])
    assert not torch.allclose(first[:2], second[:2])


def test_replica_generators_are_deterministic_given_the_seed() -> None:
    x = torch.zeros(6, 3)
    dp = VirtualDataParallel(Noise(), [0, 1, 2])
    runs = []
    for reseed in (torch.manual_seed, torch.default_generator.manual_seed, torch.manual_seed):
        reseed(0)
        runs.append(torch.cat([dp(x), dp(x), dp(x)]))
    torch.testing.assert_close(runs[0], runs[1])  # same seed, same draws, whatever came before
    torch.testing.assert_close(runs[0], runs[2])
    steps = runs[0].view(3, 3, 2, 3)  # forward, replica, row, column
    for forward in range(3):
        for replica in range(3):
            for other in range(replica + 1, 3):
                assert not torch.allclose(steps[forward, replica], steps[forward, other])


def test_replica_zero_continues_the_callers_generator_and_others_leave_it_alone() -> None:
    x = torch.zeros(4, 3)
    torch.manual_seed(1)
    VirtualDataParallel(Noise(), [0, 1])(x)
    after_dp = torch.rand(5)
    torch.manual_seed(1)
    Noise()(x[:2])  # only replica 0's draws come from the caller's generator
    torch.testing.assert_close(after_dp, torch.rand(5))


class DtypeProbe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.seen: list[tuple[bool, torch.dtype, torch.dtype]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        self.seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), out.dtype))
        return out


def test_autocast_replicas_run_in_the_default_dtype_like_torch() -> None:
    # torch's parallel_apply re-enters torch.autocast(device_type, enabled=...) in each worker
    # thread without the dtype; the dtype is thread-local, so replicas run in the device
    # type's default autocast dtype (float16 on CUDA, bfloat16 on CPU), not the caller's.
    default: list[torch.dtype] = []
    fresh = threading.Thread(target=lambda: default.append(torch.get_autocast_dtype("cpu")))
    fresh.start()
    fresh.join()
    assert default == [torch.bfloat16]
    module = DtypeProbe()
    with torch.autocast("cpu", dtype=torch.float16):
        out = VirtualDataParallel(module, [0, 1])(torch.randn(4, 3))
    assert module.seen == [(True, torch.bfloat16, torch.bfloat16)] * 2
    assert out.dtype == torch.bfloat16


def test_autocast_dtype_kept_when_the_only_replica_runs_in_the_caller_thread() -> None:
    # One chunk: torch runs its single worker in the calling thread, where the dtype holds.
    module = DtypeProbe()
    with torch.autocast("cpu", dtype=torch.float16):
        out = VirtualDataParallel(module, [0, 1])(torch.randn(1, 3))
    assert module.seen == [(True, torch.float16, torch.float16)]
    assert out.dtype == torch.float16


def _in_new_thread(fn: Any) -> Any:
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join()
    return result[0]


class ThreadsProbe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(torch.get_num_threads())
        return x


def test_replicas_compute_with_the_callers_intra_op_thread_count() -> None:
    # torch.set_num_threads sets the calling thread's OpenMP count and the count that threads
    # started later begin with; the caller's own count can differ from the latter once another
    # thread has set one, and then fresh replica threads would compute with a different count.
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        module = ThreadsProbe()
        VirtualDataParallel(module, [0, 1])(torch.zeros(4, 1))
        assert module.seen == [1, 1]
        _in_new_thread(lambda: torch.set_num_threads(2))
        assert torch.get_num_threads() == 1
        assert _in_new_thread(torch.get_num_threads) == 2
        module = ThreadsProbe()
        VirtualDataParallel(module, [0, 1, 2])(torch.zeros(6, 1))
        assert module.seen == [1, 1, 1]
        assert torch.get_num_threads() == 1
        assert _in_new_thread(torch.get_num_threads) == 2  # the process default is left as found
    finally:
        torch.set_num_threads(saved)


def test_gather_copies_into_the_first_outputs_dtype_outside_autocast() -> None:
    # comm.gather copies every output into a tensor of the first one's dtype: no promotion,
    # and no autocast (torch.cat under a float16 autocast region rejects bfloat16 inputs).
    dp = VirtualDataParallel(nn.Linear(3, 3), [0, 1])
    mixed = dp.gather([torch.ones(1, 2), torch.ones(1, 2, dtype=torch.float64) / 3], 0)
    assert mixed.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.float16):
        low = dp.gather([torch.ones(1, 2, dtype=torch.bfloat16), torch.ones(1, 2, dtype=torch.bfloat16)], 1)
    assert low.dtype == torch.bfloat16


class SeedProbe(nn.Module):
    """Records, per replica, the seed of the generator its draws would come from."""

    def __init__(self, on_forward: Any = None) -> None:
        super().__init__()
        self.seen: list[tuple[int | None, int]] = []
        self.on_forward = on_forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((current_virtual_device(), torch.initial_seed()))
        if self.on_forward is not None:
            self.on_forward(current_virtual_device())
        return x


def test_concurrent_forwards_do_not_draw_from_each_others_generators() -> None:
    # Replica 1 swaps the host generator for device 1's; a forward in another thread must
    # not start its replicas meanwhile, or its replica 0 would draw from device 1's stream.
    first_in_replica_1, second_ran_replica_0 = threading.Event(), threading.Event()

    def first_hook(device: int | None) -> None:
        if device == 1:
            first_in_replica_1.set()
            second_ran_replica_0.wait(timeout=1.0)  # times out when the forwards are serialised

    def second_hook(device: int | None) -> None:
        if device == 0:
            second_ran_replica_0.set()

    torch.manual_seed(123)
    first, second = SeedProbe(first_hook), SeedProbe(second_hook)
    x = torch.zeros(4, 1)
    a = threading.Thread(target=lambda: VirtualDataParallel(first, [0, 1])(x), daemon=True)
    b = threading.Thread(target=lambda: VirtualDataParallel(second, [0, 1])(x), daemon=True)
    a.start()
    assert first_in_replica_1.wait(timeout=30)
    b.start()
    a.join(timeout=30)
    b.join(timeout=30)
    assert not a.is_alive()
    assert not b.is_alive()
    assert dict(first.seen)[0] == 123
    assert dict(first.seen)[1] != 123  # device 1 has a generator of its own
    assert dict(second.seen)[0] == 123  # the caller's generator, not device 1's
    assert torch.initial_seed() == 123


def test_a_replica_can_run_its_own_data_parallel() -> None:
    # The inner forward runs within the outer one's turn (no deadlock on the shared lock).
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = SeedProbe()
            self.devices: list[tuple[int | None, int | None]] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            outer = current_virtual_device()
            out = VirtualDataParallel(self.inner, [2, 3])(x)
            self.devices.append((outer, current_virtual_device()))
            return out

    module = Outer()
    runner = threading.Thread(
        target=lambda: VirtualDataParallel(module, [0, 1])(torch.zeros(8, 1)), daemon=True
    )
    runner.start()
    runner.join(timeout=60)
    assert not runner.is_alive()
    assert sorted(module.devices) == [(0, 0), (1, 1)]
    assert sorted(d for d, _ in module.inner.seen) == [2, 2, 3, 3]
