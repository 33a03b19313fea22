"""The command line's exit statuses, and how a usage error is reported with one.

``dpverify.cli.main`` and the self-test (``python -m dpverify.cli.selftest`` under torchrun)
both end with these; neither imports the other to get them.
"""

from __future__ import annotations

import sys

from dpverify.core.errors import InvalidArgument
from dpverify.core.tracebacks import user_traceback

__all__ = [
    "EXIT_BROKEN_PIPE",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_NOTHING_CHECKED",
    "EXIT_OK",
    "EXIT_USAGE",
    "usage_error",
]

#: Every check that ran passed (or differed for an explained reason).
EXIT_OK = 0
#: A check failed; the report says which and why.
EXIT_FAILED = 1
#: An argument cannot be used; the message names it (argparse's own errors exit 2 too).
EXIT_USAGE = 2
#: Nothing was checked: every check was skipped, and the reasons are printed.
EXIT_NOTHING_CHECKED = 3
#: ``fuzz`` was interrupted (Ctrl-C) before a failure or its limit: 128 + SIGINT.
EXIT_INTERRUPTED = 130
#: The reader of the output went away (``dpverify check ... | head``): 128 + SIGPIPE, as a
#: shell tool killed by the closed pipe reports it.
EXIT_BROKEN_PIPE = 141


def usage_error(command: str, error: InvalidArgument) -> int:
    """Prints the message, and the user's frames when the user's code raised it (its
    ``__cause__``); returns ``EXIT_USAGE``."""
    print(f"dpverify {command}: {error}", file=sys.stderr)
    frames = user_traceback(error.__cause__) if error.__cause__ is not None else ""
    if frames:
        print(frames, file=sys.stderr)
    return EXIT_USAGE
