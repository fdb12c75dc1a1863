"""Errors that a user can act on: a damaged or malformed file, a bad setting. Every command line
(generate, eval, train, serve) prints them as one `error:` line and exits 2, without a traceback."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence


class InputError(ValueError):
    """Bad input: the message names the file or setting, what is wrong and what to do."""


class DamagedFileError(InputError):
    """A file that cannot be read as what it claims to be (truncated, corrupt, wrong format)."""

    def __init__(self, path: str, problem: str, fix: str):
        super().__init__(f"{path}: {problem}; {fix}")
        self.path = path


# What the command lines turn into `error:` lines. Anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError,
               ImportError)


def one_line(message: str) -> str:
    """An error message on one line: lists of problems are joined with '; ' (after a heading's ':', a space)."""
    text = ""
    for part in (p.strip() for p in str(message).splitlines()):
        if part:
            text += part if not text else (" " if text.endswith(":") else "; ") + part
    return text


def run_command(main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None) -> int:
    """Runs a command-line `main`, turning user errors into one `error:` line and exit status 2."""
    try:
        return main(argv)
    except USER_ERRORS as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2


class OneLineErrorParser(argparse.ArgumentParser):
    """Usage mistakes print one `error:` line and exit 2, like every other bad input here."""

    def error(self, message):
        self.exit(2, f"error: {one_line(message)} (see --help)\n")
