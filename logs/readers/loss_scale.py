"""fp16 loss-scale and NaN messages: DeepSpeed, fairseq, apex amp, Megatron-LM.

Format strings, read in each project's public sources (patterns written from them, no code copied):

- DeepSpeed ``deepspeed/runtime/fp16/loss_scaler.py`` (``update_scale``): ``[deepspeed] OVERFLOW! Rank N Skipping
  step. Attempted loss scale: X, reducing to Y`` and the hysteresis variant ``..., but hysteresis is H. Reducing
  hysteresis to H-1`` (the scale is kept); ``Current loss scale already at minimum - cannot decrease scale anymore``.
  ``runtime/fp16/fused_optimizer.py`` / ``unfused_optimizer.py``: ``[deepspeed] fp16 dynamic loss scale overflow!
  Skipping step. Attempted loss scale: X, reducing to Y``, ``Grad overflow on iteration N`` and ``Reducing /
  Increasing dynamic loss scale from X to Y``.
- fairseq ``fairseq/trainer.py``: ``NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: X``
  (the tail is ``optim/dynamic_loss_scaler.py``'s OverflowError text; older releases printed ``| WARNING: overflow
  detected, setting loss scale to: X``), ``Minimum loss scale reached (X)``, ``gradients are Nan/Inf``.
- apex ``apex/amp/handle.py`` (removed from apex in 2025, read at the commit before): ``Gradient overflow.  Skipping
  step, loss scaler N reducing loss scale to X``; ``apex/fp16_utils/fp16_optimizer.py``: ``Gradient overflow.
  Skipping step, reducing loss scale to X``, ``OVERFLOW within closure! Skipping step, reducing loss scale to X``.
  amp prints on every rank: the copies are grouped.
- Megatron-LM ``megatron/core/rerun_state_machine.py``: ``Rank R, node HOST, device D, iteration I: Unexpected result
  nan (message='found NaN in local grad norm for bucket #B in backward pass before data-parallel communication
  collective')`` (messages from ``core/distributed/param_and_grad_buffer.py`` and ``pretrain_gpt.py``: ``found NaN|Inf
  in local forward loss calculation``), ``Unexpected result X on rank R at iteration #I invocation #K (message=...)``
  and the verdicts ``Rank R, node HOST, device D, iteration #I: Possible transient|persistent error!``; the older
  assertion ``Rank R: found NaN in local grad norm in backward pass before data-parallel communication collective.
  Device: D, node: HOST`` (param_and_grad_buffer.py before Dec 2024).

Conclusions (``conclude``):

- A warm-up calibration (a chain of halvings in the first iterations that stops, the scale then holding or growing
  back) is ``info`` saying so; isolated later overflows after the scale grew (dynamic scaling probing upward) too.
- ``fp16_overflow`` ``critical``: the scale reached the minimum (a min-scale message, or <= ``Fp16Config.min_scale``),
  or fell ``Fp16Config.collapse_halvings`` halvings below its post-calibration peak. ``warning``: after calibration,
  ``LATE_RUN_HALVINGS`` halvings in a row with no growth between, or a net fall of ``FALL_HALVINGS``.
- ``nan`` ``critical``: Megatron NaN/Inf assertions (grouped by message over ranks: ranks, hosts, devices, first and
  last iteration, count), fairseq's ``gradients are Nan/Inf``.
"""

from __future__ import annotations

import bisect
import math
import re
from collections import defaultdict
from typing import Any

from analyzers.checks.fp16 import Fp16Config
from logs.inputs import InputFile
from logs.model import LineIndex, ReadResult, log_finding
from ranksight.schema import Finding

NAME = "loss_scale"

