"""probes.nccl_log: NCCL_DEBUG=INFO logs from NCCL 2.5 .. 2.2x, failure lines, watchdog lines."""

from __future__ import annotations

import gzip
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from probes.nccl_log import NcclLogParser, host_pid_from_filename, parse_file, summarize

FIX = Path(__file__).parent / "fixtures" / "nccl"
ROOT = Path(__file__).resolve().parent.parent


def events(name: str, **kw):
    return list(parse_file(str(FIX / name), **kw))


def by_cat(evs, cat):
    return [e for e in evs if e.category == cat]


# ---------------------------------------------------------------------------
# Formats across versions
# ---------------------------------------------------------------------------


def test_old_25_socket_log():
    evs = events("v25_socket.log")
    v = by_cat(evs, "version")
    assert [e.fields["version"] for e in v] == ["2.5.6", "2.5.6"]  # bare stdout line + prefixed line
    assert v[1].host == "trn-07" and v[1].pid == 31337 and v[1].fields["cuda"] == "10.1"
    nets = by_cat(evs, "net")
    assert nets[0].transport == "NET/Socket" and "eth0" in nets[0].fields["devices"]
    ring = [e for e in by_cat(evs, "ring") if "prev" in e.fields]
    assert [(e.rank, e.fields["prev"], e.fields["next"], e.fields["channels"]) for e in ring] == [(0, 1, 1, [0, 1])]
    tr = by_cat(evs, "transport")
    assert {(e.rank, e.peer, e.transport, e.fields["direction"]) for e in tr} == {
        (0, 1, "NET/Socket", "receive"), (0, 1, "NET/Socket", "send")}
    # The second channel of each connection folds into the first event's channel list.
    assert sorted(len(e.fields["channels"]) for e in tr) == [2, 2]
    init = by_cat(evs, "init")[0]
    assert (init.rank, init.nranks, init.fields["busId"], init.fields["phase"]) == (0, 2, "1000", "Init COMPLETE")
    sock = [e for e in evs if e.error_class == "socket"]
    assert sock[0].fields["peer_addr"] == "10.1.0.6<43211>" and sock[0].fields["reason"] == "Connection refused"
    assert sock[0].rank == 0  # known from the comm line printed earlier by the same process
    assert sock[1].fields["peer_addr"] == "10.1.0.6<52314>"
    traces = [e for e in evs if e.error_class == "call_trace"]
    assert [e.fields["result"] for e in traces][:2] == ["ncclSystemError", "ncclSystemError"]


def test_27_ib_log_with_old_completion_error():
    evs = events("v27_ib.log")
    assert by_cat(evs, "version")[0].fields["full"] == "2.7.8+cuda11.0"
    rings = [e for e in by_cat(evs, "ring") if "order" in e.fields]
    assert len(rings) == 1 and rings[0].fields["order"] == [0, 1, 2, 3] and rings[0].fields["channels"] == [0, 1]
    tree = by_cat(evs, "tree")[0]
    assert tree.fields["trees"]["0"]["children"] == [1, 2] and tree.fields["trees"]["1"]["parent"] == 2
    tr = {(e.fields["src"], e.fields["dst"]): e for e in by_cat(evs, "transport")}
    assert tr[(3, 0)].transport == "NET/IB" and tr[(3, 0)].fields["gdrdma"] is True and tr[(3, 0)].fields["net_dev"] == 0
    assert tr[(0, 1)].transport == "P2P/IPC"
    ib = [e for e in evs if e.error_class == "ib_completion"][0]
    assert (ib.fields["status"], ib.fields["status_name"], ib.fields["vendor_err"]) == (12, "IBV_WC_RETRY_EXC_ERR", 129)
    assert ib.rank == 0 and ib.host == "gpu-a01"


