"""Where a store table's Parquet files are, on local disk or object storage, and which of them a reader reads.

The layout (docs/store.md)::

    <store>/<run-id>/<table>/run=<run-id>/hour=<YYYY-MM-DDTHH>/part-<ns>-<pid>-<seq>.parquet    fresh parts
    <store>/<run-id>/<table>/run=<run-id>/hour=<YYYY-MM-DDTHH>/compacted-<ns>-<pid>.parquet    merged by the head
    <store>/<run-id>/<table>/part-*.parquet                                                   older stores (flat)

``run`` and ``hour`` are Hive partition keys (``key=value`` directories), so DuckDB
(``hive_partitioning=true``), Spark and pyarrow datasets read them as columns across runs. The run stays one
directory (deleted or archived whole); the key is named ``run``, not ``run_id``, because every row also carries a
``run_id`` column and pyarrow refuses a partition key that collides with a file column. ``hour`` is the UTC hour
the head *stored* the rows (not the rows' own times): a closed hour never gets new parts, so it can be compacted.

A compacted file names, in its Parquet metadata (``ranksight.covers``), every file it replaced (and, transitively,
what those replaced). Readers skip covered files, so the moment between writing a compacted file and removing its
inputs never shows a row twice; the head removes covered files afterwards, and again at its next start.

A store root is a local directory or a URI that pyarrow's filesystems open (``s3://bucket/prefix?region=...``,
``gs://``, ``hdfs://``, ``file://``). The head writes fresh parts on its local disk only; it may put compacted
partitions elsewhere (``Store(compact_to=URI)``), and says so in ``<store>/<run-id>/remote.json`` so a reader of
the local store finds them.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

RUN_KEY = "run"
HOUR_KEY = "hour"
HOUR_FORMAT = "%Y-%m-%dT%H"
PART_PREFIX = "part-"
COMPACTED_PREFIX = "compacted-"
# Parquet key-value metadata of a compacted file: JSON list of the file names (same partition) it replaces.
COVERS_KEY = b"ranksight.covers"
# Written by a head that puts compacted partitions elsewhere: {"compacted_to": URI}, in the run directory.
REMOTE_LINK = "remote.json"


class StoreLocationError(ValueError):
    """A store URI that cannot be used (credentials in it, an unknown scheme, an unreachable endpoint)."""


def is_uri(store: str | os.PathLike) -> bool:
    return isinstance(store, str) and "://" in store and not store.startswith("file://")


def hour_label(t: float) -> str:
    """The ``hour`` partition value of a time (seconds since the epoch), UTC."""
    return time.strftime(HOUR_FORMAT, time.gmtime(t))


def hour_start(label: str) -> float | None:
    """Start of an ``hour`` partition (epoch seconds), None for a value this code did not write."""
    import calendar

    try:
        return float(calendar.timegm(time.strptime(label, HOUR_FORMAT)))
    except ValueError:
        return None


def partition_dir(run_id: str, t: float) -> str:
    """The partition directory (relative to the table directory) of rows stored at time ``t``."""
    return f"{RUN_KEY}={run_id}/{HOUR_KEY}={hour_label(t)}"


# ---------------------------------------------------------------------------
# Locations: a local directory or a pyarrow filesystem + base path
# ---------------------------------------------------------------------------


def open_location(store: str | os.PathLike):
    """(pyarrow filesystem, base path) of a store root; credentials come from the environment, never the URI."""
    import pyarrow.fs as pafs

    s = os.fspath(store)
    if s.startswith("file://"):
        return pafs.LocalFileSystem(), urlsplit(s).path
    if not is_uri(s):
        return pafs.LocalFileSystem(), str(Path(s).absolute())
    parts = urlsplit(s)
    if parts.username or parts.password:
        raise StoreLocationError(f"store URI {parts.scheme}://…@{parts.hostname}: credentials do not belong in a "
                                 "URI (they end up in logs and remote.json); give them through the environment "
                                 "(e.g. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)")
    from urllib.parse import parse_qsl

    secret = [k for k, _ in parse_qsl(parts.query) if any(w in k.lower() for w in ("secret", "token", "password"))]
    if secret:
        raise StoreLocationError(f"store URI {redact(s)}: {', '.join(secret)} in the query; credentials do not belong "
                                 "in a URI, give them through the environment")
    try:
        fs, path = pafs.FileSystem.from_uri(s)
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid/OSError/ValueError by scheme
        raise StoreLocationError(f"cannot open store {redact(s)}: {e}") from e
    return fs, path.rstrip("/")


def redact(uri: str) -> str:
    """A URI fit for a log line: no user info, no query (a query may carry a session token)."""
    p = urlsplit(uri)
    return f"{p.scheme}://{p.hostname or ''}{p.path}" if p.scheme else uri


def join(base: str | os.PathLike, *names: str) -> str:
    """A store path or URI with names appended (keeps a URI's query, e.g. ``?endpoint_override=``)."""
    s = os.fspath(base)
    if is_uri(s):
        p = urlsplit(s)
        path = "/".join([p.path.rstrip("/"), *names])
        return p._replace(path=path).geturl()
    return str(Path(s, *names))


@dataclass(frozen=True)
class StoreFile:
    """One Parquet file of a table: where it is (``fs``: a pyarrow filesystem, None for local disk) and its path
    relative to the table directory (``rel``: ``run=…/hour=…/name`` or a flat ``name``). Looks enough like a
    ``Path`` (``name``, ``stat().st_size``, ``exists()``) for callers that only size and name files."""

    path: str
    rel: str
    size: int
    fs: object = None
    mtime: float = 0.0

    @property
    def name(self) -> str:
        return self.rel.rpartition("/")[2]

    @property
    def partition(self) -> str:
        return self.rel.rpartition("/")[0] or "."

    @property
    def compacted(self) -> bool:
        return self.name.startswith(COMPACTED_PREFIX)

    def stat(self):
        return os.stat_result((0, 0, 0, 0, 0, 0, self.size, 0, 0, 0))

    def exists(self) -> bool:
        return True

    def __fspath__(self) -> str:  # local files only: pandas/pyarrow open them by path
        if self.fs is not None:
            raise TypeError(f"{self.path} is on a remote filesystem; open it through its filesystem")
        return self.path

    def __str__(self) -> str:
        return self.path

    def open(self):
        """A readable file object (pyarrow NativeFile for remote files)."""
        if self.fs is None:
            return open(self.path, "rb")
        return self.fs.open_input_file(self.path)


def _is_data_file(name: str) -> bool:
    # dot-files are being written (renamed into place when whole); '_' files are engines' own (_SUCCESS, ...)
    return name.endswith(".parquet") and not name.startswith((".", "_"))


def _list_local(table_dir: Path) -> list[StoreFile]:
    if not table_dir.is_dir():
        return []
    out = []
    base = str(table_dir)
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if not d.startswith((".", "_"))]
        for fn in filenames:
            if _is_data_file(fn):
                full = os.path.join(dirpath, fn)
                try:
                    st = os.stat(full)
                except FileNotFoundError:  # removed by a compaction's cleanup since the listing
                    continue
                out.append(StoreFile(full, os.path.relpath(full, base).replace(os.sep, "/"), st.st_size,
                                     None, st.st_mtime))
    return out