# the same collapse rule as a live run's fp16 check: min_scale 1.0, 8 halvings below the peak
FP16 = Fp16Config()
# Megatron's default initial scale is 2**32 and DeepSpeed's 2**16 with hysteresis 2 (two lines per halving): reaching a
# working scale of 2**10..2**16 takes up to ~24 overflow lines, all in the first iterations
CALIBRATION_MAX_OVERFLOWS = 32
# a calibration happens at the start: overflows whose iteration is known and beyond this are not calibration
CALIBRATION_MAX_ITERATION = 200
# after calibration, dynamic scaling halves once after each growth (net zero); this many halvings in a row with no
# growth between is the scale being driven down, not probing
LATE_RUN_HALVINGS = 3
# a net fall of 2**4 below the settled scale after calibration: the gradients keep growing
FALL_HALVINGS = 4
TRAJECTORY_POINTS = 24  # scale points kept in the evidence (first and last halves)

NUM = rb"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|[-+]?(?:nan|inf)"

# literal keywords: ``in`` runs at memory speed where a regex alternation does not
_SNIFF_WORDS = (b"OVERFLOW", b"verflow", b"loss scale", b"Unexpected result", b"found NaN", b"found Inf", b"Nan/Inf")

_PATTERNS: list[tuple[str, str, re.Pattern]] = [
    ("deepspeed", "overflow", re.compile(
        rb"\[deepspeed\] OVERFLOW! Rank (?P<rank>\d+) Skipping step\.(?: Attempted loss scale: (?P<att>" + NUM +
        rb"), (?:reducing to (?P<new>" + NUM + rb")|but hysteresis is (?P<hyst>\d+)))?")),
    ("deepspeed", "overflow", re.compile(
        rb"\[deepspeed\] fp16 dynamic loss scale overflow! Skipping step\. Attempted loss scale: (?P<att>" + NUM +
        rb"), reducing to (?P<new>" + NUM + rb")")),
    ("deepspeed", "overflow_iter", re.compile(rb"Grad overflow on iteration:? (?P<iter>\d+)")),
    ("deepspeed", "reduce", re.compile(
        rb"Reducing dynamic loss scale from (?P<att>" + NUM + rb") to (?P<new>" + NUM + rb")")),
    ("deepspeed", "grow", re.compile(
        rb"Increasing dynamic loss scale from (?P<att>" + NUM + rb") to (?P<new>" + NUM + rb")")),
    ("deepspeed", "min_scale", re.compile(rb"Current loss scale already at minimum")),
    ("fairseq", "overflow", re.compile(
        rb"overflow detected, (?:ignoring gradient, )?setting loss scale to: (?P<new>" + NUM + rb")")),
    ("fairseq", "min_scale", re.compile(rb"Minimum loss scale reached \((?P<new>" + NUM + rb")\)")),
    ("fairseq", "nan", re.compile(rb"gradients are Nan/Inf")),
    ("apex", "overflow", re.compile(
        rb"Gradient overflow\.\s+Skipping step,(?: loss scaler (?P<scaler>\d+))? reducing loss scale to (?P<new>" +
        NUM + rb")")),
    ("apex", "overflow", re.compile(rb"OVERFLOW within closure! Skipping step, reducing loss scale to (?P<new>" + NUM +
                                    rb")")),
    ("megatron", "nan", re.compile(
        rb"Rank (?P<rank>\d+), node (?P<host>[^\s,]+), device (?P<dev>\d+), iteration #?(?P<iter>\d+): "
        rb"(?P<msg>[^\r\n]*)")),
    ("megatron", "nan", re.compile(
        rb"Unexpected result (?P<val>\S+) on rank (?P<rank>\d+) at iteration #(?P<iter>\d+) "
        rb"invocation #\d+ \(message='(?P<msg>[^'\r\n]*)")),
    ("megatron", "nan", re.compile(
        rb"Rank (?P<rank>\d+): (?P<msg>found (?:NaN|Inf) in local [^.\r\n]*)\.(?: Device: (?P<dev>\d+), "
        rb"node: (?P<host>[^\s,]+))?")),
]