def test_218_ib_log():
    evs = events("v218_ib.log")
    inits = by_cat(evs, "init")
    start = inits[0]
    assert start.fields["phase"] == "Init START" and start.comm_id == "0x7c1b9f0e4d2a6b31"
    assert (start.rank, start.nranks, start.fields["cudaDev"], start.fields["nvmlDev"], start.fields["busId"]) == (3, 16, 3, 3, "4e000")
    tr = by_cat(evs, "transport")
    pxn = [e for e in tr if e.fields.get("pxn")]
    assert len(pxn) == 1 and pxn[0].peer == 13 and pxn[0].fields["proxy_rank"] == 5 and pxn[0].fields["net_dev"] == 2
    recv = [e for e in tr if e.fields.get("direction") == "receive" and e.peer == 11][0]
    assert recv.rank == 3 and recv.comm_id == "0x7c1b9f0e4d2a6b31" and recv.fields["gdrdma"]
    p2p = [e for e in tr if e.transport == "P2P/IPC"]
    assert len(p2p) == 1 and p2p[0].fields["channels"] == [0, 1] and p2p[0].fields["read"]
    ib = [e for e in evs if e.error_class == "ib_completion"][0]
    assert ib.fields["peer_addr"] == "10.0.0.11<38745>" and ib.fields["status"] == 12 and ib.fields["op"] == "Send"
    assert ib.fields["remote_gid"] == "::ffff:10.0.0.11"
    ibv = [e for e in evs if e.error_class == "ibv_failure"][0]
    assert ibv.fields["call"] == "ibv_modify_qp" and "timed out" in ibv.fields["detail"]
    assert [e for e in evs if e.error_class == "ib_async"][0].fields["event"] == "port error"
    # The smaller communicator (nranks 8) does not change the process's world rank.
    assert all(e.rank == 3 for e in evs if e.category == "error")


def test_22x_log_with_newer_prefixes():
    evs = events("v226_newprefix.log")
    init = [e for e in by_cat(evs, "init") if e.fields.get("phase") == "Init COMPLETE"][0]
    assert init.fields["api"] == "ncclCommInitRankConfig" and init.comm_id == "0x9f3e2d1c0b4a5968"
    timing = [e for e in by_cat(evs, "init") if "init_time_s" in e.fields][0]
    assert timing.fields["init_time_s"] == 1.94 and timing.fields["t_bootstrap"] == 0.83
    # "comm 0x.. rank 0 nRanks 8 nNodes 1 ..." carries no commId: mapped back through the pointer.
    nodes = [e for e in by_cat(evs, "init") if "nNodes" in e.fields][0]
    assert nodes.comm_id == "0x9f3e2d1c0b4a5968" and nodes.fields["localRanks"] == 8
    kinds = {e.transport for e in by_cat(evs, "transport")}
    assert {"P2P/CUMEM", "P2P/direct", "SHM", "NVLS", "CollNet"} <= kinds
    rings = [e for e in by_cat(evs, "ring") if "order" in e.fields]
    assert rings[0].comm_id == "0x9f3e2d1c0b4a5968" and rings[0].fields["nchannels"] == 24
    plugins = {e.fields["plugin"] for e in by_cat(evs, "plugin")}
    assert plugins == {"net", "tuner", "profiler"}
    # Timestamped WARN lines (NCCL_DEBUG_TIMESTAMP_FORMAT) carry a time; INFO lines do not.
    proxy = [e for e in evs if e.error_class == "proxy"][0]
    assert proxy.peer == 5 and proxy.fields["result"] == "ncclRemoteError" and proxy.t is not None
    assert by_cat(evs, "version")[0].t is None
    oom = [e for e in evs if e.error_class == "cuda"][0]
    assert oom.fields["cuda_error"] == "out of memory" and oom.fields["cuda_code"] == 2
    ib = [e for e in evs if e.error_class == "ib_completion"][0]
    assert ib.fields["hca"] == "mlx5_0" and ib.fields["status"] == 12
    abort = [e for e in evs if e.error_class == "abort"][0]
    assert abort.category == "error" and abort.fields["phase"] == "Abort COMPLETE"


