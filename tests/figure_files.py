"""What every figure test asks of a written PNG: its size, and that it is drawn on."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from PIL import Image


class Png(NamedTuple):
    """A PNG's format, size in pixels, and the share of its pixels that are not white."""

    format: str | None
    width: int
    height: int
    inked: float


def read_png(path: Path) -> Png:
    """The facts of the image at ``path``; ``inked`` counts pixels darker than near-white
    (anti-aliasing leaves a white page at 250 and up)."""
    with Image.open(path) as image:
        levels = image.convert("L").histogram()
        return Png(image.format, image.width, image.height, sum(levels[:250]) / sum(levels))