# each pattern's leading literal (up to its first regex metacharacter): absent from the input, the pattern cannot match
def _leading_literal(pattern: bytes) -> bytes:
    m = re.match(rb"(?:\\[\[\]]|[^\\()\[\]?*+.{}|^$])*", pattern)
    lit = m.group(0) if m else b""
    if pattern[len(lit):len(lit) + 1] in (b"?", b"*", b"{"):
        lit = lit[:-1]  # the last character is optional
    return lit.replace(b"\\[", b"[").replace(b"\\]", b"]")


_KEYWORD = {rx.pattern: _leading_literal(rx.pattern) for _, _, rx in _PATTERNS}

# iteration markers other formats print, used only to place an overflow line that names no iteration (the
# iterations reader claims these lines): Megatron, DeepSpeed's step= and throughput timer, fairseq num_updates
_ITER_MARKS = (re.compile(rb"iteration\s+(\d+)/\s*\d+ \|"), re.compile(rb"step=(\d+), skipped="),
               re.compile(rb"global_step=(\d+)"), re.compile(rb"num_updates[\"']?[=:]\s*\"?(\d+)"))

# launcher prefixes: torchrun's [rankN]: and [defaultN]:, DeepSpeed log_dist's [Rank N], srun/pdsh "N: ", Ray
# "(Worker pid=N)"
_PREFIX_RANK = re.compile(rb"\[(?:rank|default|Rank )(\d+)\]:?|^(?:\s*>)*\s*(\d+):\s|\((?:\w+ )?pid=(\d+)[^)]*\)")
_ANSI = re.compile(rb"\x1b\[[0-9;]*[A-Za-z]")


def stream_of(prefix: bytes) -> tuple[int | None, str]:
    """(rank, stream label) of a line from the text before its message: the launcher prefix's rank where there is
    one; Ray's pid names a stream but not a rank."""
    m = _PREFIX_RANK.search(prefix)
    if not m:
        return None, ""
    if m.group(3) is not None:
        return None, f"pid={int(m.group(3))}"
    r = int(m.group(1) if m.group(1) is not None else m.group(2))
    return r, f"rank{r}"


def line_bounds(data: bytes, start: int, end: int) -> tuple[int, int]:
    s = data.rfind(b"\n", 0, start) + 1
    e = data.find(b"\n", end)
    return s, (len(data) if e < 0 else e)


def to_float(b: bytes | None) -> float | None:
    if b is None:
        return None
    try:
        return float(b.replace(b",", b""))
    except ValueError:
        return None


def sniff(data: bytes) -> bool:
    return any(w in data for w in _SNIFF_WORDS)


def _text(b: bytes, cap: int = 300) -> str:
    return _ANSI.sub(b"", b[:cap]).decode("utf-8", "replace").strip()


