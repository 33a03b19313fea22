"""Real ``torch.nn.DataParallel`` on CUDA devices (``pytest -m multigpu``; skipped elsewhere).

The same properties as the CPU suite, on real devices, and the conformance check that keeps
VirtualDataParallel honest: the real and the virtual DataParallel give the same chunk sizes,
outputs, gradients, buffers after the step, and warnings for the same scenario.

TF32 is disabled here (and inside every dpverify check): on Ampere and newer GPUs cuDNN
convolutions default to TF32, whose 10-bit mantissa fails any float32 comparison.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from hypothesis import given

import dpverify
from dpverify.core.step import no_tf32
from dpverify.models.specs import primary_output
from dpverify.strategies import ModelSpec, Scenario, device_lists, dtypes, model_specs, scenarios

pytestmark = pytest.mark.multigpu(2)


@given(scenarios(models=model_specs(exact=True), devices=device_lists(min_devices=2)))
def test_real_data_parallel_matches_one_device(scenario: Scenario) -> None:
    assert scenario.devices.real
    s = scenario.build()
    with no_tf32():
        dpverify.assert_dp_grads_match(
            s.module, s.inputs, s.target, loss_fn=s.loss_fn, device_ids=s.device_ids,
            output_device=s.output_device, forward_kwargs=s.kwargs,
        )


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("output", ["default", "last", "host"])
def test_device_orders_and_output_devices(cuda_device_ids: list[int], reverse: bool, output: str) -> None:
    ids = cuda_device_ids[::-1] if reverse else cuda_device_ids
    output_device = {"default": None, "last": ids[-1], "host": -1}[output]
    s = Scenario(ModelSpec("mlp", features=4, hidden=8, outputs=3, depth=2), batch_size=7).build()
    with no_tf32():
        dpverify.assert_dp_grads_match(s.module, s.inputs, s.target, loss_fn=s.loss_fn, device_ids=ids, output_device=output_device)
        dpverify.assert_grad_sum_equals_mean_loss_grad(s.module, s.inputs, s.target, loss_fn=s.loss_fn, device_ids=ids)


def _run(scenario: Scenario, *, real: bool) -> dict[str, Any]:
    """One step through the real or the virtual DataParallel, with what it did recorded."""
    s = scenario.build()
    ids = s.device_ids
    device = torch.device("cuda", ids[0]) if real else torch.device("cpu")
    module = s.module.to(device)
    rows: dict[int, int] = {}

    def record(_module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        tensor = args[0]
        where = tensor.device.index if real else dpverify.current_virtual_device()
        rows[-1 if where is None else where] = int(tensor.shape[0])

    module.register_forward_pre_hook(record)
    wrapper: Any = (torch.nn.DataParallel if real else dpverify.VirtualDataParallel)(module, ids, s.output_device)
    inputs = [x.to(device) for x in s.inputs]
    kwargs = {k: v.to(device) for k, v in s.kwargs.items()}
    with warnings.catch_warnings(record=True) as caught, no_tf32():
        warnings.simplefilter("always")
        torch.manual_seed(scenario.seed)
        output = wrapper(*inputs, **kwargs)
        logits = primary_output(output)
        loss = output[1].sum() if scenario.model.returns_loss else s.loss_fn(output, s.target.to(logits.device))
        loss.backward()
    return {
        "rows": rows,
        "output": (output[1] if scenario.model.returns_loss else logits).detach().cpu(),
        "grads": {n: p.grad.cpu() for n, p in module.named_parameters() if p.grad is not None},
        "buffers": {n: b.cpu() for n, b in module.named_buffers()},
        "warnings": sorted(str(w.message) for w in caught),
    }


@given(
    scenarios(
        models=model_specs(kinds=["linear", "mlp", "conv2d", "embedding", "tied-embedding", "lstm", "kwargs", "dict-output", "buffer-counter", "batchnorm", "loss-head"]),
        devices=device_lists(min_devices=2),
        dtype=dtypes().filter(lambda d: d == torch.float64),
    )
)
def test_virtual_conforms_to_real(scenario: Scenario) -> None:
    if scenario.model.kind == "batchnorm" and min(scenario.chunk_sizes) < 2:
        return  # both raise; nothing to compare
    real, virtual = _run(scenario, real=True), _run(scenario, real=False)
    assert real["rows"] == virtual["rows"]  # same chunk sizes on the same devices
    torch.testing.assert_close(virtual["output"], real["output"])
    assert real["grads"].keys() == virtual["grads"].keys()
    for name, grad in real["grads"].items():
        torch.testing.assert_close(virtual["grads"][name], grad, msg=lambda m, n=name: f"grad {n}: {m}")
    for name, buffer in real["buffers"].items():
        torch.testing.assert_close(virtual["buffers"][name], buffer, msg=lambda m, n=name: f"buffer {n}: {m}")
    assert real["warnings"] == virtual["warnings"]
