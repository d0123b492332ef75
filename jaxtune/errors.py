"""Errors a user can act on: each message is one line naming the problem and the fix."""

from __future__ import annotations


class JaxtuneError(Exception):
    """Base class for jaxtune's user-facing errors; the CLI prints these as one line and exits non-zero."""


class UnsupportedModelError(JaxtuneError, ValueError):
    """The checkpoint is of an architecture or variant jaxtune does not implement."""


class CheckpointError(JaxtuneError, ValueError):
    """A checkpoint is missing, truncated, corrupt or inconsistent."""
