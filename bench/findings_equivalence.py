"""Do the analyzers still produce the same findings? Dump them for every stored run, compare two dumps.

    # the findings of the working tree
    .venv/bin/python bench/findings_equivalence.py dump /tmp/findings-now.json
    # the findings of the analyzers as of a git revision (checked out into a temporary worktree)
    .venv/bin/python bench/findings_equivalence.py dump /tmp/findings-ref.json --rev HEAD
    # identical? (exit 1 and a list of the differences when not)
    .venv/bin/python bench/findings_equivalence.py compare /tmp/findings-ref.json /tmp/findings-now.json
    # both at once: dump REV and the working tree, then compare
    .venv/bin/python bench/findings_equivalence.py check --rev HEAD

What is dumped, per case, is ``analyzers.run_all(data)`` as plain data (``msgspec.to_builtins``), without
the wall clock ``t`` a finding gets when it is made (post-mortem, ``run_all`` stamps ``time.time()``):

- every run of every store given with ``--stores`` (default: bench/results/detect-runs, where
  bench/detect.py keeps its runs, and tests/fixtures/runs; a missing store is skipped and said so), read with
  ``analyzers.loader.load_run``;
- synthetic live windows (``--synthetic``, default 8, 64 and 256 ranks): the run of bench/head_analysis.py (a 1.3x
  straggler, 2 collectives per step) through the head's live path, ``RunLive.run_data(256)``, the ``RunData``
  the head's analysis hands the analyzers. The stored runs have 4-8 ranks; these exercise the code paths whose
  cost grows with the rank count. They use the *working tree's* ``RunLive`` in both dumps (only the analyzers
  are taken from ``--rev``), so a change in head/live.py is compared by the stored-run cases only through
  the loader; compare against a dump made before the change (``compare``) when it changes what the window holds.

Floats are compared after rounding to 6 significant digits (a vectorized median may differ from a
loop's in the last bits); anything else must be equal.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_STORES = ["bench/results/detect-runs", "tests/fixtures/runs"]


def _plain(f: Any) -> dict:
    import msgspec

    try:
        d = msgspec.to_builtins(f)
    except TypeError:
        d = dict(f.__dict__)
    d.pop("t", None)  # the wall clock at which the finding was made
    return d


def _synthetic_data(ranks: int):
    """The live window of bench/head_analysis.py's run as the head's analysis hands it to the analyzers."""
    import tempfile as _tf

    sys.path.insert(0, str(ROOT / "bench"))
    import head_analysis as ha  # noqa: E402

    data = ha.build(ranks, 512, t_last=1.7e9)  # a fixed clock: both dumps see the same timestamps
    with _tf.TemporaryDirectory(prefix="rs-equiv-") as tmp:
        h = ha.make_head(Path(tmp), data, 512, 256)
        try:
            return h.live.run(ha.RUN).run_data(256, now=data["now"])
        finally:
            h.close()


def dump(out: str, stores: list[str], synthetic: list[int]) -> int:
    import analyzers
    from analyzers.loader import known_runs, load_run

    result: dict[str, Any] = {}
    t0 = time.time()
    for store in stores:
        path = Path(store) if os.path.isabs(store) else ROOT / store
        if not path.is_dir():
            print(f"findings_equivalence: store {store} missing, skipped", file=sys.stderr)
            continue
        for run_id in known_runs(path):
            key = f"{store}/{run_id}"
            try:
                data = load_run(path, run_id)
            except Exception as e:  # noqa: BLE001 - an unloadable run is a result too
                result[key] = {"load_error": f"{type(e).__name__}: {e}"}
                continue
            errors: list[str] = []
            found = analyzers.run_all(data, errors=errors)
            result[key] = {"findings": [_plain(f) for f in found], "errors": [e.splitlines()[0] for e in errors]}
    for n in synthetic:
        errors = []
        found = analyzers.run_all(_synthetic_data(n), errors=errors)
        result[f"synthetic/{n}-ranks"] = {"findings": [_plain(f) for f in found],
                                          "errors": [e.splitlines()[0] for e in errors]}
    Path(out).write_text(json.dumps(result, indent=1, sort_keys=True, default=str))
    n_f = sum(len(v.get("findings", [])) for v in result.values())
    print(f"findings_equivalence: {len(result)} cases, {n_f} findings -> {out} ({time.time() - t0:.0f} s)",
          file=sys.stderr)
    return 0


def dump_at_rev(rev: str, out: str, stores: list[str], synthetic: list[int]) -> int:
    """Run ``dump`` with the analyzers package as of ``rev`` (a temporary git worktree; the rest, e.g.
    head/live.py for the synthetic cases, from the working tree)."""
    tmp = Path(tempfile.mkdtemp(prefix="rs-equiv-rev-"))
    wt = tmp / "wt"
    try:
        subprocess.run(["git", "worktree", "add", "--detach", str(wt), rev], cwd=ROOT, check=True,
                       capture_output=True)
        # a directory that holds only the old analyzers package, first on sys.path
        pkg = tmp / "pkg"
        pkg.mkdir()
        shutil.copytree(wt / "analyzers", pkg / "analyzers")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(pkg), str(ROOT)]))
        cmd = [sys.executable, str(Path(__file__).resolve()), "dump", out, "--stores", ",".join(stores),
               "--synthetic", ",".join(map(str, synthetic)), "--_analyzers-from", str(pkg)]
        return subprocess.run(cmd, cwd=ROOT, env=env).returncode
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(wt)], cwd=ROOT, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


def _same(a: Any, b: Any, path: str, diffs: list[str]) -> None:
    if isinstance(a, float) or isinstance(b, float):
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
                and not isinstance(b, bool):
            fa, fb = float(a), float(b)
            if fa == fb or (math.isnan(fa) and math.isnan(fb)) or math.isclose(fa, fb, rel_tol=1e-6, abs_tol=1e-9):
                return
        diffs.append(f"{path}: {a!r} != {b!r}")
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                diffs.append(f"{path}.{k}: only in {'first' if k in a else 'second'}")
            else:
                _same(a[k], b[k], f"{path}.{k}", diffs)
        return
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            diffs.append(f"{path}: {len(a)} items != {len(b)} items")
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]", diffs)
        return
    if a != b:
        diffs.append(f"{path}: {a!r} != {b!r}")


def compare(a_path: str, b_path: str) -> int:
    a, b = json.loads(Path(a_path).read_text()), json.loads(Path(b_path).read_text())
    diffs: list[str] = []
    _same(a, b, "", diffs)
    n_f = sum(len(v.get("findings", [])) for v in a.values())
    if diffs:
        print(f"findings_equivalence: {len(diffs)} difference(s) over {len(a)} cases:")
        for d in diffs[:200]:
            print("  " + d)
        return 1
    print(f"findings_equivalence: identical: {len(a)} cases, {n_f} findings")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("dump", "check"):
        p = sub.add_parser(name)
        if name == "dump":
            p.add_argument("out")
        p.add_argument("--rev", default=None if name == "dump" else "HEAD",
                       help="the analyzers as of this git revision (default: the working tree)")
        p.add_argument("--stores", default=",".join(DEFAULT_STORES))
        p.add_argument("--synthetic", default="8,64,256", help="rank counts of synthetic live windows ('' for none)")
        p.add_argument("--_analyzers-from", dest="analyzers_from", default=None, help=argparse.SUPPRESS)
    p = sub.add_parser("compare")
    p.add_argument("a")
    p.add_argument("b")
    args = ap.parse_args(argv)
    if args.cmd == "compare":
        return compare(args.a, args.b)
    stores = [s for s in args.stores.split(",") if s]
    synthetic = [int(x) for x in args.synthetic.split(",") if x]
    if args.cmd == "check":
        tmp = Path(tempfile.mkdtemp(prefix="rs-equiv-"))
        ref, now = str(tmp / "ref.json"), str(tmp / "now.json")
        if dump_at_rev(args.rev, ref, stores, synthetic) or dump(now, stores, synthetic):
            return 2
        return compare(ref, now)
    if args.rev:
        return dump_at_rev(args.rev, args.out, stores, synthetic)
    if args.analyzers_from:
        import analyzers

        assert Path(analyzers.__file__).resolve().is_relative_to(Path(args.analyzers_from).resolve()), \
            f"the analyzers came from {analyzers.__file__}, not {args.analyzers_from}"
    return dump(args.out, stores, synthetic)


if __name__ == "__main__":
    # appended, not prepended: with --rev the old analyzers package comes first through PYTHONPATH
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))
    raise SystemExit(main())
