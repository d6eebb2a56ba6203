"""Write GPU-like Kineto (PyTorch profiler) traces of N ranks, with known ground truth.

What a trace holds (the shapes real PyTorch 2.x / Kineto traces have, see HTA's tests/data):

- ``distributedInfo`` (rank, world_size, backend, pg_config), ``deviceProperties``, ``baseTimeNanoseconds``;
- per step a ``ProfilerStep#N`` ``user_annotation`` on the main thread;
- compute kernels (cat ``kernel``) on stream 7 and a side stream 13, each launched by a ``cudaLaunchKernel``
  (cat ``cuda_runtime``) inside a ``cpu_op``, joined by ``correlation`` and an ``ac2g`` flow (``s``/``f``);
  every ``no_launch_every``-th kernel has no launch event (as kernels of CUDA graphs or from other threads);
- ``gpu_memcpy`` (H2D input copy) and ``gpu_memset`` per step, launched by cudaMemcpyAsync / cudaMemsetAsync;
- NCCL kernels (``ncclDevKernel_AllReduce_...``) on stream 20 with the collective args (Collective name,
  In msg nelems, dtype, Process Group Name/Ranks, Group size); optionally a sub-group all-reduce on stream 24;
- pipeline layout: ranks are stages; GPipe forward/backward microbatches with ``SendRecv`` NCCL kernels; the
  first and last stages idle while the pipe fills and drains (bubbles).

Ranks are simulated together so collectives behave as NCCL's do: a rank's NCCL kernel starts when that rank
launches it and ends when the last rank of the group has arrived plus the transfer time. A slow rank
(``slow_rank``, ``slow_factor``: its compute kernels longer) therefore arrives last and waits least, while its
peers wait longer inside their NCCL kernels: the culprit's kernel time is high, its victims' NCCL time is high.

``generate(...)`` returns a :class:`SynthResult` (paths and the truth: culprit, collective counts). Run as a
script for benchmarks: ``python bench/kineto_synth.py OUT --ranks 4 --target-mb 300``.
"""

from __future__ import annotations

import argparse
import gzip as gzip_mod
import os
import random
from dataclasses import dataclass, field

BASE_TS = 1_700_000_000_000.0  # us, a plausible epoch-ish start for trace clocks
PID_CPU = 4242
TID_MAIN = 4242
TID_BWD = 4250
STREAM_COMPUTE = 7
STREAM_SIDE = 13
STREAM_NCCL = 20
STREAM_SUBGROUP = 24

# (name, base duration us): a mix of GEMMs, elementwise and norm kernels, with real-looking (long) names.
KERNELS = [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel"
     "__5x_cublas", 180.0),
    ("ampere_bf16_s16816gemm_bf16_256x128_ldg8_f2f_stages_64x3_nn", 140.0),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
     "at::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, at::detail::Array<char*, 3>)",
     12.0),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>(int, float, "
     "c10::BFloat16 const*, c10::BFloat16 const*, c10::BFloat16 const*, float*, float*, c10::BFloat16*)", 25.0),
    ("void pytorch_flash::flash_fwd_kernel<pytorch_flash::Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, "
     "cutlass::bfloat16_t> >(pytorch_flash::Flash_fwd_params)", 220.0),
    ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::GeluCUDAKernelImpl"
     "(at::TensorIteratorBase&, at::native::GeluType)::{lambda()#2}::operator()() const::{lambda(c10::BFloat16)#1}> >"
     "(int, at::native::gpu_kernel_impl_nocast<at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, "
     "at::native::GeluType)::{lambda()#2}::operator()() const::{lambda(c10::BFloat16)#1}>)", 3.0),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float, "
     "at::native::sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, "
     "unsigned int, float, 4> >(at::native::ReduceOp<float, at::native::func_wrapper_t<float, "
     "at::native::sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, "
     "unsigned int, float, 4>)", 40.0),
]
CPU_OPS = ["aten::mm", "aten::add", "aten::native_layer_norm", "aten::_flash_attention_forward", "aten::gelu",
           "aten::sum", "aten::addmm"]
