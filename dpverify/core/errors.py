"""Exceptions and warnings raised by dpverify."""

from __future__ import annotations

# Hypothesis is a hard dependency today, so the engine may import its errors module (a small
# module: no strategies, no engine). Subclassing Hypothesis's InvalidArgument gives one
# exception for every bad argument: the strategies raise what Hypothesis documents for a
# strategy's bad arguments (so ``except hypothesis.errors.InvalidArgument`` still works), and
# ``except dpverify.InvalidArgument`` catches ``scenarios(max_batch=0)`` too. The engine
# should not need Hypothesis at import time in the long run: then this base becomes
# conditional (a plain ValueError when Hypothesis is absent).
from hypothesis.errors import InvalidArgument as _HypothesisInvalidArgument

__all__ = ["DroppedRowsWarning", "InvalidArgument", "NonFiniteReference", "ParallelMismatch"]


class InvalidArgument(_HypothesisInvalidArgument, ValueError):
    """An argument cannot be used; the message names it and says what to pass instead.

    The one exception for bad arguments anywhere in dpverify: the assertion helpers, the
    strategies (it is also Hypothesis's ``InvalidArgument``), and the command line, which
    prints the message and exits with status 2. It stays a ``ValueError`` for callers that
    catch that (and is a ``TypeError`` too, as Hypothesis's is).
    """


class NonFiniteReference(InvalidArgument):
    """The single-device (or float64) reference step produced NaN or inf.

    Nothing can be compared with a reference that is not finite, so the check stops before
    any comparison; the message names the tensor and the step.
    """


class ParallelMismatch(AssertionError):
    """A parallel step disagrees with the single-device step it should reproduce.

    Attributes:
        report: the structured comparison behind the message (a ``StepComparison`` or a
            ``LossAverageReport``), for callers that want numbers rather than text.
    """

    def __init__(self, message: str, report: object = None) -> None:
        super().__init__(message)
        self.report = report


class DroppedRowsWarning(UserWarning):
    """DataParallel's scatter will silently drop rows of some inputs.

    Raised when positional tensors have different sizes along the scatter dimension:
    torch zips their chunks with ``strict=False``, so the shorter input decides how many
    replicas run and the longer inputs lose their trailing rows (pytorch issue 7358).
    """
