"""The spec's one error type; the CLI prints its message on one line and exits 2."""


class SpecError(ValueError):
    """A job spec value is invalid. The message is one line, meant for a person: the field, the bad
    value, what is accepted."""
