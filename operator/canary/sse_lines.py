"""A byte stream split into lines as the SSE standard reads it: at CR, LF or CRLF.

Pure (no I/O): the canary's stream reader feeds it the chunks as they arrive. The official OpenAI
clients split the same way (`openai._streaming._SSELineDecoder`), so a server whose events end with
bare CRs, which the standard allows, is read as they read it, not as one endless line.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

_LINE_END = re.compile(rb"\r\n|\r|\n")


class SseLines:
    """Lines of a stream fed in chunks, each with the offset of its first byte in the stream.

    Linear in the bytes fed: a chunk is scanned once, and a line that spans chunks is joined once.
    A CRLF split between two chunks ends one line, not two."""

    def __init__(self) -> None:
        self._partial = bytearray()  # the line begun and not yet ended
        self._partial_at = 0  # its first byte's offset in the stream
        self._fed = 0  # bytes fed so far
        self._after_cr = False  # the last chunk ended with a CR: an LF opening the next is its end

    def feed(self, chunk: bytes) -> Iterator[tuple[int, bytes]]:
        """The lines `chunk` ends, one at a time: a caller that counts lines, or yields to its
        event loop between them, does so while the chunk is split (one decompressed read can be
        786 KiB of line ends), and one that stops early splits no further. Consume it whole
        before feeding the next chunk."""
        base, start = self._fed, 0
        self._fed += len(chunk)
        if not chunk:
            return
        if self._after_cr and chunk[0] == 0x0A:
            start = 1
            self._partial_at = base + 1
        self._after_cr = False
        for end in _LINE_END.finditer(chunk, start):
            self._partial += chunk[start : end.start()]
            line = (self._partial_at, bytes(self._partial))
            self._partial.clear()
            start = end.end()
            self._partial_at = base + start
            self._after_cr = end.group() == b"\r" and start == len(chunk)
            yield line
        self._partial += chunk[start:]

    def finish(self) -> list[tuple[int, bytes]]:
        """The last line, when the stream ended without ending it."""
        if not self._partial:
            return []
        line = (self._partial_at, bytes(self._partial))
        self._partial.clear()
        return [line]
