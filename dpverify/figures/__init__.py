"""Figures of what dpverify measured, drawn with matplotlib (``pip install 'dpverify[plot]'``).

Every figure is drawn from a structured result, never from text: ``explain_figure`` from an
``Explanation`` (the step as a lane per device, bytes held per device, loss weights,
gradient ratios), ``check_figure`` from ``dpverify check``'s report and
``comparison_figure`` from one ``StepComparison`` (error/allowed per tensor, worst first),
``fuzz_figure`` from a fuzzing session's report, ``loss_weights_figure`` from a
``LossAverageReport``. Each returns a
``matplotlib.figure.Figure``; ``save_figure`` writes it as PNG, SVG or PDF.

Importing this package does not import matplotlib: drawing does, and says what to install
when it is missing.
"""

from dpverify.figures.base import FORMATS as FORMATS
from dpverify.figures.base import save_figure as save_figure
from dpverify.figures.check import check_figure as check_figure
from dpverify.figures.check import comparison_figure as comparison_figure
from dpverify.figures.explain import explain_figure as explain_figure
from dpverify.figures.explain import loss_weights_figure as loss_weights_figure
from dpverify.figures.fuzz import fuzz_figure as fuzz_figure

__all__ = [
    "FORMATS",
    "check_figure",
    "comparison_figure",
    "explain_figure",
    "fuzz_figure",
    "loss_weights_figure",
    "save_figure",
]
