"""What every figure shares: matplotlib loaded on demand, one size and style, and saving by
the file's suffix.

matplotlib is an optional extra (``pip install 'dpverify[plot]'``): nothing imports it until
a figure is drawn, and a figure asked for without it raises an ImportError that says what
to install. Figures are ``matplotlib.figure.Figure`` objects made without pyplot, so
drawing one touches no global state, opens no window and needs no display.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from dpverify.core.errors import InvalidArgument

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "COLOURS",
    "DPI",
    "FORMATS",
    "WIDTH",
    "drawing",
    "figure_path",
    "new_figure",
    "require_matplotlib",
    "save_figure",
]

#: The file types a figure is written as, by suffix.
FORMATS: tuple[str, ...] = (".png", ".svg", ".pdf")

#: Inches wide, and dots per inch: 1,200 pixels wide, a page or a screen at normal size.
WIDTH, DPI = 12.0, 100

#: One colour per meaning, the same in every figure.
COLOURS: dict[str, str] = {
    "pass": "#3a7d44",
    "fail": "#c0392b",
    "limit": "#222222",
    "muted": "#9e9e9e",
    "view": "#3a7d44",
    "copy": "#e08e0b",
    "idle": "#bdbdbd",
    "module": "#2e6f9e",
    "replica": "#7fa7c9",
    "gather": "#6a4c93",
    "loss": "#6a4c93",
    "backward": "#c0392b",
    "inputs": "#4e79a7",
    "parameters": "#f28e2b",
    "activations": "#59a14f",
    "gathered outputs": "#b07aa1",
    "gradients": "#e15759",
    "BatchNorm": "#f28e2b",
    "Dropout": "#4e79a7",
    "failure": "#c0392b",
    "nothing parallel": "#9e9e9e",
}

# The same look whatever the user's matplotlibrc says, and SVGs that do not change from one
# run to the next (no random ids, no date), so that the README's images diff cleanly.
_STYLE: dict[str, Any] = {
    "font.family": "DejaVu Sans",
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.titleweight": "bold",
    "axes.titlelocation": "left",
    "axes.labelsize": 10,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "legend.fontsize": 9,
    "legend.frameon": False,
    "xtick.labelsize": 9,
    "ytick.labelsize": 9,
    "svg.hashsalt": "dpverify",
    "svg.fonttype": "none",
    "savefig.facecolor": "white",
    "figure.facecolor": "white",
}

_INSTALL = "pip install 'dpverify[plot]' (or pip install matplotlib)"


def require_matplotlib(what: str = "a figure") -> None:
    """Imports matplotlib, or says what to install.

    Args:
        what: what needs it, for the message (``"--figure"``).

    Raises:
        ModuleNotFoundError: matplotlib is not installed; the message names ``what`` and
            the install command.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise ModuleNotFoundError(f"{what} needs matplotlib, which is not installed: {_INSTALL}", name="matplotlib") from error


def figure_path(path: str | Path, option: str = "path") -> Path:
    """``path`` as a Path, once its suffix is one a figure can be written as and matplotlib
    is there: checked before anything runs, so that a long check does not end in a typo.

    Args:
        path: the file to write.
        option: the argument's name, for the message (``"--figure"``).

    Raises:
        InvalidArgument: the suffix is not .png, .svg or .pdf, or matplotlib is missing.
    """
    target = Path(path)
    if target.suffix.lower() not in FORMATS:
        raise InvalidArgument(
            f"{option} {str(path)!r}: a figure is written as {', '.join(FORMATS)}; end the file name with one of them"
        )
    if target.parent != Path() and not target.parent.is_dir():
        raise InvalidArgument(f"{option} {str(path)!r}: the folder {str(target.parent)!r} does not exist; create it first")
    try:
        require_matplotlib(option)
    except ModuleNotFoundError as error:
        raise InvalidArgument(str(error)) from error
    return target


@contextlib.contextmanager
def drawing() -> Iterator[None]:
    """matplotlib with dpverify's style, for the time one figure is drawn."""
    require_matplotlib()
    import matplotlib

    # matplotlib types rc_context's keys as a Literal of every rcParam
    with matplotlib.rc_context(cast(Any, _STYLE)):
        yield


def new_figure(height: float) -> Figure:
    """An empty figure ``WIDTH`` inches wide and ``height`` tall, laid out by matplotlib's
    constrained layout (labels never overlap the next panel)."""
    require_matplotlib()
    from matplotlib.figure import Figure

    return Figure(figsize=(WIDTH, height), dpi=DPI, layout="constrained")


def message_panel(ax: Axes, text: str, label: str) -> None:
    """An axes, labelled ``label``, that says why there is nothing to draw in it, instead of
    an empty frame."""
    ax.set_label(label)
    ax.set_axis_off()
    ax.text(0.0, 0.5, text, transform=ax.transAxes, va="center", ha="left", wrap=True, color=COLOURS["limit"])


def save_figure(figure: Figure, path: str | Path) -> Path:
    """Writes ``figure`` as PNG, SVG or PDF by the suffix of ``path``, at ``DPI``.

    Raises:
        InvalidArgument: the suffix is not one of ``FORMATS``.
    """
    target = figure_path(path)
    with drawing():
        # no creation date in SVG and PDF: the same figure gives the same file
        metadata: dict[str, Any] = {"Date": None} if target.suffix.lower() in (".svg", ".pdf") else {}
        figure.savefig(target, dpi=DPI, metadata=metadata)
    return target
