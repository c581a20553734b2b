"""Text from input data made safe to print on a terminal: its control characters escaped."""
from __future__ import annotations

import re

# C0 controls, DEL and the C1 controls (U+0080-U+009F: 8-bit CSI and OSC start escape sequences
# as ESC does); the bidirectional overrides and isolates, which reorder what a terminal shows
# ("Trojan Source"); the line and paragraph separators.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code <= 0xff else f"\\u{code:04x}"


def printable(text) -> str:
    """``text`` (a class name, a file name, a message naming them) with every character that a
    terminal would act on instead of showing shown as its escape; printable unicode is kept, and
    so is a backslash (the output is for people, not to be parsed back).

    >>> printable("cat\\x1b]0;owned\\x07 \\x9b2J")
    'cat\\\\x1b]0;owned\\\\x07 \\\\x9b2J'
    >>> printable("caf\\u00e9 \\u732b\\n"), printable(3)
    ('café 猫\\\\x0a', '3')
    """
    return _UNSAFE.sub(_escape, str(text))
