"""The two ways ``csattn train`` ends on purpose: a user mistake (options, files, environment) and a run that
cannot go on (non-finite steps, non-finite weights at a save). The command line prints their message as one line
and exits non-zero; every other exception is a bug and keeps its traceback. Its warnings to the user are
:class:`TrainWarning`s, which the command line prints as one plain line each."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["UserError", "TrainingStopped", "TrainWarning", "user_errors"]


class UserError(ValueError):
    """A mistake the user fixes (the message names the option or file and what to do); ``csattn train`` exits 2.
    A ``ValueError``, so callers of the Python API catch it as before. Deterministic from the options and files,
    so under torch.distributed every rank raises it alike."""


class TrainingStopped(RuntimeError):
    """The run stopped itself (the message says why and what to do); ``csattn train`` exits 1. Decided from
    all-reduced values, so every rank stops alike."""


class TrainWarning(UserWarning):
    """Something the user should know about a run that goes on (an option the checkpoint overrides, fresh MTP
    weights, no plot). ``csattn train`` prints it as ``csattn train: warning: <message>``, without Python's source
    line; the Python API sees an ordinary ``UserWarning``. Raised by rank 0 alone when it is the same on every rank."""


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn the ``ValueError``s of a phase that only checks user input (options, checkpoints, data files) into
    :class:`UserError`; the phase's other exceptions, and every ``ValueError`` outside such phases, stay bugs."""
    try:
        yield
    except UserError:
        raise
    except ValueError as e:
        raise UserError(str(e)) from e