def test_failure_lines_are_classified():
    evs = events("failures_multihost.log")
    cls = [(e.host, e.rank, e.error_class) for e in evs if e.category == "error"]
    assert ("node-a", 0, "socket") in cls and ("node-b", 2, "cuda") in cls
    assert ("node-b", 2, "ibv_failure") in cls and ("node-a", 0, "bootstrap") in cls
    assert ("node-a", 0, "timeout") in cls and ("node-b", 2, "abort") in cls
    torch_errs = {e.error_class for e in evs if e.fields.get("source") == "torch"}
    assert {"system", "remote", "cuda"} <= torch_errs
    sys_err = [e for e in evs if e.error_class == "system"][0]
    assert sys_err.fields["nccl_version"] == "2.21.5" and "ProcessGroupNCCL.cpp" in sys_err.fields["where"]
    accept = [e for e in evs if e.error_class == "socket" and "accept" in e.message][0]
    assert accept.fields["reason"] == "Too many open files"
    assert [e.message for e in by_cat(evs, "warn")] == ["Unknown warning the parser has never seen"]
    assert "something new" in by_cat(evs, "unclassified")[0].message


def test_watchdog_lines():
    evs = events("torchrun_watchdog.log")
    wd = [e for e in by_cat(evs, "watchdog") if "SeqNum" in e.fields]
    assert [(e.rank, e.fields["SeqNum"], e.fields["OpType"], e.fields.get("NumelIn"), e.fields["Timeout(ms)"],
             e.fields["ran_for_ms"]) for e in wd] == [
        (3, 1234, "ALLREDUCE", 1048576, 600000, 600012),
        (5, 1234, "_ALLGATHER_BASE", 4096, 1800000, 1800094),
        (1, 77, "BROADCAST", None, 1800000, 1800521),
    ]
    progress = [e for e in by_cat(evs, "watchdog") if "last_completed" in e.fields]
    assert [(e.rank, e.fields["seq"], e.fields["last_enqueued"], e.fields["last_completed"]) for e in progress] == [
        (3, 1234, 1235, 1233), (3, 1234, 1235, 1233)]
    # Launcher-prefixed NCCL lines ("[default3]:host:pid:tid [3] NCCL INFO") still parse.
    assert by_cat(evs, "version")[0].host == "dgx-c02"
    assert [e.message for e in by_cat(evs, "unclassified")][0].endswith("step 120 loss 2.3141 lr 3.0e-4")


# ---------------------------------------------------------------------------
# Robustness
# ---------------------------------------------------------------------------


def test_garbage_never_raises_and_is_kept_unclassified():
    evs = events("garbage.log")
    assert evs and all(e.category in ("unclassified", "ring") for e in evs)
    assert len(by_cat(evs, "unclassified")) > 20
    assert evs[-1].message == "broken-host:99:"  # the truncated last line, flushed at EOF
    # Random bytes in random chunk sizes, including split multi-byte sequences and \r.
    rng = random.Random(5)
    for _ in range(30):
        blob = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 3000)))
        blob += b"\r\nh:1:2 [0] NCCL WARN \xff\xfe NET/IB : Got completion from peer \n" + blob[:50]
        p = NcclLogParser()
        i = 0
        while i < len(blob):
            n = rng.randint(1, 700)
            p.feed(blob[i : i + n])
            i += n
        p.close()


def test_chunking_does_not_change_events():
    raw = b"".join((FIX / n).read_bytes() for n in ("v218_ib.log", "v226_newprefix.log", "torchrun_watchdog.log"))
    whole = NcclLogParser(source_file="x")
    a = whole.feed(raw) + whole.close()
    for size in (1, 7, 64, 333):
        p = NcclLogParser(source_file="x")
        b = []
        for i in range(0, len(raw), size):
            b += p.feed(raw[i : i + size])
        b += p.close()
        assert [(e.line_no, e.category, e.error_class, e.rank, e.peer, e.message) for e in b] == [
            (e.line_no, e.category, e.error_class, e.rank, e.peer, e.message) for e in a]
        assert p.bytes_parsed == len(raw) and p.pending_bytes == 0


