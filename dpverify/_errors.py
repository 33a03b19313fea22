"""Exceptions and warnings raised by dpverify."""

from __future__ import annotations

__all__ = ["DroppedRowsWarning", "InvalidArgument", "NonFiniteReference", "ParallelMismatch"]


class InvalidArgument(ValueError):
    """An argument cannot be used; the message names it and says what to pass instead."""


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