def read(inp: InputFile) -> ReadResult | None:
    data = inp.data
    res = ReadResult(reader=NAME, source=inp.path)
    idx = LineIndex(data)
    hits: list[tuple[int, dict[str, Any]]] = []
    for fmt, kind, rx in _PATTERNS:
        if _KEYWORD[rx.pattern] not in data:
            continue  # a fast ``in`` spares the regex pass over the buffer
        for m in rx.finditer(data):
            ls = data.rfind(b"\n", 0, m.start()) + 1
            g = m.groupdict()
            ev: dict[str, Any] = {"source": inp.path, "fmt": fmt, "kind": kind, "offset": m.start()}
            prank, stream = stream_of(data[ls:m.start()])
            rank = int(g["rank"]) if g.get("rank") else prank
            ev.update(rank=rank, stream=stream or (f"rank{rank}" if rank is not None else ""))
            ev["attempted"] = to_float(g.get("att"))
            ev["scale"] = to_float(g.get("new"))
            if g.get("hyst"):
                ev["hysteresis"] = int(g["hyst"])
                ev["scale"] = ev["attempted"]  # hysteresis absorbs the overflow: the scale is kept
            if g.get("scaler"):
                ev["scaler"] = int(g["scaler"])
            if g.get("iter"):
                ev["iteration"] = int(g["iter"])
            if g.get("host"):
                ev["host"] = _text(g["host"], 128)
            if g.get("dev"):
                ev["device"] = int(g["dev"])
            if g.get("msg") is not None:
                ev["message"] = _text(g["msg"])
            if g.get("val"):
                ev["value"] = _text(g["val"], 32)
            hits.append((m.start(), ev))
    if not hits:
        return res
    hits.sort(key=lambda h: h[0])
    marks: list[tuple[int, int]] = []
    if any("iteration" not in ev for _, ev in hits):  # only then: place them after the iteration lines before them
        marks = sorted((m.start(), int(m.group(1))) for rx in _ITER_MARKS for m in rx.finditer(data))
    mark_offsets = [o for o, _ in marks]
    lines = idx.lines_of([o for o, _ in hits])
    for off, ev in hits:
        ev["line"] = idx.line_of(off) + 1
        if "iteration" not in ev and mark_offsets:
            j = bisect.bisect_right(mark_offsets, off) - 1
            if j >= 0:
                ev["near_iteration"] = marks[j][1]
        ev.pop("offset", None)
        res.events.append(ev)
    res.claimed_lines = lines
    _merge_deepspeed_pairs(res.events)
    kinds: dict[str, int] = defaultdict(int)
    for ev in res.events:
        kinds[f"{ev['fmt']}.{ev['kind']}"] += 1
    res.summary = {"messages": dict(kinds)}
    return res


def _merge_deepspeed_pairs(events: list[dict]) -> None:
    """DeepSpeed's fused optimizer prints ``Grad overflow on iteration N`` then ``Reducing dynamic loss scale from X to
    Y``: one overflow at iteration N. The pair becomes one overflow event (the iteration line keeps its line number)."""
    pending: dict[str, dict] = {}
    for ev in events:
        if ev["kind"] == "overflow_iter":
            pending[ev["stream"]] = ev
        elif ev["kind"] == "reduce":
            it = pending.pop(ev["stream"], None)
            ev["kind"] = "overflow"
            if it is not None:
                ev["iteration"] = it["iteration"]
                it["kind"] = "merged"
    for ev in events:
        if ev["kind"] == "overflow_iter":
            ev["kind"] = "overflow"  # static scale or no reduce line: still an overflow at that iteration


# ---------------------------------------------------------------------------------------------------------- conclude

def _pos(ev: dict) -> int | None:
    return ev.get("iteration", ev.get("near_iteration"))


def _fmt_scale(x: float | None) -> str:
    if x is None:
        return "?"
    return f"{x:g}"


def _streams(results: list[ReadResult], kinds: set[str]) -> dict[tuple[str, str, str], list[dict]]:
    out: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    for r in results:
        for ev in r.events:
            if ev["kind"] in kinds:
                out[(ev["fmt"], r.source, ev["stream"])].append(ev)
    return out


def _trajectory(evs: list[dict]) -> list[list]:
    pts = [[_pos(e), e["scale"]] for e in evs if e.get("scale") is not None]
    if len(pts) > TRAJECTORY_POINTS:
        h = TRAJECTORY_POINTS // 2
        pts = pts[:h] + [["...", len(pts) - 2 * h]] + pts[-h:]
    return pts


def _grew(last: float | None, e: dict) -> bool:
    """Did the scale grow between the message that left it at ``last`` and overflow ``e``? With the attempted scale
    known, it is above ``last``; apex prints only the halved scale, so a halved scale not below ``last`` shows it."""
    if last is None or e["kind"] != "overflow":
        return False
    if e.get("attempted") is not None:
        return e["attempted"] > last
    return e.get("scale") is not None and e["scale"] >= last