def test_tailer_offsets_with_partial_lines(tmp_path: Path):
    """A tailer keeps the offset of complete lines: resuming there loses and repeats nothing."""
    raw = (FIX / "v218_ib.log").read_bytes()
    cut = len(raw) // 2 + 5  # mid-line
    p = NcclLogParser()
    first = p.feed(raw[:cut])
    offset = cut - p.pending_bytes
    assert raw[offset - 1 : offset] == b"\n"
    # "restart": a new parser from the saved offset
    q = NcclLogParser()
    second = q.feed(raw[offset:]) + q.close()
    full = NcclLogParser()
    allev = full.feed(raw) + full.close()
    assert [e.message for e in first + second] == [e.message for e in allev]


def test_unknown_version_is_parsed_with_a_note():
    p = NcclLogParser()
    evs = p.feed(b"h:1:1 [0] NCCL INFO NCCL version 3.1.0+cuda13.0\n"
                 b"h:1:2 [0] NCCL INFO comm 0x1 rank 0 nranks 2 cudaDev 0 busId 1000 commId 0x2 - Init COMPLETE\n")
    assert evs[0].category == "version" and "outside" in evs[0].fields["note"]
    assert p.notes and evs[1].category == "init" and evs[1].rank == 0


def test_coll_lines_are_folded_or_emitted():
    lines = b"".join(
        b"h:1:1 [0] NCCL INFO AllReduce: opCount %x sendbuff 0x1 recvbuff 0x1 count %d datatype 7 op 0 root 0 comm 0xabc [nranks=4] stream 0x9\n"
        % (i, 100 + i) for i in range(50))
    p = NcclLogParser()
    assert p.feed(lines) == []
    assert p.collective_lines == 50
    assert p.collective_counts == {("h", 1, "0xabc"): 50}
    assert p.last_collective[("h", 1, "0xabc")]["opCount"] == 49
    q = NcclLogParser(emit_collectives=True)
    evs = q.feed(lines)
    assert len(evs) == 50 and evs[-1].fields["count"] == 149 and evs[-1].category == "collective"


def test_no_first_word_recogniser_is_shadowed_by_an_earlier_one():
    # FIRST_WORDS is tried in order: an entry whose word starts with an earlier entry's word never runs.
    from probes.nccl_log.info import FIRST_WORDS

    words = [w for w, _ in FIRST_WORDS]
    for k, w in enumerate(words):
        assert not [e for e in words[:k] if w.startswith(e)], w


def test_host_pid_from_nccl_debug_file_name():
    assert host_pid_from_filename("/logs/nccl.node01.12345") == ("node01", 12345)
    assert host_pid_from_filename("nccl.gpu-a7.99.log") == ("gpu-a7", 99)
    assert host_pid_from_filename("whatever.log") == ("", 0)


# ---------------------------------------------------------------------------
# Whole log sets and the CLI
# ---------------------------------------------------------------------------


def test_summarize_log_set(tmp_path: Path):
    gz = tmp_path / "v27_ib.log.gz"
    gz.write_bytes(gzip.compress((FIX / "v27_ib.log").read_bytes()))
    paths = [str(FIX / "v218_ib.log"), str(FIX / "failures_multihost.log"), str(gz), str(tmp_path / "missing.log")]
    s = summarize(paths)
    assert set(s["file_errors"]) == {str(tmp_path / "missing.log")}
    assert len(s["files"]) == 3
    assert set(s["versions"]) == {"2.18.5+cuda12.2", "2.21.5+cuda12.4", "2.7.8+cuda11.0"}
    assert s["hosts"]["node-a"]["ranks"] == [0] and s["hosts"]["node-b"]["ranks"] == [2]
    c = s["comms"]["0xabcdef0123456789"]
    assert c["nranks"] == 4 and c["ranks_seen"] == [0, 2] and c["init_complete"] == [0, 2]
    big = s["comms"]["0x7c1b9f0e4d2a6b31"]
    assert big["trees"]["2"]["3"]["children"] == [4, 11]
    # old NCCL: the topology printed before "comm ... Init COMPLETE" is attached to that comm
    old = s["comms"]["0x7f1c8c000e00"]
    assert old["rings"] == {"0": [0, 1, 2, 3], "1": [0, 1, 2, 3]} and old["nchannels"] == 2
    pair = [t for t in s["transports"] if t["comm_id"] == "0x7f1c8c000e00" and (t["src"], t["dst"]) == (3, 0)][0]
    assert pair["transport"] == "NET/IB" and pair["channels"] == [0, 1] and pair["gdrdma"]
    assert s["transport_counts"]["NET/IB"] >= 4
    classes = s["error_classes"]
    assert classes["ib_completion"] == 2 and classes["socket"] == 2
    ib = [e for e in s["errors"] if e["error_class"] == "ib_completion" and e["host"] == "dgx-b07"][0]
    assert ib["rank"] == 3 and ib["peer_addr"] == "10.0.0.11<38745>" and ib["status_name"] == "IBV_WC_RETRY_EXC_ERR"
    assert s["collectives"]["dgx-b07:91234:0x55d1e8a3c0e0"]["count"] == 2
    json.dumps(s)  # the whole summary is JSON-serialisable


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "cli.main", "nccl-log", *args], capture_output=True, text=True,
                          cwd=str(ROOT), timeout=120)


