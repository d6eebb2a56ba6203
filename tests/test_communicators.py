"""Issue 15: the communicator table. A process group's members are stored once (``CommunicatorRecord``, keyed by a
stable ``comm_id``); collective records name their group by that id and travel packed; the store, the loader and
the head's live window give the analyzers every record's members as before. Dedupe of collectives is bounded by
ranks x groups (``CollectiveIndex``), not by records, and exact."""

from __future__ import annotations

import numpy as np
from opentelemetry.sdk.resources import Resource

from analyzers.loader import RunData
from head.service import Head
from head.store.dedupe import CollectiveIndex
from ranksight import schema, wire
from ranksight.tables import read_table

RUN = "cm"
WORLD = list(range(8))
IDS = {g: schema.communicator_id(g, WORLD) for g in ("dp", "world")}


def coll(rank, seq, group="dp", members=None, attempt=0, step=None):
    kw = dict(group_ranks=members) if members is not None else dict(comm_id=IDS[group])
    return schema.CollectiveRecord(run_id=RUN, rank=rank, step=seq if step is None else step, seq=seq,
                                   op="all_reduce", group=group, nbytes=1 << 20, t_arrive=100.0 + seq,
                                   t_done=100.1 + seq, duration_ms=100.0, attempt=attempt, **kw)


def comm(group):
    return schema.CommunicatorRecord(run_id=RUN, comm_id=IDS[group], group=group, ranks=WORLD, rank=0)


def request(colls, comms=()):
    res = Resource.create({})
    recs = []
    packed = wire.pack_records("collective", RUN, colls)
    if packed is not None:
        recs.append(wire.make_log_record(RUN, "collective", packed[1], node=0, count=len(colls), layout=packed[0],
                                         resource=res))
    else:
        recs.append(wire.make_log_record(RUN, "collective", wire.join_array([schema.encode(c) for c in colls]),
                                         node=0, count=len(colls), resource=res))
    if comms:
        recs.append(wire.make_log_record(RUN, "communicator", wire.join_array([schema.encode(c) for c in comms]),
                                         node=0, count=len(comms), resource=res))
    from opentelemetry.exporter.otlp.proto.common._log_encoder import encode_logs

    return encode_logs(recs)


def test_the_id_is_the_same_on_every_member_and_differs_by_group_members_and_attempt():
    assert schema.communicator_id("dp", [3, 1, 2]) == schema.communicator_id("dp", [1, 2, 3])
    assert len({schema.communicator_id("dp", [0, 1]), schema.communicator_id("tp", [0, 1]),
                schema.communicator_id("dp", [0, 2]), schema.communicator_id("dp", [0, 1], attempt=1)}) == 4


def test_records_without_members_travel_packed_and_records_with_members_as_json():
    assert wire.pack_records("collective", RUN, [coll(0, 0), coll(1, 0)]) is not None
    assert wire.pack_records("collective", RUN, [coll(0, 0), coll(1, 0, members=WORLD)]) is None


def test_the_head_stores_ids_and_members_once_and_the_loader_attaches_them(tmp_path):
    h = Head(tmp_path / "store", "t")
    try:
        colls = [coll(r, s, g) for s in range(3) for r in WORLD for g in ("dp", "world")]
        acc, rej, msg = h.ingest.logs(request(colls, [comm("dp"), comm("world")]))
        assert rej == 0, msg
        # an agent re-sending all of it (no acknowledgement reached it): nothing stored twice
        h.ingest.logs(request(colls, [comm("dp"), comm("world")]))
        h.store.flush_all()
        live = h.live.run(RUN).run_data()
        assert len(live.collectives) == 48 and all(len(m) == 8 for m in live.collectives["group_ranks"])
    finally:
        h.close()
    stored = read_table(tmp_path / "store", RUN, "collectives")
    assert len(stored) == 48 and set(map(len, stored["group_ranks"])) == {0}  # members not repeated per record
    assert len(read_table(tmp_path / "store", RUN, "communicators")) == 2
    # what the loader does with the stored tables (load_run reads these two files the same way)
    data = RunData(run_id=RUN, collectives=stored,
                   communicators=read_table(tmp_path / "store", RUN, "communicators"))
    assert all(list(m) == WORLD for m in data.collectives["group_ranks"])
    keys = set(data.collectives["gkey"])
    assert keys == {f"dp[{','.join(map(str, WORLD))}]", f"world[{','.join(map(str, WORLD))}]"}
    # one shared members object per communicator (the live window's fast group keys rely on it)
    dp = data.collectives[data.collectives["group"] == "dp"]["group_ranks"]
    assert len({id(m) for m in dp}) == 1


def test_older_records_with_their_lists_and_ids_without_a_communicator_still_load():
    old = [coll(r, 0, members=[0, 1]) for r in (0, 1)]
    orphan = [coll(r, 1) for r in (0, 1)]  # its communicator's writer was lost
    data = RunData.from_records(RUN, old + orphan)
    co = data.collectives.sort_values(["seq", "rank"])
    assert [list(m) for m in co["group_ranks"]] == [[0, 1], [0, 1], [], []]


def test_collective_dedupe_is_exact_and_bounded_by_groups_not_records():
    idx = CollectiveIndex()
    rows = [coll(r, s, g) for r in range(4) for g in ("dp", "world") for s in range(100)]
    assert len(idx.new_rows(rows)) == 800
    assert idx.new_rows(rows[:10]) == []  # seen
    assert len(idx) == 8  # (rank, attempt, group) ranges, not 800 keys
    # a restart's new attempt, a gap, a late lower seq, a pipeline link group: all exact
    link = schema.CollectiveRecord(run_id=RUN, rank=1, step=0, seq=0, op="send", group="pp:1>2", t_arrive=1.0)
    more = [coll(0, 5, attempt=1), coll(0, 200), coll(0, 150), coll(0, 150), link, link]
    got = idx.new_rows(more)
    assert [(r.attempt, r.seq, r.group) for r in got] == [(1, 5, "dp"), (0, 200, "dp"), (0, 150, "dp"),
                                                          (0, 0, "pp:1>2")]
    assert idx.new_rows([coll(0, 150), coll(0, 175)]) == [coll(0, 175)]
    # the packed path agrees with the rows path
    lay, body = wire.pack_records("collective", RUN, [coll(2, 100), coll(2, 99), coll(2, 101)])
    arr = np.frombuffer(body, dtype=wire.packed_layout_of("collective", lay).dtype)
    assert idx.new_packed(arr, wire.packed_layout_of("collective", lay)).tolist() == [True, False, True]
