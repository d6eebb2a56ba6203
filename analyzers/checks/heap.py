"""Big temporaries without fresh pages: glibc's allocator told to serve large blocks from its heap for a while.

A check over a 1,024 x 10,000 run makes dozens of temporary rank x step arrays (80 MB each) and per-record arrays
of 20 M records. glibc hands every block over its mmap threshold (at most 32 MiB, however it adapts) to the kernel
as a fresh mapping and unmaps it on free, so each temporary is new memory the kernel must fault in and zero page by
page: on a busy host that costs as much as the arithmetic on it. ``reuse_freed_pages`` raises the threshold for the
duration of a block of work, so freed temporaries stay in the heap and the next one of a like size reuses their
pages; afterwards the mmap threshold goes to glibc's adaptive ceiling, the trim threshold to its initial value, and
the heap's free memory is returned (``malloc_trim``). Values are untouched: only where the bytes live changes. Elsewhere than glibc: nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import sys
from typing import Iterator

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters
M_MMAP_THRESHOLD = -3
LARGE = 1 << 30  # blocks up to this size from the heap while the work runs
AFTER_MMAP = 32 << 20  # after: glibc's ceiling for its adaptive mmap threshold (64-bit) ...
AFTER_TRIM = 128 << 10  # ... and its initial trim threshold: freed memory at the heap's top goes back at once (at
# twice the mmap threshold, as glibc pairs them, the checks after this one kept up to 64 MiB of freed blocks each)


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except (OSError, AttributeError):
        return None


_LIBC = _glibc()
_DEPTH = [0]  # nested uses: only the outermost one sets and restores


@contextlib.contextmanager
def reuse_freed_pages(enabled: bool = True) -> Iterator[None]:
    """Within the block, large temporaries reuse freed heap pages instead of fresh mappings (see the module); not
    ``enabled``: the allocator left as it is."""
    libc = _LIBC
    if libc is None or _DEPTH[0] or not enabled:
        _DEPTH[0] += 1
        try:
            yield
        finally:
            _DEPTH[0] -= 1
        return
    _DEPTH[0] += 1
    libc.mallopt(M_MMAP_THRESHOLD, LARGE)
    libc.mallopt(M_TRIM_THRESHOLD, LARGE)  # freed memory at the heap top kept up to this much
    try:
        yield
    finally:
        _DEPTH[0] -= 1
        libc.mallopt(M_MMAP_THRESHOLD, AFTER_MMAP)
        libc.mallopt(M_TRIM_THRESHOLD, AFTER_TRIM)
        libc.malloc_trim(0)  # the heap's free pages back to the system
