"""Deterministic per-rank inputs, the results they must give, and the comparison (-c 1).

Every rank can compute every other rank's input from (rank, element index) alone, so each
rank computes the exact expected result of the collective locally (in float64 / int64,
then cast to the tested type) and counts the elements that differ. Values are small
integers so that sums are exact in every float type for modest world sizes; half and
bfloat16 compare with a tolerance that grows with the number of ranks (reduction order).
"""

from __future__ import annotations

import torch

from nccl_tests.formulas import DTYPES, OPS, canonical_op

_REDUCE_RANGE = 11  # sum/avg inputs lie in 1..11
_MINMAX_RANGE = 13
_MOVE_RANGE = 97  # data-movement ops: spread values so a misplaced chunk is visible


def torch_dtype(type_name: str) -> torch.dtype:
    return getattr(torch, DTYPES[type_name][0])


def is_float(type_name: str) -> bool:
    return DTYPES[type_name][2]


def rank_values(op: str, redop: str, rank: int, n: int, length: int, offset: int = 0) -> torch.Tensor:
    """Rank ``rank``'s send buffer (``length`` elements from element ``offset``) as int64."""
    op = canonical_op(op)
    i = torch.arange(offset, offset + length, dtype=torch.int64)
    if OPS[op].reduces:
        if redop == "prod":
            # 1 everywhere except 2 where i % n == rank: every product is exactly 2.
            return 1 + (i % n == rank).to(torch.int64)
        if redop in ("min", "max"):
            return (rank * 5 + i * 3) % _MINMAX_RANGE + 1
        return (rank * 7 + i * 3) % _REDUCE_RANGE + 1
    return (rank * 31 + i * 7) % _MOVE_RANGE + 1


def _reduce(values: list[torch.Tensor], redop: str, n: int, floating: bool) -> torch.Tensor:
    stack = torch.stack(values)
    if redop == "sum":
        return stack.sum(0)
    if redop == "prod":
        return stack.prod(0)
    if redop == "min":
        return stack.min(0).values
    if redop == "max":
        return stack.max(0).values
    if redop == "avg":
        if not floating:
            raise ValueError("avg is supported for floating-point types only")
        return stack.to(torch.float64).sum(0) / n
    raise ValueError(f"unknown reduction {redop}")


def send_length(op: str, count: int, n: int) -> int:
    """Elements in one rank's send buffer for a row of ``count`` total elements."""
    return count // n if canonical_op(op) == "all_gather" else count


def recv_length(op: str, count: int, n: int) -> int:
    """Elements in one rank's receive buffer."""
    return count // n if canonical_op(op) == "reduce_scatter" else count


def make_input(op: str, redop: str, type_name: str, rank: int, n: int, count: int, device) -> torch.Tensor:
    vals = rank_values(op, redop, rank, n, send_length(op, count, n))
    return cast(vals, type_name).to(device)


def cast(values: torch.Tensor, type_name: str) -> torch.Tensor:
    dt = torch_dtype(type_name)
    if is_float(type_name):
        return values.to(torch.float64).to(dt)
    # wrap like two's complement does (int8/uint8 sums may overflow for large n)
    return values.to(torch.int64).to(dt)


def expected(op: str, redop: str, type_name: str, rank: int, n: int, count: int, root: int) -> torch.Tensor | None:
    """What this rank's receive buffer must hold after the op (CPU tensor of the tested type),
    or None when this rank's buffer is not defined (reduce on a non-root rank)."""
    op = canonical_op(op)
    floating = is_float(type_name)
    if op == "all_reduce":
        vals = [rank_values(op, redop, r, n, count) for r in range(n)]
        out = _reduce(vals, redop, n, floating)
    elif op == "reduce":
        if rank != root:
            return None
        vals = [rank_values(op, redop, r, n, count) for r in range(n)]
        out = _reduce(vals, redop, n, floating)
    elif op == "broadcast":
        out = rank_values(op, redop, root, n, count)
    elif op == "all_gather":
        c = count // n
        out = torch.cat([rank_values(op, redop, r, n, c) for r in range(n)])
    elif op == "reduce_scatter":
        c = count // n
        vals = [rank_values(op, redop, r, n, c, offset=rank * c) for r in range(n)]
        out = _reduce(vals, redop, n, floating)
    elif op == "alltoall":
        c = count // n
        # chunk j of my receive buffer is chunk `rank` of rank j's send buffer
        out = torch.cat([rank_values(op, redop, r, n, c, offset=rank * c) for r in range(n)]) if c else torch.zeros(0, dtype=torch.int64)
    elif op == "sendrecv":
        out = rank_values(op, redop, (rank - 1) % n, n, count)
    else:  # pragma: no cover - canonical_op guards this
        raise ValueError(op)
    if floating:
        return out.to(torch.float64).to(torch_dtype(type_name))
    return out.to(torch.int64).to(torch_dtype(type_name))


def tolerance(type_name: str, n: int) -> float:
    """Relative tolerance: 0 for integer types; for floats a few ulps per rank."""
    if not is_float(type_name):
        return 0.0
    eps = torch.finfo(torch_dtype(type_name)).eps
    return eps * (n + 1)


def count_wrong(got: torch.Tensor, want: torch.Tensor, type_name: str, n: int) -> int:
    """Number of elements of ``got`` that differ from ``want`` beyond the type's tolerance."""
    got = got.detach().reshape(-1).cpu()
    want = want.reshape(-1)
    if got.numel() != want.numel():
        return max(got.numel(), want.numel())
    if not is_float(type_name):
        return int((got != want).sum())
    g = got.to(torch.float64)
    w = want.to(torch.float64)
    bad = (g - w).abs() > tolerance(type_name, n) * w.abs().clamp(min=1.0)
    bad |= ~torch.isfinite(g)
    return int(bad.sum())


def corrupt_(buf: torch.Tensor) -> None:
    """Self-test hook: make element 0 certainly wrong (x -> -x - 1)."""
    flat = buf.view(-1)
    if flat.numel():
        flat[0] = -flat[0] - 1
