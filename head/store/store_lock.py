"""One head per store: the head process holds an exclusive lock on ``<store>/.head.lock`` while it runs.

Two heads on one store would interleave their write-ahead logs and compact each other's partitions, and
``ranksight compact`` (an offline compaction) on a store a head is writing would remove part files the head still
counts on. Both take this lock without waiting and refuse with the holder's pid when it is taken. The lock is the
kernel's (``flock``): it goes when the process that holds it ends, however it ends, so a crashed head never leaves a
stale lock behind. A live round's forked child closes its copy of the descriptor (``held_fds``), so a child
outliving its head does not keep the store locked.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_NAME = ".head.lock"
_held: set[int] = set()  # the descriptors held, for the forked round's child to close


class StoreBusy(RuntimeError):
    """Another process (a head, a ``ranksight compact``) holds the store."""


def held_fds() -> list[int]:
    return sorted(_held)


class StoreLock:
    """The store's lock, held until ``release`` (or the process ends). ``who`` is written into the file, for the
    message another process gets."""

    def __init__(self, store_dir: Path | str, who: str):
        store_dir = Path(store_dir)
        store_dir.mkdir(parents=True, exist_ok=True)
        self.path = store_dir / LOCK_NAME
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise StoreBusy(f"{store_dir} is in use by {holder or 'another process'}") from None
        except OSError:
            os.close(fd)  # a filesystem without flock: no protection, but no refusal either
            self.fd = None
            return
        os.ftruncate(fd, 0)
        os.write(fd, f"{who} pid {os.getpid()}\n".encode())
        self.fd = fd
        _held.add(fd)

    def release(self) -> None:
        if self.fd is not None:
            _held.discard(self.fd)
            os.close(self.fd)  # the lock goes with it; the file stays (removing it would race a new holder)
            self.fd = None


def _read_holder(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        return ""
