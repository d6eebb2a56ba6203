"""glibc's allocator settings, for the processes that make big temporary arrays (the head's live rounds, diagnose's
collective checks): one module, so each setting is made in one place and the two uses know of each other.

- ``keep_freed_memory()``: for a long-running process (the head with live analysis on). Blocks up to 32 MiB
  (glibc's usual mmap ceiling; a live round's columns and rank x step matrices at 16,384 ranks are 4-16 MiB each) come
  from the heap, and up to 1 GiB freed at its top stays there. glibc's defaults hand a round's freed arrays back to the
  system and the next round faults every page in again, kernel time that grows with the job.
- ``reuse_freed_pages()``: for a block of work over very big arrays (80 MB rank x step matrices, per-record arrays of
  20 M records): while it runs, blocks up to 1 GiB come from the heap and freed ones stay, so a temporary reuses the
  pages of the one freed before it instead of fresh ones the kernel must fault in and zero. Afterwards the settings go
  back to what the process had: those of ``keep_freed_memory`` if it was called (nothing trimmed: the process asked to
  keep), else glibc's ceiling for its adaptive mmap threshold and its initial trim threshold, and the heap's free
  memory is returned (``malloc_trim``).

Values are never touched, only where the bytes live. Elsewhere than glibc (musl, macOS) both do nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import sys
from typing import Iterator

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters
M_MMAP_THRESHOLD = -3

KEEP_MMAP_THRESHOLD = 32 << 20  # keep_freed_memory's settings
KEEP_TRIM_THRESHOLD = 1 << 30
LARGE = 1 << 30  # reuse_freed_pages: blocks up to this size from the heap while the work runs
AFTER_MMAP = 32 << 20  # after it, in a process that did not ask to keep: glibc's ceiling for its adaptive mmap
AFTER_TRIM = 128 << 10  # threshold, and its initial trim threshold (freed memory at the heap's top goes back at once)


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return None


_LIBC = _glibc()
_KEPT = [False]  # keep_freed_memory was called: what reuse_freed_pages restores
_DEPTH = [0]  # nested reuse_freed_pages: only the outermost one sets and restores


def keep_freed_memory() -> bool:
    """Let the allocator keep what the process frees, for its next round of like allocations (see the module).
    True where it was set (glibc), False elsewhere (the defaults stay)."""
    libc = _LIBC
    if libc is None:
        return False
    ok = bool(libc.mallopt(M_MMAP_THRESHOLD, KEEP_MMAP_THRESHOLD)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, KEEP_TRIM_THRESHOLD))
    _KEPT[0] = _KEPT[0] or ok
    return ok


@contextlib.contextmanager
def reuse_freed_pages(enabled: bool = True) -> Iterator[None]:
    """Within the block, large temporaries reuse freed heap pages instead of fresh mappings (see the module); not
    ``enabled``: the allocator left as it is."""
    libc = _LIBC
    outermost = libc is not None and enabled and not _DEPTH[0]
    _DEPTH[0] += 1
    if outermost:
        libc.mallopt(M_MMAP_THRESHOLD, LARGE)
        libc.mallopt(M_TRIM_THRESHOLD, LARGE)  # freed memory at the heap's top kept up to this much
    try:
        yield
    finally:
        _DEPTH[0] -= 1
        if outermost:
            _put_back(libc)


def _put_back(libc) -> None:
    """The settings the process had before ``reuse_freed_pages``."""
    if _KEPT[0]:  # a head keeping freed memory between rounds: back to its settings, nothing handed back
        libc.mallopt(M_MMAP_THRESHOLD, KEEP_MMAP_THRESHOLD)
        libc.mallopt(M_TRIM_THRESHOLD, KEEP_TRIM_THRESHOLD)
    else:
        libc.mallopt(M_MMAP_THRESHOLD, AFTER_MMAP)
        libc.mallopt(M_TRIM_THRESHOLD, AFTER_TRIM)
        libc.malloc_trim(0)  # the heap's free pages back to the system
