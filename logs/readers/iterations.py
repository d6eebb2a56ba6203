"""Per-iteration training logs: Megatron-LM, torchtitan, fairseq, DeepSpeed, Hugging Face ``Trainer``.

Format strings, read in each project's public sources (patterns written from them, no code copied):

- Megatron-LM ``megatron/training/training.py`` (``training_log``): `` iteration N/ M | consumed samples: ... |
  elapsed time per iteration (ms): X | throughput per GPU (TFLOP/s/GPU): Y | learning rate: ... | global batch
  size: ... | lm loss: ... | loss scale: ... | grad norm: ... | number of skipped iterations: ... | number of nan
  iterations: ... |`` (counts per log interval; a NaN loss is left out of the line, ``number of nan iterations`` says it).
- torchtitan ``torchtitan/components/metrics.py`` (older: ``train.py``): ``step: N  loss: X  [grad_norm: G]  memory:
  M GiB(P%)  tps|wps: T  [tflops: F]  mfu: U%`` with ANSI colours (``tools/utils.py`` ``Color``) or without.
- fairseq ``fairseq/logging/progress_bar.py`` + ``fairseq_cli/train.py``: the json bar's ``{"epoch": E, "update": U,
  "loss": ..., "wps": ..., "ups": ..., "num_updates": ..., "loss_scale": ..., ...}`` (values quoted strings), the
  simple bar's ``epoch 001:    100 / 1000 loss=..., ups=..., num_updates=...`` (older releases: a leading ``| ``).
- DeepSpeed ``deepspeed/runtime/engine.py``: ``[Rank 0] step=N, skipped=K, lr=[...], mom=[...]`` (K cumulative);
  ``deepspeed/utils/timer.py``: ``epoch=E/micro_step=M/global_step=N, RunningAvgSamplesPerSec=..., CurrSamplesPerSec=...,
  MemAllocated=...GB, MaxMemAllocated=...GB``.
- Hugging Face ``Trainer`` (its ProgressCallback writes ``str(logs)``): ``{'loss': 2.1, 'grad_norm': ..., 'learning_rate':
  ..., 'epoch': 0.5}`` (newer releases quote the numbers), often after a tqdm bar on the same line (``50/1000 [00:25<08:00,
  1.98it/s]``: the bar gives the step and the speed), and the final ``{'train_runtime': ..., ...}``.

Copies of the same iteration printed by several ranks (launcher prefixes ``[rank3]:``, ``3: ``, one file per rank) are
one point per iteration: the slowest copy's time, the mean throughput. Trends go through the live checks' rules: a dip
is the MFU check's (``analyzers.checks.mfu.MfuConfig``: below the run's 90th percentile by max(15 %, 4 robust sigma),
3 low points out of 5, ``analyzers.persistence.persistent_runs``), its onset placed by ``analyzers.changepoint
.refine_onset``; fp16 rules are the fp16 check's (``Fp16Config``).
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from typing import Any

import numpy as np
import pandas as pd

from analyzers.changepoint import refine_onset
from analyzers.checks.mfu import MfuConfig
from analyzers.persistence import persistent_runs
from analyzers.stats import robust_sigma
from logs.inputs import InputFile
from logs.model import LineIndex, ReadResult, log_finding
from logs.readers.loss_scale import CALIBRATION_MAX_ITERATION, CALIBRATION_MAX_OVERFLOWS, FP16, NUM, stream_of
from ranksight.schema import Finding

NAME = "iterations"

DIP = MfuConfig()  # drop_frac 0.15, critical_frac 0.5, mad_k 4, persist 3, window 5, ref_quantile 0.9
# the first logged point carries start-up (compilation, NCCL init, the first data loads): never judged
WARMUP_POINTS = 1
# a dip that starts at the first judged point and recovers is the warm-up still settling, not a slowdown
MIN_POINTS = DIP.persist + 2  # fewer logged points than this: too short to judge a trend
MAX_POINTS_PER_INPUT = 2_000_000  # a cap on events per input (memory), noted when reached

_ANSI = re.compile(rb"\x1b\[[0-9;]*[A-Za-z]")
# literal keywords: ``in`` runs at memory speed where a regex alternation does not
_SNIFF_WORDS = (b"iteration ", b"step:", b"num_updates", b", skipped=", b"global_step=", b"{'loss': ", b"{'train_runtime'")

_MEGATRON = re.compile(rb"iteration\s+(\d+)/\s*(\d+) \|([^\r\n]*)")
_MEGATRON_KV = re.compile(rb"\s*([A-Za-z][^:|\r\n]*?):\s*([^|\r\n]*?)\s*\|")
_TITAN = re.compile(rb"step:\s*(\d+)\s+(?:\x1b\[[\d;]*m)*loss:[^\r\n]*")  # "validate step:" is skipped in read
_TITAN_KV = re.compile(rb"(\w+):\s*([^\s]+)")
_FAIRSEQ_JSON = re.compile(rb"\{\"epoch\": \d+[^\r\n]*?\"num_updates\": \"?\d+[^\r\n]*\}")
_FAIRSEQ_SIMPLE = re.compile(rb"epoch (\d+):\s+(\d+) / (\d+) ([^\r\n]*?num_updates=\d+[^\r\n]*)")
_FAIRSEQ_KV = re.compile(rb"(\w+)=([^,\s]+)")
_DS_STEP = re.compile(rb"step=(\d+), skipped=(\d+), lr=\[([^\]\r\n]*)\]")
_DS_TIMER = re.compile(rb"epoch=(\d+)/micro_step=(\d+)/global_step=(\d+), RunningAvgSamplesPerSec=(" + NUM +
                       rb"), CurrSamplesPerSec=(" + NUM + rb"), MemAllocated=(" + NUM + rb")GB")
_HF = re.compile(rb"\{'(?:loss|train_runtime)': [^\r\n{}]*\}")
_HF_KV = re.compile(rb"'(\w+)': '?([^,'}]+)'?")
_TQDM = re.compile(rb"(\d+)/(\d+) \[[^\]\r\n]*?(" + NUM + rb")(it/s|s/it)\]")


def sniff(data: bytes) -> bool:
    return any(w in data for w in _SNIFF_WORDS)


def _f(b: bytes | str | None) -> float | None:
    if b is None:
        return None
    if isinstance(b, bytes):
        b = b.decode("ascii", "replace")
    b = b.strip().strip("'\"").replace(",", "").rstrip("%")
    try:
        return float(b)
    except ValueError:
        return None


def _megatron(fields: bytes) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in _MEGATRON_KV.findall(fields + b"|"):
        key = k.decode("ascii", "replace").strip()
        val = _f(v)
        if key.startswith("elapsed time per iteration"):
            out["iter_ms"] = val
        elif key.startswith("throughput per GPU"):
            out["tflops"] = val
        elif key == "loss scale":
            out["loss_scale"] = val
        elif key == "grad norm":
            out["grad_norm"] = val
        elif key == "number of skipped iterations":
            out["skipped"] = val
        elif key == "number of nan iterations":
            out["nan_iters"] = val
        elif key == "learning rate":
            out["lr"] = val
        elif key.endswith("loss") and "loss" not in out:
            out["loss"] = val
            out["loss_key"] = key
    return out


def _titan(line: bytes) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in _TITAN_KV.findall(_ANSI.sub(b"", line)):
        key = k.decode("ascii", "replace")
        if key == "loss":
            out["loss"] = _f(v)
        elif key == "grad_norm":
            out["grad_norm"] = _f(v)
        elif key in ("tps", "wps"):
            out["tps"] = _f(v)
        elif key == "tflops":
            out["tflops"] = _f(v)
        elif key == "mfu":
            out["mfu"] = _f(v)
    return out


def _fairseq_stats(d: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ups = _f(str(d.get("ups"))) if d.get("ups") is not None else None
    if ups and ups > 0:
        out["iter_ms"] = 1000.0 / ups
    for src, dst in (("loss", "loss"), ("wps", "tps"), ("gnorm", "grad_norm"), ("loss_scale", "loss_scale"),
                     ("lr", "lr")):
        if d.get(src) is not None:
            out[dst] = _f(str(d[src]))
    return out


def _add(res: ReadResult, idx: LineIndex, off: int, fmt: str, stream: str, rank: int | None, step: int,
         vals: dict[str, Any]) -> None:
    ev = {"source": res.source, "line": idx.line_of(off) + 1, "fmt": fmt, "stream": stream, "rank": rank,
          "step": step}
    ev.update({k: v for k, v in vals.items() if v is not None})
    loss = ev.get("loss")
    if isinstance(loss, float) and not math.isfinite(loss):
        ev["loss_nonfinite"] = True
    res.events.append(ev)


def read(inp: InputFile) -> ReadResult | None:
    data = inp.data
    res = ReadResult(reader=NAME, source=inp.path)
    idx = LineIndex(data)
    offsets: list[int] = []

    def where(m: re.Match) -> tuple[int | None, str, int]:
        ls = data.rfind(b"\n", 0, m.start()) + 1
        rank, stream = stream_of(data[ls:m.start()])
        return rank, stream, ls

    for m in _MEGATRON.finditer(data):
        rank, stream, _ = where(m)
        _add(res, idx, m.start(), "megatron", stream, rank, int(m.group(1)), _megatron(m.group(3)) |
             {"total": int(m.group(2))})
        offsets.append(m.start())
    for m in _TITAN.finditer(data):
        if data[max(0, m.start() - 9):m.start()] == b"validate ":
            offsets.append(m.start())  # an evaluation line: understood, not an iteration
            continue
        rank, stream, _ = where(m)
        _add(res, idx, m.start(), "torchtitan", stream, rank, int(m.group(1)), _titan(m.group(0)))
        offsets.append(m.start())
    for m in _FAIRSEQ_JSON.finditer(data):
        try:
            d = json.loads(m.group(0).decode("utf-8", "replace"))
            step = int(float(d["num_updates"]))
        except (ValueError, KeyError, TypeError):
            continue
        rank, stream, _ = where(m)
        _add(res, idx, m.start(), "fairseq", stream, rank, step, _fairseq_stats(d))
        offsets.append(m.start())
    for m in _FAIRSEQ_SIMPLE.finditer(data):
        d = {k.decode("ascii", "replace"): v.decode("ascii", "replace") for k, v in _FAIRSEQ_KV.findall(m.group(4))}
        try:
            step = int(float(d["num_updates"]))
        except (ValueError, KeyError):
            continue
        rank, stream, _ = where(m)
        _add(res, idx, m.start(), "fairseq", stream, rank, step, _fairseq_stats(d))
        offsets.append(m.start())
    for m in _DS_STEP.finditer(data):
        rank, stream, _ = where(m)
        _add(res, idx, m.start(), "deepspeed", stream, rank, int(m.group(1)), {"skipped_total": int(m.group(2))})
        offsets.append(m.start())
    for m in _DS_TIMER.finditer(data):
        rank, stream, _ = where(m)
        sps = _f(m.group(5))
        _add(res, idx, m.start(), "deepspeed", stream, rank, int(m.group(3)),
             {"samples_per_s": sps, "iter_ms": 1000.0 / sps if sps and sps > 0 else None})
        offsets.append(m.start())
    hf_n: dict[str, int] = defaultdict(int)
    for m in _HF.finditer(data):
        rank, stream, ls = where(m)
        d = {k.decode("ascii", "replace"): _f(v) for k, v in _HF_KV.findall(m.group(0))}
        offsets.append(m.start())
        if "train_runtime" in d:
            res.summary.setdefault("hf_final", []).append({k: v for k, v in d.items() if v is not None})
            continue
        bars = list(_TQDM.finditer(data, ls, m.start()))
        vals: dict[str, Any] = {"loss": d.get("loss"), "grad_norm": d.get("grad_norm"), "lr": d.get("learning_rate"),
                                "epoch": d.get("epoch")}
        hf_n[stream] += 1
        step = hf_n[stream]
        if bars:
            b = bars[-1]
            step = int(b.group(1))
            rate = _f(b.group(3))
            if rate and rate > 0:
                vals["iter_ms"] = 1000.0 / rate if b.group(4) == b"it/s" else 1000.0 * rate
        if "loss" in d and d["loss"] is None:  # 'loss': nan parses as nan, anything else unreadable: keep the text
            vals["loss"] = float("nan") if b"nan" in m.group(0).lower() else None
        _add(res, idx, m.start(), "hf", stream, rank, step, vals)
    if len(res.events) > MAX_POINTS_PER_INPUT:
        res.notes.append(f"{len(res.events)} iteration lines: only the first {MAX_POINTS_PER_INPUT} kept")
        del res.events[MAX_POINTS_PER_INPUT:]
    res.claimed_lines = idx.lines_of(offsets) if offsets else set()
    fmts: dict[str, int] = defaultdict(int)
    for ev in res.events:
        fmts[ev["fmt"]] += 1
    res.summary["lines"] = dict(fmts)
    return res


# ---------------------------------------------------------------------------------------------------------- conclude

def _frame(results: list[ReadResult]) -> pd.DataFrame:
    rows = [ev for r in results for ev in r.events]
    if not rows:
        return pd.DataFrame()
    df = pd.DataFrame(rows)
    for c in ("iter_ms", "tflops", "mfu", "tps", "samples_per_s", "loss", "loss_scale", "skipped", "skipped_total",
              "nan_iters", "grad_norm", "total", "rank"):
        if c not in df:
            df[c] = np.nan
        df[c] = pd.to_numeric(df[c], errors="coerce")
    if "loss_nonfinite" not in df:
        df["loss_nonfinite"] = False
    df["loss_nonfinite"] = df["loss_nonfinite"].fillna(False).astype(bool)
    df["copy"] = df["source"] + "|" + df["stream"].astype(str)
    return df


def _per_step(df: pd.DataFrame) -> pd.DataFrame:
    """One row per iteration over every rank's copy: the slowest copy's time, the mean throughput."""
    g = df.groupby("step")
    out = g.agg(iter_ms=("iter_ms", "max"), tflops=("tflops", "mean"), mfu=("mfu", "mean"), tps=("tps", "mean"),
                samples_per_s=("samples_per_s", "mean"), loss_scale=("loss_scale", "min"), skipped=("skipped", "max"),
                skipped_total=("skipped_total", "max"), nan_iters=("nan_iters", "max"),
                nonfinite=("loss_nonfinite", "any"), line=("line", "first"), source=("source", "first"))
    return out.sort_index()


def dips(y: pd.Series, cfg: MfuConfig = DIP) -> list[dict[str, Any]]:
    """Episodes where a higher-is-better series ``y`` (indexed by iteration) falls below its good level, by the MFU
    check's rule (reference: the ``ref_quantile``; low: below it by max(``drop_frac``, ``mad_k`` sigma); ``persist`` low
    points out of ``window``), over logged points (a log prints every N iterations: persistence counts points, not
    iterations). One change from the live check: sigma is the robust spread of successive differences / sqrt 2, the
    point-to-point noise, since a log can be slow for most of its length and the upper half's spread would then be
    the shift itself. Each episode: onset (``refine_onset`` of the log-ratio), end, level, reference, recovery."""
    y = y.dropna()
    y = y[y > 0]
    if len(y) < MIN_POINTS:
        return []
    steps = [int(s) for s in y.index]
    ref = float(y.quantile(cfg.ref_quantile))
    rel = pd.Series((y / ref).to_numpy(), index=range(len(y)))
    sigma = robust_sigma(np.diff(rel.to_numpy())) / math.sqrt(2)
    thr = max(cfg.drop_frac, cfg.mad_k * sigma)
    flags = rel < (1 - thr)
    cost = -np.log(rel)  # higher = slower: refine_onset places the split where the mean rises
    out = []
    for p0, p1, n in persistent_runs(flags, cfg.persist, cfg.window):
        onset = min(refine_onset(cost, int(p0), int(p1)), int(p0))
        level = float(y.iloc[onset:p1 + 1].median())
        after = rel.iloc[p1 + 1:p1 + 1 + cfg.window]  # the points right after the episode: back at the good level?
        recovered = len(after) >= cfg.persist and float(after.median()) >= 1 - thr
        out.append(dict(onset=steps[onset], end=steps[p1], points=int(n), level=level, ref=ref, threshold=thr,
                        drop=1 - level / ref, recovered=bool(recovered),
                        recovered_at=steps[p1 + 1] if recovered else None))
    return out


def _fmt_ranks(df: pd.DataFrame) -> tuple[list[int], int]:
    ranks = sorted({int(r) for r in df["rank"].dropna().unique()})
    return ranks, int(df["copy"].nunique())


def _loc(ps: pd.DataFrame, step: int) -> str:
    row = ps.loc[step]
    return f"{row['source']}:{int(row['line'])}"


def _trend_findings(fmt: str, df: pd.DataFrame, ps: pd.DataFrame, inputs: list[str], ranks: list[int],
                    copies: int) -> tuple[list[Finding], list[str]]:
    out: list[Finding] = []
    notes: list[str] = []
    judged = ps.iloc[WARMUP_POINTS:]
    first_judged = int(judged.index[0]) if len(judged) else None
    has_time = judged["iter_ms"].notna().sum() >= MIN_POINTS
    tput_col = next((c for c in ("mfu", "tflops", "tps") if judged[c].notna().sum() >= MIN_POINTS), None)
    time_windows: list[tuple[int, int]] = []
    if has_time:
        speed = 1000.0 / judged["iter_ms"]
        for d in dips(speed):
            if d["onset"] <= first_judged and d["recovered"]:
                notes.append(f"warm-up: iterations {int(ps.index[0])}-{d['end']} slower, not judged")
                continue
            ms_before = float(judged["iter_ms"].loc[:d["onset"] - 1].median()) if (judged.index < d["onset"]).any() \
                else 1000.0 / d["ref"]
            ms_during = float(judged["iter_ms"].loc[d["onset"]:d["end"]].median())
            pct = 100.0 * (ms_during / ms_before - 1)
            time_windows.append((d["onset"], d["end"]))
            ev = dict(format=fmt, onset_iteration=d["onset"], last_slow_iteration=d["end"], slow_points=d["points"],
                      ms_per_iteration_before=round(ms_before, 1), ms_per_iteration_during=round(ms_during, 1),
                      slower_pct=round(pct, 1), threshold_pct=round(100 * d["threshold"], 1),
                      recovered=d["recovered"], recovered_at_iteration=d["recovered_at"],
                      onset_line=_loc(ps, _nearest(ps, d["onset"])), rank_copies=copies)
            if tput_col:
                col = judged[tput_col]
                ev[f"{tput_col}_before"] = _r(col.loc[:d["onset"] - 1].median())
                ev[f"{tput_col}_during"] = _r(col.loc[d["onset"]:d["end"]].median())
            rec = f", recovered at iteration {d['recovered_at']}" if d["recovered"] else ", not recovered by the end"
            sev = "critical" if not d["recovered"] and d["drop"] >= DIP.critical_frac else "warning"
            out.append(log_finding(
                NAME, "slowdown", sev,
                f"iterations {pct:.0f}% slower from iteration {d['onset']} ({ms_before:.0f} -> {ms_during:.0f} ms per "
                f"iteration, {fmt}){rec}", inputs=inputs, evidence=ev, ranks=ranks, step_start=d["onset"],
                step_end=d["end"], confidence=0.8,
                recommendation=("Find what changed at that iteration: another job or a throttled GPU on a node, a "
                                "slower link (run nccl-tests), data loading, or checkpointing; ranksight run/diagnose on "
                                "the live job names the rank.")))
    if tput_col:
        for d in dips(judged[tput_col]):
            if d["onset"] <= first_judged and d["recovered"]:
                if not has_time:  # with iteration times the warm-up is already noted
                    notes.append(f"warm-up: {tput_col} low until iteration {d['end']}, not judged")
                continue
            if any(a <= d["end"] and d["onset"] <= b for a, b in time_windows):
                continue  # the same episode, already reported as a slowdown (its numbers are in that evidence)
            unit = {"mfu": "% MFU", "tflops": " TFLOP/s/GPU", "tps": " tokens/s/GPU"}[tput_col]
            rec = f", recovered at iteration {d['recovered_at']}" if d["recovered"] else ", not recovered by the end"
            ev = dict(format=fmt, metric=tput_col, reference=_r(d["ref"]), level=_r(d["level"]),
                      drop_pct=round(100 * d["drop"], 1), threshold_pct=round(100 * d["threshold"], 1),
                      onset_iteration=d["onset"], last_low_iteration=d["end"], low_points=d["points"],
                      recovered=d["recovered"], recovered_at_iteration=d["recovered_at"],
                      onset_line=_loc(ps, _nearest(ps, d["onset"])), rank_copies=copies)
            sev = "critical" if not d["recovered"] and d["drop"] >= DIP.critical_frac else "warning"
            out.append(log_finding(
                NAME, "mfu_drop", sev,
                f"{tput_col} fell {100 * d['drop']:.0f}% ({_r(d['ref'])} -> {_r(d['level'])}{unit}) from iteration "
                f"{d['onset']} to {d['end']} ({fmt}){rec}", inputs=inputs, evidence=ev, ranks=ranks,
                step_start=d["onset"], step_end=d["end"], confidence=0.75,
                recommendation=("Throughput dipped: look at what ran then (evaluation, checkpoint saves, another job, "
                                "GPU clocks); ranksight on the live run attributes a drop to data, compute, comm or a "
                                "straggler.")))
    return out, notes


def _nearest(ps: pd.DataFrame, step: int) -> int:
    i = int(np.searchsorted(ps.index.to_numpy(), step))
    return int(ps.index[min(i, len(ps) - 1)])


def _r(x: Any) -> float | None:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return round(x, 3) if math.isfinite(x) else None


def _nan_findings(fmt: str, df: pd.DataFrame, ps: pd.DataFrame, inputs: list[str], ranks: list[int]) -> list[Finding]:
    bad = ps[ps["nonfinite"] | (ps["nan_iters"].fillna(0) > 0)]
    if bad.empty:
        return []
    s0, s1 = int(bad.index.min()), int(bad.index.max())
    nan_iters = int(bad["nan_iters"].fillna(0).sum())
    sub = df[df["step"].isin(bad.index) & (df["loss_nonfinite"] | (df["nan_iters"].fillna(0) > 0))]
    bad_ranks = sorted({int(r) for r in sub["rank"].dropna().unique()}) or ranks
    ev = dict(format=fmt, first_iteration=s0, last_iteration=s1, points=int(len(bad)), first_line=_loc(ps, s0),
              last_finite_iteration=_r(ps.index[(ps.index < s0)].max()) if (ps.index < s0).any() else None)
    if nan_iters:
        ev["nan_iterations_counted"] = nan_iters
    what = (f"{nan_iters} NaN iteration(s) counted" if nan_iters and not bad["nonfinite"].any()
            else "loss is NaN/inf")
    return [log_finding(
        NAME, "nan", "critical", f"{what} from iteration {s0}" + (f" to {s1}" if s1 != s0 else "") +
        f" ({len(bad)} logged point(s), {fmt})", inputs=inputs, evidence=ev, ranks=bad_ranks, step_start=s0,
        step_end=s1, confidence=0.95,
        recommendation=("Training diverged: resume from the last checkpoint before that iteration with a lower learning "
                        "rate or gradient clipping, check that iteration's data; prefer bf16 over fp16."))]


def _fp16_findings(fmt: str, df: pd.DataFrame, ps: pd.DataFrame, inputs: list[str], ranks: list[int]) -> list[Finding]:
    skipped = ps["skipped"]
    if skipped.notna().sum() == 0 and ps["skipped_total"].notna().any():
        tot = ps["skipped_total"].dropna()
        skipped = tot.diff().fillna(tot.iloc[0]).clip(lower=0).reindex(ps.index)
    if fmt == "megatron":
        skipped = (skipped - ps["nan_iters"].fillna(0)).clip(lower=0)  # a NaN iteration is skipped too: nan's
    scale = ps["loss_scale"].dropna()
    scale = scale[scale > 0]
    if skipped.notna().sum() == 0 and scale.empty:
        return []
    skipped = skipped.fillna(0)
    steps = ps.index.to_numpy()
    span = np.diff(steps, prepend=steps[0] - 1 if len(steps) else 0).clip(min=1)
    # calibration: the leading points with skips, early and few
    cal_end, cal_n = None, 0
    for s, k in skipped.items():
        if k <= 0:
            break
        if s > CALIBRATION_MAX_ITERATION or cal_n + k > CALIBRATION_MAX_OVERFLOWS:
            cal_end, cal_n = None, 0
            break
        cal_end, cal_n = int(s), cal_n + int(k)
    after = skipped[skipped.index > cal_end] if cal_end is not None else skipped
    iters_after = int(span[len(skipped) - len(after):].sum()) if len(after) else 0
    n_after = int(after.sum())
    rate = n_after / iters_after if iters_after else 0.0
    sc_after = scale[scale.index > cal_end] if cal_end is not None else scale
    peak = float(sc_after.max()) if len(sc_after) else None
    low = float(sc_after.min()) if len(sc_after) else None
    halvings = round(math.log2(peak / low)) if peak and low else 0
    # a scale that never moved (1.0 under bf16, a static scale) is no collapse: it must have fallen
    collapsed = halvings >= 1 and ((low is not None and low <= FP16.min_scale) or halvings >= FP16.collapse_halvings)
    ev = dict(format=fmt, calibration_skipped=cal_n, calibration_until_iteration=cal_end, skipped_after=n_after,
              iterations_after=iters_after, skipped_rate_after=round(rate, 4),
              loss_scale_peak_after=_r(peak), loss_scale_min_after=_r(low), halvings_from_peak=halvings,
              loss_scale_first=_r(scale.iloc[0]) if len(scale) else None,
              loss_scale_last=_r(scale.iloc[-1]) if len(scale) else None)
    hits = after[after > 0]
    s0 = int(hits.index.min()) if len(hits) else (int(sc_after.idxmin()) if collapsed and len(sc_after) else None)
    s1 = int(hits.index.max()) if len(hits) else s0
    if collapsed:
        return [log_finding(
            NAME, "fp16_overflow", "critical",
            f"fp16 loss scale collapsed to {low:g} ({halvings} halvings below its peak {peak:g}); {n_after} skipped "
            f"iteration(s) after warm-up ({fmt})", inputs=inputs, evidence=dict(ev, cause="loss_scale_collapse"),
            ranks=ranks, step_start=s0, step_end=s1, confidence=0.9,
            recommendation=("Training is no longer progressing: resume before the collapse with a lower learning rate "
                            "or gradient clipping; prefer bf16."))]
    if rate >= FP16.skip_rate_warn and n_after >= DIP.persist:
        return [log_finding(
            NAME, "fp16_overflow", "warning",
            f"fp16: {n_after} of {iters_after} iterations skipped for overflow after warm-up ({100 * rate:.1f}%, "
            f"iterations {s0}-{s1}, {fmt})", inputs=inputs, evidence=dict(ev, cause="skip_rate"), ranks=ranks,
            step_start=s0, step_end=s1, confidence=0.75,
            recommendation="Frequent overflow wastes steps: lower the learning rate or clip gradients; prefer bf16.")]
    if cal_n:
        return [log_finding(
            NAME, "fp16_overflow", "info",
            f"fp16 loss-scale warm-up: {cal_n} iteration(s) skipped up to iteration {cal_end} while the scale "
            f"calibrated, then {n_after} in {iters_after} ({fmt}); benign", inputs=inputs,
            evidence=dict(ev, cause="calibration"), ranks=ranks, step_start=int(ps.index[0]), step_end=cal_end,
            confidence=0.8, recommendation="Nothing to do: skipped steps while the loss scale calibrates are expected.")]
    return []


def conclude(results: list[ReadResult]) -> list[Finding]:
    df = _frame(results)
    if df.empty:
        return []
    out: list[Finding] = []
    for fmt, sub in df.groupby("fmt"):
        ps = _per_step(sub)
        inputs = sorted(sub["source"].unique())
        ranks, copies = _fmt_ranks(sub)
        trend, notes = _trend_findings(fmt, sub, ps, inputs, ranks, copies)
        nan = _nan_findings(fmt, sub, ps, inputs, ranks)
        fp16 = _fp16_findings(fmt, sub, ps, inputs, ranks)
        out += trend + nan + fp16
        if not trend and len(ps) >= MIN_POINTS:
            judged = ps.iloc[WARMUP_POINTS:]
            ev: dict[str, Any] = dict(format=fmt, first_iteration=int(ps.index[0]), last_iteration=int(ps.index[-1]),
                                      points=int(len(ps)), rank_copies=copies, warmup=notes)
            parts = []
            for col, label in (("iter_ms", "ms/iteration"), ("tflops", "TFLOP/s/GPU"), ("mfu", "% MFU"),
                               ("tps", "tokens/s/GPU"), ("samples_per_s", "samples/s")):
                if judged[col].notna().any():
                    v = float(judged[col].median())
                    ev[f"median_{col}"] = _r(v)
                    parts.append(f"{v:.4g} {label}")
            out.append(log_finding(
                NAME, "slowdown", "info",
                f"steady: iterations {int(judged.index[0])}-{int(ps.index[-1])} ({fmt}, {len(ps)} logged points"
                + (f", {copies} rank copies" if copies > 1 else "") + ")" + (": median " + ", ".join(parts)
                                                                          if parts else ""),
                inputs=inputs, evidence=ev, ranks=ranks, step_start=int(judged.index[0]),
                step_end=int(ps.index[-1]), confidence=0.7, recommendation="Nothing to do."))
    return out


def summarize(results: list[ReadResult]) -> dict:
    df = _frame(results)
    if df.empty:
        return {"inputs": len(results)}
    out: dict[str, Any] = {"inputs": len(results), "formats": {}}
    for fmt, sub in df.groupby("fmt"):
        ps = _per_step(sub)
        out["formats"][fmt] = {"lines": int(len(sub)), "iterations": int(len(ps)),
                               "first_iteration": int(ps.index[0]), "last_iteration": int(ps.index[-1]),
                               "rank_copies": int(sub["copy"].nunique()),
                               "median_iter_ms": _r(ps["iter_ms"].median())}
    finals = [f for r in results for f in r.summary.get("hf_final", [])]
    if finals:
        out["hf_final"] = finals
    return out