ALLREDUCE = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"
SENDRECV = "ncclDevKernel_SendRecv(ncclDevComm*, unsigned long, ncclWork*)"


@dataclass
class SynthResult:
    paths: list[str]
    culprit: int | None  # the slow rank, when one was injected
    n_collectives: list[int]  # NCCL kernels written per rank
    n_kernels: list[int]  # all kernels written per rank (NCCL included)
    n_no_launch: list[int]  # kernels written without a launch event, per rank
    steps: list[int] = field(default_factory=list)  # ProfilerStep numbers written
    bytes_written: list[int] = field(default_factory=list)


class _Rank:
    """One rank's output stream and its clocks."""

    def __init__(self, rank: int, path: str, gz: bool, header: str):
        self.rank = rank
        self.path = path
        self.f = gzip_mod.open(path, "wt", compresslevel=1) if gz else open(path, "w", buffering=1 << 20)
        self.f.write(header)
        self.nbytes = len(header)
        self.first = True
        self.corr = 1000 + rank  # correlation ids: unique per rank
        self.ext = 1
        self.buf: list[str] = []
        self.n_coll = 0
        self.n_kern = 0
        self.n_nolaunch = 0

    def flush(self) -> None:
        if not self.buf:
            return
        text = ",\n".join(self.buf)
        if not self.first:
            text = ",\n" + text
        self.first = False
        self.f.write(text)
        self.nbytes += len(text)
        self.buf.clear()

    def close(self) -> None:
        self.flush()
        tail = '\n],\n"traceName": "%s",\n"displayTimeUnit": "ms"\n}\n' % os.path.basename(self.path)
        self.f.write(tail)
        self.nbytes += len(tail)
        self.f.close()


def _header(rank: int, world: int, groups: list[list[int]]) -> str:
    pg = ['{"pg_name": "0", "pg_desc": "default_pg", "backend_config": "cuda:nccl", "pg_size": %d, "ranks": %s}'
          % (world, list(range(world)))]
    for i, g in enumerate(groups):
        pg.append('{"pg_name": "%d", "pg_desc": "sub_pg", "backend_config": "cuda:nccl", "pg_size": %d, "ranks": %s}'
                  % (i + 1, len(g), g))
    return ('{\n"schemaVersion": 1,\n"deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3", '
            '"totalGlobalMem": 85520809984, "computeMajor": 9, "computeMinor": 0, "numSms": 132}],\n'
            '"distributedInfo": {"backend": "nccl", "rank": %d, "world_size": %d, "pg_count": %d, "pg_config": [%s],'
            ' "nccl_version": "2.21.5"},\n"baseTimeNanoseconds": 1700000000000000000,\n"traceEvents": [\n'
            % (rank, world, len(pg), ", ".join(pg)))


def _launch(r: _Rank, cpu_t: float, op: str, api: str, tid: int = TID_MAIN) -> tuple[float, int, int]:
    """A cpu_op wrapping a runtime launch at ``cpu_t``; returns (launch end, correlation, external id)."""
    r.corr += 1
    corr = r.corr
    r.ext += 1
    ext = r.ext
    op_dur = 9.0
    rt_ts = cpu_t + 2.0
    rt_dur = 5.0
    r.buf.append('{"ph":"X","cat":"cpu_op","name":"%s","pid":%d,"tid":%d,"ts":%.3f,"dur":%.3f,'
                 '"args":{"External id":%d,"Sequence number":%d}}' % (op, PID_CPU, tid, cpu_t, op_dur, ext, ext))
    r.buf.append('{"ph":"X","cat":"cuda_runtime","name":"%s","pid":%d,"tid":%d,"ts":%.3f,"dur":%.3f,'
                 '"args":{"External id":%d,"cbid":211,"correlation":%d}}' % (api, PID_CPU, tid, rt_ts, rt_dur, ext, corr))
    r.buf.append('{"ph":"s","id":%d,"pid":%d,"tid":%d,"ts":%.3f,"cat":"ac2g","name":"ac2g"}'
                 % (corr, PID_CPU, tid, rt_ts))
    return rt_ts + rt_dur, corr, ext


