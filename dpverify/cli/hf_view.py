"""How ``dpverify check --hf-config`` looks: what was shrunk to what, a row per backend,
then every failure's message in full (rich)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from dpverify.hf.check import HFCheckReport
from dpverify.registry import Verdict

__all__ = ["render_hf_check", "structure_line"]

_STYLES = {Verdict.PASS: "green", Verdict.FAIL: "bold red", Verdict.SKIP: "dim"}

#: the fields ``structure_line`` shows, as a configuration names them
_FIELDS = (
    ("hidden_size", "hidden"), ("num_hidden_layers", "layers"), ("num_attention_heads", "heads"),
    ("num_key_value_heads", "kv heads"), ("intermediate_size", "intermediate"), ("vocab_size", "vocab"),
    ("num_local_experts", "experts"), ("num_experts", "experts"), ("num_experts_per_tok", "per token"),
    ("sliding_window", "window"), ("tie_word_embeddings", "tied"),
)


def structure_line(config: Any) -> str:
    """The shrunk configuration's widths and structure, in one line."""
    parts = []
    for field, name in _FIELDS:
        value = getattr(config, field, None)
        if value is not None and value is not False:
            parts.append(name if value is True else f"{name} {value}")
    return ", ".join(dict.fromkeys(parts))


def render_hf_check(console: Console, report: HFCheckReport) -> None:
    """The report: the configuration checked, a row per backend, the failures' messages."""
    console.print(f"{type(report.config).__name__} shrunk to {report.parameters:,} parameters: {structure_line(report.config)}", markup=False)
    table = Table(show_edge=False, pad_edge=False)
    for column in ("backend", "verdict", "time", "detail"):
        table.add_column(column, justify="right" if column == "time" else "left")
    for outcome in report.outcomes:
        first = outcome.detail.splitlines()[0] if outcome.detail else ""
        # the check's title is the backend's: the row keeps what follows it
        first = first.split(": ", 1)[1] if outcome.report is not None and ": " in first else first
        table.add_row(
            outcome.backend, f"[{_STYLES[outcome.verdict]}]{outcome.verdict.value}[/]", f"{outcome.seconds:.1f} s", first,
        )
    console.print(table)
    for note in report.notes:
        console.print(f"note: {note}", markup=False)
    for outcome in report.outcomes:
        if outcome.verdict is Verdict.FAIL:
            console.print(f"\n{outcome.backend}: {outcome.error or 'mismatch'}", style="bold red", markup=False)
            console.print(outcome.detail, markup=False)
    verdict = "OK" if report.ok else "FAILED"
    console.print(f"\n{verdict}: {report.model_type} under {', '.join(o.backend for o in report.outcomes)}", markup=False)
