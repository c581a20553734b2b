"""What ``inspect`` and the first-problem line say of a listing and its scan."""
from __future__ import annotations

from collections import Counter

import numpy as np

from pipeline.data.imagefolder.layout import Listing


def first_problems(files: tuple, infos: tuple) -> str | None:
    """One line for the first bad file (and how many more there are), or None if all are good."""
    bad = [info.error for info in infos if info.error]
    if not bad:
        return None
    more = f" (and {len(bad) - 1} more bad file{'s' if len(bad) > 2 else ''})" if len(bad) > 1 \
        else ""
    return bad[0] + more


def class_counts(listing: Listing) -> dict:
    """{class name: images} of a split."""
    counts = np.bincount([f.label for f in listing.files], minlength=len(listing.class_names))
    return {name: int(c) for name, c in zip(listing.class_names, counts)}


def summary(infos: tuple) -> dict:
    """Image sizes seen, formats and modes of scanned files, for ``inspect`` (plain ints, strs)."""
    widths = [i.width for i in infos]
    heights = [i.height for i in infos]
    sizes = Counter(f"{i.width}x{i.height}" for i in infos)
    return {
        "formats": dict(Counter(i.format for i in infos).most_common()),
        "modes": dict(Counter(i.mode for i in infos).most_common()),
        "sizes_seen": dict(sizes.most_common(10)),
        "distinct_sizes": len(sizes),
        "width_range": [min(widths), max(widths)] if widths else [],
        "height_range": [min(heights), max(heights)] if heights else [],
    }
