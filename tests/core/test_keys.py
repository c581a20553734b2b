"""Task keys: the builders give the documented shapes, and only keys.py formats a key prefix."""
import ast
import re

import pytest

from pipeline.core import keys
from tests.clusters import REPO

# A literal stage name right before the "-" that joins it to a token: "train-", "images-".
_STAGE_DASH = re.compile(r"(?:^|[^a-z_])(?:%s)-$" % "|".join(keys.STAGES + keys._LOAD_PREFIXES))

# Any name joined to a token: "scan-{token}".
_NAME_DASH = re.compile(r"(?:^|[^a-z_])[a-z_]+-$")


def _names(node) -> str:
    return ast.unparse(node)


def _hand_made(tree):
    """Line numbers of expressions that format ``"<stage>-<token>"`` by hand."""
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            parts = node.values
            for before, after in zip(parts, parts[1:]):
                if not isinstance(after, ast.FormattedValue):
                    continue
                if isinstance(before, ast.Constant) and _STAGE_DASH.search(before.value):
                    yield node.lineno  # f"train-{token}"
                elif (isinstance(before, ast.Constant) and _NAME_DASH.search(before.value)
                      and "token" in _names(after.value)):
                    yield node.lineno  # f"scan-{token}"
                elif (isinstance(before, ast.Constant) and before.value == "-"
                      and "token" in _names(after.value)):
                    yield node.lineno  # f"{stage}-{token}", f"-{token}" (keys.suffix)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left = node.left
            if (isinstance(left, ast.Constant) and isinstance(left.value, str)
                    and _STAGE_DASH.search(left.value)):
                yield node.lineno  # "train-" + token


def test_only_keys_formats_a_key_prefix():
    found = [f"{path.relative_to(REPO)}:{line}"
             for path in sorted((REPO / "pipeline").rglob("*.py"))
             if path != REPO / "pipeline" / "core" / "keys.py"
             for line in _hand_made(ast.parse(path.read_text()))]
    assert not found, f"build keys with pipeline.core.keys, not by hand: {found}"


@pytest.mark.parametrize("source, bad", [
    ('k = (f"train-{token}", 1)', True),
    ('k = ("average-" + token, 1)', True),
    ('k = (f"{self.name}-{self.token}", *coords)', True),
    ('d = f"round-{r:06d}"', False),
    ('k = (f"scan-{token}", i)', True),
    ('m = f"-{self.token}"', True),  # a run's key suffix: keys.suffix
    ('w = f"gpu-{d}"', False),
])
def test_the_scan_sees_hand_made_prefixes(source, bad):
    assert bool(list(_hand_made(ast.parse(source)))) is bad


def test_prefix_is_the_head_of_make():
    assert keys.prefix("images", "0123abcd") == keys.make("images", "0123abcd", 1, 0)[0]
    with pytest.raises(ValueError, match="token"):
        keys.prefix("train", "abcdef")
