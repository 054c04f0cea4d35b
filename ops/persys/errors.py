"""The CLI's failures, each with the exit status it ends the process with.

0 success; 1 the scheduler refused (its reason printed); 2 a usage or input error (a bad file
names its line); 3 the scheduler cannot be reached (naming the address and the cause).
"""

from __future__ import annotations

REFUSED = 1
INPUT = 2
UNREACHABLE = 3


class CliError(Exception):
    """A failure to report in one line, without a traceback."""

    exit_code = REFUSED


class Refused(CliError):
    """The scheduler answered, and said no."""

    exit_code = REFUSED


class InputError(CliError):
    """What the operator gave cannot be used (a file, a flag's value)."""

    exit_code = INPUT


class Unreachable(CliError):
    """No answer from the scheduler: not listening, a failed handshake, a deadline."""

    exit_code = UNREACHABLE
