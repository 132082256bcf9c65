"""The project's errors for expected failures, and the exit code of each class (docs/reliability.md).

    MarlhfError (exit 2)     bad input: options, config files, paths, data, output-directory conflicts, resume
                             problems, unreachable Hub ids; raised before anything is written, or with the run's
                             earlier output untouched
    MissingPackage (exit 3)  an optional package that this use needs is not installed
    OutOfMemory (exit 4)     the device (or the host) ran out of memory; the checkpoints saved so far are complete
    Interrupted (exit 130)   Ctrl-C (SIGINT); the checkpoints saved so far are complete and `--resume latest`
                             continues from the newest; SIGTERM during a trainer: the same, exit 143

`MarlhfError` is a ValueError, the type every marlhf check raises for bad input, so `except ValueError` catches
both. The command line (marlhf.cli) prints any of them, a plain ValueError (exit 2) and an OSError about the
user's files (exit 2) as one line, `marlhf: error: ...`; `--verbose` adds the traceback. Anything else is a bug
in marlhf: its traceback, then a line asking for a report (exit 1).
"""

from __future__ import annotations

import difflib
import os

__all__ = ["MarlhfError", "MissingPackage", "OutOfMemory", "Interrupted", "USAGE_EXIT", "one_line", "did_you_mean"]

USAGE_EXIT = 2  # argparse's code for a usage error; every input error shares it


class MarlhfError(ValueError):
    """An expected failure, reported to the user in one line."""

    exit_code = USAGE_EXIT


class MissingPackage(MarlhfError):
    """An optional package is not installed; the line names the install command."""

    exit_code = 3


class OutOfMemory(MarlhfError):
    """The device or host memory ran out; the line names the options that lower it."""

    exit_code = 4


class Interrupted(MarlhfError):
    """Ctrl-C; the line says what was saved and how to continue."""

    exit_code = 130  # 128 + SIGINT, as a shell reports a process killed by Ctrl-C


def did_you_mean(word: str, choices) -> str:
    """' (did you mean X?)' for the closest of `choices`, or ''."""
    close = difflib.get_close_matches(word, [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def one_line(error: BaseException) -> str:
    """The error's message on one line (a file error names its file)."""
    if isinstance(error, (FileExistsError, NotADirectoryError)) and error.filename is not None \
            and not os.path.isdir(error.filename):  # mkdir of an output directory where a file is (or in one)
        text = (f"cannot make the directory {error.filename}: a file is in the way ({error.strerror}); give another "
                "output directory or move the file")
    elif isinstance(error, OSError) and error.filename is not None:
        text = f"{error.strerror or error}: {error.filename}"
    else:
        text = str(error) or type(error).__name__
    return " ".join(text.split())