def test_cli_json_and_tables(tmp_path: Path):
    missing = str(tmp_path / "nope.log")
    r = _cli("--json", str(FIX / "torchrun_watchdog.log"), str(FIX / "v226_newprefix.log"), missing)
    assert r.returncode == 0, r.stderr
    assert f"cannot read {missing}" in r.stderr
    s = json.loads(r.stdout)
    assert len(s["watchdog"]) == 5 and {w["rank"] for w in s["watchdog"]} == {1, 3, 5}
    assert s["comms"]["0x9f3e2d1c0b4a5968"]["init_time_s"] == {"0": 1.94}
    r = _cli(str(FIX / "v218_ib.log"))
    assert r.returncode == 0, r.stderr
    for text in ("2.18.5+cuda12.2", "NET/IB", "ib_completion", "IBV_WC_RETRY_EXC_ERR", "dgx-b07"):
        assert text in r.stdout
    r = _cli(missing, str(tmp_path))
    assert r.returncode == 1
    assert r.stderr.count("cannot read") == 2


@pytest.mark.parametrize("name", sorted(p.name for p in FIX.glob("*.log")))
def test_every_fixture_parses_line_for_line(name):
    raw = (FIX / name).read_bytes()
    p = NcclLogParser()
    p.feed(raw)
    p.close()
    assert p.line_no == raw.count(b"\n") + (0 if raw.endswith(b"\n") else 1)


def test_truncated_and_corrupt_gzip_logs(tmp_path: Path):
    raw = (FIX / "v218_ib.log").read_bytes()
    cut = tmp_path / "cut.log.gz"
    cut.write_bytes(gzip.compress(raw)[:-30])
    bad = tmp_path / "bad.log.gz"
    bad.write_bytes(b"\x1f\x8b\x08\x00 not really gzip")
    s = summarize([str(cut), str(bad)])
    # What could be decompressed is used; both problems are reported per file.
    assert s["files"] == [str(cut)] and 0 < s["lines"] <= raw.count(b"\n")
    assert set(s["file_errors"]) == {str(cut), str(bad)}
    assert "2.18.5+cuda12.2" in s["versions"]


def test_prime_restores_ranks_after_a_restart():
    raw = (FIX / "v218_ib.log").read_bytes()
    cut = raw.index(b"dgx-b07:91234:92011 [3] NCCL WARN")  # all comm lines come before this
    fresh = NcclLogParser()
    assert all(e.rank is None for e in fresh.feed(raw[cut:]) if e.category == "error")
    p = NcclLogParser()
    p.line_no = raw[:cut].count(b"\n")
    p.prime(raw[:cut])
    assert p.line_no == raw[:cut].count(b"\n") and p.bytes_parsed == 0
    errs = [e for e in p.feed(raw[cut:]) if e.category == "error"]
    assert errs and all(e.rank == 3 for e in errs)
    assert errs[0].line_no == raw[:cut].count(b"\n") + 1
