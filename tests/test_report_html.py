"""The diagnose HTML page as people share it (issue 17): each plot's SVG with step ticks, gridlines and event marks,
evidence as sentences with the numbers, the layout in words, no "None" and no raw dict, a "what to do next", the
plots whose data is absent left out with a reason, and a headless-Chromium screenshot that is not blank."""

from __future__ import annotations

import html
import json
import re
import shutil

import msgspec
import pandas as pd
import pytest
from analyzer_fixtures import build, gpu_samples, with_records

from analyzers import run_all
from analyzers.report.model import build_report
from analyzers.report.render_html import render_html
from analyzers.report.render_json import render_json
from analyzers.report.sentences import evidence_sentences
from ranksight.schema import Action, FaultSpec


def page_of(data) -> tuple[str, dict]:
    errors, coverage = [], []
    findings = run_all(data, errors=errors, coverage=coverage)
    report = build_report(data, findings, errors, coverage)
    return render_html(report), json.loads(render_json(report))


def visible_text(page: str) -> str:
    """What a reader sees: no style, no tags, entities decoded."""
    body = re.sub(r"<style>.*?</style>", "", page, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", " ", body))


def svg_of(page: str, plot: str) -> str:
    m = re.search(rf'<svg class="plot-svg" data-plot="{plot}".*?</svg>', page, flags=re.S)
    assert m, f"no {plot} SVG in the page"
    return m.group(0)


def assert_time_axis(svg: str, plot: str, event_kinds: set[str]) -> None:
    """Step ticks (matplotlib's xtick groups with integer labels), y ticks, gridlines, and a mark per event kind."""
    assert len(re.findall(rf'id="{plot}-xtick_\d+"', svg)) >= 4, "step ticks"
    assert len(re.findall(rf'id="{plot}-ytick_\d+"', svg)) >= 3, "value ticks"
    assert re.search(rf'id="{plot}-gridx-\d+-\d+"', svg) and re.search(rf'id="{plot}-gridy-\d+-\d+"', svg), "gridlines"
    assert ">step<" in svg
    for kind in event_kinds:
        assert re.search(rf'id="{plot}-event-{kind}-\d+-\d+"', svg), f"{plot}: no {kind} mark"


def assert_clean(page: str) -> None:
    text = visible_text(page)
    assert "None" not in text and "nan" not in text.split()
    assert not re.search(r"[{}]", text), "a raw dict or set on the page"
    assert not re.search(r"\b[a-z]+_[a-z_]+=-?\d", text), "a key=value dump"
    assert "node None" not in page


@pytest.fixture(scope="module")
def straggler():
    """Rank 3 on node 1 computes 1.5x from step 10, the fault injected there; simulated GPU samples."""
    data = build(world=4, nodes=2, steps=30, compute_factor=lambda r, s: 1.5 if (r == 3 and s >= 10) else 1.0,
                 faults=[FaultSpec(kind="slow_rank", rank=3, factor=1.5, start=10),
                         FaultSpec(kind="slow_link", node=1, delay_ms=40.0, start=25, end=26)])
    return page_of(with_records(data, gpu_samples(data)))


def test_straggler_page_plots_with_ticks_grid_and_event_marks(straggler):
    page, _ = straggler
    for plot in ("plot-throughput", "plot-arrival", "plot-gpu", "plot-collectives"):
        assert_time_axis(svg_of(page, plot), plot, {"fault", "finding"})
    # per-rank stacked time: a compute, comm and data bar for each of the 4 ranks
    rt = svg_of(page, "plot-ranktime")
    for part in ("compute", "comm", "data"):
        assert len(re.findall(rf'id="plot-ranktime-bar-{part}-rank\d"', rt)) == 4
    # the numbered legend of the marks: ground truth labelled so, and the finding's onset
    assert re.search(r'<li class="ev-fault" id="event-1">step 10: fault injected \(ground truth\): slow rank on rank 3', page)
    assert re.search(r'class="ev-finding"[^>]*>step 10: straggler found from here \(warning, rank 3\)', page)
    # the GPU telemetry is the simulator's, and the page says so
    assert "GPU SM clock and temperature per GPU (SIMULATED)" in page and "SIMULATED" in svg_of(page, "plot-gpu")
    assert 'id="missing-pipeline"' in page and "no pipeline parallelism in this run" in page


def test_straggler_page_says_the_evidence_in_sentences(straggler):
    page, _ = straggler
    text = " ".join(visible_text(page).split())
    assert re.search(r"Rank 3 computes 15\d ms per step against its peers' 10\d ms \(1\.[45]\dx\) since step 10", text)
    assert re.search(r"It arrives at the gradient sync 5\d ms after them", text)
    assert re.search(r"Its peers wait 5\d ms per step for it", text)
    assert "cusum_threshold" not in text and "how it was measured" in text  # the rest, plainly, in details
    assert re.search(r"<details><summary>how it was measured \(\d+ more values\)</summary>.*?<td>cusum threshold</td>", page, re.S)
    # the header: the layout in words, never the dict
    assert "dp 4 × tp 1 × pp 1, 4 ranks on 2 nodes" in text and '"dp"' not in page
    # the faults table names where each fault acted: a rank with its node, or a node; never "node None"
    assert re.search(r"<td>slow rank</td><td>rank 3 \(node 1\)</td><td>1\.5x slower</td><td>10 to the end</td>", page)
    assert re.search(r"<td>slow link</td><td>node 1</td><td>\+40 ms</td><td>25 to 26</td>", page)
    # what to do next: the straggler's recommendation, once
    nxt = re.search(r'<h2 id="next">What to do next</h2><ol class=\'next\'>(.*?)</ol>', page, re.S).group(1)
    assert nxt.count("<li>") >= 1 and "rank 3" in nxt and "node 1" in nxt
    assert_clean(page)


def test_the_page_is_themed_printable_and_self_contained(straggler):
    page, _ = straggler
    assert "@media (prefers-color-scheme:dark)" in page and "@media print" in page
    assert "break-inside:avoid" in page and 'name="viewport"' in page
    for external in ("<script", "<link ", "http://", "https://", "src=", "url("):
        assert external not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "<style" not in page.split("</style>", 1)[1], "a plot's own style sheet, which would style the whole page"
    ids = re.findall(r'\bid="([^"]+)"', page)
    assert len(ids) == len(set(ids)), "ids clash between plots"


def test_fp16_curves_sit_beside_the_fp16_finding():
    data = build(world=4, steps=40, fp16=True, overflow=lambda r, s: s >= 15 and s % 2 == 0)
    page, _ = page_of(data)
    card = re.search(r'<div class="f finding-fp16_overflow">.*?<div class="rec">', page, re.S).group(0)
    tr = svg_of(card, "plot-training")
    assert_time_axis(tr, "plot-training", {"finding"})
    assert 'id="plot-training-overflow-marks"' in tr
    assert ">loss scale<" in tr and ">loss<" in tr
    text = " ".join(visible_text(card).split())
    assert re.search(r"The loss scale went from 32768 to 16, 12 halvings below its peak of 65536: it collapsed\.", text)
    assert re.search(r"Gradients overflowed in 12 step\(s\), 30% of steps skipped since step 16", text)
    assert page.count('data-plot="plot-training"') == 1  # not drawn twice
    assert_clean(page)


def test_pipeline_timeline_from_the_stage_records():
    data = build(world=4, pp=2, steps=30, stage_compute_ms=[100, 160], microbatches=4)
    page, _ = page_of(data)
    pl = svg_of(page, "plot-pipeline")
    for stage in (0, 1):
        for mb in range(4):
            assert f'id="plot-pipeline-mb-F-{stage}-{mb}"' in pl and f'id="plot-pipeline-mb-B-{stage}-{mb}"' in pl
    assert ">stage 0<" in pl and ">stage 1<" in pl
    text = " ".join(visible_text(page).split())
    assert "Pipeline timeline, 2 stages × 4 micro-batches" in text
    assert "Replayed, not traced" in text and "stage 1: 160 ms compute" in text
    assert "dp 2 × tp 1 × pp 2, 4 ranks on 1 node; 1f1b schedule, 4 micro-batches" in text
    assert_clean(page)


def test_an_evicted_node_and_the_restart_are_marked_on_the_time_axes():
    data = build(world=4, nodes=2, steps=30, compute_factor=lambda r, s: 1.5 if (r == 3 and s >= 10) else 1.0)
    data.manifest = msgspec.structs.replace(data.manifest, attempts=[
        dict(attempt=0, t=1.0, world_size=4, resumed_step=None, ended_step=20, evicted_node=1),
        dict(attempt=1, t=2.0, world_size=2, resumed_step=20, ended_step=29)])
    base = dict(run_id="synth", id="a1", t=5.0, action="evict", node=1, ranks=[3], finding_kind="straggler",
                reason="straggler on node 1 confirmed 3 rounds", requested_by="policy")
    data.actions = pd.DataFrame([{f: getattr(a, f) for f in Action.__struct_fields__}
                                 for a in (Action(**base, status="applied", applied_step=20),)])
    page, obj = page_of(data)
    for plot in ("plot-throughput", "plot-arrival"):
        assert_time_axis(svg_of(page, plot), plot, {"evict", "restart", "finding"})
    assert "step 20: evict node 1 (by policy)" in page and "step 20: restart: attempt 1 on 2 ranks from step 20" in page
    assert "What happened to the job" in page
    # diagnose --json keeps its keys and adds the marks
    assert {"run_id", "verdict", "findings", "faults", "history", "layout", "coverage"} <= set(obj)
    assert [(e["step"], e["kind"]) for e in obj["events"] if e["kind"] in ("evict", "restart")] == [(20, "evict"), (20, "restart")]
    assert_clean(page)


def test_a_plot_without_data_is_left_out_with_one_line():
    data = build(world=2, steps=12)
    data.collectives = data.collectives.iloc[0:0]
    page, _ = page_of(data)
    assert '<p class="missing" id="missing-gpu">GPU clock and temperature: left out, no GPU samples in this run.</p>' in page
    assert 'id="missing-collectives"' in page and 'data-plot="plot-collectives"' not in page
    assert 'data-plot="plot-arrival"' in page  # sync_arrival is in the step records


def test_sentences_keep_unknown_keys_and_survive_odd_evidence():
    f = dict(kind="straggler", ranks=[2], evidence=dict(scope="rank", rank_median_compute_ms=120.0,
                                                        peers_median_compute_ms=100.0, ratio=1.2, new_key=3))
    sentences, rest = evidence_sentences(f)
    assert sentences[0] == "Rank 2 computes 120 ms per step against its peers' 100 ms (1.20x)."
    assert rest == {"new_key": 3}
    odd = dict(kind="straggler", ranks=[2], evidence=dict(scope="rank", rank_median_compute_ms="fast",
                                                          peers_median_compute_ms=100.0))
    sentences, rest = evidence_sentences(odd)  # a string where a number belongs: no crash, all of it shown plainly
    assert sentences == [] and rest["rank_median_compute_ms"] == "fast"
    sentences, rest = evidence_sentences(dict(kind="a_kind_added_later", ranks=[], evidence={"x": 1}))
    assert sentences == [] and rest == {"x": 1}


@pytest.mark.skipif(shutil.which("chromium") is None, reason="headless Chromium (Debian package chromium) not installed")
def test_headless_chromium_screenshot_is_not_blank(straggler, tmp_path):
    from analyzers.report.screenshot import blank_reason, take

    page = tmp_path / "r.html"
    page.write_text(straggler[0], encoding="utf-8")
    png = tmp_path / "r.png"
    take(page, png, width=1280, height=1400)
    assert blank_reason(png, 1280) == ""
    blank = tmp_path / "blank.html"
    blank.write_text("<!doctype html><html><body></body></html>")
    take(blank, tmp_path / "blank.png", width=1280, height=400)
    assert "differ from the background" in blank_reason(tmp_path / "blank.png", 1280)


def test_the_terminal_report_says_the_evidence_in_sentences_too():
    """Issue 17: evidence as readable sentences, not a key=value dump, in the terminal report as on the page."""
    import io

    from rich.console import Console

    from analyzers import run_all
    from analyzers.report.model import build_report
    from analyzers.report.render_text import render_text

    data = build(world=4, steps=30, compute_factor=lambda r, s: 1.5 if r == 3 and s >= 10 else 1.0)
    buf = io.StringIO()
    render_text(build_report(data, run_all(data)), Console(file=buf, width=200))
    text = buf.getvalue()
    assert "Rank 3 " in text and "against its peers'" in text, text[:3000]
    assert "cusum_threshold=" not in text and "evidence: " not in text
