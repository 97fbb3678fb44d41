"""An adapter upload's multipart body, parsed as it arrives: the field `name`, and each `files`
part written straight into the staging folder under its own (plain) file name, so that a
folder of files is never spooled to a temporary file first and copied again.

The parser (python-multipart's) runs on the event loop over the body's chunks gathered to
`CHUNK`; what a chunk brought for the files is written in one thread hop. Anything wrong with
the form (no boundary, bad framing, a file name with a directory in it, a file sent twice,
too many parts, a body over the limit) is a 4xx naming it, raised before the engine sees the
folder; the caller removes the staging folder.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from io import BufferedWriter
from pathlib import Path

from python_multipart.multipart import FormParserError, MultipartParser, parse_options_header

from gateway.errors import bad_request, too_large

CHUNK = 4 << 20  # bytes of the body handed to the parser at a time
MAX_FILES = 16
MAX_FIELD_BYTES = 1 << 20  # a plain field's value (a name past 64 characters is refused later)
MAX_FIELDS = 4


class StagedForm:
    """The form of one upload, its files written into `staging` as they arrive."""

    def __init__(self, staging: Path) -> None:
        self.staging = staging
        self.name: str | None = None
        self.sizes: dict[str, int] = {}  # file name -> bytes, in the order they came
        self._fields = 0
        self._header = b""  # the part's header being read: name, then value
        self._value = b""
        self._disposition = b""
        self._out: BufferedWriter | None = None  # the file part being written
        self._file: str | None = None
        self._field: str | None = None  # a plain field's name while its value is read
        self._data = bytearray()
        self._pending: list[tuple[BufferedWriter, bytes]] = []  # writes for the next hop
        self._finished: list[BufferedWriter] = []

    async def read(self, body: AsyncIterator[bytes], content_type: str, limit: int) -> None:
        """Parse `body` (capped at `limit` bytes: 413 beyond). Raises APIError (400) for a
        malformed form; on any error the files written so far are closed."""
        _, params = parse_options_header(content_type)
        boundary = params.get(b"boundary")
        if not boundary:
            raise bad_request("invalid multipart body: no boundary in its Content-Type")
        parser = MultipartParser(boundary, {
            "on_part_begin": self._part_begin, "on_header_field": self._header_field,
            "on_header_value": self._header_value, "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished, "on_part_data": self._part_data,
            "on_part_end": self._part_end})
        try:
            size, buf = 0, bytearray()
            async for chunk in body:
                size += len(chunk)
                if size > limit:
                    raise too_large(limit)
                buf += chunk
                if len(buf) >= CHUNK:
                    await self._feed(parser, bytes(buf))
                    buf.clear()
            await self._feed(parser, bytes(buf))
            parser.finalize()
        except FormParserError as e:
            raise bad_request(f"invalid multipart body: {e}") from None
        finally:
            await asyncio.to_thread(self._flush)
            for out in (*self._finished, *([self._out] if self._out else [])):
                out.close()
            self._out = None

    async def _feed(self, parser: MultipartParser, data: bytes) -> None:
        if data:
            parser.write(data)
        await asyncio.to_thread(self._flush)

    def _flush(self) -> None:
        """The file data parsed since the last hop, written (in a thread)."""
        pending, finished, self._pending, self._finished = self._pending, self._finished, [], []
        for out, data in pending:
            out.write(data)
        for out in finished:
            out.close()

    # -- the parser's callbacks (on the event loop, within `parser.write`) -------------------

    def _part_begin(self) -> None:
        self._disposition, self._data = b"", bytearray()

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _header_end(self) -> None:
        if self._header.lower() == b"content-disposition":
            self._disposition = self._value
        self._header = self._value = b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        if b"name" not in options:
            raise bad_request("invalid multipart body: a part without a name in its "
                              "Content-Disposition")
        field = options[b"name"].decode(errors="replace")
        if b"filename" not in options:
            self._fields += 1
            if self._fields > MAX_FIELDS:
                raise bad_request(f"invalid multipart body: more than {MAX_FIELDS} fields")
            self._field = field
            return
        self._field = None
        filename = options[b"filename"].decode(errors="replace")
        if field != "files":
            self._file = None  # a file under another field: read past, not kept
            return
        if not plain_file_name(filename):
            raise bad_request(f"bad file name {filename!r}: send plain file names (such as "
                              "adapter_config.json), without directories", "files")
        if filename in self.sizes:
            raise bad_request(f"file {filename!r} is sent twice", "files")
        if len(self.sizes) == MAX_FILES:
            raise bad_request(f"invalid multipart body: more than {MAX_FILES} files", "files")
        self._file, self.sizes[filename] = filename, 0
        self._out = (self.staging / filename).open("xb")

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._out is not None and self._file is not None:
            self._pending.append((self._out, data[start:end]))
            self.sizes[self._file] += end - start
        elif self._field is not None:
            if len(self._data) + end - start > MAX_FIELD_BYTES:
                raise bad_request(f"form field {self._field!r} is over {MAX_FIELD_BYTES} "
                                  "bytes", self._field)
            self._data += data[start:end]

    def _part_end(self) -> None:
        if self._out is not None:
            self._finished.append(self._out)
            self._out = self._file = None
        elif self._field == "name" and self.name is None:
            self.name = self._data.decode(errors="replace")
        self._field = None


def plain_file_name(name: str) -> bool:
    """A name that stays inside the staging folder: no directory part, no traversal, no NUL,
    short enough for any file system."""
    return (name not in ("", ".", "..") and not any(c in name for c in "/\\\0")
            and len(name.encode(errors="replace")) <= 255)
