"""The inputs of ``ranksight logs``: paths expanded to files, each read whole as bytes (gzip undone).

Directories are walked recursively (hidden files and directories skipped); a file that cannot be read, or that is
larger than the cap, is reported with the reason and skipped, never fatal. Reading is bytes, not text: every reader
decodes what it needs, so invalid UTF-8 costs one replaced character, not the file.
"""

from __future__ import annotations

import gzip
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

MAX_INPUT_BYTES = 4 << 30  # per file, after decompression: beyond this a file is refused (a gzip bomb, a core dump)


@dataclass
class InputFile:
    path: str
    data: bytes
    note: str | None = None  # e.g. "truncated gzip stream: read what was there"


def expand(paths: list[str]) -> Iterator[str | tuple[str, str]]:
    """Each file under ``paths`` in a stable order; a path that does not exist yields (path, reason)."""
    for p in paths:
        if os.path.isdir(p):
            for root, dirs, files in os.walk(p):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for f in sorted(files):
                    if not f.startswith("."):
                        yield os.path.join(root, f)
        elif os.path.exists(p) or p == "-":
            yield p
        else:
            yield (p, "no such file or directory")


def _gunzip(raw: bytes) -> tuple[bytes, str | None]:
    """Every gzip member, up to MAX_INPUT_BYTES; a torn stream gives what decompressed before the tear."""
    out, note = bytearray(), None
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    buf = raw
    while buf:
        try:
            out += d.decompress(buf, MAX_INPUT_BYTES + 1 - len(out))
        except zlib.error as e:
            note = f"corrupt gzip stream ({e}): read the {len(out)} bytes before it"
            break
        if len(out) > MAX_INPUT_BYTES:
            raise ValueError(f"larger than {MAX_INPUT_BYTES >> 30} GiB once decompressed")
        if d.unconsumed_tail:
            buf = d.unconsumed_tail
            continue
        if d.eof:
            buf = d.unused_data  # a concatenated member
            d = zlib.decompressobj(16 + zlib.MAX_WBITS)
            continue
        note = f"truncated gzip stream: read the {len(out)} bytes it held"
        break
    return bytes(out), note


def read_input(path: str) -> InputFile:
    """The file's bytes; raises OSError/ValueError with a reason a person can act on."""
    if path == "-":
        import sys

        raw = sys.stdin.buffer.read(MAX_INPUT_BYTES + 1)
        path = "<stdin>"
    else:
        size = os.path.getsize(path)
        if size > MAX_INPUT_BYTES:
            raise ValueError(f"{size} bytes: larger than {MAX_INPUT_BYTES >> 30} GiB")
        with open(path, "rb") as f:
            raw = f.read()
    if raw[:2] == b"\x1f\x8b":
        data, note = _gunzip(raw)
        return InputFile(path, data, note)
    if len(raw) > MAX_INPUT_BYTES:
        raise ValueError(f"larger than {MAX_INPUT_BYTES >> 30} GiB")
    return InputFile(path, raw)


def iter_inputs(paths: list[str]) -> Iterator[InputFile | tuple[str, str]]:
    """InputFile per readable file, (path, reason) per one that is not."""
    for item in expand(paths):
        if isinstance(item, tuple):
            yield item
            continue
        try:
            yield read_input(item)
        except (OSError, ValueError, EOFError, gzip.BadGzipFile) as e:
            yield (item, str(e) or type(e).__name__)
