"""Peak memory of a check against the footprint of the model and its gradients.

Each measurement runs in a fresh Python process, so that its peak resident set
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``, a high-water mark the process cannot lower)
is the check's and no earlier measurement's. The process imports dpverify, builds the model
and its batches, then runs the check once; it records

* the peak after the imports, after the model was built, and after the check;
* the footprint: the float32 parameters plus a gradient of each (2 x 4 bytes a parameter);
* the ratio (peak after the check - peak after the imports) / footprint: everything the
  check needed, the user's model included, per byte of model and gradients;
* what the check leaves behind: the resident set after it returned, the same after
  ``malloc_trim`` (memory glibc kept for reuse, not held by any object), and the bytes of
  tensors alive after the check that were not before (a check that frees what it no
  longer needs leaves none).

Measurements: ``resnet`` is ``dpverify check``'s one-step checks on the ResNet-18 shape of
``bench_check.py`` (its defaults: batch sizes 8, 5, 2 on 2 and 4 virtual devices, and eval
mode); ``dp`` is one ``assert_dp_grads_match`` on ``bench_scaling.py``'s MLP on 4 virtual
devices, batch 32, at a given size.

Usage: python benchmarks/bench_memory.py [--resnet] [--dp 1e6 1e7] [--quick]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import resource
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MB = 2**20


def _peak() -> int:
    """The process's peak resident set so far, in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _resident() -> int:
    """The process's resident set now, in bytes."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def _live_tensors() -> dict[int, object]:
    import torch

    gc.collect()
    return {id(o): o for o in gc.get_objects() if isinstance(o, torch.Tensor)}


@dataclass(frozen=True)
class Memory:
    """One measurement, in bytes."""

    what: str
    parameters: int
    imports: int
    model: int
    peak: int
    after: int
    after_trim: int
    left_tensors: int

    @property
    def footprint(self) -> int:
        """float32 parameters and one gradient each."""
        return 2 * 4 * self.parameters

    @property
    def ratio(self) -> float:
        return (self.peak - self.imports) / self.footprint


def _run(what: str, size: str, quick: bool) -> Memory:
    """In the child: builds the model, runs the check once, and measures."""
    import bench_check
    import bench_scaling
    import torch
    import torch.nn.functional as F

    import dpverify

    imports = _peak()
    if what == "resnet":
        model = bench_check.load(quick)
        parameters = model.parameter_count

        def check() -> None:
            bench_check.run_check(model)
    else:
        torch.manual_seed(0)
        width = bench_scaling.WIDTHS[size]
        module = bench_scaling.mlp(width)
        x, y = torch.randn(bench_scaling.BATCH, width), torch.randn(bench_scaling.BATCH, width)
        parameters = sum(p.numel() for p in module.parameters())

        def check() -> None:
            dpverify.assert_dp_grads_match(module, x, y, loss_fn=F.mse_loss, device_ids=[0, 1, 2, 3])

    before = _live_tensors()
    model_peak = _peak()
    check()
    peak = _peak()
    left = sum(t.untyped_storage().nbytes() for i, t in _live_tensors().items() if i not in before)  # type: ignore[attr-defined]
    after = _resident()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    label = f"dpverify check, {'tiny ResNet' if quick else 'ResNet-18'} shape" if what == "resnet" else "assert_dp_grads_match, MLP, 4 devices"
    return Memory(label, parameters, imports, model_peak, peak, after, _resident(), left)


def measure(what: str, size: str = "", quick: bool = False) -> Memory:
    """One measurement in a fresh process (this script with ``--child``)."""
    command = [sys.executable, str(Path(__file__).resolve()), "--child", what, size or "-"] + (["--quick"] if quick else [])
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr}")
    return Memory(**json.loads(done.stdout.splitlines()[-1]))


def table(rows: list[Memory]) -> str:
    lines = [
        "| check | parameters | model + gradients | peak RSS: imports / model / check | peak over imports | ratio | RSS after / after malloc_trim | tensors left |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in rows:
        lines.append(
            f"| {m.what} | {m.parameters:,} | {m.footprint / MB:,.0f} MiB | {m.imports / MB:,.0f} / {m.model / MB:,.0f} / "
            f"{m.peak / MB:,.0f} MiB | {(m.peak - m.imports) / MB:,.0f} MiB | {m.ratio:.1f}x | "
            f"{m.after / MB:,.0f} / {m.after_trim / MB:,.0f} MiB | {m.left_tensors / MB:,.0f} MiB |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Memory]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--resnet", action="store_true", help="measure dpverify check on the ResNet-18 shape")
    parser.add_argument("--dp", nargs="*", default=[], metavar="SIZE", help="measure assert_dp_grads_match at these sizes (1e6 ...)")
    parser.add_argument("--quick", action="store_true", help="the tiny ResNet of the same layout (a smoke)")
    parser.add_argument("--child", nargs=2, metavar=("WHAT", "SIZE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        what, size = args.child
        print(json.dumps(asdict(_run(what, size, args.quick))))
        return []
    rows = ([measure("resnet", quick=args.quick)] if args.resnet else []) + [measure("dp", size) for size in args.dp]
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
