"""Reading a CIFAR file's bytes from a plain file or one pass over a tarball, capped by its format.

A read is refused before it starts where a file or member is larger than its format allows
(``layout.MAX_*``); tarballs are never extracted.
"""
from __future__ import annotations

import os
import tarfile
import zlib

from pipeline.core import errors
from pipeline.core.errors import DataError
from pipeline.core.files import check_size, open_regular, os_reason, read_capped
from pipeline.data.cifar.layout import (LAYOUTS, MAX_BINARY_BATCH_BYTES, MAX_IMAGES_PER_FILE,
                                        MAX_META_BYTES, MAX_PYTHON_BATCH_BYTES, Layout,
                                        layout_of_top)

_MAX_TAR_HEADER = 64 << 10  # a pax or GNU long-name header; ours and the official ones are none
_MAX_TAR_TRAILER = 1 << 20  # zero padding after the end-of-archive blocks (tar pads to 10 KiB)


def limit_of(lay: Layout, name: str) -> tuple[int, str]:
    """(most bytes, what it is) that file ``name`` of layout ``lay`` may hold.

    >>> limit_of(LAYOUTS["cifar10-binary"], "test_batch.bin")
    (184380000, 'a CIFAR binary batch of at most 60000 images')
    """
    if name == lay.meta:
        return MAX_META_BYTES, "a CIFAR meta file"
    if lay.key == "cifar10-binary":
        return (MAX_BINARY_BATCH_BYTES,
                f"a CIFAR binary batch of at most {MAX_IMAGES_PER_FILE} images")
    return MAX_PYTHON_BATCH_BYTES, f"a CIFAR python batch of at most {MAX_IMAGES_PER_FILE} images"


def read_file(path: str, lay: Layout) -> bytes:
    """All bytes of a regular file, at most what its format allows; one-line errors."""
    return read_capped(path, *limit_of(lay, os.path.basename(path)))


class _MemberError(DataError):
    """A problem with one tar member, raised where the archive's path is not known."""


class _CappedTarInfo(tarfile.TarInfo):
    """Refuses, before tarfile reads them whole into memory, pax and GNU long-name headers larger
    than any real archive has, and old-style GNU sparse members (a small sparse member can
    expand to terabytes)."""

    def _proc_member(self, tarfile_):  # tarfile's documented hook for member processing
        if self.type == tarfile.GNUTYPE_SPARSE:
            raise _MemberError(f"{self.name[:80]}: is a sparse file, not a regular file")
        if self.type in (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE,
                         tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK) \
                and self.size > _MAX_TAR_HEADER:
            raise DataError(f"an extended tar header of {self.size} bytes (at most "
                            f"{_MAX_TAR_HEADER})")
        return super()._proc_member(tarfile_)


def read_archive(path: str, wanted: set[str] | None
                  ) -> tuple[str, dict[str, bytes], set[str]]:
    """(top directory, {member name: bytes}, every member name) of a tarball, in one sequential
    pass, never extracted.

    ``wanted=None`` reads every file of the layout that the top directory names and checks the
    whole archive: members elsewhere, nested directories, links, sparse files and a name twice
    are errors, as is a member larger than its format allows (checked before it is read).
    """
    f = open_regular(path)
    top, out, seen = None, {}, set()
    try:
        with f, tarfile.open(fileobj=f, mode="r:*", tarinfo=_CappedTarInfo) as tar:
            for member in tar:
                name = member.name.removeprefix("./").rstrip("/")
                head, _, rest = name.partition("/")
                top = head if top is None else top
                if head != top or "/" in rest:
                    raise DataError(f"{path}: unexpected member {member.name[:80]} (an official "
                                    f"archive holds only the files of {top}/)")
                if name in seen:
                    raise DataError(f"{path}: holds {name} twice (an archive with a duplicated "
                                    "member is refused: which copy counts is ambiguous)")
                seen.add(name)
                _check_member(path, name, member, layout_of_top(top), wanted)
                if not rest or (wanted is not None and name not in wanted) or \
                        not _needed(layout_of_top(top), rest):
                    continue
                out[name] = _member_bytes(tar, member, path, name)
                if wanted is not None and wanted <= out.keys():
                    break  # a load- task needs one member: stop decompressing
            if wanted is None:
                _check_archive_end(tar, path)
    except DataError as exc:
        text = str(exc)
        raise DataError(f"{path}:{text}" if isinstance(exc, _MemberError) else
                        text if text.startswith(path) else f"{path}: {text}") from None
    except MemoryError:
        raise DataError(f"{path}: not enough memory to read the archive") from None
    except (tarfile.TarError, EOFError, OSError, zlib.error, ValueError) as exc:
        raise DataError(f"{path}: corrupt, truncated or not a tar archive "
                        f"({os_reason(exc)})") from None
    if top is None:
        raise DataError(f"{path}: the archive is empty")
    return top, out, seen


def _check_member(path: str, name: str, member: tarfile.TarInfo, lay: Layout | None,
                  wanted) -> None:
    """What can be refused from a member's header alone, before its data is read."""
    if member.issparse():
        raise DataError(f"{path}:{name}: is a sparse file, not a regular file")
    if lay is None or "/" not in name:
        return
    base = name.split("/", 1)[1]
    if _needed(lay, base) and (wanted is None or name in wanted):
        if not member.isfile():
            raise DataError(f"{path}:{name}: is not a regular file")
        limit, what = limit_of(lay, base)
        check_size(f"{path}:{name}", member.size, limit, what)


def _needed(lay: Layout | None, base: str) -> bool:
    """Whether a member's bytes are read: the layout's batches and meta file (not the readme)."""
    return lay is not None and base in (*lay.train, *lay.test, lay.meta)


def _member_bytes(tar: tarfile.TarFile, member: tarfile.TarInfo, path: str, name: str) -> bytes:
    data = tar.extractfile(member).read(member.size + 1)
    if len(data) != member.size:
        raise DataError(f"{path}:{name}: holds {len(data)} bytes, its header says {member.size}")
    return data


def _check_archive_end(tar: tarfile.TarFile, path: str) -> None:
    """Corruption tarfile lets pass: it ends the member list silently at a garbled header, and
    gzip verifies its CRC only at the end of the stream. Padding after the end is capped."""
    tar.fileobj.seek(tar.offset)  # where iteration stopped: must be the zero end-of-archive block
    if tar.fileobj.read(tarfile.BLOCKSIZE).strip(b"\0"):
        raise DataError(f"{path}: corrupt, truncated or not a tar archive (invalid tar header at "
                        f"byte {tar.offset})")
    trailer = 0
    while block := tar.fileobj.read(1 << 16):  # to the end, so gzip/bz2/xz check integrity
        trailer += len(block)
        if trailer > _MAX_TAR_TRAILER or block.strip(b"\0"):
            raise DataError(f"{path}: unexpected data after the end of the tar archive")
