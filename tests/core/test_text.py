"""Text from input data on a terminal (pipeline.core.text.printable): what a terminal would act on
is shown as its escape, everything printable is kept."""
from __future__ import annotations

from pipeline.core.text import printable


def test_escape_sequences_and_every_control_character_are_shown_escaped():
    title, clear, colour = "\x1b]0;owned\x07", "\x1b[2J", "\x1b[31m"
    assert printable(f"a{title}b{clear}{colour}c") == r"a\x1b]0;owned\x07b\x1b[2J\x1b[31mc"
    assert printable("\x9b2J\x9d0;t\x9c") == r"\x9b2J\x9d0;t\x9c"  # the 8-bit CSI, OSC, ST
    assert printable("a\nb\rc\td\x00\x7f") == r"a\x0ab\x0dc\x09d\x00\x7f"
    assert printable("\u202eevil\u2066\u2028") == r"\u202eevil\u2066\u2028"
    for code in [*range(0x20), *range(0x7f, 0xa0)]:
        assert printable(chr(code)) == f"\\x{code:02x}"


def test_printable_text_is_kept_as_it_is():
    text = "daisy, tulip \u732b caf\u00e9 \u00a0\u00ff \U0001f33c C:\\images\\x1b.png"
    assert printable(text) == text
    assert printable(7) == "7"
