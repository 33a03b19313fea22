"""Text for people: counts with their noun, and names shortened in the middle so that
rows stay apart (``bert.encoder…0.attention.self.key.bias``), never cut off at the end."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ELLIPSIS", "and_list", "name_list", "plural", "shape_text", "shorten_middle", "shorten_names"]


#: Stands for the characters ``shorten_middle`` leaves out.
ELLIPSIS = "…"


def plural(count: int, word: str, many: str | None = None) -> str:
    """``"1 rank"``, ``"2 ranks"``: the count and the word, plural unless the count is 1.

    Args:
        count: how many.
        word: the singular.
        many: the plural where it is not ``word + "s"``.
    """
    return f"{count:,} {word if count == 1 else many or word + 's'}"


def shape_text(shape: Sequence[int]) -> str:
    """``"5x7"``, or ``"scalar"`` for a shape with no dimensions."""
    return "x".join(map(str, shape)) or "scalar"


def _indices(parts: Sequence[str]) -> int:
    """How many components are ModuleList/Sequential indices (``layer.11``): they are what
    tells repeated blocks apart."""
    return sum(part.isdigit() for part in parts)


def _prefix(parts: Sequence[str], room: int) -> list[str]:
    """The most leading components whose dotted join fits ``room`` characters."""
    taken: list[str] = []
    for part in parts:
        if len(".".join([*taken, part])) > room:
            break
        taken.append(part)
    return taken


def _suffix(parts: Sequence[str], room: int) -> list[str]:
    """The most trailing components whose dotted join fits ``room`` characters."""
    return _prefix(parts[::-1], room)[::-1]


def _split(parts: Sequence[str], room: int) -> tuple[list[str], list[str]] | None:
    """Whole components for the head and the tail within ``room`` characters, or None when
    not even the first and the last component fit.

    The balanced split gives the tail about two thirds of the room (then the head takes
    what fits, and the tail what the head left). Where it drops a ModuleList index that
    another split keeps, the split keeping the most indices wins: the tail from the last
    index on, or the head up to it.
    """
    if len(parts) < 2 or len(parts[0]) + len(parts[-1]) > room:
        return None
    # the head keeps at least the first component
    tail = _suffix(parts[1:], min(room - max(room // 3, 1), room - len(parts[0]))) or parts[-1:]
    head = _prefix(parts[: len(parts) - len(tail)], room - len(".".join(tail)))
    tail = _suffix(parts[len(head):], room - len(".".join(head)))
    candidates = [(head, tail)]
    last = max((i for i, part in enumerate(parts) if part.isdigit() and 0 < i < len(parts) - 1), default=None)
    if last is not None:
        from_index = list(parts[last:])
        if len(parts[0]) + len(".".join(from_index)) <= room:
            candidates.append((_prefix(parts[:last], room - len(".".join(from_index))), from_index))
        through = list(parts[: last + 1])
        if len(".".join(through)) + len(parts[-1]) <= room:
            candidates.append((through, _suffix(parts[last + 1:], room - len(".".join(through)))))

    def score(split: tuple[list[str], list[str]]) -> tuple[int, int]:
        kept = [*split[0], *split[1]]
        return _indices(kept), len(".".join(split[0])) + len(".".join(split[1]))

    # max keeps the first of equals: the balanced split unless another keeps more
    return max(candidates, key=score)


def shorten_middle(name: str, width: int) -> str:
    """``name`` in at most ``width`` characters, cut in the middle, never at the end.

    The head (which part of the model) and the tail (which layer, which tensor) are what
    tell rows apart, so an ellipsis replaces the middle: whole dotted components are kept
    at both ends, as many ModuleList indices as fit first, then as many characters, e.g.
    ``bert.encoder…0.attention.self.key.bias``. Where not even the first and the last
    component fit, the head (and if need be the tail) is cut by characters instead.

    Args:
        name: a dotted parameter, buffer or module name (any text works).
        width: the most characters the result may have.

    Returns:
        ``name`` itself when it fits, else ``head + "…" + tail``.
    """
    if len(name) <= width:
        return name
    if width < 3:
        # no room for both ends; the head alone still says where the name starts
        return (name[: width - 1] + ELLIPSIS) if width > 0 else ""
    room = width - len(ELLIPSIS)
    parts = name.split(".")
    split = _split(parts, room)
    if split is not None:
        return ".".join(split[0]) + ELLIPSIS + ".".join(split[1])
    # a component too long for whole ones: the tail's whole components in two thirds of
    # the room (or its last characters), the head's first characters in the rest
    share = room - max(room // 3, 1)
    taken = _suffix(parts[1:], share)
    tail = ".".join(taken) if taken else name[len(name) - share:]
    return name[: room - len(tail)] + ELLIPSIS + tail


def _kept_indices(short: str) -> int:
    """The indices a shortened name still shows, in its head and in its tail."""
    return sum(_indices(side.split(".")) for side in short.split(ELLIPSIS))


def shorten_names(names: Sequence[str], width: int) -> list[str]:
    """Each name shortened in the middle to ``width``, and distinct names kept distinct.

    Names that would read the same (``layer.0…weight`` and ``layer.1…weight`` both losing
    their layer number) are given more characters until they differ and keep their
    indices; at worst they are shown whole. Names that clash with none keep ``width``.

    Args:
        names: the names of one table column.
        width: the characters each may have, unless it must have more to stay distinct.
    """
    widths = dict.fromkeys(names, width)
    widening: set[str] = set()
    while True:
        short = {name: shorten_middle(name, room) for name, room in widths.items()}
        seen: dict[str, int] = {}
        for text in short.values():
            seen[text] = seen.get(text, 0) + 1
        widening.update(name for name, text in short.items() if seen[text] > 1)
        # a clashing name that still drops an index would be told apart by luck, not by it
        grow = [
            name for name in widening
            if short[name] != name and (seen[short[name]] > 1 or _kept_indices(short[name]) < _indices(name.split(".")))
        ]
        if not grow:
            return [short[name] for name in names]
        for name in grow:
            widths[name] += 1


def name_list(names: Sequence[str], width: int, *, most: int = 8) -> str:
    """``'a', 'b' and 'c'``: the names quoted, each shortened in the middle to ``width``;
    over ``most`` names, the first and last few with the count of the others between.

    Args:
        names: module or tensor names.
        width: the characters each name may have.
        most: the most names shown.
    """
    shown = [repr(name) for name in shorten_names(names, width)]
    if len(shown) > most:
        keep = most // 2
        shown = [*shown[:keep], f"{ELLIPSIS} {len(shown) - 2 * keep} more {ELLIPSIS}", *shown[-keep:]]
    return and_list(shown)


def and_list(items: Sequence[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"
