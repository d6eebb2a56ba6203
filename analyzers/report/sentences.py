"""A finding's evidence as sentences a person reads, with the numbers in them.

``evidence_sentences(finding)`` returns the sentences and the evidence keys they did not use: one function per
finding kind (``SENTENCES``) reads the keys it knows; the page shows the rest plainly in a collapsible details block
(``plain_items``), so nothing a check measured is hidden, and a key a check adds later still shows. Each function
reads with ``.get``: evidence missing a key gives a shorter sentence, never a crash or a "None".
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable


class Ev:
    """A finding's evidence dict that remembers which keys a sentence used."""

    def __init__(self, evidence: dict[str, Any]):
        self.d = evidence or {}
        self.used: set[str] = set()

    def __call__(self, key: str, default: Any = None) -> Any:
        self.used.add(key)
        v = self.d.get(key, default)
        if isinstance(v, float) and not math.isfinite(v):
            return default
        return default if v is None else v

    def has(self, *keys: str) -> bool:
        return all(self.d.get(k) is not None for k in keys)

    def rest(self) -> dict[str, Any]:
        return {k: v for k, v in self.d.items() if k not in self.used}


def ms(x: Any) -> str:
    x = float(x)
    return f"{x:.0f} ms" if abs(x) >= 10 else f"{x:.1f} ms"


def pct(x: Any, nd: int = 0) -> str:
    return f"{float(x) * 100:.{nd}f}%"


def ranks_txt(xs: Any) -> str:
    xs = sorted(int(x) for x in xs) if isinstance(xs, (list, tuple, set)) else [xs]
    return ("rank " if len(xs) == 1 else "ranks ") + ", ".join(str(x) for x in xs)


def _since(ev: Ev) -> str:
    onset, found = ev("onset_step"), ev("detected_at_step")
    if onset is None:
        return ""
    s = f" since step {onset}"
    if found is not None and found != onset:
        s += f" (confirmed at step {found})"
    return s


def _span(ev: Ev) -> str:
    n = ev("steps_affected")
    return f"It lasted {n} step{'s' if n != 1 else ''}." if n else ""


def straggler(f: dict, ev: Ev) -> list[str]:
    who = ranks_txt(f["ranks"]) if f["ranks"] else "a rank"
    scope = ev("scope")
    out = []
    if scope == "node" and ev.has("node_median_compute_ms", "peers_median_compute_ms"):
        out.append(f"The ranks of node {ev('node')} compute {ms(ev('node_median_compute_ms'))} per step against the other "
                   f"nodes' {ms(ev('peers_median_compute_ms'))} ({ev('ratio', 0):.2f}x){_since(ev)}.")
    elif scope == "stage" and ev.has("pp_stage"):
        out.append(f"Pipeline stage {ev('pp_stage')} ({ranks_txt(ev('ranks', []))}) is slower than its peers{_since(ev)}.")
    elif ev.has("kernel_ms_per_step", "peers_kernel_ms_median"):
        out.append(f"{who.capitalize()} spends {ms(ev('kernel_ms_per_step'))} per step in device kernels against its peers' "
                   f"{ms(ev('peers_kernel_ms_median'))} ({ev('ratio', 0):.2f}x, {ev('excess_pct', 0):.0f}% more), "
                   f"in the profiler traces.")
        if ev.has("peers_wait_more_ms"):
            out.append(f"Its peers wait {ms(ev('peers_wait_more_ms'))} more per step in NCCL kernels.")
    elif ev.has("rank_median_compute_ms", "peers_median_compute_ms"):
        sig = ev("signal", "compute_ms")
        what = "computes" if sig == "compute_ms" else "is busy on its device" if sig == "device_ms" else f"takes ({sig})"
        out.append(f"{who.capitalize()} {what} {ms(ev('rank_median_compute_ms'))} per step against its peers' "
                   f"{ms(ev('peers_median_compute_ms'))} ({ev('ratio', 0):.2f}x){_since(ev)}.")
    if ev.has("arrival_lag_ms"):
        s = f"It arrives at the gradient sync {ms(ev('arrival_lag_ms'))} after them"
        if ev.has("last_arrival_share"):
            s += f" and is the last to arrive in {pct(ev('last_arrival_share'))} of those steps"
        out.append(s + ".")
    if ev.has("victims_mean_wait_ms"):
        out.append(f"Its peers wait {ms(ev('victims_mean_wait_ms'))} per step for it"
                   + (f"; it waits {ms(ev('own_wait_ms'))} itself." if ev.has("own_wait_ms") else "."))
    if ev.has("mfu_drop"):
        out.append(f"MFU fell {pct(ev('mfu_drop'))} over the same steps.")
    span = _span(ev)
    return out + ([span] if span else [])


