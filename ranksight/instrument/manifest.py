"""The run manifest (run.json), written by global rank 0 only, always atomically.

Written at start (config, layout, rank placement, FLOPs, peak), updated when a fault
takes effect (its onset_t) and at the end (finished). An elastic restart reads the
existing manifest and appends one entry to ``attempts``.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import time
from pathlib import Path

import torch

from ranksight import __version__
from ranksight.layout import RunDir, atomic_write
from ranksight.peaks import gpu_peak
from ranksight.schema import Manifest, encode, read_manifest

def peak_flops(device: torch.device) -> tuple[float, str, bool]:
    """(peak FLOP/s per device, where it came from, simulated?)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        known = gpu_peak(name)
        if known is not None:
            return known[0], known[1], False
        return 312e12, f"device table: unknown GPU {name!r}, assumed A100 bf16 dense", False
    return measure_cpu_peak()


# (m, k, n): square matmuls and the thin shapes a small transformer's linear layers have
# (a thin k is often *faster* per FLOP on a CPU than a square one).
CPU_PEAK_SHAPES = ((512, 512, 512), (1024, 1024, 1024), (512, 128, 512), (512, 256, 128))
CPU_PEAK_REPS = 5


def _shape_s(s) -> str:
    return f"{s[0]}x{s[1]}@{s[1]}x{s[2]}"


def peak_cache_path() -> Path:
    base = os.environ.get("RANKSIGHT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ranksight")
    return Path(base) / "cpu-peak.json"


def cpu_key(threads: int) -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{socket.gethostname()}|{model}|threads={threads}|torch={torch.__version__}"


def measure_cpu_peak(shapes=CPU_PEAK_SHAPES, reps: int = CPU_PEAK_REPS, min_rep_s: float = 0.04,
                     cache: Path | None = None) -> tuple[float, str, bool]:
    """fp32 matmul FLOP/s on this CPU with this process's thread count: the best repetition over
    several matmul shapes (after a warm-up). Meant to run while every other rank of the job
    waits in a blocking barrier (see trainer.train), so it is what one rank can do with the
    cores to itself: an upper bound for the rank's achieved FLOP/s, hence MFU <= 100 %.

    On a machine shared with other work, a measurement taken while it was busy is too low; so
    the result is the max of this measurement and the best earlier one on this host with the
    same CPU, thread count and torch (kept in ``peak_cache_path()``, updated when beaten)."""
    threads = torch.get_num_threads()
    best, best_shape = 0.0, shapes[0]
    for shp in shapes:
        m, k, n = shp
        a, b = torch.randn(m, k), torch.randn(k, n)
        a @ b  # warm-up (allocation, first-touch)
        for _ in range(reps):
            iters, t0 = 0, time.perf_counter()
            while True:
                a @ b
                iters += 1
                dt = time.perf_counter() - t0
                if dt >= min_rep_s:
                    break
            rate = 2 * m * k * n * iters / dt
            if rate > best:
                best, best_shape = rate, shp
    now = best
    cache = peak_cache_path() if cache is None else cache
    key = cpu_key(threads)
    earlier = 0.0
    try:
        data = json.loads(cache.read_text())
        earlier = float(data.get(key, {}).get("peak_flops", 0.0))
    except (OSError, ValueError, AttributeError):
        data = {}
    if now > earlier:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            data = data if isinstance(data, dict) else {}
            data[key] = {"peak_flops": now, "shape": _shape_s(best_shape), "t": time.time()}
            atomic_write(cache, json.dumps(data, indent=1).encode())
        except OSError:
            pass
    peak = max(now, earlier)
    shapes_s = ", ".join(_shape_s(s) for s in shapes)
    src = (f"measured fp32 matmul on this CPU: best of {reps} repetitions of each of {shapes_s} "
           f"(best {_shape_s(best_shape)}: {now / 1e9:.1f} GFLOP/s), {threads} thread(s) as each rank uses, "
           "by rank 0 while the other ranks waited in a barrier")
    if earlier > now:
        src += f"; an earlier measurement on this host was higher ({earlier / 1e9:.1f} GFLOP/s, {cache}) and is used"
    return peak, src + "; not a GPU peak", True


class ManifestWriter:
    def __init__(self, run: RunDir):
        self.run = run
        self.m: Manifest | None = None

    def start(self, m: Manifest, attempt: dict, carry=None) -> Manifest:
        """Keep what an earlier attempt recorded (start time, attempts), append this attempt. ``carry(old, m)``:
        what else the caller keeps from the earlier attempt's manifest (the trainer: its faults' onsets)."""
        old = read_manifest(self.run.manifest)
        if old is not None and old.run_id == m.run_id and old.attempts:
            m.created, m.start_time = old.created, old.start_time
            if carry is not None:
                carry(old, m)
            m.attempts = list(old.attempts)
        m.attempts.append(attempt)
        self.m = m
        self.write()
        return m

    def write(self) -> None:
        if self.m is not None:
            atomic_write(self.run.manifest, encode(self.m))

    def update_attempt(self, **kw) -> None:
        if self.m is not None:
            self.m.attempts[-1].update(kw)
            self.write()

    def finish(self) -> None:
        if self.m is not None:
            self.m.finished = time.time()
            self.write()


def make_manifest(run_id: str, cfg_dict: dict, layout: dict, ranks, backend: str, device: torch.device,
                  flops_per_token: float, params: int, faults=(),
                  peak: tuple[float, str, bool] | None = None) -> Manifest:
    peak, source, simulated = peak if peak is not None else peak_flops(device)
    now = time.time()
    return Manifest(
        run_id=run_id, ranksight_version=__version__, created=now, start_time=now, config=cfg_dict, layout=layout,
        nodes=len({r.node for r in ranks}), ranks=ranks, backend=backend, device=device.type,
        flops_per_token=flops_per_token, params=params, peak_flops=peak, peak_source=source,
        peak_simulated=simulated, faults=list(faults), attempts=[],
    )


def attempt_entry(world: int, resumed_step: int | None) -> dict:
    return {"attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), "t": time.time(),
            "world_size": world, "resumed_step": resumed_step,
            "torchelastic_run_id": os.environ.get("TORCHELASTIC_RUN_ID", "")}
