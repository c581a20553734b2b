"""Safe reads of user files: one reader and one OS-error reason for every package."""
import pytest

from pipeline.core import files
from pipeline.core.errors import DataError
from pipeline.data import imagefolder
from pipeline.outputs import checkpoint, fs


def test_every_package_gives_the_one_os_reason():
    assert fs.os_reason is checkpoint.os_reason is imagefolder.os_reason is files.os_reason


def test_an_os_error_without_text_still_has_a_reason_and_long_ones_are_cut():
    assert files.os_reason(OSError()) == "OSError"
    assert files.os_reason(OSError(5, "x" * 500)) == "x" * 200


def test_image_files_are_read_with_the_core_reader(tmp_path, monkeypatch):
    path = tmp_path / "a.jpg"
    path.write_bytes(b"\xff\xd8" + b"0" * 98)
    monkeypatch.setattr(imagefolder, "MAX_FILE_BYTES", 10)
    info = imagefolder.scan_file(imagefolder.ImageFile(str(path), 0, 100, 0))
    assert info.error == (f"{path}: 100 bytes is more than an image file can hold "
                          "(at most 10 bytes)")

    def denied(name, *args, **kwargs):
        raise PermissionError(13, "Permission denied", name)
    monkeypatch.setattr(files, "_os_open", denied)  # the one open of the files we read
    with pytest.raises(DataError, match=r"a.jpg: cannot read the file \(permission denied\)"):
        imagefolder.decode_file(imagefolder.ImageFile(str(path), 0, 100, 0), 8)
