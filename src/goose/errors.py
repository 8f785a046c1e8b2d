"""The one exception type users see: a clear, one-line message about bad input or an unsupported setup."""


class GooseError(ValueError):
    """Bad input or unsupported configuration; the message says what to change."""
