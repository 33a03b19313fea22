"""The likely cause and the fix when the ranks cannot import the main module: every rank is
a new process that imports it again (forkserver and spawn start methods)."""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Sequence

from dpverify.ddp.runner import RankFailure

__all__ = ["RERUN_MARKER", "importing_main_again", "main_module_advice"]

#: In the error a rank raises when it finds itself re-running the main module.
RERUN_MARKER = "re-ran the main module"


def _main_module() -> tuple[str, str]:
    """How a new process (forkserver, spawn) finds this process's main module: ``(kind,
    where)`` with kind ``"module"`` (``python -m``, run again by name), ``"script"`` (run
    again from its file), ``"nofile"`` (``<stdin>``: multiprocessing tries a file of that
    name), ``"none"`` (``python -c``, a REPL, a notebook: not imported at all) or
    ``"package"`` (a package's ``__main__``, which multiprocessing leaves alone)."""
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if isinstance(name, str):
        return ("package" if name == "__main__" or name.endswith(".__main__") else "module"), name
    path = getattr(main, "__file__", None)
    if not isinstance(path, str):
        return "none", ""
    origin = multiprocessing.process.ORIGINAL_DIR or os.getcwd()  # type: ignore[attr-defined]
    full = path if os.path.isabs(path) else os.path.join(origin, path)
    return ("script", full) if os.path.isfile(full) else ("nofile", path)


_GUARD = "`if __name__ == '__main__':`"
_IMPORTABLE = (
    "define models, loss functions and steps in an importable module (a .py file on "
    "sys.path) and import them"
)


def main_module_advice(failures: Sequence[RankFailure], starting: bool) -> str:
    """The likely cause and the fix when the ranks could not import the main module, or what
    it defines; empty otherwise. Every rank is a new process that imports the main module
    again (forkserver and spawn start methods), so its top-level code runs in every rank."""
    text = "\n".join(f.traceback for f in failures)
    kind, where = _main_module()
    anew = (
        "Every DDP rank is a new process that imports the main module again "
        "(multiprocessing's forkserver and spawn start methods run it as '__mp_main__')"
    )
    again = f"{anew}, so its top-level code runs in every rank."
    if RERUN_MARKER in text:
        script = f"the script {where}" if kind == "script" else f"the main module {where or '__main__'}"
        return (
            f"dpverify: likely cause: {script} has no {_GUARD} guard. {again} The ranks re-ran "
            "the code that calls dpverify and tried to start ranks of their own. Fix: put the "
            f"code that calls dpverify under {_GUARD}, keeping models, loss functions and steps "
            "defined at the top level, where the ranks import them from."
        )
    reimport = "_fixup_main_from_path" in text or "_fixup_main_from_name" in text
    silent = starting and bool(failures) and all(f.kind == "exited" for f in failures)
    if kind == "nofile" and (reimport or silent):
        return (
            f"dpverify: likely cause: the main module is {where!r}, code fed on standard input "
            f"(python - < script.py). {anew}, and code read from standard input has no file to "
            "import it from. Fix: save the "
            f"code as a script and run it as a file, with the code that calls dpverify under "
            f"{_GUARD}; for stdin and notebooks, {_IMPORTABLE}."
        )
    if reimport:
        return (
            f"dpverify: the ranks failed while importing the main module {where} again. {again} "
            f"Fix: keep only definitions at its top level and put the rest, including the code "
            f"that calls dpverify, under {_GUARD}."
        )
    if "on <module '__main__'" in text or "on <module '__mp_main__'" in text:
        if kind in ("none", "nofile"):
            return (
                "dpverify: likely cause: the main module has no file (python -c, an interactive "
                "session, a notebook or standard input), so the ranks cannot import the classes "
                f"and functions defined in it. Fix: {_IMPORTABLE}; or run a script file with "
                f"the code that calls dpverify under {_GUARD}."
            )
        return (
            f"dpverify: likely cause: a class or function sent to the ranks is defined under "
            f"{_GUARD} or inside a function of the main module {where}; the ranks import the "
            "main module without running that block. Fix: define it at the top level of the "
            f"script, or {_IMPORTABLE}."
        )
    if silent and kind in ("script", "module"):
        return (
            "dpverify: the ranks exited while starting, before they could report anything; "
            f"their error is on this process's standard error. {again} If that error shows the "
            f"main module {where} being imported again, put the code that calls dpverify under "
            f"{_GUARD}."
        )
    return ""


def importing_main_again() -> str:
    """In a new process that is still importing the main module, the cause and the fix: the
    main module starts DDP ranks at its top level, and this process is one of those ranks
    (or any other process that multiprocessing started), re-running it. Empty elsewhere; the
    pool raises it as a ``ParallelError``, which its parent shows."""
    process = multiprocessing.current_process()
    # Set while multiprocessing prepares a child; no public API tells (spawn.py reads it too).
    if not getattr(process, "_inheriting", False):
        return ""
    # multiprocessing runs the main script as '__mp_main__'; '__main__' is still the fork
    # server's own until that run ends.
    rerun = sys.modules.get("__mp_main__")
    where = getattr(rerun, "__file__", None) or getattr(getattr(rerun, "__spec__", None), "name", None)
    return (
        f"{process.name} {RERUN_MARKER} {where or '__main__'}, which starts DDP ranks at its "
        f"top level (no {_GUARD} guard)\nThe ranks are new processes that import the main "
        f"module again; put the code that calls dpverify under {_GUARD}."
    )