def comm_bottleneck(f: dict, ev: Ev) -> list[str]:
    cause, scope = ev("cause"), ev("scope")
    out = []
    if cause == "slow_link" and scope == "node" and isinstance(ev.d.get("ranks"), list):
        for r in ev("ranks"):
            if isinstance(r, dict) and r.get("own") is not None and r.get("peers") is not None:
                out.append(f"Rank {r.get('rank')} spends {ms(r['own'])} per step in transfers against its peers' "
                           f"{ms(r['peers'])} ({float(r['own']) / max(float(r['peers']), 1e-9):.1f}x)"
                           + (f" since step {r['onset_step']}." if r.get("onset_step") is not None else "."))
        if ev.has("compute_ratio"):
            out.append(f"Its compute stays at {ev('compute_ratio'):.2f}x its peers': the link, not the GPU, is slow.")
    elif cause == "slow_link":
        if ev.has("rank_transfer_ms", "peers_transfer_ms"):
            out.append(f"{ranks_txt(f['ranks']).capitalize()} spends {ms(ev('rank_transfer_ms'))} per step in transfers against "
                       f"its peers' {ms(ev('peers_transfer_ms'))} ({ev('ratio', 0):.1f}x){_since(ev)}.")
        if ev.has("lead_ms", "op_ms"):
            out.append(f"Its collectives end {ms(ev('lead_ms'))} before its peers' (ops of {ms(ev('op_ms'))}): its data "
                       "reaches them late.")
        if ev.has("rank_sync_wait_ms", "peers_sync_wait_ms"):
            out.append(f"It waits {ms(ev('rank_sync_wait_ms'))} per step at the sync while its peers wait "
                       f"{ms(ev('peers_sync_wait_ms'))}, {ms(ev('unexplained_wait_ms', 0))} not explained by its arrival.")
        if ev.has("last_arriver_op_ms", "peers_last_arriver_op_ms"):
            out.append(f"When it arrives last, an op still takes {ms(ev('last_arriver_op_ms'))} against "
                       f"{ms(ev('peers_last_arriver_op_ms'))} when a peer is last.")
        if ev.has("compute_ratio"):
            out.append(f"Its compute is {ev('compute_ratio'):.2f}x its peers'.")
    elif cause == "comm_growth" and ev.has("exposed_share_baseline", "exposed_share"):
        out.append(f"Communication not hidden under compute grew from {pct(ev('exposed_share_baseline'))} to "
                   f"{pct(ev('exposed_share'))} of step time{_since(ev)}.")
    elif cause == "exposed_comm" and ev.has("exposed_share"):
        out.append(f"Communication not hidden under compute takes {pct(ev('exposed_share'))} of step time.")
    elif cause == "busbw" and ev.has("achieved_busbw_gbs"):
        out.append(f"{ev('op', 'The collective')} on group {ev('group', '?')} reaches {ev('achieved_busbw_gbs'):.2f} GB/s "
                   "of bus bandwidth.")
    if ev.has("explained_by"):
        out.append("Explained by the " + "; ".join(str(x) for x in ev("explained_by")) + ".")
    if ev.has("mfu_drop"):
        out.append(f"MFU fell {pct(ev('mfu_drop'))} over the same steps.")
    span = _span(ev)
    return out + ([span] if span else [])