def _calibration_len(evs: list[dict]) -> int:
    """How many leading events are the warm-up calibration: overflows in a chain of halvings (each attempted scale the
    previous one's result), no growth between, at known iterations under CALIBRATION_MAX_ITERATION."""
    n, prev = 0, None
    for e in evs:
        if e["kind"] != "overflow" or n >= CALIBRATION_MAX_OVERFLOWS:
            break
        p = _pos(e)
        if p is not None and p > CALIBRATION_MAX_ITERATION:
            break
        if prev is not None and (_grew(prev.get("scale"), e) or (
                e.get("attempted") is not None and prev.get("scale") is not None and e["attempted"] != prev["scale"])):
            break  # not a chain of halvings: the scale grew (or was changed) between
        n, prev = n + 1, e
    return n


def _ev_loc(ev: dict) -> str:
    return f"{ev['source']}:{ev['line']}"


def _overflow_findings(results: list[ReadResult]) -> list[Finding]:
    out: list[Finding] = []
    streams = _streams(results, {"overflow", "grow", "min_scale"})
    by_fmt: dict[str, list[tuple[tuple, list[dict]]]] = defaultdict(list)
    for key, evs in streams.items():
        by_fmt[key[0]].append((key, evs))
    for fmt, group in sorted(by_fmt.items()):
        # every rank prints the same synchronized decisions: the stream with the most messages stands for all
        key, evs = max(group, key=lambda kv: (len(kv[1]), -min([e["rank"] for e in kv[1] if e["rank"] is not None]
                                                               or [0])))
        ranks = sorted({e["rank"] for _, es in group for e in es if e["rank"] is not None})
        inputs = sorted({k[1] for k, _ in group})
        n_copies = len(group)
        ovf = [e for e in evs if e["kind"] == "overflow"]
        n_cal = _calibration_len(evs)
        cal, late = evs[:n_cal], evs[n_cal:]
        late_ovf = [e for e in late if e["kind"] == "overflow"]
        min_msgs = [e for _, es in group for e in es if e["kind"] == "min_scale"]
        scales_all = [s for e in evs for s in (e.get("attempted"), e.get("scale")) if s is not None and s > 0]
        scales_late = [s for e in late for s in (e.get("attempted"), e.get("scale")) if s is not None and s > 0]
        settled = cal[-1]["scale"] if cal and cal[-1].get("scale") is not None else (
            scales_late[0] if scales_late else None)
        peak_late = max(scales_late) if scales_late else None
        low_all = min(scales_all) if scales_all else None
        low_late = min(scales_late) if scales_late else None
        final = next((e["scale"] for e in reversed(evs) if e.get("scale") is not None), None)
        # the longest run of halvings after calibration with no growth between
        run = best = 0
        best_end, last_scale = None, settled
        for e in late:
            if e["kind"] == "grow" or _grew(last_scale, e):
                run = 0  # a growth message, or the scale grew silently since the last message
            if e.get("scale") is not None:
                last_scale = e["scale"]
            if e["kind"] == "grow":
                continue
            if e["kind"] == "overflow" and e.get("scale") is not None and (e.get("attempted") is None
                                                                            or e["scale"] < e["attempted"]):
                run += 1
                if run > best:
                    best, best_end = run, e
        halvings_from_peak = (round(math.log2(peak_late / low_late)) if peak_late and low_late else 0)
        net_fall = (round(math.log2(settled / final)) if settled and final and final > 0 else 0)
        pos_all = [p for p in (_pos(e) for e in ovf) if p is not None]
        ev: dict[str, Any] = {
            "format": fmt, "overflows": len(ovf), "calibration_overflows": sum(1 for e in cal),
            "late_overflows": len(late_ovf), "growths": sum(1 for e in evs if e["kind"] == "grow"),
            "scale_start": _fmt_scale(evs[0].get("attempted") or evs[0].get("scale")),
            "scale_settled": _fmt_scale(settled), "scale_final": _fmt_scale(final), "scale_min": _fmt_scale(low_all),
            "halvings_from_peak_after_calibration": halvings_from_peak, "longest_halving_run_after_calibration": best,
            "trajectory": _trajectory(evs), "rank_copies": n_copies,
            "first_line": _ev_loc(evs[0]), "last_line": _ev_loc(evs[-1]),
            "first_iteration": min(pos_all) if pos_all else None, "last_iteration": max(pos_all) if pos_all else None,
        }
        hyst = [e for e in ovf if "hysteresis" in e]
        if hyst:
            ev["hysteresis_absorbed"] = len(hyst)
        s0, s1 = ev["first_iteration"], ev["last_iteration"]
        who = f" on {len(ranks)} rank(s)" if len(ranks) > 1 else (f" on rank {ranks[0]}" if ranks else "")
        collapsed = bool(min_msgs) or (low_all is not None and low_all <= FP16.min_scale) or \
            halvings_from_peak >= FP16.collapse_halvings
        if collapsed:
            if min_msgs:
                ev["min_scale_message"] = _ev_loc(min_msgs[0])
            why = ("the minimum loss scale was reached" if min_msgs or (low_all is not None and low_all <= FP16.min_scale)
                   else f"{halvings_from_peak} halvings below its peak")
            out.append(log_finding(
                NAME, "fp16_overflow", "critical",
                f"fp16 loss scale collapsed ({fmt}): {len(ovf)} overflow(s){who}, scale {ev['scale_start']} -> "
                f"{ev['scale_min']}: {why}" + (f" (iterations {s0}-{s1})" if s0 is not None else ""),
                inputs=inputs, evidence=dict(ev, cause="loss_scale_collapse"), ranks=ranks, step_start=s0,
                step_end=s1, confidence=0.9,
                recommendation=("Training is no longer progressing: the gradients overflow at any scale. Resume from a "
                                "checkpoint before the collapse with a lower learning rate or gradient clipping; prefer "
                                "bf16 where the hardware has it; look for the layer whose activations grow.")))
            continue
        if best >= LATE_RUN_HALVINGS or net_fall >= FALL_HALVINGS:
            lp = [p for p in (_pos(e) for e in late_ovf) if p is not None]
            why = (f"{best} halvings in a row after calibration" if best >= LATE_RUN_HALVINGS
                   else f"the scale fell {net_fall} halvings below its settled {ev['scale_settled']}")
            out.append(log_finding(
                NAME, "fp16_overflow", "warning",
                f"fp16 overflows after warm-up ({fmt}): {len(late_ovf)} late overflow(s){who}, {why}, scale now "
                f"{ev['scale_final']}" + (f" (iterations {min(lp)}-{max(lp)})" if lp else ""),
                inputs=inputs, evidence=dict(ev, cause="overflow_run", run_end_line=_ev_loc(best_end) if best_end
                                             else None),
                ranks=ranks, step_start=min(lp) if lp else s0, step_end=max(lp) if lp else s1, confidence=0.8,
                recommendation=("The scale is being driven down past the warm-up: lower the learning rate or clip "
                                "gradients, and watch for a collapse to the minimum scale; bf16 avoids loss scaling.")))
            continue
        if cal:
            cp = [p for p in (_pos(e) for e in cal) if p is not None]
            where = f" in iterations {min(cp)}-{max(cp)}" if cp else " at the start"
            after = (f"; later {len(late_ovf)} isolated overflow(s) after growth (normal dynamic scaling)"
                     if late_ovf else "; no overflow after it")
            summary = (f"fp16 loss-scale warm-up calibration ({fmt}): {len(cal)} overflow(s){where} took the scale "
                       f"{ev['scale_start']} -> {ev['scale_settled']}, then it settled{after}; benign")
        else:
            summary = (f"fp16 dynamic loss scaling ({fmt}): {len(ovf)} isolated overflow(s), each after the scale "
                       f"grew; scale {ev['scale_final']}; benign")
        out.append(log_finding(NAME, "fp16_overflow", "info", summary, inputs=inputs,
                               evidence=dict(ev, cause="calibration" if cal else "dynamic_scaling"), ranks=ranks,
                               step_start=s0, step_end=s1, confidence=0.8,
                               recommendation="Nothing to do: skipped steps while the loss scale calibrates are expected."))
    return out


