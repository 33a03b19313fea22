"""The live display of a ``dpverify fuzz`` session, apart from the engine (``fuzz.py``),
which only counts: the engine runs without rich, and the display can change without
touching how examples are checked."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dpverify.cli.fuzz import FuzzConfig, Tally

__all__ = ["FuzzProgress", "outcome_line"]


class FuzzProgress:
    """The live display: a progress bar with examples per second, and below it the
    outcomes (passed, expected divergences by class, failures).

    On a terminal it redraws in place; elsewhere (a CI log, a pipe) it prints one plain
    status line every ``log_every`` seconds and none in between, so logs stay readable.
    """

    def __init__(self, console: Any, config: FuzzConfig, *, log_every: float = 10.0) -> None:
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
        from rich.text import Text

        self.console = console
        self.config = config
        self.log_every = log_every
        self.logged_at = time.perf_counter()
        self.outcomes = Text("starting")
        outcomes = self.outcomes

        class _Progress(Progress):
            def get_renderables(self) -> Iterator[Any]:
                yield self.make_tasks_table(self.tasks)
                yield outcomes

        self.progress = _Progress(
            SpinnerColumn(),
            TextColumn("[bold]fuzz"),
            BarColumn(bar_width=30),
            TextColumn("{task.fields[count]}"),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            console=console,
            refresh_per_second=4,
            transient=True,
            disable=not console.is_terminal,
        )
        total = config.time_budget if config.max_examples is None and config.time_budget is not None else config.examples
        self.task = self.progress.add_task("fuzz", total=total, count="", rate="")

    def __enter__(self) -> FuzzProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.progress.stop()

    def update(self, tally: Tally) -> None:
        budget = self.config.time_budget
        if self.config.max_examples is None and budget is not None:
            completed: float = min(tally.elapsed, budget)
            count = f"{tally.run} examples, budget {budget:g}s"
        else:
            completed = tally.run
            count = f"{tally.run}/{self.config.examples} examples"
            if budget is not None:
                count += f" or {budget:g}s"
        status = outcome_line(tally)
        self.outcomes.plain = status
        self.progress.update(self.task, completed=completed, count=count, rate=f"{tally.rate:.1f}/s")
        now = time.perf_counter()
        if not self.console.is_terminal and now - self.logged_at >= self.log_every:
            self.logged_at = now
            self.console.print(f"fuzz: {count}, {tally.rate:.1f}/s; {status}", markup=False, soft_wrap=True)


def outcome_line(tally: Tally) -> str:
    """``passed 38 · expected divergences 2 (BatchNorm 1, Dropout 1) · failed 0``."""
    serial = f" · nothing parallel {tally.serial}" if tally.serial else ""
    text = f"passed {tally.passed}{serial} · {tally.describe_divergence()} · failed {tally.failed}"
    if tally.first_failure_at is not None:
        text += f" · shrinking the failure ({tally.shrink_runs} tried)"
    return text
