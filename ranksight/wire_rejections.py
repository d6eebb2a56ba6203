"""Which log records (and rows) the head refused, and why: the OTLP partial success's message, read and written
by both ends (the head writes it, the agent reads it; ``ranksight.wire`` carries the records).

The head says so in the OTLP partial success (``rejected_log_records``, ``error_message``). The message is JSON,
``{"rejected": [{"i": <log record index>, "why": <reason>, "rows": [<row>, ...]}, ...], "more": <entries left out>}``:
``i`` counts log records in request order (``iter_indexed``); ``rows``, when present, are the refused records'
positions in that log record's JSON array (the rest of it was stored), absent when the whole log record was
refused; ``rows_more`` counts refused rows beyond those listed. Bounded (``MAX_REJECTION_MESSAGE`` bytes), so it
stays a short, valid OTLP status message; a receiver that does not know the format still reads the reasons.
"""

from __future__ import annotations

import msgspec

MAX_REJECTION_MESSAGE = 16 * 1024
MAX_WHY = 200
MAX_ROWS_LISTED = 256


class Rejection(msgspec.Struct, omit_defaults=True):
    i: int
    why: str
    rows: list[int] | None = None
    rows_more: int = 0


class Rejections(msgspec.Struct, omit_defaults=True):
    rejected: list[Rejection] = []
    more: int = 0


_rejections_decoder = msgspec.json.Decoder(Rejections)


def rejections_message(entries: list[Rejection], limit: int = MAX_REJECTION_MESSAGE) -> str:
    """The partial-success ``error_message`` for ``entries``, at most ``limit`` bytes: reasons cut to ``MAX_WHY``
    characters, rows to ``MAX_ROWS_LISTED`` per log record, and entries past the limit counted in ``more``."""
    if not entries:
        return '{"rejected":[]}'
    out: list[bytes] = []
    size = len(b'{"rejected":[],"more":99999999}')
    for e in sorted(entries, key=lambda e: e.i):
        rows = e.rows
        more = e.rows_more
        if rows is not None and len(rows) > MAX_ROWS_LISTED:
            rows, more = rows[:MAX_ROWS_LISTED], more + len(rows) - MAX_ROWS_LISTED
        enc = msgspec.json.encode(Rejection(i=e.i, why=e.why[:MAX_WHY], rows=rows, rows_more=more))
        if size + len(enc) + 1 > limit:
            break
        out.append(enc)
        size += len(enc) + 1
    left = len(entries) - len(out)
    return (b'{"rejected":[' + b",".join(out) + b"]" + (b',"more":%d' % left if left else b"") + b"}").decode()


def parse_rejections(message: str) -> Rejections | None:
    """The rejections a head listed in a partial success's ``error_message``; None when the message is not in this
    format (an older head, a Collector in between): then only the count of rejected log records is known."""
    try:
        return _rejections_decoder.decode(message)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
