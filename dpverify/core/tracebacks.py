"""What the user's code raised, told without dpverify's own frames: one line for a table,
and the traceback from the first frame the user wrote."""

from __future__ import annotations

import importlib
import os
import sysconfig
import traceback

__all__ = ["describe_exception", "failure_detail", "user_traceback"]

#: Frames a user never wrote: dpverify's own, and the import machinery's.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_IMPORTLIB_DIR = os.path.dirname(os.path.abspath(importlib.__file__)) + os.sep
#: Where installed libraries and the standard library live (torch, site, ...).
_LIBRARY_DIRS = tuple(
    {os.path.abspath(path) + os.sep for key, path in sysconfig.get_paths().items() if key in ("stdlib", "platstdlib", "purelib", "platlib")}
)


def describe_exception(error: BaseException) -> str:
    """``Type: message`` on one line; a ``SystemExit`` says that something asked to exit.

    ``quit()`` and ``sys.exit()`` print nothing and carry no message, so the text names them.
    """
    if isinstance(error, SystemExit):
        return f"SystemExit({error.code!r}): the code under test called sys.exit(), exit() or quit()"
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def _hidden_frame(filename: str) -> bool:
    return filename.startswith("<frozen ") or os.path.abspath(filename).startswith((_PACKAGE_DIR, _IMPORTLIB_DIR))


def user_traceback(error: BaseException) -> str:
    """The traceback of ``error`` as the user's code saw it, or ``""`` if none of it is theirs.

    dpverify's frames and the import machinery's are left out, and so are the library frames
    (torch's ``Module.__call__``) above the first frame of the user's code; the library
    frames below it stay, as they say where the error was raised. The exception's notes
    are kept.
    """
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if not _hidden_frame(frame.filename)]
    first_own = next((i for i, frame in enumerate(frames) if not os.path.abspath(frame.filename).startswith(_LIBRARY_DIRS)), None)
    if first_own is None:
        return ""  # nothing of the user's: the message alone says it better
    lines = ["Traceback (most recent call last; dpverify's own frames left out):\n"]
    lines += traceback.format_list(frames[first_own:])
    lines += traceback.format_exception_only(type(error), error)
    return "".join(lines).rstrip("\n")


def failure_detail(error: BaseException) -> str:
    """A failed check's report of ``error``: ``describe_exception``'s line, then the user's
    frames, or the exception and its notes alone when none of the frames is the user's."""
    frames = user_traceback(error) or "".join(traceback.format_exception_only(type(error), error)).rstrip("\n")
    return f"{describe_exception(error)}\n{frames}"
