"""What a console script does with an error: one line, a documented exit code, a traceback on request.

Bad input (a config value, a file, a name) raises `InputError` with a message that names the key or
file, what was expected and what to do. Every `dart-*` command prints any error as one line,
`dart-<cmd>: error: <message>`, and exits with

    2  bad input: the command refused before (or instead of) doing the work; nothing was written
    1  the run failed for another reason (a bug, an out-of-memory, a failed write)
    130  interrupted (Ctrl-C / SIGTERM)

`DART_DEBUG=1` prints the full traceback as well (README "When something goes wrong").
"""

from __future__ import annotations

import os
import sys
import traceback

DEBUG_ENV = "DART_DEBUG"
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


class InputError(ValueError):
    """A bad value, file or name given by the user. The message is one line and says how to fix it."""


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def _is_bad_input(err: BaseException) -> bool:
    """Errors that mean 'the input is wrong' rather than 'the program failed'."""
    from omegaconf.errors import OmegaConfBaseException

    from ngram_builder import NgramFormatError, NgramMismatchError
    from ngram_builder.build import MalformedLineError

    if isinstance(err, (InputError, OmegaConfBaseException, FileNotFoundError, NotADirectoryError,
                        IsADirectoryError, NgramFormatError, NgramMismatchError, MalformedLineError)):
        return True
    try:  # Hydra's own config errors (unknown group option, bad override syntax, missing key)
        from hydra.errors import HydraException

        return isinstance(err, HydraException)
    except ImportError:  # pragma: no cover - hydra is a dependency
        return False


def one_line(err: BaseException) -> str:
    """The error as one line: its message (first line, whitespace folded), its type when that helps."""
    text = " ".join(str(err).split()) if str(err).strip() else ""
    if isinstance(err, KeyError) and err.args:
        text = str(err.args[0])
    if not text:
        return type(err).__name__
    if isinstance(err, (InputError, OSError)) or type(err).__module__.startswith(("dart_", "ngram_builder")):
        return text
    return f"{type(err).__name__}: {text}"


def report(err: BaseException, command: str) -> int:
    """Print `err` for a user (one line on stderr; the traceback too under DART_DEBUG=1); the exit code."""
    if isinstance(err, KeyboardInterrupt):
        print(f"{command}: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    if debug_enabled():
        traceback.print_exception(err, file=sys.stderr)
    code = EXIT_BAD_INPUT if _is_bad_input(err) else EXIT_FAILED
    hint = "" if debug_enabled() or code == EXIT_BAD_INPUT else f" ({DEBUG_ENV}=1 shows the traceback)"
    print(f"{command}: error: {one_line(err)}{hint}", file=sys.stderr, flush=True)
    return code
