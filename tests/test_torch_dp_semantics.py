"""The behaviours PyTorch's own DataParallel tests assert, checked on virtual devices.

PyTorch checks ``torch.nn.DataParallel`` and the functional ``torch.nn.parallel`` API in
``test/distributed/test_data_parallel.py``, on real GPUs only. Each test here asserts one
of those behaviours for ``VirtualDataParallel``, or for torch's functional API running
under ``virtual_primitives`` (with ``virtual_parallel_apply`` standing in for ``parallel_apply``).
Behaviours that only mean something on CUDA (streams, memory, NCCL, which GPU a tensor
lives on) are left out; "on device k" becomes "aliases the source" for device_ids[0] and
"is a copy" for the others, as on GPUs.
"""

from __future__ import annotations

import copy
import gc
import io
import re
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import gradcheck, gradgradcheck
from torch.nn import parallel as torch_parallel

from dpverify import VirtualDataParallel, current_virtual_device
from dpverify.core.patching import virtual_primitives
from dpverify.core.primitives import virtual_parallel_apply


def _scatter(x: torch.Tensor, devices: Sequence[int] = (0, 1)) -> tuple[torch.Tensor, ...]:
    with virtual_primitives():
        return tuple(torch_parallel.scatter(x, list(devices)))


def _gather(parts: Sequence[Any], target: Any, devices: Sequence[int] = (0, 1)) -> Any:
    with virtual_primitives(devices[: len(parts)]):
        return torch_parallel.gather(parts, target)


def _replicate(module: nn.Module, devices: Sequence[int], detach: bool = False) -> list[nn.Module]:
    with virtual_primitives():
        return torch_parallel.replicate(module, devices, detach=detach)


# --- parallel_apply ------------------------------------------------------------------


@pytest.mark.parametrize("as_tuples", [True, False])
def test_parallel_apply_takes_argument_tuples_or_single_arguments(as_tuples: bool) -> None:
    torch.manual_seed(0)
    first, second = nn.Linear(10, 5), nn.Linear(10, 5)
    x0, x1 = torch.randn(2, 10), torch.randn(2, 10)
    inputs: list[Any] = [(x0,), (x1,)] if as_tuples else [x0, x1]
    outputs = virtual_parallel_apply((first, second), inputs, None)
    torch.testing.assert_close(outputs[0], first(x0), rtol=0, atol=0)
    torch.testing.assert_close(outputs[1], second(x1), rtol=0, atol=0)


def test_parallel_apply_under_autocast_matches_autocast_in_the_caller() -> None:
    # With the default autocast dtype, replicas compute exactly what the caller would.
    torch.manual_seed(0)
    first, second = nn.Linear(10, 5), nn.Linear(10, 5)
    x0, x1 = torch.randn(2, 10), torch.randn(2, 10)
    with torch.autocast("cpu"):
        expected = [first(x0), second(x1)]
        outputs = virtual_parallel_apply((first, second), [x0, x1], None, [0, 1])
    for got, want in zip(outputs, expected, strict=True):
        assert got.dtype == want.dtype == torch.get_autocast_dtype("cpu")
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_parallel_apply_reraises_a_replica_error_with_its_type_and_place() -> None:
    class Lookup(nn.Module):
        def forward(self, *args: Any) -> Any:
            return {}["wonderful"]

    module = Lookup()
    with pytest.raises(KeyError, match=r"Caught KeyError in replica \d on device 0\.\nOriginal Traceback[\s\S]+wonderful"):
        virtual_parallel_apply((module, module), (None, None), devices=[0, 0])


def test_parallel_apply_checks_lengths_like_torch() -> None:
    module = nn.Identity()
    with pytest.raises(AssertionError, match="The number of modules 2 is not equal to the number of inputs 1"):
        virtual_parallel_apply((module, module), (torch.ones(1),), None, [0, 1])
    with pytest.raises(AssertionError, match="the number of kwargs_tup 1"):
        virtual_parallel_apply((module, module), (torch.ones(1), torch.ones(1)), ({},), [0, 1])
    with pytest.raises(AssertionError, match="the number of devices 3"):
        virtual_parallel_apply((module, module), (torch.ones(1), torch.ones(1)), None, [0, 1, 2])


