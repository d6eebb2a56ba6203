"""head.findings_book: one live finding per episode across analysis rounds, updated, escalated, closed."""

from head.findings_book import FindingsBook, latest_per_id
from ranksight import schema


def straggler(start, end, severity="warning", rank=3):
    return schema.Finding(analyzer="stragglers", kind="straggler", severity=severity, ranks=[rank], nodes=[1],
                          step_start=start, step_end=end, evidence={"ratio": 1.5}, summary=f"rank {rank} slow")


def test_an_episode_grows_escalates_and_closes_under_one_id():
    book = FindingsBook("r", close_after=5)
    r1 = book.observe([straggler(12, 15)], last_step=15, now=1.0)
    assert len(r1.new) == 1 and r1.changed == []
    ep = r1.new[0]
    assert ep.id and ep.status == "open" and ep.t == 1.0 and ep.run_id == "r"
    # next round: the same slow rank, seen up to step 20, onset refined one step later: the same episode
    r2 = book.observe([straggler(13, 20)], last_step=20, now=2.0)
    assert r2.new == [] and [f.id for f in r2.changed] == [ep.id]
    cur = book.current()[0]
    assert (cur.step_start, cur.step_end, cur.t, cur.updated) == (12, 20, 1.0, 2.0)
    # escalation is reported as such (worth another alert)
    r3 = book.observe([straggler(12, 24, "critical")], last_step=24, now=3.0)
    assert [f.id for f in r3.escalated] == [ep.id] and book.current()[0].severity == "critical"
    # a round with nothing new to say changes nothing
    r4 = book.observe([straggler(12, 24, "critical")], last_step=24, now=4.0)
    assert r4.new == r4.changed == [] and book.current()[0].updated == 3.0
    # the rank recovered: no longer reported; the run moves on; closed once 5 steps past its end
    assert book.observe([], last_step=28, now=5.0).changed == []
    r6 = book.observe([], last_step=30, now=6.0)
    assert [(f.id, f.status) for f in r6.changed] == [(ep.id, "closed")]
    assert book.observe([], last_step=40, now=7.0).changed == []  # closed stays closed, reported once


def test_a_later_episode_of_the_same_rank_is_a_new_finding():
    book = FindingsBook("r", close_after=5)
    first = book.observe([straggler(5, 10)], last_step=10).new[0]
    book.observe([], last_step=30)
    again = book.observe([straggler(5, 10), straggler(40, 45)], last_step=45)
    assert len(again.new) == 1 and again.new[0].id != first.id
    assert [f.step_start for f in book.current()] == [5, 40]
    # another rank is another finding
    assert len(book.observe([straggler(40, 46, rank=2)], last_step=46).new) == 1


def test_latest_per_id_reads_the_current_state_from_the_append_only_table():
    rows = [dict(id="a", t=1.0, updated=1.0, step_end=15), dict(id="a", t=1.0, updated=3.0, step_end=24),
            dict(id="a", t=1.0, updated=2.0, step_end=20), dict(id="", t=0.5, kind="old-store row")]
    got = latest_per_id(rows)
    assert [(r["id"], r.get("step_end")) for r in got] == [("", None), ("a", 24)]