def _gpu(r: _Rank, cat: str, name: str, stream: int, ts: float, dur: float, corr: int, ext: int,
         extra: str = "", flow: bool = True) -> None:
    r.buf.append('{"ph":"X","cat":"%s","name":"%s","pid":0,"tid":%d,"ts":%.3f,"dur":%.3f,"args":{"External id":%d,'
                 '"queued":0,"device":%d,"context":1,"stream":%d,"correlation":%d%s}}'
                 % (cat, name, stream, ts, dur, ext, r.rank % 8, stream, corr, extra))
    if flow:
        r.buf.append('{"ph":"f","id":%d,"pid":0,"tid":%d,"ts":%.3f,"cat":"ac2g","name":"ac2g","bp":"e"}'
                     % (corr, stream, ts))
    if cat == "kernel":
        r.n_kern += 1


def _kernel_args(grid: int) -> str:
    return (',"registers per thread":64,"shared memory":16384,"blocks per SM":%.6f,"warps per SM":8.0,'
            '"grid":[%d,1,1],"block":[256,1,1],"est. achieved occupancy %%":25' % (grid / 132.0, grid))


def _nccl_args(coll: str, nelems: int, group: list[int], pg_name: str, seq: int) -> str:
    return (',"Collective name":"%s","In msg nelems":%d,"Out msg nelems":%d,"Group size":%d,"dtype":"BFloat16",'
            '"In split size":"[]","Out split size":"[]","Process Group Name":"%s","Process Group Description":"%s",'
            '"Process Group Ranks":"%s","Seq":%d' % (coll, nelems, nelems, len(group), pg_name,
                                                     "default_pg" if pg_name == "0" else "sub_pg", group, seq))


