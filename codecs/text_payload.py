"""Media bytes that arrived as text: a `data:` URL or base64, the usual client mistake when a bytes field is filled
from a web page or from JSON code that already base64-encodes (`ImagePart(data=base64.b64encode(raw))` sends the
text itself; grpcurl's JSON base64-decodes once, so encoding twice does the same).

`decoded_head(data)` returns the first bytes under that text, so the image and audio decoders can say "this is base64
of a PNG: send the raw bytes" instead of "not an image in a known format".
"""

from __future__ import annotations

import base64
import binascii
import re

_BASE64_HEAD = re.compile(rb"[A-Za-z0-9+/_-]{16,}")
_DATA_URL = re.compile(rb"data:[\w.+-]+/[\w.+-]+(;[\w.+-]+=[\w.+-]+)*;base64,")


def decoded_head(data: bytes, size: int = 64) -> tuple[str, bytes] | None:
    """("a data: URL" | "base64 text", the first decoded bytes) when `data` is media written as text, else None."""
    head = data[:1024].lstrip()
    what = "base64 text"
    url = _DATA_URL.match(head)
    if url:
        head, what = head[url.end() :], "a data: URL"
    match = _BASE64_HEAD.match(head)
    if match is None:
        return None
    text = match.group()[: size // 3 * 4]
    try:
        return what, base64.b64decode(text.replace(b"-", b"+").replace(b"_", b"/"), validate=True)
    except (binascii.Error, ValueError):
        return None
