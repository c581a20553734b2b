"""Errors the user can fix: each becomes one line on stderr and exit status 2 in the CLI."""


class UsageError(ValueError):
    """Bad arguments or configuration."""


class DataError(UsageError):
    """A dataset file or directory that is missing, malformed or unsafe."""


class ClusterError(UsageError):
    """A scheduler that cannot be reached, or no worker that can run a stage."""


class ResumeError(UsageError):
    """A checkpoint that does not belong to this run or cannot be read."""


class DivergenceError(RuntimeError):
    """NaN or Inf appeared in a loss or in the weights."""