def pipeline_bubble(f: dict, ev: Ev) -> list[str]:
    out = []
    if ev.has("measured_bubble", "theory_bubble"):
        out.append(f"The pipeline idles {pct(ev('measured_bubble'))} of each step against {pct(ev('theory_bubble'))} in "
                   f"theory for {ev('pp', '?')} stages, {ev('microbatches', '?')} micro-batches and the "
                   f"{ev('schedule', '?')} schedule.")
    sc, sw = ev("stage_compute_ms"), ev("stage_wait_ms")
    if isinstance(sc, dict) and sc:
        parts = [f"stage {s} computes {ms(v)}" + (f" and waits {ms(sw[s])}" if isinstance(sw, dict) and sw.get(s) is not None else "")
                 for s, v in sc.items() if v is not None]
        out.append("Per step, " + "; ".join(parts) + ".")
    if ev.has("imbalance_ratio", "slowest_stage"):
        out.append(f"The slowest stage ({ev('slowest_stage')}) takes {ev('imbalance_ratio'):.2f}x the fastest.")
    if ev.has("microbatches_for_target", "target"):
        out.append(f"{ev('microbatches_for_target')} micro-batches would bring the theoretical bubble under {pct(ev('target'))}.")
    ev("cause"), ev("stage_bubble"), ev("excess"), ev("virtual_stages")  # said by the summary and the sentences above
    return out


def mfu_drop(f: dict, ev: Ev) -> list[str]:
    out = []
    metric = ev("metric", "MFU")
    fmt = (lambda v: f"{float(v):.1%}") if metric == "MFU" else (lambda v: f"{float(v):.3g}")
    if ev.has("reference", "level"):
        out.append(f"{metric} fell from {fmt(ev('reference'))} to {fmt(ev('level'))} ({pct(ev('drop', 0))} lower){_since(ev)}.")
    if ev.has("step_ms_baseline", "step_ms_drop"):
        out.append(f"Step time went from {ms(ev('step_ms_baseline'))} to {ms(ev('step_ms_drop'))}.")
    delta = ev("delta_ms")
    if isinstance(delta, dict):
        parts = [f"{k} +{ms(v)}" for k, v in sorted(delta.items(), key=lambda kv: -(kv[1] or 0)) if v and v >= 1]
        if parts:
            out.append("Where the extra time went: " + ", ".join(parts) + ".")
    cause = ev("cause")
    if cause:
        out.append(f"Likely cause: {str(cause).replace('_', ' ')}"
                   + (" (confirmed by another finding)." if ev("cause_confirmed") else "."))
    sym = ev("symptom_of")
    if isinstance(sym, dict) and sym.get("kind"):
        out.append(f"A symptom of the {sym['kind'].replace('_', ' ')} finding.")
    ev("peak")  # the header says it
    return out


def fp16_overflow(f: dict, ev: Ev) -> list[str]:
    out = []
    cause = ev("cause")
    if cause == "nonfinite_loss":
        out.append(f"The loss was NaN or infinite in {ev('nonfinite_steps', '?')} step(s).")
    if ev.has("overflow_steps"):
        out.append(f"Gradients overflowed in {ev('overflow_steps')} step(s)"
                   + (f", {pct(ev('skipped_rate'))} of steps skipped" if ev.has("skipped_rate") else "") + f"{_since(ev)}.")
    elif ev.has("skipped_rate"):
        out.append(f"{pct(ev('skipped_rate'))} of steps were skipped ({ev('skipped_steps', '?')} steps){_since(ev)}.")
    if ev.has("scale_at_onset", "scale_at_end"):
        s = f"The loss scale went from {ev('scale_at_onset'):g} to {ev('scale_at_end'):g}"
        if ev.has("scale_peak", "halvings_from_peak"):
            s += f", {ev('halvings_from_peak')} halvings below its peak of {ev('scale_peak'):g}"
        out.append(s + (": it collapsed." if cause == "loss_scale_collapse" else "."))
    ev("scale_min")
    return out


