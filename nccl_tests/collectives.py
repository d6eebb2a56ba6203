"""The seven operations over torch.distributed, out-of-place and in-place.

torch.distributed does not offer every operation in both forms on every backend, so some are
emulated; ``Collective.notes`` lists exactly which, and the report header prints them:

- all_reduce, broadcast, reduce are in-place in torch: out-of-place = copy the send buffer
  into the receive buffer, then the in-place op (the copy is inside the timed region).
- sendrecv (send to rank+1, receive from rank-1, as nccl-tests) in-place sends a copy of the
  buffer (concurrent send and receive on one buffer would race).
- alltoall in-place sends a copy (all_to_all_single on one buffer races: -c 1 counts wrong
  elements on gloo).
- all_gather_into_tensor / reduce_scatter_tensor / ReduceOp.AVG are probed at start-up; where the
  backend lacks them: list all_gather into views, all_reduce + local slice, SUM then divide by n.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nccl_tests import data
from nccl_tests.formulas import OPS, canonical_op
from nccl_tests.runtime import Hooks, all_gather_single, reduce_scatter_single

_REDOP = {
    "sum": dist.ReduceOp.SUM,
    "prod": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "avg": dist.ReduceOp.AVG,
}


def _probe(fn) -> bool:
    try:
        fn()
        return True
    except (RuntimeError, NotImplementedError, ValueError) as exc:
        msg = str(exc).lower()
        if "not supported" in msg or "not implemented" in msg or "unsupported" in msg or "does not support" in msg:
            return False
        raise


class Collective:
    def __init__(self, op: str, redop: str, root: int, rank: int, n: int, backend: str, device: str, hooks: Hooks):
        self.op = canonical_op(op)
        self.spec = OPS[self.op]
        self.redop = redop
        self.root = root
        self.rank = rank
        self.n = n
        self.backend = backend
        self.device = device
        self.hooks = hooks
        self.notes: list[str] = []
        self.native_gather = True
        self.native_rs = True
        self.native_avg = True
        self._probe_backend()
        self._describe()

    # -- capabilities -------------------------------------------------------
    def _probe_backend(self) -> None:
        n, dev = self.n, self.device
        if self.op == "all_gather":
            self.native_gather = _probe(lambda: all_gather_single(torch.empty(n, device=dev), torch.ones(1, device=dev)))
        if self.op == "reduce_scatter":
            self.native_rs = _probe(lambda: reduce_scatter_single(torch.empty(1, device=dev), torch.ones(n, device=dev)))
        if self.spec.reduces and self.redop == "avg":
            self.native_avg = _probe(lambda: dist.all_reduce(torch.ones(1, device=dev), op=dist.ReduceOp.AVG))
            if self.op == "reduce_scatter" and self.native_avg and self.native_rs:
                self.native_avg = _probe(lambda: reduce_scatter_single(torch.empty(1, device=dev), torch.ones(n, device=dev), op=dist.ReduceOp.AVG))
            if self.op == "reduce" and self.native_avg:
                self.native_avg = _probe(lambda: dist.reduce(torch.ones(1, device=dev), self.root, op=dist.ReduceOp.AVG))

    def _describe(self) -> None:
        op, notes = self.op, self.notes
        if op in ("all_reduce", "broadcast", "reduce"):
            notes.append(f"out-of-place {op} = copy into the receive buffer + in-place torch.distributed.{op} (torch has no out-of-place form; the copy is timed)")
        if op == "sendrecv":
            notes.append("sendrecv: each rank sends to rank+1 and receives from rank-1 (batch_isend_irecv); in-place sends a copy of the buffer")
            if self.n == 1:
                notes.append("sendrecv with 1 rank: a local copy (no peer)")
        if op == "alltoall":
            notes.append("in-place alltoall sends a copy of the buffer (all_to_all_single with one buffer as input and "
                         "output gives wrong results on gloo: measured by -c 1)")
        if op == "all_gather" and not self.native_gather:
            notes.append(f"all_gather_single (all_gather_into_tensor) not supported by {self.backend}: emulated with list all_gather into views of the buffer")
        if op == "reduce_scatter" and not self.native_rs:
            notes.append(f"reduce_scatter_single (reduce_scatter_tensor) not supported by {self.backend}: emulated with all_reduce of the whole buffer + local slice (moves n x the data)")
        if self.spec.reduces and self.redop == "avg" and not self.native_avg:
            notes.append(f"ReduceOp.AVG not supported by {self.backend} for {op}: emulated as SUM then divide by n locally")

    # -- buffers --------------------------------------------------------------
    def chunk(self, buf: torch.Tensor) -> torch.Tensor:
        c = buf.numel() // self.n
        return buf[self.rank * c:(self.rank + 1) * c]

    def _torch_op(self):
        if self.redop == "avg" and not self.native_avg:
            return dist.ReduceOp.SUM
        return _REDOP[self.redop]

    def _fix_avg(self, out: torch.Tensor) -> None:
        if self.redop == "avg" and not self.native_avg:
            out.div_(self.n)

    # -- one call -------------------------------------------------------------
    def run(self, send: torch.Tensor, recv: torch.Tensor, in_place: bool) -> None:
        """One operation. For in-place, ``recv`` is the one buffer and ``send`` the view of it that
        nccl-tests would pass as the send buffer (same storage)."""
        self.hooks.before_comm()
        op, n, rank = self.op, self.n, self.rank
        if op == "all_reduce":
            if not in_place:
                recv.copy_(send)
            dist.all_reduce(recv, op=self._torch_op())
            self._fix_avg(recv)
        elif op == "broadcast":
            if not in_place and rank == self.root:
                recv.copy_(send)
            dist.broadcast(recv, self.root)
        elif op == "reduce":
            if not in_place:
                recv.copy_(send)
            dist.reduce(recv, self.root, op=self._torch_op())
            if rank == self.root:
                self._fix_avg(recv)
        elif op == "all_gather":
            if self.native_gather:
                all_gather_single(recv, send)
            else:
                src = send.clone() if in_place else send
                dist.all_gather(list(recv.chunk(n)), src)
        elif op == "reduce_scatter":
            if self.native_rs:
                reduce_scatter_single(recv, send, op=self._torch_op())
                self._fix_avg(recv)
            else:
                tmp = send.clone()
                dist.all_reduce(tmp, op=self._torch_op())
                self._fix_avg(tmp)
                recv.copy_(self.chunk(tmp))
        elif op == "alltoall":
            src = send.clone() if in_place else send
            dist.all_to_all_single(recv, src)
        elif op == "sendrecv":
            src = send.clone() if in_place else send
            if n == 1:
                recv.copy_(src)
                return
            reqs = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, src, (rank + 1) % n),
                dist.P2POp(dist.irecv, recv, (rank - 1) % n),
            ])
            for r in reqs:
                r.wait()
        else:  # pragma: no cover
            raise ValueError(op)

    # -- buffers for a row ----------------------------------------------------
    def buffers(self, type_name: str, count: int, in_place: bool, fill: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(send, recv) for a row of ``count`` total elements; filled with this rank's
        deterministic input when ``fill``."""
        dt = data.torch_dtype(type_name)
        dev = self.device
        slen = data.send_length(self.op, count, self.n)
        rlen = data.recv_length(self.op, count, self.n)
        inp = data.make_input(self.op, self.redop, type_name, self.rank, self.n, count, dev) if fill else None
        if not in_place:
            send = inp if inp is not None else torch.zeros(slen, dtype=dt, device=dev)
            recv = torch.zeros(rlen, dtype=dt, device=dev)
            if fill:
                recv.fill_(0)
            return send, recv
        if self.op == "all_gather":
            buf = torch.zeros(count, dtype=dt, device=dev)
            send = self.chunk(buf)
            if inp is not None:
                send.copy_(inp)
            return send, buf
        if self.op == "reduce_scatter":
            buf = inp if inp is not None else torch.zeros(count, dtype=dt, device=dev)
            return buf, self.chunk(buf)
        buf = inp if inp is not None else torch.zeros(count, dtype=dt, device=dev)
        return buf, buf
