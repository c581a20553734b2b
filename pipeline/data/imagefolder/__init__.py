"""Image folders and file lists: list and check the files, decode them to square uint8 NCHW arrays.

Pure format code (no dask), the peer of ``pipeline.data.cifar``; ``pipeline.data.images`` maps
:func:`scan_files` (``scan-`` tasks) and :func:`decode_chunk` (``decode-`` tasks) over chunks of
files on the workers.

Modules, from the bottom up: ``layout`` (limits, formats, the values: ``ImageFile``, ``Listing``,
``FileInfo``, ``DecodeChunk``; a listing's split and fingerprint), ``lists`` (file lists),
``folders`` (image folders and their splits), ``decode`` (reading one file: scan and decode) and
``reports`` (what ``inspect`` shows).

Sources:

* an image folder ``root/<class>/<image>`` (ImageNet / torchvision ``ImageFolder`` style; classes
  are the sorted names of the subfolders, files may sit in nested folders of a class, as
  Tiny-ImageNet's ``<class>/images/*.JPEG``), optionally split as ``root/train/<class>/...`` and
  ``root/val/<class>/...`` (or ``root/val/`` holding one folder of images and one file list
  naming their classes, as Tiny-ImageNet's ``val/images/`` and ``val_annotations.txt``). As torchvision does, files without an image extension (a
  ``<wnid>_boxes.txt``, ``.xml`` annotations) are skipped, and so are hidden files and folders
  (``.DS_Store``, macOS ``._*`` files, ``.git/``); ``Listing.skipped`` counts them by kind;
* a file list (Chainer's ``LabeledImageDataset``): lines ``path label``, the label an integer
  ``0 <= label < K`` or a class name (Tiny-ImageNet's ``val_annotations.txt``: ``path<TAB>wnid
  <TAB>box...``, extra columns ignored), paths relative to a root directory (the list's own
  directory unless given); blank lines and lines starting with ``#`` are skipped; a path may
  contain spaces (the label is then the last field).

Every image becomes RGB: grayscale, bilevel, palette (transparency dropped), RGBA / LA (alpha
dropped, as torchvision's loader does), CMYK and YCbCr through Pillow's conversion; 16-bit
grayscale (``I;16``, ``I``) scaled from 0..65535 to 0..255 (Pillow reads 16-bit RGB PNGs as 8-bit
RGB itself). The EXIF orientation of photos is applied. Only the first frame of an animation is
used.

Safety: a file is read with ``pipeline.core.files.read_capped`` (never a FIFO or a device, never
more than a size cap) and given to Pillow from memory with the formats restricted to plain
raster ones (no EPS, which would run Ghostscript); the header's pixel count is checked against
``max_pixels`` before any pixel is decoded. Every problem is one line naming the file.
"""
from pipeline.data.imagefolder.decode import (decode_chunk, decode_file, jpeg_scans, scan_file,
                                              scan_files, to_rgb)
from pipeline.data.imagefolder.folders import (class_folders, folder_splits, list_folder,
                                               skip_kind)
from pipeline.data.imagefolder.layout import (EVAL_CROP, EXTENSIONS, FORMATS, LIST_EXTENSIONS,
                                              MAX_FILE_BYTES, MAX_JPEG_SCANS, MAX_LIST_BYTES,
                                              MAX_PIXELS, RUN_MARKER, DecodeChunk, FileInfo,
                                              ImageFile, Listing, fingerprint, listed,
                                              split_listing)
from pipeline.data.imagefolder.lists import read_file_list
from pipeline.data.imagefolder.reports import class_counts, first_problems, summary

__all__ = ("EVAL_CROP", "EXTENSIONS", "FORMATS", "LIST_EXTENSIONS", "MAX_FILE_BYTES",
           "MAX_JPEG_SCANS", "MAX_LIST_BYTES", "MAX_PIXELS", "RUN_MARKER", "DecodeChunk",
           "FileInfo", "ImageFile", "Listing", "fingerprint", "listed", "split_listing",
           "read_file_list", "class_folders", "folder_splits", "list_folder", "skip_kind",
           "decode_chunk", "decode_file", "jpeg_scans", "scan_file", "scan_files", "to_rgb",
           "class_counts", "first_problems", "summary")
