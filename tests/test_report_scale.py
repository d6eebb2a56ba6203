"""The report's per-rank plots at thousands of ranks (issue 17): the ranks that matter one by one, the rest as a band
(p5-p95 and the median), so the page stays small, quick to draw and readable; a job of a few ranks keeps one line,
bar and heat-map row per rank."""

from __future__ import annotations

import html
import re
import time

import numpy as np
import pandas as pd
import pytest
from report_scale_fixtures import big_run

from analyzers.report import plots as P
from analyzers.report.model import build_report
from analyzers.report.render_html import render_html
from analyzers.report.series import FOCUS_K, band, focus

SLOW = 1234


def page_of(world: int, **kw) -> tuple[str, float]:
    data, findings = big_run(world, slow=kw.pop("slow", SLOW), **kw)
    t = time.perf_counter()
    page = render_html(build_report(data, findings, [], []))
    return page, time.perf_counter() - t


def figure(page: str, fig_id: str) -> str:
    m = re.search(rf'<figure id="{fig_id}">.*?</figure>', page, flags=re.S)
    assert m, f"no {fig_id}"
    return m.group(0)


@pytest.fixture(scope="module")
def pages():
    return {4096: page_of(4096), 256: page_of(256)}


def test_a_4096_rank_page_is_small_and_drawn_in_time(pages):
    page, seconds = pages[4096]
    # drawn whole, every rank a line, bar and row, this page was about 30 MB; now the size does not grow with the job
    assert len(page) < 2_000_000, f"{len(page) / 1e6:.1f} MB"
    assert seconds < 180, f"{seconds:.0f} s"  # generous: a few seconds on an idle 2-core box


def test_the_straggler_is_drawn_and_the_rest_is_a_band(pages):
    page, _ = pages[4096]
    arrival = figure(page, "fig-arrival")
    lines = re.findall(r'id="plot-arrival-line-0-rank-(\d+)"', arrival)
    assert lines[0] == str(SLOW) and len(lines) == FOCUS_K  # the named rank first, FOCUS_K lines in all
    assert 'id="plot-arrival-band-0"' in arrival and 'id="plot-arrival-band-median-0"' in arrival
    assert "Of 4096 ranks, 6 are drawn one by one" in arrival and "p5–p95 of 4090 others" in arrival

    ranktime = figure(page, "fig-ranktime")
    bars = re.findall(r'id="plot-ranktime-bar-compute-rank(\d+)"', ranktime)
    assert bars[0] == str(SLOW) and len(bars) == FOCUS_K + 4 + 3
    for q in ("p95", "median", "p5"):
        assert re.search(rf"rank \d+ \(others&#x27; {q}\)|rank \d+ \(others' {q}\)", ranktime)

    heat = figure(page, "fig-heat")
    labels = [html.unescape(x) for x in re.findall(r'<text x="2" y="\d+" font-size="10">([^<]+)</text>', heat)]
    assert labels[0] == f"rank {SLOW}" and labels[-3:] == ["others' p95", "others' median", "others' p5"]
    assert len(labels) == 15 and heat.count("<rect") <= 15 * 120
    assert "the other 4084 ranks" in heat

    gpu = figure(page, "fig-gpu")  # the straggler's GPU (node 154, GPU 2) clocks down: drawn on both axes
    assert 'id="plot-gpu-line-0-node-154-GPU-2"' in gpu and 'id="plot-gpu-line-1-node-154-GPU-2"' in gpu
    assert 'id="plot-gpu-band-0"' in gpu and "Of 4096 GPUs" in gpu


def test_the_per_rank_figures_do_not_grow_with_the_job(pages):
    big, small = pages[4096][0], pages[256][0]
    for fig in ("fig-arrival", "fig-ranktime", "fig-heat", "fig-gpu"):
        a, b = len(figure(big, fig)), len(figure(small, fig))
        assert a < 1.2 * b, f"{fig}: {a} bytes at 4,096 ranks against {b} at 256"


def test_a_small_job_keeps_every_rank():
    page, _ = page_of(12, per_node=4, slow=5)
    arrival = figure(page, "fig-arrival")
    assert len(re.findall(r'id="plot-arrival-line-0-rank-\d+"', arrival)) == 12 and "band" not in arrival
    assert len(re.findall(r'id="plot-ranktime-bar-compute-rank\d+"', page)) == 12 and "others'" not in html.unescape(page)
    assert len(re.findall(r'<text x="2" y="\d+" font-size="10">rank \d+</text>', figure(page, "fig-heat"))) == 12


def test_focus_takes_the_named_first_then_the_highest():
    scores = pd.Series({0: 1.0, 1: 5.0, 2: np.nan, 3: 4.0, 4: 9.0})
    assert focus(scores, prefer=[3, 99], k=3) == [3, 4, 1]  # a name not in the data is skipped
    assert focus(scores, k=10) == [4, 1, 3, 0, 2]  # NaN last


def test_band_is_the_others_quantiles_per_step():
    frame = pd.DataFrame(np.arange(1, 102, dtype=float)[None, :].repeat(2, axis=0), columns=range(101))
    frame.iloc[1, :] = np.nan
    q = band(frame, exclude=[100])
    assert list(q.index) == [0]  # a step where no column has a value is dropped
    assert q.loc[0].tolist() == pytest.approx([5.95, 50.5, 95.05])  # linear interpolation over 1..100


def test_lines_keep_the_page_ids_unique_across_axes(pages):
    page, _ = pages[4096]
    ids = re.findall(r'\bid="([^"]+)"', page)
    assert len(ids) == len(set(ids))
    assert P.MANY < 4096