def list_fs(fs, table_path: str) -> list[StoreFile]:
    import pyarrow.fs as pafs

    try:
        infos = fs.get_file_info(pafs.FileSelector(table_path, recursive=True, allow_not_found=True))
    except Exception as e:  # noqa: BLE001 - network, permissions: a clear error, not a silently short table
        raise StoreLocationError(f"cannot list {table_path}: {e}") from e
    out = []
    prefix = table_path.rstrip("/") + "/"
    for fi in infos:
        if fi.type != pafs.FileType.File or not fi.path.startswith(prefix):
            continue
        rel = fi.path[len(prefix):]
        if any(seg.startswith((".", "_")) for seg in rel.split("/")[:-1]) or not _is_data_file(fi.base_name):
            continue
        out.append(StoreFile(fi.path, rel, fi.size or 0, fs, fi.mtime.timestamp() if fi.mtime else 0.0))
    return out


def list_table(table_dir: str | os.PathLike) -> list[StoreFile]:
    """Every finished Parquet file under a table directory (local path or URI), covered ones included."""
    if is_uri(table_dir) or os.fspath(table_dir).startswith("file://"):
        fs, path = open_location(table_dir)
        if fs.type_name == "local":
            return _list_local(Path(path))
        return list_fs(fs, path)
    return _list_local(Path(table_dir))


def remote_of(run_root: str | os.PathLike) -> str | None:
    """The URI a head put this (local) run's compacted partitions under, if any (``remote.json``)."""
    if is_uri(run_root):
        return None
    try:
        link = json.loads((Path(run_root) / REMOTE_LINK).read_text())
    except (OSError, ValueError):
        return None
    uri = link.get("compacted_to") if isinstance(link, dict) else None
    return uri if isinstance(uri, str) and uri else None


# A compacted file never changes once in place, so what it covers is read once per process (a footer read; on
# object storage a request): keyed by where it is, its size and mtime, bounded.
_covers_cache: dict[tuple, frozenset[str]] = {}
_COVERS_CACHE_MAX = 20_000


def read_covers(f: StoreFile) -> frozenset[str]:
    """The names a compacted file replaces (empty for a part, or a compacted file whose footer is unreadable)."""
    if not f.compacted:
        return frozenset()
    key = (id(f.fs) if f.fs is not None else None, f.path, f.size, f.mtime)
    got = _covers_cache.get(key)
    if got is not None:
        return got
    import pyarrow.parquet as pq

    try:
        with f.open() as fh:
            meta = pq.read_metadata(fh).metadata or {}
        names = json.loads(meta.get(COVERS_KEY, b"[]"))
    except Exception:  # noqa: BLE001 - a damaged compacted file covers nothing: its inputs stay readable
        return frozenset()
    got = frozenset(n for n in names if isinstance(n, str))
    if len(_covers_cache) >= _COVERS_CACHE_MAX:
        _covers_cache.clear()
    _covers_cache[key] = got
    return got


def covered(files: list[StoreFile]) -> set[tuple[str, str]]:
    """(partition, name) of every file some compacted file replaces."""
    out: set[tuple[str, str]] = set()
    for f in files:
        if f.compacted:
            out.update((f.partition, n) for n in read_covers(f))
    return out


def visible(files: list[StoreFile]) -> list[StoreFile]:
    """The files a reader reads: covered ones left out, in partition then name order (that is: the order they
    were stored in; a compacted file sorts before the parts written after it)."""
    cov = covered(files)
    keep = [f for f in files if (f.partition, f.name) not in cov]
    return sorted(keep, key=lambda f: f.rel)


def table_files(table_dir: str | os.PathLike, include_remote: bool = True) -> list[StoreFile]:
    """The files of one table a reader reads: local (or URI) files, plus the run's compacted partitions a head put
    elsewhere (``remote.json``), covered files left out."""
    files = list_table(table_dir)
    if include_remote and not is_uri(table_dir):
        d = Path(table_dir)
        uri = remote_of(d.parent)
        if uri is not None:
            files += list_table(join(uri, d.parent.name, d.name))
    return visible(files)
