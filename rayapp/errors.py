"""Errors meant for a person: the CLI prints their message on one line and exits non-zero."""


class RayappError(RuntimeError):
    """Something rayapp cannot do as asked; the message says what and how to fix it."""
