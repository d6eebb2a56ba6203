"""nccl-tests' arithmetic, pure (no torch, no processes): sizes, counts and bandwidths.

Follows NVIDIA nccl-tests ``doc/PERFORMANCE.md`` and ``src/*.cu``:

- ``algbw = S / t`` in GB/s (bytes / seconds / 1e9), where ``S`` is the bytes the
  operation moves as nccl-tests counts them: the whole buffer. For all_gather and
  reduce_scatter that is ``count_per_rank x type size x n`` (the gathered / the
  un-scattered buffer); for alltoall the whole per-rank send buffer; for the others
  the message.
- ``busbw = algbw x factor``, the factor making the figure comparable to the link's
  peak independently of the number of ranks ``n``:
  all_reduce ``2(n-1)/n``; all_gather, reduce_scatter, alltoall ``(n-1)/n``;
  broadcast, reduce, sendrecv ``1``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

# op -> (busbw factor kind, whether the buffer is split in n per-rank chunks, reduces?, rooted?)
@dataclass(frozen=True)
class OpSpec:
    name: str
    factor_kind: str  # "allreduce" | "n-1/n" | "one"
    chunked: bool  # count must be a multiple of n (per-rank chunks of the buffer)
    reduces: bool  # takes a reduction op (-o)
    rooted: bool  # takes a root (-r)


OPS: dict[str, OpSpec] = {
    "all_reduce": OpSpec("all_reduce", "allreduce", False, True, False),
    "all_gather": OpSpec("all_gather", "n-1/n", True, False, False),
    "reduce_scatter": OpSpec("reduce_scatter", "n-1/n", True, True, False),
    "alltoall": OpSpec("alltoall", "n-1/n", True, False, False),
    "broadcast": OpSpec("broadcast", "one", False, False, True),
    "reduce": OpSpec("reduce", "one", False, True, True),
    "sendrecv": OpSpec("sendrecv", "one", False, False, False),
}

# Accepted spellings of op names (nccl-tests binary names and torch names).
OP_ALIASES = {
    **{name: name for name in OPS},
    **{f"{name}_perf": name for name in OPS},
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "reducescatter": "reduce_scatter",
    "all_to_all": "alltoall",
    "alltoall_single": "alltoall",
    "send_recv": "sendrecv",
}

REDOPS = ("sum", "prod", "min", "max", "avg")

# nccl-tests type names -> (torch dtype attribute, size in bytes, is float)
DTYPES: dict[str, tuple[str, int, bool]] = {
    "int8": ("int8", 1, False),
    "uint8": ("uint8", 1, False),
    "int32": ("int32", 4, False),
    "int64": ("int64", 8, False),
    "half": ("float16", 2, True),
    "float": ("float32", 4, True),
    "double": ("float64", 8, True),
    "bfloat16": ("bfloat16", 2, True),
}
DTYPE_ALIASES = {
    **{name: name for name in DTYPES},
    "char": "int8",
    "int": "int32",
    "long": "int64",
    "float16": "half",
    "fp16": "half",
    "float32": "float",
    "fp32": "float",
    "float64": "double",
    "fp64": "double",
    "bf16": "bfloat16",
}


def canonical_op(name: str) -> str:
    key = name.strip().lower()
    if key not in OP_ALIASES:
        raise ValueError(f"unknown operation {name!r}; choose one of: {', '.join(f'{o}_perf' for o in OPS)}")
    return OP_ALIASES[key]


def canonical_dtype(name: str) -> str:
    key = name.strip().lower()
    if key not in DTYPE_ALIASES:
        raise ValueError(f"unknown data type {name!r}; choose one of: {', '.join(DTYPES)}")
    return DTYPE_ALIASES[key]


def canonical_redop(name: str) -> str:
    key = name.strip().lower()
    if key == "product":
        key = "prod"
    if key not in REDOPS:
        raise ValueError(f"unknown reduction op {name!r}; choose one of: {', '.join(REDOPS)}")
    return key


def busbw_factor(op: str, n: int) -> float:
    """The factor busbw = algbw x factor for ``op`` over ``n`` ranks (nccl-tests)."""
    return float(busbw_factor_exact(op, n))


def busbw_factor_exact(op: str, n: int) -> Fraction:
    if n < 1:
        raise ValueError(f"number of ranks must be >= 1, got {n}")
    kind = OPS[canonical_op(op)].factor_kind
    if kind == "allreduce":
        return Fraction(2 * (n - 1), n)
    if kind == "n-1/n":
        return Fraction(n - 1, n)
    return Fraction(1)


def algbw(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 bytes per second); 0 when the time is not positive."""
    if seconds <= 0 or not math.isfinite(seconds):
        return 0.0
    return nbytes / seconds / 1e9


def busbw(op: str, n: int, nbytes: int, seconds: float) -> float:
    return algbw(nbytes, seconds) * busbw_factor(op, n)


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(i?[bB])?\s*$")
_SUFFIX = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str | int) -> int:
    """Parse a byte count like nccl-tests: ``8``, ``1K``, ``128M``, ``1G`` (binary multiples)."""
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE_RE.match(str(text))
        if not m:
            raise ValueError(f"invalid size {text!r}: use a number of bytes with an optional K, M or G suffix (e.g. 8, 64K, 1M)")
        value = float(m.group(1)) * _SUFFIX[m.group(2).lower()]
        if value != int(value):
            raise ValueError(f"invalid size {text!r}: not a whole number of bytes")
        value = int(value)
    if value < 0:
        raise ValueError(f"invalid size {text!r}: must not be negative")
    return value


def size_sequence(min_bytes: int, max_bytes: int, factor: int = 2, step_bytes: int = 0) -> list[int]:
    """The message sizes nccl-tests visits: min, min*f, ... <= max (or min, min+i, ... with -i)."""
    if min_bytes > max_bytes:
        raise ValueError(f"minimum size {min_bytes} B is larger than maximum size {max_bytes} B")
    if step_bytes:
        if step_bytes < 0:
            raise ValueError("step bytes (-i) must be positive")
        return list(range(min_bytes, max_bytes + 1, step_bytes))
    if factor < 2 and min_bytes != max_bytes:
        raise ValueError(f"step factor (-f) must be >= 2, got {factor}")
    if min_bytes == 0:
        raise ValueError("minimum size must be > 0 with a step factor (-f); use -i for additive steps")
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        if factor < 2:
            break
        size *= factor
    return sizes


def element_count(op: str, size_bytes: int, type_size: int, n: int) -> int:
    """Total element count for a size row (nccl-tests rounds down to whole elements, and to a
    multiple of n for ops whose buffer is split into per-rank chunks)."""
    count = size_bytes // type_size
    if OPS[canonical_op(op)].chunked:
        count = (count // n) * n
    return count


def row_bytes(count: int, type_size: int) -> int:
    """The 'size (B)' column and the S of algbw: the whole buffer."""
    return count * type_size


def aggregate(times: list[float], mode: int) -> float:
    """Combine per-rank times like nccl-tests' -a: 0 rank 0, 1 mean, 2 min, 3 max."""
    if not times:
        raise ValueError("no times")
    if mode == 0:
        return times[0]
    if mode == 1:
        return sum(times) / len(times)
    if mode == 2:
        return min(times)
    if mode == 3:
        return max(times)
    raise ValueError(f"invalid average mode {mode}: 0 rank0, 1 mean, 2 min, 3 max")


AVG_MODE_NAMES = {0: "rank 0", 1: "mean across ranks", 2: "min across ranks", 3: "max across ranks"}
