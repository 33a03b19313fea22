"""The data checks called from a user's script under torchrun: ``assert_ddp_data_matches``
and ``assert_ddp_metric_matches`` with ``pool=None`` inside the group the script initialised,
on 2 gloo ranks. The loaders and the evaluation loop run on the group's own ranks; the metric's
single-device runs run on every rank in a one-rank subgroup standing in as the default group
(``one_rank_world``), after which the user's group must still work. A model built with other
weights on each rank is refused alike on every rank, since each rank compares the group with
the single-device run it makes itself.

The launcher helpers (starting torchrun in a session of its own, killing it with its ranks)
are those of ``tests/test_torchrun.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_torchrun import _finish, _launchers, needs_torchrun

#: The user's script: a padding evaluation loader (buggy) and one that does not pad (fixed),
#: each through both checks; a gather-and-trim evaluation over the padding (right); a model
#: seeded per rank (refused). Every rank writes its verdicts to a file; rank 0 prints what
#: was caught.
DATA_SCRIPT = '''
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

import dpverify


def padded(dataset, rank, world_size, epoch):
    return DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, shuffle=False))


def strided(dataset, rank, world_size, epoch):
    return DataLoader(Subset(dataset, range(rank, len(dataset), world_size)), batch_size=2)


def summed_loss(model, loader):
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for x, y in loader:
            total[0] += F.cross_entropy(model(x), y, reduction="sum").double()
            total[1] += len(y)
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def gathered_loss(model, loader):
    with torch.no_grad():
        mine = torch.cat([F.cross_entropy(model(x), y, reduction="none") for x, y in loader])
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    return torch.stack(parts, dim=1).reshape(-1)[: len(loader.dataset)].double().mean().item()


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
generator = torch.Generator().manual_seed(0)
dataset = TensorDataset(torch.randn(9, 4, generator=generator), torch.randint(0, 3, (9,), generator=generator))
torch.manual_seed(0)
model = nn.Linear(4, 3)
checks = {
    "data-padded": lambda: dpverify.assert_ddp_data_matches(dataset, padded, world_size=world),
    "data-strided": lambda: dpverify.assert_ddp_data_matches(dataset, strided, world_size=world),
    "metric-padded": lambda: dpverify.assert_ddp_metric_matches(model, dataset, summed_loss, world_size=world, loader_factory=padded),
    "metric-strided": lambda: dpverify.assert_ddp_metric_matches(model, dataset, summed_loss, world_size=world, loader_factory=strided),
    "metric-gathered": lambda: dpverify.assert_ddp_metric_matches(model, dataset, gathered_loss, world_size=world, loader_factory=padded),
}
verdicts = open(f"data-verdicts-{rank}.txt", "w")
for name, check in checks.items():
    try:
        check()
        verdict = "passed"
    except dpverify.ParallelMismatch as failure:
        verdict = "caught"
        if rank == 0:
            print(f"--- {name}\\n{failure}", flush=True)
    print(f"VERDICT {name} rank {rank}: {verdict}", file=verdicts, flush=True)
torch.manual_seed(rank)  # each rank seeded its own way: a model of other weights on every rank
unseeded = nn.Linear(4, 3)
try:
    dpverify.assert_ddp_metric_matches(unseeded, dataset, summed_loss, world_size=world, loader_factory=strided)
except dpverify.InvalidArgument as error:
    print(f"DIFFERENT rank {rank}: {error}", file=verdicts, flush=True)
total = torch.ones(1)
dist.all_reduce(total)  # the user's group, restored as the default after the single-device runs
print(f"GROUP rank {rank}: {dist.get_world_size()} ranks, all_reduce {total.item():g}", file=verdicts, flush=True)
dist.destroy_process_group()
'''


@pytest.mark.timeout(120)
@needs_torchrun
@pytest.mark.deep
def test_data_checks_in_a_torchrun_script_catch_the_padding_loader_and_pass_the_fixed_ones_on_every_rank(tmp_path: Path) -> None:
    (tmp_path / "data_script.py").write_text(DATA_SCRIPT)
    with _launchers([["--standalone", "--nproc-per-node", "2", "data_script.py"]], tmp_path) as (launcher,):
        code, out, err = _finish(launcher, 100)
    assert code == 0, out + err
    written = "".join(path.read_text() for path in sorted(tmp_path.glob("data-verdicts-*.txt")))
    verdicts = {(name, int(rank)): verdict for name, rank, verdict in re.findall(r"VERDICT (\S+) rank (\d+): (\w+)", written)}
    expected = {"data-padded": "caught", "data-strided": "passed", "metric-padded": "caught", "metric-strided": "passed", "metric-gathered": "passed"}
    assert verdicts == {(name, rank): verdict for name, verdict in expected.items() for rank in (0, 1)}
    assert written.count("ranks, all_reduce 2") == 2, written
    assert "GROUP rank 0: 2 ranks" in written
    assert "GROUP rank 1: 2 ranks" in written
    assert written.count("DIFFERENT rank") == 2  # refused alike on every rank, not compared
    assert "the module's weights on rank 1 differ from rank 0's" in written
    # rank 0 alone prints what was caught, with the ids and the causes
    assert out.count("--- ") == 2
    assert "dataset of 9 samples on 2 ranks (gloo), 2 epochs; loader_factory padded" in out
    assert "Samples seen twice: [0]; in training it carries double weight in epoch 0." in out
    assert "samples [0] were counted twice (DistributedSampler pads the dataset" in out
