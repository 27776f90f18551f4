"""JSON for the job table's JSON columns, written so that every database hands a float back as a
float: PostgreSQL's ``jsonb`` keeps a number as ``numeric``, and reads ``1e+20`` back as the int
``100000000000000000000``, but ``100000000000000000000.0`` as a float."""

from __future__ import annotations

import json
import re
from typing import Any

# A JSON string (kept as it is, so nothing inside one is touched), or a number with a positive
# exponent: json.dumps writes a float so from 1e16 up, where every float is a whole number.
_STRING_OR_EXPONENT = re.compile(r'("(?:[^"\\]|\\.)*")|-?\d+(?:\.\d+)?e\+\d+')


class FloatKeepingEncoder(json.JSONEncoder):
    """``json.dumps``' encoder, but a float it would write with a positive exponent is written in
    plain decimal with a point (``1e+20``: ``100000000000000000000.0``), exactly: the digits of
    the whole number the float is. A text with no ``e+`` (nearly all) is not looked at again."""

    def encode(self, o: Any) -> str:
        text = super().encode(o)
        if "e+" not in text:
            return text
        return _STRING_OR_EXPONENT.sub(_plain, text)


def _plain(match: re.Match[str]) -> str:
    """A string as it is; a number with a positive exponent in plain decimal, with a point."""
    string = match.group(1)
    return string if string is not None else f"{int(float(match.group(0)))}.0"
