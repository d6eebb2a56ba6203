"""Runs a GPU probe in its own process for tests/test_probe_nvml.py.

Loading a shared library into pynvml cannot be undone inside a process, so each test drives a
probe here: argv[1] is a JSON config, stdin carries one command per line (sample, poll,
describe, pynvml, quit), stdout answers one JSON line per command. The first line describes
the probe that was built.

Config keys: node, host, sim_dir, lib_path, mode (build_gpu_probe mode, default auto),
direct (construct NvmlProbe(node, host, sim_dir, lib_path=...) instead), retry_s,
hide_real_nvml (make pynvml's own CDLL("libnvidia-ml.so.1") fail, as on a machine without NVML,
so "auto" behaves the same on a GPU machine).
"""

from __future__ import annotations

import json
import sys

import msgspec


def main() -> None:
    cfg = json.loads(sys.argv[1])
    import pynvml

    if cfg.get("hide_real_nvml"):
        def _no_nvml(*_a, **_k):
            raise OSError("libnvidia-ml.so.1: hidden by the test")

        pynvml.CDLL = _no_nvml  # only pynvml's own loader uses this name (``from ctypes import *``)

    from probes.nvml import NvmlProbe, build_gpu_probe

    if cfg.get("direct"):
        probe = NvmlProbe(cfg.get("node", 0), cfg.get("host", "h"), cfg.get("sim_dir"),
                          lib_path=cfg.get("lib_path"), retry_s=cfg.get("retry_s", 10.0))
    else:
        probe = build_gpu_probe(cfg.get("node", 0), cfg.get("host", "h"), cfg.get("sim_dir"),
                                lib_path=cfg.get("lib_path"), mode=cfg.get("mode", "auto"))
    if "retry_s" in cfg and hasattr(probe, "retry_s"):
        probe.retry_s = cfg["retry_s"]

    def say(obj) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    say({"mode": probe.mode, "status": probe.status, "selection": getattr(probe, "selection", [])})
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "sample":
            say([msgspec.to_builtins(s) for s in probe.sample()])
        elif cmd == "poll":
            say([msgspec.to_builtins(e) for e in probe.poll_xids()])
        elif cmd == "describe":
            say(probe.describe())
        elif cmd == "pynvml":
            lib = pynvml.nvmlLib
            maps = open("/proc/self/maps").read()
            say({"pynvml_file": pynvml.__file__, "lib_name": getattr(lib, "_name", None),
                 "mapped": [ln.split()[-1] for ln in maps.splitlines() if "libnvidia-ml" in ln][:1],
                 "driver": pynvml.nvmlSystemGetDriverVersion() if getattr(probe, "ok", False) else None})
        elif cmd == "quit":
            probe.close()
            say({"closed": True, "status": probe.status})
            return
        else:
            say({"error": f"unknown command {cmd!r}"})


if __name__ == "__main__":
    main()
