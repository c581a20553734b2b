"""Safe reads of user files: one reader and one OS-error reason for every package."""
import pytest

from pipeline.core import files
from pipeline.core.errors import DataError
from pipeline.data import imagefolder
from pipeline.data.imagefolder import decode, folders
from pipeline.outputs import checkpoint, fs


def test_every_package_gives_the_one_os_reason():
    assert fs.os_reason is checkpoint.os_reason is files.os_reason
    assert decode.os_reason is folders.os_reason is files.os_reason


def test_an_os_error_without_text_still_has_a_reason_and_long_ones_are_cut():
    assert files.os_reason(OSError()) == "OSError"
    assert files.os_reason(OSError(5, "x" * 500)) == "x" * 200


def test_image_files_are_read_with_the_core_reader(tmp_path, monkeypatch):
    path = tmp_path / "a.jpg"
    path.write_bytes(b"\xff\xd8" + b"0" * 98)
    monkeypatch.setattr(decode, "MAX_FILE_BYTES", 10)  # the module that reads
    info = imagefolder.scan_file(imagefolder.ImageFile(str(path), 0, 100, 0))
    assert info.error == (f"{path}: 100 bytes is more than an image file can hold "
                          "(at most 10 bytes)")

    def denied(name, *args, **kwargs):
        raise PermissionError(13, "Permission denied", name)
    monkeypatch.setattr(files, "_os_open", denied)  # the one open of the files we read
    with pytest.raises(DataError, match=r"a.jpg: cannot read the file \(permission denied\)"):
        imagefolder.decode_file(imagefolder.ImageFile(str(path), 0, 100, 0), 8)


def test_every_reader_names_a_file_that_is_not_regular_alike(tmp_path):
    """One wording for a FIFO (device, socket) where a file belongs: the image listing says what
    ``open_regular`` says (it had its own shorter copy of ``files.describe``)."""
    import os
    fifo = tmp_path / "pipe.jpg"
    os.mkfifo(fifo)
    with pytest.raises(DataError) as opened:
        files.open_regular(fifo)
    with pytest.raises(DataError) as listed:
        imagefolder.read_file_list(str(_list(tmp_path, "pipe.jpg 0\n")))
    assert str(opened.value) == f"{fifo}: is a FIFO (named pipe), expected a regular file"
    assert str(listed.value).endswith(f": {opened.value}")


def _list(tmp_path, text: str):
    path = tmp_path / "train.txt"
    path.write_text(text)
    return path


def _hand_made_reasons(tree):
    """Lines that put an exception on one line by hand: ``" ".join(str(exc).split())``."""
    import ast
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "join" and isinstance(node.func.value, ast.Constant)
                and node.func.value.value == " " and len(node.args) == 1):
            arg = node.args[0]
            if (isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute)
                    and arg.func.attr == "split" and isinstance(arg.func.value, ast.Call)
                    and getattr(arg.func.value.func, "id", None) == "str"
                    and not any(isinstance(a, ast.Attribute) and a.attr == "message"
                                for a in arg.func.value.args)):  # a warning's text is no error
                yield node.lineno


def test_an_exception_becomes_one_line_only_in_errors():
    """One formatter for the reason of an error in a message (``errors.one_line``, and
    ``files.os_reason`` over it): the strerror of an OS error, whitespace folded, cut to a
    limit, the type where there is no text. Copies of it each did a part of that."""
    import ast

    from tests.clusters import REPO
    found = [f"{f.relative_to(REPO)}:{line}" for f in sorted((REPO / "pipeline").rglob("*.py"))
             if f != REPO / "pipeline" / "core" / "errors.py"
             for line in _hand_made_reasons(ast.parse(f.read_text()))]
    assert found == []
