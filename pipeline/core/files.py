"""Reading the files a user hands us: regular files only, never more bytes than the format allows.

Every file we load (CIFAR batches and archives, weights, checkpoints, ``config.json``,
``metrics.jsonl``) is opened here. A FIFO, a socket or a device (``/dev/zero``) would block the
open or never end, so the open does not block and anything but a regular file is refused before
a byte is read. A size limit is checked against the file's size before reading, and the read
itself stops one byte past the limit, so a file that grows meanwhile is refused too.

Errors are one line naming the path; the caller picks the class (``DataError`` for data,
``ResumeError`` for run directories).
"""
from __future__ import annotations

import contextlib
import os
import stat
from typing import BinaryIO

from pipeline.core.errors import DataError, one_line

KIB, MIB = 1 << 10, 1 << 20
_os_open = os.open  # the one call that opens; tests replace it to simulate permission errors


def describe(mode: int) -> str:
    """What a non-regular file is, in words.

    >>> describe(stat.S_IFIFO), describe(stat.S_IFCHR)
    ('a FIFO (named pipe)', 'a character device')
    """
    for test, words in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                        (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return words
    return "not a regular file"


def os_reason(exc: BaseException) -> str:
    """Why an OS call (or a file parser) failed, for the parentheses of a one-line message: the
    ``strerror`` when there is one, at most 200 characters.

    >>> os_reason(PermissionError(13, "Permission denied", "/x"))
    'Permission denied'
    """
    return one_line(exc, kind=False, limit=200)


def open_regular(path: str | os.PathLike, error: type[Exception] = DataError) -> BinaryIO:
    """Open ``path`` for binary reading if it is a regular file; ``error`` with one line if not.

    The open itself does not block (``O_NONBLOCK``: opening a FIFO with no writer would wait
    forever); the descriptor is checked with ``fstat``, so a path swapped after a check cannot
    slip a FIFO in.

    >>> open_regular("/dev/zero")
    Traceback (most recent call last):
    pipeline.core.errors.DataError: /dev/zero: is a character device, expected a regular file
    """
    path = os.fspath(path)
    try:
        fd = _os_open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except IsADirectoryError:
        raise error(f"{path}: is a directory, expected a file") from None
    except PermissionError:
        raise error(f"{path}: cannot read the file (permission denied)") from None
    except OSError as exc:
        raise error(f"{path}: cannot read the file ({os_reason(exc)})") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise error(f"{path}: is a directory, expected a file")
        if not stat.S_ISREG(mode):
            raise error(f"{path}: is {describe(mode)}, expected a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def size_of(f: BinaryIO) -> int:
    """Bytes in the open regular file ``f``."""
    return os.fstat(f.fileno()).st_size


def check_size(path, size: int, limit: int, what: str, error: type[Exception] = DataError) -> None:
    """``error`` when ``size`` exceeds ``limit``.

    >>> check_size("x", 11, 10, "a meta file")
    Traceback (most recent call last):
    pipeline.core.errors.DataError: x: 11 bytes is more than a meta file can hold (at most 10 bytes)
    """
    if size > limit:
        raise error(f"{os.fspath(path)}: {size} bytes is more than {what} can hold "
                    f"(at most {limit} bytes)")


def read_capped(path: str | os.PathLike, limit: int, what: str,
                error: type[Exception] = DataError) -> bytes:
    """All bytes of the regular file ``path``, refusing one larger than ``limit`` bytes.

    ``what`` names the format in the message ("a CIFAR batch file").
    """
    with open_regular(path, error) as f:
        size = size_of(f)
        check_size(path, size, limit, what, error)
        try:  # read(limit + 1) would reserve the whole limit (256 MiB for an image) at once
            data = f.read(size + 1)
            if len(data) > size:  # grown since, or a file that reports no size (/proc)
                data += f.read(limit + 1 - len(data))
        except OSError as exc:
            raise error(f"{os.fspath(path)}: cannot read the file ({os_reason(exc)})") from None
    check_size(path, len(data), limit, what, error)
    return data


def read_text(path: str | os.PathLike, limit: int, what: str,
              error: type[Exception] = DataError) -> str:
    """A UTF-8 text file read with :func:`read_capped`; undecodable bytes are an ``error``."""
    raw = read_capped(path, limit, what, error)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{os.fspath(path)}: not UTF-8 text (byte {exc.start})") from None


# ---------------------------------------------------------------------------------------------
# Writing inside a run's output directory: never through a symbolic link


def open_append(path: str | os.PathLike, error: type[Exception] = DataError, text: bool = True):
    """``path`` opened for appending, created if missing, the way every file a run appends to
    (``metrics.jsonl``, ``metrics.csv``, ``dashboard.log``) opens: never through a symbolic link
    (``O_NOFOLLOW``: the lines go into this directory or nowhere), without blocking (a FIFO with no
    reader is refused, not waited on), and only if it is a regular file.

    >>> import tempfile; d = tempfile.mkdtemp(); os.symlink("/tmp", d + "/x")
    >>> open_append(d + "/x")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    pipeline.core.errors.DataError: .../x: is a symbolic link; a run writes only inside its directory (remove the link)
    """
    path = os.fspath(path)
    flags = (os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
             | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        fd = os.open(path, flags, 0o666)  # the umask applies, as for every output
    except OSError as exc:
        refuse_link(path, error)
        with contextlib.suppress(OSError):  # a FIFO with no reader: ENXIO
            mode = os.lstat(path).st_mode
            if not stat.S_ISREG(mode):
                raise error(f"{path}: is {describe(mode)}, expected a regular file") from None
        raise error(f"cannot write {path}: {os_reason(exc)}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise error(f"{path}: is {describe(mode)}, expected a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "a" if text else "ab", newline="" if text else None)
    except BaseException:
        os.close(fd)
        raise


_LINK = "is a symbolic link; a run writes only inside its directory (remove the link)"


def refuse_link(path: str | os.PathLike, error: type[Exception] = DataError) -> None:
    """``error`` if ``path`` is a symbolic link (a run's outputs are never written through one)."""
    if os.path.islink(path):
        raise error(f"{os.fspath(path)}: {_LINK}")


def own_dir(path: str | os.PathLike, error: type[Exception] = DataError) -> str:
    """``path`` made (with its parents) and checked to be a directory of its own, not a symbolic
    link to one elsewhere: what a run writes under it stays under its output directory.

    >>> import tempfile; d = tempfile.mkdtemp(); os.symlink("/tmp", d + "/tb")
    >>> own_dir(d + "/tb")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    pipeline.core.errors.DataError: .../tb: is a symbolic link; a run writes only inside its directory (remove the link)
    """
    path = os.fspath(path)
    refuse_link(path, error)
    try:
        os.makedirs(path, exist_ok=True)
        mode = os.lstat(path).st_mode
    except OSError as exc:
        raise error(f"cannot write {path}: {os_reason(exc)}") from None
    if stat.S_ISLNK(mode):
        raise error(f"{path}: {_LINK}")
    if not stat.S_ISDIR(mode):
        raise error(f"{path}: is {describe(mode)}, expected a directory")
    return path


def links_in(root: str | os.PathLike, names) -> list[str]:
    """Which of ``names`` (entries of the directory ``root``) are symbolic links.

    >>> import tempfile; d = tempfile.mkdtemp(); os.symlink("/tmp", d + "/tensorboard")
    >>> links_in(d, ["tensorboard", "metrics.jsonl"])
    ['tensorboard']
    """
    return [name for name in names if os.path.islink(os.path.join(root, name))]


def regular_or_absent(path: str | os.PathLike) -> bool:
    """True if ``path`` is missing or a regular file (symlinks followed); False for anything else.

    >>> regular_or_absent("/nonexistent/x"), regular_or_absent("/dev/null")
    (True, False)
    """
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        return stat.S_ISREG(os.stat(path).st_mode)
    return True
