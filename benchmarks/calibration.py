"""What the calibration scripts share: their command line, their driver loop, the tally of
one class of scenarios, and how an error is shortened for their tables.

``calibrate.py`` (the tolerance), ``calibrate_data.py`` (the data path and metrics) and
``calibrate_exact.py`` (exact mode) each generate their own scenarios, run and report them
their own way; ``drive`` runs one pasted or indexed scenario with full messages, or ``--n``
of them with a progress line, on one intra-op thread, and reports.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ClassTally:
    """The outcomes of the scenarios of one class: ``refused`` (an argument error the
    scenario was built to meet), ``skipped`` (a scenario a script does not count, e.g. not
    finite in its working dtype) and ``ratios`` (the worst error/allowed of each passing
    scenario, where a script records them)."""

    scenarios: int = 0
    passes: int = 0
    refused: int = 0
    false_alarms: int = 0
    crashes: int = 0
    skipped: int = 0
    ratios: list[float] = field(default_factory=list)
    seconds: float = 0.0


def error_lines(error: BaseException, count: int = 4) -> str:
    """The error's type and its first ``count`` non-empty lines, on one line."""
    text = [line for line in str(error).strip().splitlines() if line.strip()]
    return f"{type(error).__name__}: " + " | ".join(text[:count])


def drive(
    argv: Sequence[str] | None,
    *,
    description: str,
    scenarios: int,
    tally: Any,
    generate: Callable[[int, int], Any],
    parse: Callable[[str], Any],
    run: Callable[[Any, bool], str],
    report: Callable[[int, int], None],
    describe: Callable[[Any], str],
    progress: Callable[[], str],
    show: str = "failing specs listed (default 20)",
) -> Any:
    """Parses the shared command line and runs: ``--only``/``--spec`` one scenario, with
    ``run(spec, True)`` (verbose), else ``--n`` (default ``scenarios``) drawn by
    ``generate(index, seed)``, a ``progress()`` line every ``--progress`` of them; then
    ``report(seed, show)``. Torch runs on one intra-op thread meanwhile (tiny tensors: more
    threads only add overhead). Returns ``tally``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--n", type=int, default=scenarios, help=f"scenarios (default {scenarios})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", type=int, default=None, metavar="INDEX", help="run one scenario, with full messages")
    parser.add_argument("--spec", default=None, help="run one pasted spec line, with full messages")
    parser.add_argument("--show", type=int, default=20, help=show)
    parser.add_argument("--progress", type=int, default=0, metavar="K", help="a progress line every K scenarios")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if args.only is not None or args.spec is not None:
            spec = parse(args.spec) if args.spec is not None else generate(args.only, args.seed)
            print(f"spec: {spec}\n{describe(spec)}\n")
            print(f"outcome: {run(spec, True)}")
        else:
            for index in range(args.n):
                run(generate(index, args.seed), False)
                if args.progress and (index + 1) % args.progress == 0:
                    print(f"{index + 1}/{args.n}: {progress()}", flush=True)
        report(args.seed, args.show)
    finally:
        torch.set_num_threads(threads)
    return tally
