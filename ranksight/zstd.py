"""pyarrow's zstd codec, made once: what the agent compresses its exports with and the head decompresses them with
(``Content-Encoding: zstd``). pyarrow ships it, so zstd costs neither end a dependency of its own."""

from __future__ import annotations

_CODEC: list = []  # [codec or None], made on first use


def zstd_codec():
    """pyarrow's zstd codec at its default level, or None where this pyarrow was built without zstd (or does not
    import): the agent then sends deflate, the head answers zstd bodies 415."""
    if not _CODEC:
        try:
            import pyarrow as pa

            _CODEC.append(pa.Codec("zstd") if pa.Codec.is_available("zstd") else None)
        except Exception:  # noqa: BLE001 - no pyarrow, or a broken one: no zstd
            _CODEC.append(None)
    return _CODEC[0]
