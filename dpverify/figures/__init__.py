"""Figures of what dpverify measured, drawn with matplotlib (``pip install 'dpverify[plot]'``)
from the structured results, never from text; docs/figures.md shows each. Each function
returns a ``matplotlib.figure.Figure``; ``save_figure`` writes it as PNG, SVG or PDF.

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
