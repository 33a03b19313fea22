"""Exceptions and warnings raised by dpverify."""

from __future__ import annotations

# Subclassing Hypothesis's InvalidArgument gives one exception for every bad argument: the
# strategies raise what Hypothesis documents for a strategy's bad arguments (so
# ``except hypothesis.errors.InvalidArgument`` still works), and ``except
# dpverify.InvalidArgument`` catches ``scenarios(max_batch=0)`` too. The import is guarded
# because the engine must run where Hypothesis is not installed (it is needed only by the
# strategies, the fuzzer and the pytest plugin); the base is then a plain TypeError, as
# Hypothesis's is. This is the one import of Hypothesis the engine may make
# (tests/test_layout.py).
try:
    from hypothesis.errors import InvalidArgument as _Base
except ImportError:

    class _Base(TypeError):  # type: ignore[no-redef]
        """Stands in for Hypothesis's InvalidArgument (a TypeError) when it is absent."""


__all__ = ["DroppedRowsWarning", "InvalidArgument", "NonFiniteReference", "ParallelMismatch"]


class InvalidArgument(_Base, ValueError):
    """An argument cannot be used; the message names it and says what to pass instead.

    The one exception for bad arguments anywhere in dpverify: the assertion helpers, the
    strategies (it is also Hypothesis's ``InvalidArgument`` when Hypothesis is installed),
    and the command line, which prints the message and exits with status 2. It stays a
    ``ValueError`` for callers that catch that (and is a ``TypeError`` too, as Hypothesis's
    is).
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