def generate(out_dir: str, *, ranks: int = 4, steps: int = 4, kernels: int = 120, slow_rank: int | None = None,
             slow_factor: float = 1.0, pipeline: bool = False, microbatches: int = 4, buckets: int = 4,
             subgroup_size: int = 0, slow_comm_group: int | None = None, slow_comm_factor: float = 1.0,
             no_launch_every: int = 10, target_mb: float | None = None, seed: int = 0, gzip: bool = False,
             truncate_at: int | None = None, first_step: int = 1, name: str = "rank-{rank}.pt.trace.json",
             cpu_stall_every: int = 40, cpu_stall_us: float = 150.0) -> SynthResult:
    """Write one trace per rank under ``out_dir``; see the module doc for what they hold.

    ``target_mb``: keep writing steps until rank 0's (uncompressed) trace reaches this many MB (``steps`` is then a
    minimum). ``truncate_at``: cut every file at this byte count after writing (a crashed job's trace).
    ``subgroup_size``: also one all-reduce per step within consecutive groups of this many ranks (Process Group
    Names "1", "2", ...); ``slow_comm_group`` (index of such a group) makes its transfers ``slow_comm_factor``x
    longer.
    """
    os.makedirs(out_dir, exist_ok=True)
    rng = random.Random(seed)
    groups = ([list(range(i, min(i + subgroup_size, ranks))) for i in range(0, ranks, subgroup_size)]
              if subgroup_size and not pipeline else [])
    ext = ".gz" if gzip else ""
    rs = [_Rank(i, os.path.join(out_dir, name.format(rank=i) + ext), gzip, _header(i, ranks, groups))
          for i in range(ranks)]
    # Rank clocks: each rank's CPU and GPU stream frontiers (us).
    cpu = [BASE_TS + 50.0 + rng.random() * 20 for _ in range(ranks)]
    written_steps: list[int] = []
    step = first_step
    seqs = {"0": 0}
    for i in range(len(groups)):
        seqs[str(i + 1)] = 0
    kstat = 0  # global kernel counter (for no-launch picks and side streams)

    def comp_dur(r: int, base: float) -> float:
        d = base * (0.9 + 0.2 * rng.random())
        return d * (slow_factor if r == slow_rank else 1.0)

    while True:
        step_start = list(cpu)
        step_cpu_end = [0.0] * ranks
        gpu_end = [0.0] * ranks
        if not pipeline:
            # Per rank: H2D copy, memset, forward/backward kernels; gradient buckets become ready during backward.
            ready: list[list[float]] = [[] for _ in range(ranks)]
            s7 = list(cpu)
            s13 = list(cpu)
            for r in range(ranks):
                R = rs[r]
                t = cpu[r] + 300.0 + rng.random() * 100  # dataloader: the GPU waits on the host (host wait)
                le, c, e = _launch(R, t, "aten::copy_", "cudaMemcpyAsync")
                st = le + 4.0
                d = 60.0 + rng.random() * 10
                _gpu(R, "gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", STREAM_COMPUTE, st, d, c, e,
                     ',"bytes":%d,"memory bandwidth (GB/s)":%.3f' % (int(d * 25e3), 25.0))
                s7[r] = st + d
                t += 12.0
                le, c, e = _launch(R, t, "aten::zero_", "cudaMemsetAsync")
                st = max(le + 3.0, s7[r])
                d = 4.0 + rng.random()
                _gpu(R, "gpu_memset", "Memset (Device)", STREAM_COMPUTE, st, d, c, e, ',"bytes":1048576')
                s7[r] = st + d
                t += 12.0
                bucket_at = set(kernels // 2 + (j + 1) * (kernels - kernels // 2) // (buckets + 1)
                                for j in range(buckets))
                for k in range(kernels):
                    kstat += 1
                    ki = (k * 3 + step) % len(KERNELS)
                    kname, base = KERNELS[ki]
                    side = kstat % 11 == 0
                    stream = STREAM_SIDE if side else STREAM_COMPUTE
                    if cpu_stall_every and k % cpu_stall_every == cpu_stall_every - 1:
                        t += cpu_stall_us * (0.5 + rng.random())  # the host falls behind: GPU drains (host wait)
                    no_launch = no_launch_every and kstat % no_launch_every == 0
                    d = comp_dur(r, base)
                    if no_launch:
                        R.corr += 1  # a correlation id no runtime event carries
                        c, e2 = R.corr, 0
                        st = (s13[r] if side else s7[r]) + 1.5
                        R.n_nolaunch += 1
                    else:
                        le, c, e2 = _launch(R, t, CPU_OPS[ki], "cudaLaunchKernel")
                        frontier = s13[r] if side else s7[r]
                        st = max(le + 3.0 + rng.random() * 2, frontier + 1.0)
                        t += 14.0
                    _gpu(R, "kernel", kname, stream, st, d, c, e2, _kernel_args(132 + ki * 8), flow=not no_launch)
                    if side:
                        s13[r] = st + d
                    else:
                        s7[r] = st + d
                    if k in bucket_at:
                        # record the bucket: NCCL launched after this kernel's launch; ready when it ends
                        ready[r].append((max(st + d, t), t))
                cpu[r] = t
            # All-reduce buckets across ranks, on stream 20: each rank enters when ready, all leave together.
            frontier20 = [0.0] * ranks
            for b in range(buckets):
                arrive = []
                corr_ext = []
                for r in range(ranks):
                    rd, lt = ready[r][b]
                    le, c, e = _launch(rs[r], lt + 1.0, "c10d::allreduce_", "cudaLaunchKernel", tid=TID_BWD)
                    arrive.append(max(rd, le + 3.0, frontier20[r]))
                    corr_ext.append((c, e))
                nelems = 25_000_000 // buckets
                end = max(arrive) + 400.0 * (0.95 + 0.1 * rng.random())
                seqs["0"] += 1
                for r in range(ranks):
                    c, e = corr_ext[r]
                    _gpu(rs[r], "kernel", ALLREDUCE, STREAM_NCCL, arrive[r], end - arrive[r], c, e,
                         _nccl_args("allreduce", nelems, list(range(ranks)), "0", seqs["0"]))
                    rs[r].n_coll += 1
                    frontier20[r] = end
            for gi, g in enumerate(groups):
                # A sub-group all-reduce (e.g. a tensor/expert-parallel group) after the buckets.
                arrive = {}
                ce = {}
                for r in g:
                    le, c, e = _launch(rs[r], cpu[r], "c10d::allreduce_", "cudaLaunchKernel")
                    cpu[r] += 14.0
                    arrive[r] = max(le + 3.0, s7[r])
                    ce[r] = (c, e)
                xfer = 150.0 * (slow_comm_factor if gi == slow_comm_group else 1.0)
                end = max(arrive.values()) + xfer
                seqs[str(gi + 1)] += 1
                for r in g:
                    _gpu(rs[r], "kernel", ALLREDUCE, STREAM_SUBGROUP, arrive[r], end - arrive[r], *ce[r],
                         _nccl_args("allreduce", 2_000_000, g, str(gi + 1), seqs[str(gi + 1)]))
                    rs[r].n_coll += 1
                    s7[r] = max(s7[r], end)  # the compute stream waits for it (stream wait event)
            # Optimizer: waits for the last bucket (cudaStreamWaitEvent), then a few kernels on stream 7.
            for r in range(ranks):
                R = rs[r]
                t = cpu[r]
                front = max(s7[r], frontier20[r], s13[r])
                for k in range(4):
                    le, c, e = _launch(R, t, "aten::_foreach_add_", "cudaLaunchKernel")
                    st = max(le + 3.0, front + 1.0)
                    d = comp_dur(r, 30.0)
                    _gpu(R, "kernel", KERNELS[2][0], STREAM_COMPUTE, st, d, c, e, _kernel_args(132))
                    front = st + d
                    t += 14.0
                gpu_end[r] = front
                step_cpu_end[r] = max(t, front) + 5.0
        else:
            # Pipeline (GPipe): rank s is stage s. Forward of microbatch m on stage s waits for stage s-1's send.
            S, M = ranks, microbatches
            fwd_base, p2p = 60.0 * kernels / 8, 40.0
            free = [cpu[s] + 300.0 for s in range(S)]
            fwd_end = [[0.0] * M for _ in range(S)]
            t_cpu = [cpu[s] + 300.0 for s in range(S)]

            def run_chunk(s: int, st: float, base: float, tag: str) -> float:
                R = rs[s]
                n = 4
                for j in range(n):
                    ki = (j * 3 + (0 if tag == "fwd" else 1)) % len(KERNELS)
                    le, c, e = _launch(R, t_cpu[s], CPU_OPS[ki], "cudaLaunchKernel")
                    t_cpu[s] = max(t_cpu[s] + 14.0, st - 200.0)
                    d = comp_dur(s, base / n)
                    st = max(st, le + 3.0)
                    _gpu(R, "kernel", KERNELS[ki][0], STREAM_COMPUTE, st, d, c, e, _kernel_args(132))
                    st += d + 1.0
                return st

            def p2p_kernels(src: int, dst: int, t_ready: float) -> float:
                for s in (src, dst):
                    R = rs[s]
                    le, c, e = _launch(R, t_cpu[s], "nccl:send" if s == src else "nccl:recv", "cudaLaunchKernel")
                    _gpu(R, "kernel", SENDRECV, STREAM_NCCL, t_ready, p2p, c, e,
                         _nccl_args("send" if s == src else "recv", 1_000_000, [src, dst], "0", 0))
                    R.n_coll += 1
                return t_ready + p2p

            for m in range(M):
                for s in range(S):
                    st = free[s] if s == 0 else max(free[s], fwd_end[s - 1][m])
                    end = run_chunk(s, st, fwd_base, "fwd")
                    free[s] = end
                    if s < S - 1:
                        end = p2p_kernels(s, s + 1, end)
                    fwd_end[s][m] = end
            bwd_end = [[0.0] * M for _ in range(S)]
            for m in range(M):
                for s in reversed(range(S)):
                    st = free[s] if s == S - 1 else max(free[s], bwd_end[s + 1][m])
                    end = run_chunk(s, st, 2 * fwd_base, "bwd")
                    free[s] = end
                    if s > 0:
                        end = p2p_kernels(s, s - 1, end)
                    bwd_end[s][m] = end
            for s in range(S):
                gpu_end[s] = free[s]
                step_cpu_end[s] = max(t_cpu[s], free[s]) + 5.0
            # stages sync at the step end (the loss all-reduce / optimizer barrier)
            sync = max(step_cpu_end)
            step_cpu_end = [sync] * S
        for r in range(ranks):
            R = rs[r]
            end = max(step_cpu_end[r], gpu_end[r] + 2.0)
            R.buf.append('{"ph":"X","cat":"user_annotation","name":"ProfilerStep#%d","pid":%d,"tid":%d,"ts":%.3f,'
                         '"dur":%.3f,"args":{"External id":%d}}' % (step, PID_CPU, TID_MAIN, step_start[r],
                                                                  end - step_start[r], R.ext))
            cpu[r] = end + 1.0
            R.flush()
        written_steps.append(step)
        step += 1
        done_steps = len(written_steps) >= steps
        if target_mb is not None:
            if done_steps and rs[0].nbytes >= target_mb * 1e6:
                break
        elif done_steps:
            break
    for R in rs:
        R.buf.append('{"name":"process_name","ph":"M","ts":%.3f,"pid":%d,"tid":0,"args":{"name":"python3"}}'
                     % (BASE_TS, PID_CPU))
        R.buf.append('{"name":"thread_name","ph":"M","ts":%.3f,"pid":%d,"tid":%d,"args":{"name":"thread %d (python3)"}}'
                     % (BASE_TS, PID_CPU, TID_MAIN, TID_MAIN))
        R.close()
    sizes = []
    for R in rs:
        if truncate_at is not None and os.path.getsize(R.path) > truncate_at:
            os.truncate(R.path, truncate_at)
        sizes.append(os.path.getsize(R.path))
    return SynthResult(paths=[R.path for R in rs], culprit=slow_rank if slow_factor > 1.0 else None,
                       n_collectives=[R.n_coll for R in rs], n_kernels=[R.n_kern for R in rs],
                       n_no_launch=[R.n_nolaunch for R in rs], steps=written_steps, bytes_written=sizes)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--kernels", type=int, default=120, help="compute kernels per step")
    ap.add_argument("--slow-rank", type=int)
    ap.add_argument("--slow-factor", type=float, default=1.0)
    ap.add_argument("--pipeline", action="store_true")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--subgroup-size", type=int, default=0)
    ap.add_argument("--target-mb", type=float)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gzip", action="store_true")
    ap.add_argument("--truncate-at", type=int)
    a = ap.parse_args(argv)
    res = generate(a.out, ranks=a.ranks, steps=a.steps, kernels=a.kernels, slow_rank=a.slow_rank,
                   slow_factor=a.slow_factor, pipeline=a.pipeline, microbatches=a.microbatches,
                   subgroup_size=a.subgroup_size, target_mb=a.target_mb, seed=a.seed, gzip=a.gzip,
                   truncate_at=a.truncate_at)
    for p, n in zip(res.paths, res.bytes_written):
        print(f"{p}\t{n / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
