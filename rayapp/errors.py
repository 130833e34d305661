"""Errors meant for a person: the CLI prints their message on one line and exits non-zero; and
the one way rayapp cuts a long error down to the line it shows."""


class RayappError(RuntimeError):
    """Something rayapp cannot do as asked; the message says what and how to fix it."""


def first_line(text: object) -> str:
    """The first non-blank line of `text` (a message or an exception), stripped; "" when there is
    none. A one-line error has room for no more of a long report."""
    return next((line.strip() for line in str(text).splitlines() if line.strip()), "")


def cause_line(error: BaseException) -> str:
    """The line that names what went wrong in `error`, for a one-line message: Ray wraps a remote
    error in a long report whose last line is the original exception ("ValueError: ..."), so this
    is the last non-blank line of the innermost cause, or its type's name when it says nothing."""
    while error.__cause__ is not None:
        error = error.__cause__
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__
