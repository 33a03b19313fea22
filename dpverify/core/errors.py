"""Exceptions and warnings raised by dpverify."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# The engine must run where Hypothesis is not installed (only the strategies, the fuzzer
# and the pytest plugin need it), so this import, the one the engine may make of Hypothesis
# (tests/test_layout.py), is guarded.
try:
    from hypothesis.errors import InvalidArgument as _Base
except ImportError:

    class _Base(TypeError):  # type: ignore[no-redef]
        """Stands in for Hypothesis's InvalidArgument (a TypeError) when it is absent."""


__all__ = ["DroppedRowsWarning", "InvalidArgument", "NonFiniteReference", "ParallelMismatch"]


class InvalidArgument(_Base, ValueError):
    """An argument cannot be used; the message names it and says what to pass instead.

    The one exception for bad arguments anywhere in dpverify: the assertion helpers, the
    strategies and the command line, which prints the message and exits with status 2. It
    is Hypothesis's ``InvalidArgument`` when Hypothesis is installed (what Hypothesis
    documents for a strategy's bad arguments), else a ``TypeError`` as that one is, and a
    ``ValueError`` for callers that catch that.
    """


class NonFiniteReference(InvalidArgument):
    """The single-device (or float64) reference step produced NaN or inf.

    Nothing can be compared with a reference that is not finite, so the check stops before
    any comparison; the message names the tensor and the step.
    """


class ParallelMismatch(AssertionError):
    """A parallel step disagrees with the single-device step it should reproduce.

    ``message`` may be a function that makes it, called when the message is first read.

    Attributes:
        report: the structured comparison behind the message (a ``StepComparison`` or a
            ``LossAverageReport``), for callers that want numbers rather than text.
    """

    def __init__(self, message: str | Callable[[], str], report: object = None) -> None:
        self._render = None if isinstance(message, str) else message
        super().__init__(*([message] if isinstance(message, str) else []))
        self.report = report

    def _rendered(self) -> None:
        # A message given as a function is made on first read: a failure report of every
        # tensor costs passes over each, and a caller that only needs the verdict (and
        # ``report``) never reads it.
        if self._render is not None:
            render, self._render = self._render, None
            BaseException.args.__set__(self, (render(),))  # type: ignore[attr-defined]

    @property  # type: ignore[override]
    def args(self) -> tuple[Any, ...]:
        self._rendered()
        return BaseException.args.__get__(self)  # type: ignore[attr-defined,no-any-return]

    @args.setter
    def args(self, value: tuple[Any, ...]) -> None:
        self._render = None
        BaseException.args.__set__(self, value)  # type: ignore[attr-defined]

    def __str__(self) -> str:
        self._rendered()
        return super().__str__()

    def __repr__(self) -> str:
        self._rendered()
        return super().__repr__()

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.report))


class DroppedRowsWarning(UserWarning):
    """DataParallel's scatter will silently drop rows of some inputs.

    Raised when positional tensors have different sizes along the scatter dimension:
    torch zips their chunks with ``strict=False``, so the shorter input decides how many
    replicas run and the longer inputs lose their trailing rows (pytorch issue 7358).
    """