def hang(f: dict, ev: Ev) -> list[str]:
    cause = ev("cause")
    out = []
    if cause == "missing_ranks":
        out.append(f"{ranks_txt(ev('missing_ranks', [])).capitalize()} never joined {ev('op', 'a collective')} number "
                   f"{ev('seq', '?')} on group {ev('group', '?')}, which {ranks_txt(ev('waiting_ranks', []))} entered"
                   f"{_since(ev)}.")
    elif cause == "silent" and ev.has("silent_s"):
        out.append(f"No rank has written a record for {ev('silent_s'):.0f} s (stall threshold {ev('stall_threshold_s', 0):.0f} s).")
    elif cause == "stopped_early":
        last = ev("last_step")
        if isinstance(last, dict):
            out.append("Last steps per rank: " + ", ".join(f"rank {r} at {s}" for r, s in last.items()) + ".")
    elif cause == "ended_early":
        out.append(f"The run stopped at step {ev('last_step', '?')} of {ev('planned_steps', '?')} planned.")
    elif cause == "crashed":
        out.append(f"{ranks_txt(ev('failed_ranks', [])).capitalize()} failed: {ev('first_error', 'no error text')}.")
    elif cause == "watchdog_timeout":
        out.append(f"The NCCL watchdog timed out ({ev('lines', '?')} line(s)); for example: {ev('example', '')}")
    return out


def gpu_health(f: dict, ev: Ev) -> list[str]:
    cause = ev("cause")
    where = f"Node {ev('node', '?')} GPU {ev('gpu', '?')}"
    out = []
    if cause == "throttle":
        if ev.has("throttled_share"):
            out.append(f"{where} was throttled in {pct(ev('throttled_share'))} of its busy samples "
                       f"({ev('throttled_samples', '?')} of {ev('samples', '?')})"
                       + (f": {', '.join(ev('reasons'))}." if ev.has("reasons") and ev("reasons") else "."))
        if ev.has("sm_clock_mhz", "max_sm_clock_mhz"):
            out.append(f"Its SM clock ran at {ev('sm_clock_mhz'):.0f} of {ev('max_sm_clock_mhz'):.0f} MHz"
                       + (f"; it reached {ev('temp_c_max'):.0f} °C." if ev.has("temp_c_max") else "."))
    elif cause == "xid":
        gpus = ev("gpus", [])
        out.append(f"Node {ev('node', '?')} GPU{'s' if len(gpus) != 1 else ''} {', '.join(map(str, gpus))} raised "
                   f"{ev('xid_count', '?')} XID error(s)" + (f" (codes {', '.join(map(str, ev('codes')))})" if ev("codes") else "")
                   + f"{_since(ev)}.")
    elif cause == "ecc_dbe":
        out.append(f"{where} counted {ev('ecc_dbe', '?')} uncorrectable (double-bit) ECC error(s){_since(ev)}.")
    elif cause == "memory_errors":
        inc = {k[:-len('_increase')]: v for k, v in ev.d.items() if k.endswith("_increase")}
        for k in inc:
            ev(k + "_increase")
        out.append(f"{where}'s memory error counters rose: " + ", ".join(f"{k.replace('_', ' ')} +{v}" for k, v in inc.items()) + ".")
    ev("first_t")
    return out


def data_stall(f: dict, ev: Ev) -> list[str]:
    who = "Every rank" if ev("scope") == "world" else ranks_txt(f["ranks"]).capitalize()
    out = []
    if ev.has("data_ms_median", "data_share"):
        out.append(f"{who} waits {ms(ev('data_ms_median'))} per step for the next batch, {pct(ev('data_share'))} of step "
                   f"time{_since(ev)}" + (f", against its peers' {ms(ev('peers_data_ms_median'))}." if ev.has("peers_data_ms_median") else "."))
    if ev.has("victims_mean_wait_ms"):
        out.append(f"Its peers wait {ms(ev('victims_mean_wait_ms'))} per step for it.")
    if ev.has("mfu_drop"):
        out.append(f"MFU fell {pct(ev('mfu_drop'))} over the same steps.")
    span = _span(ev)
    return out + ([span] if span else [])


