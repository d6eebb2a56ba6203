"""GET /api/runs/<id>/findings serves each finding's evidence in the sentences diagnose's page uses (issue 17): the
TUI imports no analyzers, so the head says them. The stored fields stay as they were."""

from __future__ import annotations

from functools import partial
import json

import pytest

from agent_helpers import api_get, serving
from head.service import Head

RUN = "findings-run"
TOKEN = "findings-test-token"

STRAGGLER = {"analyzer": "stragglers", "kind": "straggler", "severity": "warning", "ranks": [3], "nodes": [1],
             "step_start": 10, "step_end": 29, "summary": "rank 3 is the straggler", "recommendation": "evict node 1",
             "confidence": 0.9, "run_id": RUN, "t": 1.0, "simulated": False, "id": "st-1", "status": "open",
             "evidence": {"rank_median_compute_ms": 151.2, "peers_median_compute_ms": 100.4, "ratio": 1.506,
                          "onset_step": 10, "detected_at_step": 13, "arrival_lag_ms": 50.3,
                          "victims_mean_wait_ms": 49.8, "cusum_threshold": 0.393, "signal": "compute_ms"}}


@pytest.fixture
def head(tmp_path):
    h = Head(tmp_path / "store", TOKEN, analyzer=None)
    (h.store.root / RUN).mkdir(parents=True, exist_ok=True)  # a run the store knows: the GET is not a 404
    with serving(h):
        yield h


get = partial(api_get, token=TOKEN)  # (status, JSON body) with this file's token


def serve(h: Head, monkeypatch, findings: list[dict]) -> list[dict]:
    monkeypatch.setattr(h.analysis, "findings_of", lambda run_id: [dict(f) for f in findings])
    code, body = get(f"{h.url}/api/runs/{RUN}/findings")
    assert code == 200, body
    return body


def test_findings_carry_their_evidence_in_sentences(head, monkeypatch):
    (f,) = serve(head, monkeypatch, [STRAGGLER])
    # the old fields, unchanged
    assert {k: f[k] for k in STRAGGLER} == STRAGGLER
    assert f["evidence_sentences"] == [
        "Rank 3 computes 151 ms per step against its peers' 100 ms (1.51x) since step 10 (confirmed at step 13).",
        "It arrives at the gradient sync 50 ms after them.",
        "Its peers wait 50 ms per step for it."]
    # what no sentence says, in words: nothing hidden, no key=value
    assert f["evidence_other"] == [["cusum threshold", "0.393"]]


def test_findings_read_back_from_the_store_get_sentences_too(head, monkeypatch):
    stored = dict(STRAGGLER, evidence=json.dumps(STRAGGLER["evidence"]), ranks="[3]", nodes="[1]")
    (f,) = serve(head, monkeypatch, [stored])
    assert f["evidence"] == stored["evidence"] and f["ranks"] == "[3]"  # served as stored
    assert f["evidence_sentences"][0].startswith("Rank 3 computes 151 ms per step")


def test_odd_evidence_gives_plain_words_never_a_500(head, monkeypatch):
    odd = [dict(STRAGGLER, id="a", evidence="not json"),
           dict(STRAGGLER, id="b", evidence={"rank_median_compute_ms": "fast", "peers_median_compute_ms": None}),
           dict(STRAGGLER, id="c", kind="some_future_kind", evidence={"new_key": 2.5}),
           dict(STRAGGLER, id="d", evidence=None)]
    got = {f["id"]: f for f in serve(head, monkeypatch, odd)}
    assert got["a"]["evidence_sentences"] == [] and got["a"]["evidence_other"] == []
    assert got["b"]["evidence_sentences"] == []  # a word where a number belongs: no sentence, the value plainly
    assert ["rank median compute ms", "fast"] in got["b"]["evidence_other"]
    assert got["c"]["evidence_other"] == [["new key", "2.5"]]
    assert got["d"]["evidence_sentences"] == [] and got["d"]["evidence_other"] == []


def test_findings_still_need_the_token(head, monkeypatch):
    monkeypatch.setattr(head.analysis, "findings_of", lambda run_id: [STRAGGLER])
    assert get(f"{head.url}/api/runs/{RUN}/findings", token=None)[0] == 401
