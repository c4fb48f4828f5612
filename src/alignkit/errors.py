"""The user-error hierarchy: what the CLI reports as one line (``alignkit: error: ...``, exit 2).

Anything else that escapes a command is a bug in alignkit (or a library) and is shown with its
traceback. Each class keeps the built-in base it replaced (``ValueError``, ``KeyError``) so callers
that caught those keep working.

Under a launcher every rank runs the same command, so an error that follows from the config, the data
or the model files alone is raised by every rank at once; such classes say ``same_on_every_rank`` and
the CLI lets local rank 0 print them (one line, not one per rank). Errors that can belong to one rank
(a pre-flight failure naming a rank) keep the default ``False`` and are printed by the rank that hit
them.
"""

from __future__ import annotations

import signal
from pathlib import Path


class UserError(Exception):
    """Bad input from the user (config, data, files, environment): the message is one line that
    names the key, file, row or value and what was expected."""

    #: raised identically by every rank of a run (see the module docstring); an instance may override it
    same_on_every_rank: bool = False


class ConfigError(UserError, ValueError):
    """A bad config: names the dotted key and what was expected."""

    same_on_every_rank = True


class DataError(UserError, ValueError):
    """A bad data row or file: names the file and line.

    ``cause`` is a short phrase for the kind of problem ("not valid JSON"): with ``data.skip_invalid``
    the row is skipped and counted under it.
    """

    same_on_every_rank = True

    def __init__(self, message: str, *, cause: str = "malformed") -> None:
        super().__init__(message)
        self.cause = cause


class UnknownNameError(UserError, KeyError):
    """A registry lookup of a name that is not registered (names the closest valid one)."""

    same_on_every_rank = True

    def __str__(self) -> str:  # KeyError quotes its message; a user reads it as a sentence
        return str(self.args[0]) if self.args else ""


class ModelError(UserError, ValueError):
    """A model directory that cannot be used as asked (missing, wrong kind, no dimensions, corrupt weights)."""

    same_on_every_rank = True


class TrainingError(UserError, RuntimeError):
    """Training cannot go on for a reason the user can act on (e.g. the loss stays non-finite)."""


__all__ = ["ConfigError", "DataError", "ModelError", "TrainingError", "UnknownNameError", "UserError"]


class Interrupted(Exception):
    """Not an error: training stopped early on a signal (Ctrl-C, a scheduler's SIGTERM) at ``step``, after
    saving ``checkpoint`` (``checkpoint.save_on_interrupt``, :mod:`alignkit.train.interrupt`). The CLI says so
    in one line with the resume command and exits 128 + the signal."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(f"interrupted by {signal.Signals(signum).name} at step {step}")

    @property
    def exit_code(self) -> int:
        """The shell's status for a process ended by the signal: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + self.signum
