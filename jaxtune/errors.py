"""Errors a user can act on: each message is one line naming the problem and the fix."""

from __future__ import annotations


class JaxtuneError(Exception):
    """Base class for jaxtune's user-facing errors; the CLI prints these as one line and exits non-zero."""


class UnsupportedModelError(JaxtuneError, ValueError):
    """The checkpoint is of an architecture or variant jaxtune does not implement."""


class CheckpointError(JaxtuneError, ValueError):
    """A checkpoint is missing, truncated, corrupt or inconsistent."""


class ConfigError(JaxtuneError, ValueError):
    """A training option is out of range, of the wrong type, unknown, or in a combination that cannot work."""

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.field = field  # the TrainConfig field at fault, so the CLI can name its flag
