"""The user-error hierarchy: what the CLI reports as one line (``alignkit: error: ...``, exit 2).

Anything else that escapes a command is a bug in alignkit (or a library) and is shown with its
traceback. Each class keeps the built-in base it replaced (``ValueError``, ``KeyError``) so callers
that caught those keep working.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user (config, data, files, environment): the message is one line that
    names the key, file, row or value and what was expected."""


class ConfigError(UserError, ValueError):
    """A bad config: names the dotted key and what was expected."""


class DataError(UserError, ValueError):
    """A bad data row or file: names the file and line."""


class UnknownNameError(UserError, KeyError):
    """A registry lookup of a name that is not registered (names the closest valid one)."""

    def __str__(self) -> str:  # KeyError quotes its message; a user reads it as a sentence
        return str(self.args[0]) if self.args else ""


class ModelError(UserError, ValueError):
    """A model directory that cannot be used as asked (missing, wrong kind, no dimensions)."""


class TrainingError(UserError, RuntimeError):
    """Training cannot go on for a reason the user can act on (e.g. the loss stays non-finite)."""


__all__ = ["ConfigError", "DataError", "ModelError", "TrainingError", "UnknownNameError", "UserError"]
