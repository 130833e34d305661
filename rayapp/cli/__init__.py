"""The `rayapp` command line. Thin: parse flags, build the spec, call the library; nothing else in
rayapp imports it."""

from rayapp.cli.app import main

__all__ = ["main"]
