"""Every decoder architecture of the installed transformers with a tensor-parallel plan,
shrunk and checked under each backend with its own plans.

For each ``model_type`` of ``transformers.CONFIG_MAPPING`` whose default configuration has
a ``base_model_tp_plan`` and a causal-LM class: ``shrink(config, tp=2, pp=2)`` and
``check_hf_config`` under DataParallel, DDP and FSDP2 (2 devices / ranks), tensor
parallelism with the configuration's own plan (2 ranks) and the pipeline split of its
decoder layers (2 stages). Prints a markdown table: the architecture, its parameters after
shrinking, each backend's verdict and the time it took; ``--out FILE`` writes the table
with its date, command and machine, and ``--json FILE`` every outcome's first line.

    python benchmarks/sweep_hf.py --out docs/figures/hf_sweep.md
    python benchmarks/sweep_hf.py --only llama mixtral qwen2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import torch

from dpverify import InvalidArgument
from dpverify.hf.check import HF_BACKENDS, check_hf_config


@dataclass
class Row:
    """One architecture's outcome: its parameters after shrinking, a verdict per backend
    (``refused``: why it could not be shrunk or built), the seconds it took."""

    model_type: str
    parameters: int | None = None
    verdicts: dict[str, str] = field(default_factory=dict)
    details: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    refused: str | None = None


def architectures(only: Sequence[str] = ()) -> list[str]:
    """The model types with a causal-LM class whose default configuration has a
    tensor-parallel plan (``only``: those of them named)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = []
    for model_type in sorted(transformers.CONFIG_MAPPING.keys()):
        if only and model_type not in only:
            continue
        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            continue
        try:
            config = transformers.CONFIG_MAPPING[model_type]()
        except Exception:  # a configuration that cannot be built without arguments
            continue
        if getattr(config, "base_model_tp_plan", None):
            found.append(model_type)
    return found


def sweep_one(model_type: str) -> Row:
    """One architecture through ``check_hf_config``, every backend."""
    row = Row(model_type)
    started = time.perf_counter()
    try:
        report = check_hf_config(model_type, backend="all")
    except InvalidArgument as error:
        row.refused = str(error).splitlines()[0]
    except Exception as error:  # a crash is a finding too: the table says which
        row.refused = f"crashed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    else:
        row.parameters = report.parameters
        for outcome in report.outcomes:
            row.verdicts[outcome.backend] = f"error ({outcome.error})" if outcome.error else outcome.verdict.value
            row.details[outcome.backend] = outcome.detail.splitlines()[0] if outcome.detail else ""
    row.seconds = time.perf_counter() - started
    return row


def table(rows: Sequence[Row]) -> str:
    head = "| architecture | parameters | " + " | ".join(HF_BACKENDS) + " | time |"
    lines = [head, "|---|---:|" + "---|" * len(HF_BACKENDS) + "---:|"]
    for row in rows:
        if row.refused is not None:
            lines.append(f"| {row.model_type} | | {row.refused} " + "| " * (len(HF_BACKENDS) - 1) + f"| {row.seconds:.1f} s |")
            continue
        cells = " | ".join(row.verdicts.get(backend, "") for backend in HF_BACKENDS)
        lines.append(f"| {row.model_type} | {row.parameters:,} | {cells} | {row.seconds:.1f} s |")
    return "\n".join(lines)


def summary(rows: Sequence[Row]) -> str:
    checked = [row for row in rows if row.refused is None]
    failed = [row.model_type for row in checked if any(v == "FAIL" for v in row.verdicts.values())]
    errors = [row.model_type for row in checked if any(v.startswith("error") for v in row.verdicts.values())]
    passing = len([row for row in checked if row.model_type not in {*failed, *errors}])
    return (
        f"{len(rows)} architectures: {len(checked)} checked, {len(rows) - len(checked)} refused by shrink; "
        f"{passing} pass every backend that applies"
        + (f"; a mismatch: {', '.join(failed)}" if failed else "")
        + (f"; a backend that could not run the model: {', '.join(errors)}" if errors else "")
    )


def main(argv: Sequence[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", default=(), metavar="MODEL_TYPE", help="these model types only")
    parser.add_argument("--out", type=Path, help="write the table, with its date, command and machine, to this file")
    parser.add_argument("--json", type=Path, help="write every outcome (verdicts and first lines) as JSON")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    rows = []
    for model_type in architectures(args.only):
        row = sweep_one(model_type)
        rows.append(row)
        verdicts = row.refused or " ".join(f"{b}={v}" for b, v in row.verdicts.items())
        print(f"{model_type:<28} {verdicts}  {row.seconds:.1f} s", flush=True)
    text = table(rows)
    print(text)
    print(summary(rows))
    if args.out is not None:
        command = "python benchmarks/sweep_hf.py" + (f" --only {' '.join(args.only)}" if args.only else "")
        machine = f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, transformers {transformers.__version__}"
        date = datetime.now(UTC).strftime("%Y-%m-%d")
        args.out.write_text(f"{date}, `{command}`, {machine}.\n\n{text}\n\n{summary(rows)}\n")
    if args.json is not None:
        args.json.write_text(json.dumps([row.__dict__ for row in rows], indent=1))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
