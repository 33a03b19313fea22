"""User code for the command-line tests of ``--parallel``, ``--parallel-loss`` and ``--dim``
(``tests/test_cli_pairs.py``), loaded as ``cli_pairs_code:NAME`` from the tests directory.

* ``seq_first_gru`` and ``seq_first_inputs``: a GRU reading ``(time, batch, features)``, the
  batch along dim 1, and batches of that shape.
* ``ignores_dim``: a DataParallel factory that takes ``dim=`` and drops it, so it splits
  along dim 0 (time, for the GRU) whatever it is asked.
* ``balanced``: ``BalancedDataParallel`` with one row on device 0, as ``--parallel`` calls it.
* ``NoScalarGather``: DataParallel whose gather refuses scalars (one loss per replica), so
  explain's questions about losses returned by forward cannot be measured for it.
* ``NOT_CALLABLE``: something that is not a wrapper.
"""

from __future__ import annotations

from typing import Any

import torch
from dp_lookalikes import BalancedDataParallel
from torch import nn

NOT_CALLABLE = 42


class SeqFirstGRU(nn.Module):
    """A GRU over ``(time, batch, features)`` and a head on every step."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(4, 5)
        self.head = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _hidden = self.gru(x)
        result: torch.Tensor = self.head(out)
        return result


def seq_first_gru() -> nn.Module:
    return SeqFirstGRU()


def seq_first_inputs(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(6, batch_size, 4), torch.randn(6, batch_size, 2)


def ignores_dim(module: nn.Module, device_ids: Any = None, output_device: Any = None, dim: int = 0) -> nn.Module:
    del dim  # the bug: scatters and gathers along dim 0 whatever it is asked
    return nn.DataParallel(module, device_ids=device_ids, output_device=output_device)


def balanced(module: nn.Module, device_ids: Any = None, output_device: Any = None, dim: int = 0) -> nn.Module:
    return BalancedDataParallel(1, module, device_ids=device_ids, output_device=output_device, dim=dim)


class NoScalarGather(nn.DataParallel):
    def gather(self, outputs: Any, output_device: Any) -> Any:
        if any(isinstance(output, torch.Tensor) and output.dim() == 0 for output in outputs):
            raise ValueError("this wrapper gathers batches, not scalars")
        return super().gather(outputs, output_device)
