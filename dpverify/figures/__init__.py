"""Figures of what dpverify measured, drawn with matplotlib (``pip install 'dpverify[plot]'``).

Every figure is drawn from a structured result, never from text: ``explain_figure`` from an
``Explanation`` (the step as a lane per device, bytes held per device, loss weights,
gradient ratios), ``check_figure`` from ``dpverify check``'s report and
``comparison_figure`` from one ``StepComparison`` (error/allowed per tensor, worst first),
``fuzz_figure`` from a fuzzing session's report. Each returns a
``matplotlib.figure.Figure``; ``save_figure`` writes it as PNG, SVG or PDF.

Importing this package does not import matplotlib: drawing does, and says what to install
when it is missing.
"""

from dpverify.figures.base import FORMATS as FORMATS
from dpverify.figures.base import save_figure as save_figure
