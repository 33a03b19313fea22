"""One DataParallel check run on one drawn scenario: shared by the mutant properties and
the fuzz sessions, so that both run exactly the same assertion."""

from __future__ import annotations

from typing import Any

from dpverify.checks.buffers import assert_dp_buffers_match
from dpverify.checks.dp import assert_dp_grads_match, assert_grad_sum_equals_mean_loss_grad
from dpverify.strategies import Scenario

__all__ = ["dp_buffers", "dp_grad_sum", "dp_grads"]


def dp_grads(scenario: Scenario, parallel: Any = None) -> None:
    """``assert_dp_grads_match`` on the scenario, through ``parallel`` (None: torch's)."""
    s = scenario.build()
    assert_dp_grads_match(
        s.module, s.inputs, s.target, loss_fn=s.loss_fn, device_ids=s.device_ids,
        output_device=s.output_device, forward_kwargs=s.kwargs, parallel=parallel,
    )


def dp_grad_sum(scenario: Scenario, parallel: Any = None) -> None:
    """``assert_grad_sum_equals_mean_loss_grad`` on the scenario."""
    s = scenario.build()
    assert_grad_sum_equals_mean_loss_grad(
        s.module, s.inputs, s.target, loss_fn=s.loss_fn, device_ids=s.device_ids,
        forward_kwargs=s.kwargs, parallel=parallel,
    )


def dp_buffers(scenario: Scenario, parallel: Any = None) -> None:
    """``assert_dp_buffers_match`` on the scenario."""
    s = scenario.build()
    assert_dp_buffers_match(
        s.module, s.inputs, device_ids=s.device_ids, output_device=s.output_device,
        forward_kwargs=s.kwargs, parallel=parallel,
    )
