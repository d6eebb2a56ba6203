"""Load the machine as a user's job would: a 4-rank run of the bundled trainer with its data path (a head and a
node agent), started again as soon as it ends, until this process is stopped (Ctrl-C / SIGTERM).

    .venv/bin/python bench/background_load.py --store /tmp/load &   # then, beside it:
    make test

Used to check that the suite passes on a busy machine (issue 12: "make test passes 3 times in a row on a fresh
clone while another 4-rank run loads the machine"). Prints one line per finished run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cli.datapath import DataPath  # noqa: E402

MODEL = ["--d-model", "128", "--n-layers", "4", "--n-heads", "4", "--seq-len", "48", "--batch-size", "16"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default="/tmp/ranksight-load")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--runs", type=int, default=0, help="stop after this many runs (0: until stopped)")
    args = ap.parse_args()
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    n = 0
    try:
        while not stop and (args.runs == 0 or n < args.runs):
            run_id = f"load-{n}"
            shutil.rmtree(Path(args.store) / run_id, ignore_errors=True)
            t0 = time.time()
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                   "--max-restarts=0", "-m", "trainer", "--dp", "4", *MODEL, "--steps", str(args.steps),
                   "--store", args.store, "--run-id", run_id, "--quiet"]
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
            with DataPath(args.store, run_id, 1):
                proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        start_new_session=True)
                while proc.poll() is None and not stop:
                    time.sleep(0.5)
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            print(f"load run {n}: exit {proc.returncode} in {time.time() - t0:.0f} s", flush=True)
            shutil.rmtree(Path(args.store) / run_id, ignore_errors=True)
            n += 1
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