def memory_pressure(f: dict, ev: Ev) -> list[str]:
    cause = ev("cause")
    out = []
    if cause == "near_capacity":
        frac, gib, cap = ev("peak_fraction", {}), ev("peak_gib", {}), ev("capacity_gib", {})
        for r, x in (frac or {}).items():
            if x is not None:
                out.append(f"Rank {r} peaked at {pct(x)} of its memory" +
                           (f" ({gib[r]:.1f} of {cap[r]:.1f} GiB)." if gib.get(r) is not None and cap.get(r) is not None else "."))
    elif cause == "growth":
        slope, a, b, full = ev("slope_mib_per_step", {}), ev("start_gib", {}), ev("end_gib", {}), ev("projected_full_step", {})
        for r, x in (slope or {}).items():
            if x is not None:
                s = f"Rank {r}'s memory grows {x:.1f} MiB per step"
                if a.get(r) is not None and b.get(r) is not None:
                    s += f" ({a[r]:.2f} to {b[r]:.2f} GiB)"
                if full.get(r):
                    s += f", full at about step {full[r]}"
                out.append(s + ".")
        ev("rising_share")
    return out


SENTENCES: dict[str, Callable[[dict, Ev], list[str]]] = {
    "straggler": straggler, "comm_bottleneck": comm_bottleneck, "pipeline_bubble": pipeline_bubble,
    "mfu_drop": mfu_drop, "fp16_overflow": fp16_overflow, "hang": hang, "gpu_health": gpu_health,
    "data_stall": data_stall, "memory_pressure": memory_pressure,
}


def evidence_sentences(finding: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """(sentences with the numbers, the evidence keys no sentence used) for a finding (``model.finding_dict``'s)."""
    ev = Ev(finding.get("evidence") or {})
    fn = SENTENCES.get(finding.get("kind", ""))
    try:
        sentences = fn(finding, ev) if fn is not None else []
    except (TypeError, ValueError, KeyError, AttributeError, IndexError):
        # evidence of an unexpected shape: the plain list below still shows all of it
        ev.used.clear()
        sentences = []
    return [s for s in sentences if s], ev.rest()


def _decoded(v: Any) -> Any:
    """A dict or list column read back from Parquet comes as JSON text; anything else as it is."""
    if isinstance(v, str) and v[:1] in ("{", "["):
        try:
            return json.loads(v)
        except ValueError:
            return v
    return v


def explained(finding: dict[str, Any]) -> dict[str, Any]:
    """The finding as served to clients that cannot import this module (the head's API, for the TUI): the dict as it
    was, plus ``evidence_sentences`` (the sentences above) and ``evidence_other`` (``[name, value]`` in words for
    each evidence key no sentence used). Evidence that is not a dict gives no sentences and is left as it was."""
    f = dict(finding)
    ev, ranks = _decoded(f.get("evidence")), _decoded(f.get("ranks"))
    ev = ev if isinstance(ev, dict) else {}
    ranks = [r for r in ranks if isinstance(r, int)] if isinstance(ranks, list) else []
    try:
        sentences, rest = evidence_sentences({**f, "evidence": ev, "ranks": ranks})
        other = plain_items(rest)
    except Exception:  # a sentence that trips on odd evidence must not cost the API its findings: say it plainly
        sentences, other = [], [(plain_key(str(k)), str(v)) for k, v in ev.items()]
    f["evidence_sentences"] = sentences
    f["evidence_other"] = [list(kv) for kv in other]
    return f


def plain_value(v: Any) -> str:
    """A value as a person reads it: no braces, no quotes, no None."""
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else "n/a"
    if isinstance(v, dict):
        return "; ".join(f"{plain_key(str(k))} {plain_value(x)}" for k, x in v.items()) or "none"
    if isinstance(v, (list, tuple)):
        return ", ".join(plain_value(x) for x in v) or "none"
    return str(v)


def plain_key(k: str) -> str:
    return k.replace("_", " ")


def plain_items(rest: dict[str, Any]) -> list[tuple[str, str]]:
    """The evidence keys no sentence used, as (name, value) in words."""
    return [(plain_key(k), plain_value(v)) for k, v in rest.items()]