def _norm_msg(msg: str) -> str:
    return re.sub(r"#\d+", "#N", msg).rstrip("!.')")


def _nan_findings(results: list[ReadResult]) -> list[Finding]:
    groups: dict[str, list[dict]] = defaultdict(list)
    verdicts: list[dict] = []
    for r in results:
        for ev in r.events:
            if ev["kind"] != "nan":
                continue
            msg = ev.get("message", "gradients are Nan/Inf")
            if "Possible" in msg or "rerun" in msg or "Correct result" in msg:
                verdicts.append(ev)  # the rerun state machine's verdict on an earlier unexpected result
                continue
            m = re.match(r"Unexpected result (\S+) \(message='(.*)", msg)
            if m:
                ev = dict(ev, value=m.group(1), message=m.group(2))
            groups[_norm_msg(ev.get("message", msg))].append(ev)
    out: list[Finding] = []
    for msg, evs in sorted(groups.items()):
        evs.sort(key=lambda e: (e.get("iteration") or e.get("near_iteration") or 0, e["source"], e["line"]))
        ranks = sorted({e["rank"] for e in evs if e.get("rank") is not None})
        hosts = sorted({e["host"] for e in evs if e.get("host")})
        gpus = sorted({f"{e['host']}:{e['device']}" if e.get("host") else str(e["device"])
                       for e in evs if e.get("device") is not None})
        its = [p for p in (_pos(e) for e in evs) if p is not None]
        per_rank = []
        for e in evs[:32]:
            per_rank.append({k: e[k] for k in ("rank", "host", "device", "iteration", "value") if e.get(k) is not None}
                            | {"at": _ev_loc(e)})
        rel_verdicts = [{"verdict": v.get("message"), "rank": v.get("rank"), "at": _ev_loc(v)} for v in verdicts
                        if v.get("rank") in ranks][:8]
        low = msg.lower()
        kind_word = "NaN/Inf" if "nan" in low and "inf" in low else "Inf" if "inf" in low else "NaN"
        # a message may name no rank (fairseq's "gradients are Nan/Inf"): say where it was instead
        where = ", ".join((f"rank {d['rank']}" if "rank" in d else f"{d['at']}")
                          + (f" (node {d['host']}, device {d.get('device', '?')})" if "host" in d else "")
                          for d in per_rank[:4])
        if len(per_rank) > 4:
            where += f" and {len(evs) - 4} more"
        it_txt = (f" at iteration {its[0]}" if len(set(its)) == 1 else f" at iterations {min(its)}-{max(its)}") if its \
            else ""
        out.append(log_finding(
            NAME, "nan", "critical",
            f"{kind_word} detected{it_txt}: '{msg}' on {where}" if where else f"{kind_word} detected{it_txt}: '{msg}'",
            inputs=[e["source"] for e in evs], ranks=ranks, hosts=hosts, gpus=gpus,
            step_start=min(its) if its else None, step_end=max(its) if its else None, confidence=0.95,
            evidence={"message": msg, "count": len(evs), "ranks": ranks, "first_iteration": min(its) if its else None,
                      "last_iteration": max(its) if its else None, "reports": per_rank, "rerun_verdicts": rel_verdicts,
                      "first_line": _ev_loc(evs[0])},
            recommendation=("Training diverged or a device computes wrong values. If one rank/device reports it alone "
                            "and a rerun says 'transient', suspect that GPU (run its diagnostics, evict the node); if "
                            "every rank does, lower the learning rate, clip gradients, check that iteration's data, and "
                            "resume from the last good checkpoint.")))
    return out


def conclude(results: list[ReadResult]) -> list[Finding]:
    return _overflow_findings(results) + _nan_findings(results)


def summarize(results: list[ReadResult]) -> dict:
    kinds: dict[str, int] = defaultdict(int)
    for r in results:
        for k, v in r.summary.get("messages", {}).items():
            kinds[k] += v
    return {"inputs": len(results), "messages": dict(kinds)}