def test_parallel_apply_accepts_device_objects() -> None:
    seen: list[int | None] = []

    class Where(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(current_virtual_device())
            return x

    module = Where()
    virtual_parallel_apply((module, module), (torch.ones(1), torch.ones(1)), None, [torch.device("cuda:3"), "cuda:5"])
    assert seen == [3, 5]


# --- forward through VirtualDataParallel -----------------------------------------------


def test_buffers_that_require_grad_are_differentiated_through() -> None:
    # replicate broadcasts buffers that require grad with autograd, so they get gradients.
    class Scaled(nn.Module):
        def __init__(self, t: torch.Tensor) -> None:
            super().__init__()
            self.register_buffer("t_rg", t)
            self.register_buffer("t_not_rg", t.detach().clone())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.t_rg + self.t_not_rg

    torch.manual_seed(0)
    module = Scaled(torch.randn(6, dtype=torch.float64, requires_grad=True))
    dp = VirtualDataParallel(module, [0, 1])
    x = torch.randn(2, 6, dtype=torch.float64)
    assert gradcheck(lambda t: dp(x), (module.t_rg,))
    dp(x).sum().backward()
    torch.testing.assert_close(module.t_rg.grad, x.sum(0))


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(6, 8, 1, batch_first=True, bidirectional=True)

    def forward(self, x: torch.Tensor) -> Any:
        self.rnn.flatten_parameters()
        return self.rnn(x)


def test_recurrent_model_under_no_grad_then_a_training_step_matches() -> None:
    torch.manual_seed(0)
    single = _Recurrent()
    parallel = VirtualDataParallel(copy.deepcopy(single), [0, 1])
    with torch.no_grad():
        parallel(torch.rand(2, 4, 6))  # must not fail without grad (pytorch issue 21108)

    def step(model: nn.Module) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=10)
        output = model(torch.ones(4, 4, 6))
        F.mse_loss(output[0], torch.zeros_like(output[0])).backward()
        opt.step()

    step(single)
    step(parallel)
    for p_single, p_parallel in zip(single.parameters(), parallel.parameters(), strict=True):
        torch.testing.assert_close(p_single, p_parallel)


def test_lazy_module_with_uninitialized_parameters_is_refused() -> None:
    with pytest.raises(ValueError, match="uninitialized parameter"):
        VirtualDataParallel(nn.LazyLinear(10), [0, 1])(torch.rand(10, 10))


class _Product(nn.Module):
    def forward(self, var1: torch.Tensor, var2: torch.Tensor, float1: float, var3: torch.Tensor | None = None) -> torch.Tensor:
        if var3 is None:
            return float1 * (var1 * var2)
        return float1 * (var1 * var2 + var3)


@pytest.mark.parametrize("device_ids", [[0, 1], [1, 0], [0]])
@pytest.mark.parametrize("with_kwarg", [False, True])
def test_several_inputs_a_python_scalar_and_a_keyword(device_ids: list[int], with_kwarg: bool) -> None:
    torch.manual_seed(0)
    var1 = torch.randn(5, 5, requires_grad=True)
    var2 = torch.randn(5, 5, requires_grad=True)
    var3 = torch.randn(5, 5)
    float1 = torch.randn(1).item()
    kwargs = {"var3": var3} if with_kwarg else {}
    expected = _Product()(var1, var2, float1, **kwargs)
    expected.sum().backward()
    grads = (var1.grad.clone(), var2.grad.clone())
    var1.grad, var2.grad = None, None
    out = VirtualDataParallel(_Product(), device_ids)(var1, var2, float1, **kwargs)
    out.sum().backward()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(var1.grad, grads[0])
    torch.testing.assert_close(var2.grad, grads[1])


def test_small_linear_output_matches() -> None:
    torch.manual_seed(0)
    module = nn.Linear(10, 5)
    x = torch.randn(20, 10)
    torch.testing.assert_close(VirtualDataParallel(module, [0, 1])(x), module(x))


