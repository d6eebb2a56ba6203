"""The GPU check: ``ranksight.init`` on a real CUDA job, a slow rank made by extra kernels, found from device time.

    python bench/gpu_check.py --out DIR            # on a machine with at least one NVIDIA GPU

1. ``torchrun`` starts ``--nproc`` ranks of a DDP MLP instrumented with the public API (``ranksight.init``,
   ``rs.watch``, ``rs.step``). With as many GPUs as ranks each rank has its own GPU and the backend is NCCL; with
   fewer (NCCL refuses two ranks on one device) the ranks share GPU 0 and talk over gloo, and the report says so.
   From ``--slow-start`` on, rank ``--slow-rank`` queues extra matmul kernels after its forward pass (about
   ``--slow-factor`` - 1 of its compute): the rank *is* slower on the device; nothing tells ranksight so.
2. The analyzers run on the recorded steps: the straggler must be the slow rank, named from ``device_ms`` (CUDA
   events), and no other rank.
3. The NVML probe (``probes.nvml``, the real pynvml path) samples the real device(s).

Prints the figures and writes ``DIR/gpu_check.json``; exit 0 when the culprit was named from device time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import ranksight

    gpus = torch.cuda.device_count()
    local = int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    own_gpu = gpus >= world
    dev = torch.device("cuda", local if own_gpu else 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if own_gpu else "gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    width = args.width
    net = torch.nn.Sequential(*[m for _ in range(args.layers) for m in (torch.nn.Linear(width, width), torch.nn.GELU())])
    model = torch.nn.parallel.DistributedDataParallel(net.to(dev), device_ids=[dev.index] if own_gpu else None)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    rs = ranksight.init(args.run_id, args.store, config={"gpu_check": True, "shared_gpu": not own_gpu})
    rs.watch(model)
    x = torch.randn(args.batch, width, device=dev)
    extra = torch.randn(width, width, device=dev)
    for step in range(1, args.steps + 1):
        with rs.step(step) as s:
            with rs.phase("forward"):
                loss = model(x).float().pow(2).mean()
                if rank == args.slow_rank and step >= args.slow_start:
                    # the fault: real kernels on this rank's stream (forward + backward ~ 3 x forward of matmuls)
                    for _ in range(int(round(3 * args.layers * (args.slow_factor - 1.0)))):
                        x2 = extra @ extra
                    del x2
            with rs.phase("backward"):
                loss.backward()
            with rs.phase("optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)
            s.report(loss=loss)
    rs.finish()
    dist.barrier()
    dist.destroy_process_group()


def nvml_samples() -> dict:
    from probes.nvml import build_gpu_probe

    probe = build_gpu_probe(node=0, host="gpu-check")
    samples = probe.sample()
    return {"mode": probe.mode, "status": getattr(probe, "status", ""),
            "samples": [{k: getattr(s, k) for k in ("gpu", "name", "uuid", "source", "simulated", "util_pct", "mem_used_bytes", "mem_total_bytes",
                                                     "sm_clock_mhz", "max_sm_clock_mhz", "temp_c", "power_w", "throttle_reasons")
                         if hasattr(s, k)} for s in samples]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="gpu-check")
    ap.add_argument("--store", default="")
    ap.add_argument("--run-id", default="gpu-check")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--slow-rank", type=int, default=1)
    ap.add_argument("--slow-factor", type=float, default=1.5)
    ap.add_argument("--slow-start", type=int, default=20)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store = Path(args.store or out / "store")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           str(Path(__file__).resolve()), "--worker", "--store", str(store), "--run-id", args.run_id,
           "--steps", str(args.steps), "--width", str(args.width), "--layers", str(args.layers),
           "--batch", str(args.batch), "--slow-rank", str(args.slow_rank), "--slow-factor", str(args.slow_factor),
           "--slow-start", str(args.slow_start)]
    t0 = time.time()
    res = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True)
    if res.returncode != 0:
        print(res.stdout[-3000:], res.stderr[-3000:])
        return 1
    import torch

    from analyzers import run_all
    from analyzers.loader import load_run

    data = load_run(store, args.run_id)
    findings = run_all(data)
    st = data.steps
    per_rank = st[st["step"] >= args.slow_start + 2].groupby("rank")[["device_ms", "step_ms", "sync_wait_ms"]].median()
    stragglers = [f for f in findings if f.kind == "straggler" and f.severity in ("warning", "critical")]
    named = sorted({r for f in stragglers for r in f.ranks})
    report = {
        "gpus": torch.cuda.device_count(), "device": torch.cuda.get_device_name(0),
        "mode": "NCCL, one GPU per rank" if torch.cuda.device_count() >= args.nproc
        else f"gloo between {args.nproc} ranks sharing GPU 0 (NCCL refuses two ranks on one device)",
        "wall_s": round(time.time() - t0, 1),
        "device_ms_null": int(st["device_ms"].isna().sum()), "steps": int(len(st)),
        "median_after_onset": {int(r): {k: round(float(v), 2) for k, v in row.items()} for r, row in per_rank.iterrows()},
        "stragglers": [{"ranks": f.ranks, "severity": f.severity, "summary": f.summary,
                        "signal": (f.evidence or {}).get("signal")} for f in stragglers],
        "all_findings": [f"{f.severity} {f.kind} ranks={f.ranks}: {f.summary}" for f in findings],
        "nvml": nvml_samples(),
    }
    ok = named == [args.slow_rank] and report["device_ms_null"] == 0
    report["culprit_found_from_device_time"] = ok
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps(report, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
