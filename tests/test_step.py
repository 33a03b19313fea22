"""``dpverify.core.step.ReplicaGradRecorder``: the one recorder of replica forwards, read by
the checks (``run_step(record_replicas=...)``) and by ``explain`` (a subclass)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from dpverify import VirtualDataParallel
from dpverify.core.step import ReplicaGradRecorder, ReplicaRecord, copy_module, parameter_sites


def _step(module: nn.Module, recorder: ReplicaGradRecorder, rows: int = 5) -> None:
    recorder.attach(module)
    try:
        out = VirtualDataParallel(module, [0, 1])(torch.randn(rows, 3, generator=torch.Generator().manual_seed(0)))
        out.pow(2).sum().backward()
    finally:
        recorder.detach()


def test_each_replica_forward_is_recorded_with_its_device_rows_and_gradients() -> None:
    torch.manual_seed(0)
    module = nn.Linear(3, 2)
    recorder = ReplicaGradRecorder(parameter_sites(module))
    _step(module, recorder)
    records = recorder.ordered([0, 1])
    assert [r.device for r in records] == [0, 1]
    assert [r.rows for r in records] == [3, 2]
    assert [r.first_input.shape if r.first_input is not None else None for r in records] == [(3, 3), (2, 3)]
    for name in ("weight", "bias"):
        param = getattr(module, name)
        assert param.grad is not None
        # the reduce-add sums exactly the contributions the hooks saw
        torch.testing.assert_close(records[0].grads[name] + records[1].grads[name], param.grad)
        assert recorder.magnitudes[name] > 0
        assert recorder.norms[name] > 0
    assert [r.grad_bytes for r in records] == [(6 + 2) * 4] * 2
    # the hooks are gone, and outside a replica no thread has a current record
    assert recorder.current() is None
    module(torch.randn(1, 3))
    assert len(recorder.replicas) == 2


def test_without_keep_only_the_magnitudes_and_sizes_are_recorded() -> None:
    module = nn.Linear(3, 2)
    recorder = ReplicaGradRecorder(parameter_sites(module), keep=False)
    _step(module, recorder)
    assert [r.grads for r in recorder.replicas] == [{}, {}]
    assert all(r.grad_bytes for r in recorder.replicas)
    assert set(recorder.magnitudes) == {"weight", "bias"}


def test_a_replica_without_a_known_device_keeps_the_order_it_started_in() -> None:
    module = nn.Linear(3, 2)
    recorder = ReplicaGradRecorder(parameter_sites(module))
    recorder.attach(module)
    module(torch.randn(4, 3)).sum().backward()  # on the host: no replica device
    recorder.detach()
    assert [(r.device, r.rows) for r in recorder.ordered([0, 1])] == [(None, 4)]


def test_a_deep_copied_module_reports_to_the_same_recorder() -> None:
    module = nn.Linear(3, 2)
    recorder = ReplicaGradRecorder(parameter_sites(module))
    recorder.attach(module)
    copy.deepcopy(module)(torch.randn(2, 3))
    recorder.detach()
    assert copy.deepcopy(recorder) is recorder
    assert len(recorder.replicas) == 1


@dataclass
class _Counted(ReplicaRecord):
    parameters: int = 0


class _Counting(ReplicaGradRecorder):
    record_type = _Counted

    def on_parameter(self, record: ReplicaRecord, name: str, tensor: torch.Tensor) -> None:
        assert isinstance(record, _Counted)
        assert self.current() is record
        record.parameters += 1


def test_a_subclass_records_more_in_a_record_of_its_own() -> None:
    module = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    recorder = _Counting(parameter_sites(module), keep=False)
    _step(module, recorder)
    records = [r for r in recorder.ordered([0, 1]) if isinstance(r, _Counted)]
    assert [r.parameters for r in records] == [4, 4]


class _Holding(nn.Module):
    """Empty containers of its own, one shared with its child, and a non-empty one."""

    def __init__(self) -> None:
        super().__init__()
        self.child = nn.Linear(2, 2)
        self.seen: list[int] = []
        self.cache: dict[str, int] = {}
        self.tags: set[str] = set()
        self.shared = self.child._forward_hooks  # the same empty OrderedDict
        self.counts = {"calls": 1}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.child(x)


def test_copy_module_copies_as_deepcopy_does_with_empty_containers_made_anew() -> None:
    module = _Holding()
    for dtype in (None, torch.float64):
        copied = copy_module(module, dtype)
        assert isinstance(copied, _Holding)
        # every container is the copy's own, of the same type and size (the hooks' empty ones too)
        for original, duplicate in zip(module.modules(), copied.modules(), strict=True):
            for name, value in vars(original).items():
                if isinstance(value, (dict, set, list)):
                    assert type(vars(duplicate)[name]) is type(value), name
                    assert len(vars(duplicate)[name]) == len(value), name
                    assert vars(duplicate)[name] is not value, name
        # what one module shares, its copy shares, as deepcopy's memo keeps it
        assert copied.shared is copied.child._forward_hooks
        # a hook on the copy does not reach the module
        copied.child.register_forward_hook(lambda *_: None)
        copied.tags.add("copy")
        assert not module.child._forward_hooks
        assert not module.tags
        assert copied.counts == {"calls": 1}
        assert copied.counts is not module.counts