def test_forward_checks_the_module_is_still_on_the_source_device() -> None:
    # torch's forward re-checks parameters and buffers on every call, against
    # src_device_obj (the host stands for device_ids[0]).
    dp = VirtualDataParallel(nn.Linear(2, 2), [0, 1])
    dp.module.to("meta")
    with pytest.raises(
        RuntimeError,
        match=r"module must have its parameters and buffers on device cpu \(device_ids\[0\]\) "
        r"but found one of them on device: meta",
    ):
        dp(torch.randn(2, 2))


@pytest.mark.parametrize("rows", [1, 4])
def test_forward_and_backward_leave_no_reference_cycles(rows: int) -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(1, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x)

    model = VirtualDataParallel(Model(), [0, 1])
    gc.collect()
    model(torch.randn(rows, 1)).sum().backward()
    assert gc.collect() == 0


def test_replicas_see_the_callers_grad_mode() -> None:
    class Layer(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            assert not torch.is_grad_enabled()
            return x

    dp = VirtualDataParallel(Layer(), [0, 1])
    x = torch.randn(20, 10)
    with torch.no_grad():
        dp(x)
    with pytest.raises(AssertionError, match="in replica 0 on device 0"):
        dp(x)


@pytest.mark.parametrize("device_ids", [[0, 1], [1, 0]])
def test_output_and_gradients_match_for_either_device_order(device_ids: list[int]) -> None:
    torch.manual_seed(0)
    module = nn.Linear(10, 5)
    x = torch.randn(20, 10)
    expected = module(x)
    expected.sum().backward()
    grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    dp = VirtualDataParallel(module, device_ids)
    assert dp.output_device == device_ids[0]
    out = dp(x)
    out.sum().backward()
    torch.testing.assert_close(out, expected)
    for p, grad in zip(module.parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad, grad)


@pytest.mark.parametrize("device_ids", [[0, 1], [1, 0]])
def test_sparse_embedding_gradients_are_summed(device_ids: list[int]) -> None:
    torch.manual_seed(0)
    module = nn.Embedding(10, 5, sparse=True)
    idx = torch.randint(10, (20, 5))
    expected = module(idx)
    expected.sum().backward()
    grad = module.weight.grad.clone()
    module.zero_grad()
    out = VirtualDataParallel(module, device_ids)(idx)
    out.sum().backward()
    torch.testing.assert_close(out, expected)
    assert module.weight.grad.is_sparse
    torch.testing.assert_close(module.weight.grad.coalesce(), grad.coalesce())


def test_nested_outputs_keep_their_types() -> None:
    def structure(x: torch.Tensor) -> list[Any]:
        return [x, (x.sin(), x.cos(), [x.add(1)]), x, OrderedDict(a=x, b=[x.sin()])]

    class Net(nn.Module):
        def forward(self, x: torch.Tensor) -> list[Any]:
            return structure(x)

    x = torch.randn(4, 2)
    out = VirtualDataParallel(Net(), [0, 1, 2])(x)
    expected = structure(x)
    assert isinstance(out, list)
    assert isinstance(out[1], tuple)
    assert isinstance(out[1][2], list)
    assert isinstance(out[3], OrderedDict)
    assert list(out[3]) == ["a", "b"]
    assert isinstance(out[3]["b"], list)
    torch.testing.assert_close(out, expected)


def test_nested_inputs_are_scattered() -> None:
    class Net(nn.Module):
        def forward(self, *inputs: Any) -> torch.Tensor:
            return inputs[1][0]

    x = torch.randn(20, 3)
    inputs = (x.cos(), (x.sin(), x), x.sin())
    torch.testing.assert_close(VirtualDataParallel(Net(), [0, 1, 2])(*inputs), x.sin())


@pytest.mark.parametrize(("device_ids", "expected_devices"), [([0], [None]), ([0, 1], [0]), ([1, 0], [1])])
def test_forward_without_inputs_runs_once_on_the_first_device(
    device_ids: list[int], expected_devices: list[int | None]
) -> None:
    seen: list[int | None] = []

    class NoInputs(nn.Module):
        def forward(self) -> torch.Tensor:
            seen.append(current_virtual_device())
            t = torch.eye(2, 3)
            return t + (1 - t)

    out = VirtualDataParallel(NoInputs(), device_ids)()
    torch.testing.assert_close(out, torch.ones(2, 3))
    assert seen == expected_devices


def test_device_objects_for_device_ids_and_output_device() -> None:
    torch.manual_seed(0)
    cuda0, cuda1 = torch.device("cuda:0"), torch.device("cuda:1")
    module = nn.Linear(10, 5)
    x = torch.randn(20, 10, requires_grad=True)
    for device_ids in ([0, 1], [cuda0, cuda1]):
        dp = VirtualDataParallel(module, device_ids, output_device=cuda0)
        assert dp.device_ids == [0, 1]
        assert dp.output_device == 0
        torch.testing.assert_close(dp(x), module(x))


def test_double_backward_through_replicas() -> None:
    # A gradient penalty: autograd.grad with create_graph, then backward through it
    # (pytorch issue 16532); needs Scatter/Gather/Broadcast to be twice differentiable.
    net = nn.Linear(4, 1)
    dp = VirtualDataParallel(net, [0, 1])
    x = torch.ones(2, 4, requires_grad=True)
    output = dp(x)
    (penalty,) = torch.autograd.grad(output, x, grad_outputs=torch.ones_like(output), create_graph=True)
    penalty.mean().backward()
    torch.testing.assert_close(net.weight.grad, torch.full((1, 4), 0.25))
    torch.testing.assert_close(net.bias.grad, torch.zeros(1))


def test_complex_parameters_and_inputs() -> None:
    class Shift(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shift = nn.Parameter(torch.randn(1, 10, dtype=torch.cfloat))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.shift

    torch.manual_seed(0)
    module = Shift()
    x = torch.rand(4, 10, dtype=torch.cfloat)
    expected = module(x)
    (expected * expected.conj()).real.sum().backward()
    grad = module.shift.grad.clone()
    module.zero_grad()
    out = VirtualDataParallel(module, [0, 1])(x)
    assert out.dtype == torch.cfloat
    torch.testing.assert_close(out, expected)
    (out * out.conj()).real.sum().backward()
    torch.testing.assert_close(module.shift.grad, grad)


def test_replica_calling_zero_grad_is_warned_about() -> None:
    calls: list[str] = []

    class ZeroesGrads(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append("forward")
            self.zero_grad()
            return x

    module = ZeroesGrads()
    message = r"Calling \.zero_grad\(\) from a module created with nn\.DataParallel\(\) has no effect"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        VirtualDataParallel(module, [0, 1])(torch.rand(4, 3))
    assert calls == ["forward", "forward"]
    assert len([w for w in caught if w.category is UserWarning and re.search(message, str(w.message))]) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module(torch.rand(4, 3))  # the module itself is no replica


def test_forward_decorated_with_autocast_returns_the_low_precision_dtype() -> None:
    class Model(nn.Linear):
        def __init__(self) -> None:
            super().__init__(8, 8)

        @torch.autocast("cpu")
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x)

    out = VirtualDataParallel(Model(), [0, 1])(torch.randn(8, 8))
    assert out.dtype is torch.bfloat16


@pytest.mark.parametrize("detach", [False, True])
def test_replicas_can_be_saved_and_loaded(detach: bool) -> None:
    # pytorch issue 37182
    torch.manual_seed(0)
    module = nn.Linear(8, 8)
    replicas = _replicate(module, [0, 1], detach=detach)
    data = io.BytesIO()
    torch.save(replicas, data)
    data.seek(0)
    loaded = torch.load(data, weights_only=False)
    x = torch.randn(2, 8)
    for replica in loaded:
        torch.testing.assert_close(replica(x), module(x))


class _ConvNet(nn.Module):
    def __init__(self, layouts: Sequence[torch.memory_format]) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(8, 16, (2, 2)).to(memory_format=layouts[0])
        self.conv1 = nn.Conv2d(16, 32, (2, 2)).to(memory_format=layouts[1])
        self.conv2 = nn.Conv2d(32, 16, (2, 2)).to(memory_format=layouts[2])
        self.conv3 = nn.Conv2d(16, 8, (2, 2)).to(memory_format=layouts[3])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv3(self.conv2(self.conv1(self.conv0(x))))


@pytest.mark.parametrize(
    "layouts",
    [
        [torch.contiguous_format] * 4,
        [torch.channels_last] * 2 + [torch.contiguous_format] * 2,
        [torch.channels_last] * 4,
    ],
)
def test_gradient_layout_follows_the_parameters(layouts: list[torch.memory_format]) -> None:
    torch.manual_seed(0)
    single = _ConvNet(layouts)
    parallel = VirtualDataParallel(copy.deepcopy(single), [0, 1])
    opt_single = torch.optim.SGD(single.parameters(), lr=0.1)
    opt_parallel = torch.optim.SGD(parallel.parameters(), lr=0.1)
    x, target = torch.randn(16, 8, 8, 8), torch.randn(16, 8, 4, 4)
    for _ in range(2):  # the first step creates the gradients, the second reuses them
        F.mse_loss(single(x), target).backward()
        F.mse_loss(parallel(x), target).backward()
        for layout, layer, dp_layer in zip(layouts, single.children(), parallel.module.children(), strict=True):
            assert isinstance(layer, nn.Conv2d)
            assert isinstance(dp_layer, nn.Conv2d)
            assert dp_layer.weight.grad is not None
            assert dp_layer.weight.grad.is_contiguous(memory_format=layout)
            for p, p_dp in zip(layer.parameters(), dp_layer.parameters(), strict=True):
                torch.testing.assert_close(p_dp.grad, p.grad, rtol=1e-5, atol=1e-5)
        opt_single.step()
        opt_parallel.step()
        opt_single.zero_grad()
        opt_parallel.zero_grad()


@pytest.mark.parametrize("container", ["list", "dict"])
def test_parameter_list_and_dict_reach_replicas_as_broadcast_tensors(container: str) -> None:
    p1, p2 = nn.Parameter(torch.rand(10)), nn.Parameter(torch.rand(10))
    keys: tuple[Any, Any] = (0, 1) if container == "list" else ("0", "1")
    data: nn.Module = nn.ParameterList([p1, p2]) if container == "list" else nn.ParameterDict({"0": p1, "1": p2})
    checked: list[int | None] = []

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.data = data

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for key, original in zip(keys, (p1, p2), strict=True):
                held = self.data[key]
                torch.testing.assert_close(held, original)
                assert held.requires_grad
                assert held.grad_fn is not None  # a broadcast output, not the leaf itself
            checked.append(current_virtual_device())
            return x

    VirtualDataParallel(Holder(), [0, 1])(torch.randn(8, 8))
    assert sorted(checked) == [0, 1]  # type: ignore[type-var]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_module_output_matches_in_each_dtype(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    module = nn.Linear(10, 5).to(dtype)
    x = torch.randn(20, 10, dtype=dtype)
    out = VirtualDataParallel(module, [0, 1])(x)
    assert out.dtype == dtype
    # each replica computes the module on its chunk, bit for bit; the whole batch in one
    # matmul may round differently (torch's numerical accuracy notes: batched and sliced
    # computations need not be bitwise identical), so it agrees only up to rounding
    torch.testing.assert_close(out, torch.cat([module(chunk) for chunk in x.chunk(2)]), rtol=0, atol=0)
    torch.testing.assert_close(out, module(x))


@pytest.mark.parametrize("unused", [None, [], {}, ()])
def test_keyword_only_inputs_including_empty_containers(unused: Any) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(10, 5)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = linear

        def forward(self, input: Any) -> torch.Tensor:
            return self.linear(input if isinstance(input, torch.Tensor) else input["data"])

    x = torch.randn(20, 10)
    argument: Any = x if unused is None else {"data": x, "unused": unused}
    out = VirtualDataParallel(Net(), [0, 1])(input=argument)
    torch.testing.assert_close(out, torch.cat([linear(chunk) for chunk in x.chunk(2)]), rtol=0, atol=0)
    torch.testing.assert_close(out, linear(x))  # the whole batch: up to rounding


# --- the functional API: scatter, gather, replicate -------------------------------------


def test_scatter_splits_and_backward_fills_only_the_used_chunk() -> None:
    x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    first, second = _scatter(x)
    torch.testing.assert_close(first, x[:2])
    torch.testing.assert_close(second, x[2:])
    assert first.data_ptr() == x.data_ptr()  # the source device's chunk is a view
    assert second.data_ptr() != x[2:].data_ptr()  # the other device gets a copy
    grad = torch.full_like(first, 2.0)
    first.backward(grad)
    assert x.grad is not None
    torch.testing.assert_close(x.grad[:2], grad)
    torch.testing.assert_close(x.grad[2:], torch.zeros_like(grad))


def test_scatter_is_twice_differentiable() -> None:
    x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    assert gradcheck(_scatter, (x,))
    assert gradgradcheck(_scatter, (x,))


@pytest.mark.parametrize("target", [0, 1, -1, "cpu", torch.device("cuda:1")])
def test_gather_concatenates_and_splits_the_gradient(target: Any) -> None:
    torch.manual_seed(0)
    parts = (torch.randn(2, 4, dtype=torch.float64, requires_grad=True), torch.randn(2, 4, dtype=torch.float64, requires_grad=True))
    result = _gather(parts, target)
    assert result.shape == (4, 4)
    torch.testing.assert_close(result[:2], parts[0])
    torch.testing.assert_close(result[2:], parts[1])
    grad = torch.randn(4, 4, dtype=torch.float64)
    result.backward(grad)
    torch.testing.assert_close(parts[0].grad, grad[:2])
    torch.testing.assert_close(parts[1].grad, grad[2:])

    def gather_two(a: torch.Tensor, b: torch.Tensor) -> Any:
        return _gather((a, b), target)

    assert gradcheck(gather_two, parts)
    assert gradgradcheck(gather_two, parts)


@pytest.mark.parametrize("target", [0, -1])
def test_gather_of_scalars_stacks_them_into_a_vector(target: int) -> None:
    torch.manual_seed(0)
    parts = (torch.randn((), dtype=torch.float64, requires_grad=True), torch.randn((), dtype=torch.float64, requires_grad=True))
    with pytest.warns(UserWarning, match="all input tensors were scalars; will instead unsqueeze and return a vector"):
        result = _gather(parts, target)
    assert result.shape == (2,)
    torch.testing.assert_close(result[0], parts[0])
    torch.testing.assert_close(result[1], parts[1])
    grad = torch.randn(2, dtype=torch.float64)
    result.backward(grad)
    torch.testing.assert_close(parts[0].grad, grad[0])
    torch.testing.assert_close(parts[1].grad, grad[1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        assert gradcheck(lambda a, b: _gather((a, b), target), parts)
        assert gradgradcheck(lambda a, b: _gather((a, b), target), parts)


def test_gather_refuses_dicts_with_different_keys() -> None:
    parts = ({"a": torch.randn(1, 2)}, {"b": torch.randn(1, 2), "a": torch.randn(1, 2)})
    with pytest.raises(ValueError, match="All dicts must have the same number of keys"):
        _gather(parts, 0)


@pytest.mark.parametrize("devices", [(0, 1), [0, 1]])
def test_replicate_gives_equivalent_modules(devices: Sequence[int]) -> None:
    torch.manual_seed(0)
    module = nn.Linear(10, 5)
    x = torch.randn(2, 10)
    replicas = _replicate(module, devices)
    assert len(replicas) == 2
    for replica in replicas:
        torch.testing.assert_close(replica(x), module(x), rtol=0, atol=0)
    assert replicas[0].weight.data_ptr() == module.weight.data_ptr()  # replica 0 is on the source
    assert replicas[1].weight.data_ptr() != module.weight.data_ptr()


@pytest.mark.parametrize("devices", [(0, 1), [0, 1]])
def test_replicate_copies_buffers_to_every_replica(devices: Sequence[int]) -> None:
    net = nn.Module()
    net.bn = nn.BatchNorm2d(10)
    with torch.no_grad():
        net.bn.running_mean.uniform_()
    net.bn.num_batches_tracked.fill_(3)
    replicas = _replicate(net, devices)
    for index, replica in enumerate(replicas):
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            original, held = getattr(net.bn, name), getattr(replica.bn, name)
            torch.testing.assert_close(held, original, rtol=0, atol=0)
            assert (held.data_ptr() == original.data_ptr()) == (index == 0), name
