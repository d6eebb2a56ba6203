"""Long fuzzing runs of every parser and the receiver: the suite's hypothesis fuzz tests, with many more random
examples than the suite's short seeded ones.

    .venv/bin/python bench/fuzz.py [--scale 50] [--tests PATTERN]

Every test module that fuzzes (the parsers, the log readers, the trace readers, the host probe, the OTLP receiver
in both encodings) takes its hypothesis settings from tests/fuzz_settings.py, which is how they are found; here
they run with RANKSIGHT_FUZZ_SCALE times as many examples and random (not seeded) data, each test under a wall-clock limit (a hang is a failure) and the whole run under a memory
limit (RLIMIT_AS: unbounded memory is a failure). Prints, per test, passed or the failing example hypothesis shrank
to, and the totals: inputs tried, escapes (failures), hangs (timeouts).
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
def fuzz_files() -> list[str]:
    """Every test module whose hypothesis settings come from tests/fuzz_settings.py."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                  if "fuzz_settings" in p.read_text(encoding="utf-8", errors="replace"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=50.0, help="examples per fuzz test: the suite's times this")
    ap.add_argument("--tests", default="fuzz", help="pytest -k expression selecting the fuzz tests")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per test before it counts as a hang")
    ap.add_argument("--mem-gb", type=float, default=4.0, help="address-space limit of the test process")
    a = ap.parse_args()
    files = fuzz_files()
    env = {**os.environ, "RANKSIGHT_FUZZ_SCALE": str(a.scale), "RANKSIGHT_FUZZ_RANDOM": "1"}
    limit = int(a.mem_gb * 2**30)

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", a.tests,
                        f"--timeout={a.timeout}", "-rA", "--hypothesis-show-statistics", *files], cwd=ROOT, env=env,
                       capture_output=True, text=True, preexec_fn=cap)
    out = r.stdout + r.stderr
    inputs = examples_per_test(out)
    passed = len(re.findall(r"^PASSED ", out, re.M))
    failed = re.findall(r"^FAILED (\S+)", out, re.M)
    hangs = [f for f in failed if "Timeout" in out.split(f, 1)[-1][:400]]
    for line in out.splitlines():
        if line.startswith(("PASSED ", "FAILED ", "ERROR ")):
            test = line.split()[1]
            print(f"{line}  ({inputs.get(test, '?')} inputs)")
    n = sorted(inputs.values())
    print(f"\n{passed} fuzz test(s) passed, {len(failed)} failed ({len(hangs)} hang(s)); {sum(n)} inputs in all, "
          f"{n[0] if n else 0} to {n[-1] if n else 0} per test; scale {a.scale:g}x the suite's examples, random data, "
          f"{a.mem_gb:g} GiB memory limit; {time.monotonic() - t0:.0f} s")
    if failed:  # the falsifying examples hypothesis shrank to (the statistics come after them)
        start = out.find("= FAILURES =")
        end = out.find("= Hypothesis Statistics =", start) if start >= 0 else -1
        print(out[start:end][-12000:] if start >= 0 else out[-6000:])
    return 1 if failed else 0


def examples_per_test(out: str) -> dict[str, int]:
    """Inputs each test ran, from hypothesis' statistics (``--hypothesis-show-statistics``): the passing and failing
    examples of its phases, summed (invalid ones, which the test's strategy rejected before running, not counted)."""
    counts: dict[str, int] = {}
    test = None
    for line in out.splitlines():
        m = re.match(r"^(tests/\S+::\S+):\s*$", line.strip())
        if m:
            test = m.group(1)
            continue
        m = re.search(r"(\d+) passing, (\d+) failing", line)
        if m and test:
            counts[test] = counts.get(test, 0) + int(m.group(1)) + int(m.group(2))
    return counts


if __name__ == "__main__":
    sys.exit(main())
