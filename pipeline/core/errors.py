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


class Interrupted(Exception):
    """The run stopped on request (SIGINT/SIGTERM) at a round boundary; ``exit_status`` is 130/143.

    The message is the one line to print: where it stopped and how to go on.
    """

    def __init__(self, message: str, exit_status: int):
        super().__init__(message)
        self.exit_status = exit_status


def one_line(exc: BaseException, *, kind: bool = True, limit: int | None = None) -> str:
    """``Type: message`` on one line: the one formatter for errors that end up in a message.

    Messages of distributed and of the OS carry newlines and hints; ``strerror`` is preferred when
    the exception has one. ``kind=False`` leaves the type out when the message has text;
    ``limit`` cuts the text to that many characters.

    >>> one_line(ValueError("bad\\n  value"))
    'ValueError: bad value'
    >>> one_line(FileNotFoundError(2, "No such file or directory", "x"))
    'FileNotFoundError: No such file or directory'
    >>> one_line(KeyError()), one_line(OSError("gone"), kind=False)
    ('KeyError', 'gone')
    """
    text = " ".join(str(getattr(exc, "strerror", None) or exc).split())
    if not text:
        text = type(exc).__name__
    elif kind:
        text = f"{type(exc).__name__}: {text}"
    return text[:limit] if limit else text


class OutputError(UsageError):
    """The output directory cannot be written (disk full, permissions, a file where a directory
    belongs). Not lost cluster work: the driver never replays for it."""
