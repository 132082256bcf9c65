"""The project's error for expected failures: bad input, bad paths and data, output-directory conflicts, resume
problems, missing extras, unreachable Hub ids.

`MarlhfError` is a ValueError, the type every marlhf check raises for bad input, so `except ValueError` catches
both. The command line prints either as one line, `marlhf: error: ...`, and exits with 2; `--verbose` shows the
traceback. Anything else (a bug) keeps its traceback.
"""

from __future__ import annotations

import difflib

__all__ = ["MarlhfError", "one_line", "did_you_mean"]


class MarlhfError(ValueError):
    """An expected failure, reported to the user in one line."""


def did_you_mean(word: str, choices) -> str:
    """' (did you mean X?)' for the closest of `choices`, or ''."""
    close = difflib.get_close_matches(word, [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def one_line(error: BaseException) -> str:
    """The error's message on one line (a file error names its file)."""
    if isinstance(error, OSError) and error.filename is not None:
        text = f"{error.strerror or error}: {error.filename}"
    else:
        text = str(error) or type(error).__name__
    return " ".join(text.split())
