"""logs.readers.nccl: NCCL_DEBUG logs (2.5 .. 2.28), launcher prefixes, PyTorch watchdog lines, ncclras reports."""

from __future__ import annotations

import time
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from logs import analyze
from logs.inputs import InputFile
from logs.readers import nccl as reader
from probes.nccl_log import parse_file
from probes.nccl_log.failures import magic_ascii
from fuzz_settings import fuzz_settings

FIX = Path(__file__).parent / "fixtures" / "logs" / "nccl"


def run(*names):
    return analyze([str(FIX / n) for n in names])


def by_kind(rep, kind):
    return [f for f in rep.findings if f.kind == kind]


def err(rep, cls, kind):
    return [f for f in by_kind(rep, "nccl_error") if f.evidence.get("class") == cls and f.evidence.get("kind") == kind]


def test_sniff_and_no_raw_lines():
    assert reader.sniff(b"x:1:2 [0] NCCL INFO hi\n") and not reader.sniff(b"\x00\x01 plain training log\n")
    rep = run("v228_torchrun_ts.log")
    for f in rep.findings:
        assert "Epoch 1" not in str(f.evidence)  # the progress bar is counted, never echoed
    assert rep.inputs[0].unknown_lines == 1


def test_legacy_25_prefixes_trace_and_socket_fallback():
    rep = run("v25_legacy_socket.log")
    sock = err(rep, "socket", "connect_failed")[0]
    assert sock.ranks == [0] and sock.hosts == ["trn-01"] and sock.evidence["peers"] == ["10.1.0.6<43211>"]
    assert sock.evidence["nccl_source"] == ["include/socket.h:403"]
    assert sock.evidence["call_trace"] == ["bootstrap.cc:95 -> ncclSystemError", "init.cc:696 -> ncclSystemError"]
    ib = err(rep, "ib_completion", "IBV_WC_RETRY_EXC_ERR")[0]
    assert ib.severity == "critical" and ib.evidence["status"] == "12" and ib.evidence["vendor_err"] == "129"
    fb = by_kind(rep, "network_fallback")[0]
    assert fb.severity == "warning" and fb.evidence["no_ib_device_hosts"] == ["trn-01"]
    assert fb.evidence["socket_connections"] == 1
    # "NCCL INFO Launch mode Parallel" without host:pid:tid is understood, not unknown
    assert rep.inputs[0].unknown_lines == 0


def test_218_srun_prefixes_ib_errors_qp_and_mr():
    rep = run("v218_ib_srun.log")
    ib = err(rep, "ib_completion", "IBV_WC_RETRY_EXC_ERR")[0]
    assert ib.ranks == [2] and ib.hosts == ["dgx-01"] and ib.gpus == ["dgx-01:0"]
    assert ib.evidence["call_trace"] == ["transport/net.cc:1134 -> ncclRemoteError", "proxy.cc:679 -> ncclRemoteError"]
    assert "NCCL_IB_TIMEOUT" in ib.recommendation
    qp = err(rep, "ibv_failure", "qp_setup")[0]
    assert qp.ranks == [3] and qp.evidence["call"] == "ibv_modify_qp" and qp.evidence["errno"] == "110"
    mr = err(rep, "ibv_failure", "mr_registration")[0]
    assert mr.ranks == [3] and "ulimit" in mr.recommendation
    topo = by_kind(rep, "topology")[0]
    assert topo.severity == "info" and topo.evidence["nodes"] == 2 and topo.evidence["ranks_seen"] == 4
    assert topo.evidence["bootstrap_interfaces"] == ["ib0"] and topo.evidence["transports"] == {"NET/IB": 4}
    assert topo.evidence["nics"] == ["mlx5_0:1/IB", "mlx5_1:1/IB"] and topo.evidence["gdrdma_connections"] == 4
    assert "healthy" not in topo.summary
    assert rep.inputs[0].unknown_lines == 1  # "step 120 loss 2.31"


def test_228_timestamps_func_empty_host_magic_oom_ray_ansi_quote():
    rep = run("v228_torchrun_ts.log")
    ib = err(rep, "ib_completion", "IBV_WC_REM_ACCESS_ERR")[0]
    assert ib.hosts == ["gpu-a"] and ib.evidence["hca"] == "mlx5_2" and ib.evidence["first_t"] is not None
    assert ib.evidence["call_trace"] == ["transport/net.cc:1298 -> ncclRemoteError"]
    magic = err(rep, "socket", "wrong_magic")[0]
    assert magic.evidence["magic_ascii"] == "GET / HT" and magic.ranks == [1]
    assert magic_ascii(0x564AB9F2FC4B9D6C) == "l.K...JV"
    oom = err(rep, "cuda", "out_of_memory")[0]
    assert oom.evidence["count"] == 2 and oom.ranks == [1] and oom.evidence["bytes"] == "2097152"
    gdr = [f for f in by_kind(rep, "network_fallback") if "gdr_disabled" in f.evidence][0]
    assert gdr.hosts == ["gpu-b"] and gdr.evidence["gdr_disabled"] == ["gpu-b:mlx5_0"]
    evs = list(parse_file(str(FIX / "v228_torchrun_ts.log")))
    hosts = {e.host for e in evs if e.category != "unclassified"}
    assert "gpu-a" in hosts and "" not in {e.host for e in evs if e.pid == 7001}
    assert [e.fields.get("launcher_rank") for e in evs if e.category == "init"][:2] == [1, 0]


def test_healthy_init_is_info_only():
    rep = run("v221_healthy.log")
    assert {f.severity for f in rep.findings} == {"info"}
    topo = by_kind(rep, "topology")[0]
    assert "healthy init" in topo.summary
    assert topo.evidence["nodes"] == 2 and topo.evidence["world_size"] == 16 and topo.evidence["ranks_seen"] == 16
    assert topo.evidence["transports"] == {"P2P/IPC": 14, "NET/IB": 2} and topo.evidence["gdrdma_connections"] == 2
    assert topo.evidence["bootstrap_interfaces"] == ["bond0"] and topo.evidence["versions"] == ["2.21.5+cuda12.4"]


def test_ras_report_behind_rank_and_dead_process():
    rep = run("ras_report.txt")
    hang = by_kind(rep, "hang")[0]
    assert hang.ranks == [15] and hang.evidence["behind_opcount"] == 4511 and hang.evidence["ahead_opcount"] == 4512
    assert hang.evidence["ranks_ahead"] == 15 and hang.hosts == ["10.9.0.2"] and hang.evidence["op"] == "AllReduce"
    dead = [f for f in by_kind(rep, "nccl_error") if "dead" in f.summary][0]
    assert dead.evidence["processes"] == ["pid 9015 on 10.9.0.2"] and dead.severity == "critical"
    assert rep.inputs[0].unknown_lines <= 1


def test_watchdog_old_format_behind_missing_and_late():
    rep = run("watchdog_old.log")
    hang = by_kind(rep, "hang")[0]
    ev = hang.evidence
    assert ev["reporting_ranks"] == [0, 1, 2, 3, 4, 5, 6] and ev["world_size"] == 8 and ev["never_reported"] == [7]
    assert ev["behind_ranks"] == [5] and ev["behind_seq"] == 311 and ev["ahead_seq"] == 312
    assert ev["late_watchdog"] == {"rank": 2, "factor": 2.5} and ev["timeout_ms"] == [600000]
    assert hang.ranks == [5] and not by_kind(rep, "collective_mismatch")


def test_watchdog_new_format_across_files_mismatch():
    rep = analyze([str(FIX / "watchdog_new")])
    mm = by_kind(rep, "collective_mismatch")[0]
    assert mm.ranks == [2] and mm.evidence["seq"] == 57 and mm.evidence["pg"] == 0
    assert mm.evidence["variants"] == [["ALLREDUCE NumelIn=1048576 NumelOut=1048576", [0, 1, 3]],
                                       ["ALLGATHER NumelIn=4096 NumelOut=16384", [2]]]
    hang = by_kind(rep, "hang")[0]
    assert hang.evidence["pg_name"] == "default_pg" and hang.evidence["pending_by_rank"] == {"0": 1, "1": 1, "2": 1, "3": 1}
    assert len(mm.inputs) == 4


@fuzz_settings(60)
@given(st.binary(max_size=4000))
def test_fuzz_random_bytes(data):
    res = reader.read(InputFile("fuzz", data))
    reader.conclude([res])
    reader.summarize([res])


_CORPUS = b"".join((FIX / n).read_bytes() for n in ("v218_ib_srun.log", "v228_torchrun_ts.log", "ras_report.txt",
                                                     "watchdog_old.log", "v25_legacy_socket.log"))


@fuzz_settings(60)
@given(st.integers(0, len(_CORPUS)), st.integers(0, len(_CORPUS)), st.binary(max_size=40), st.integers(0, 1 << 30))
def test_fuzz_cut_and_mutated_corpus(a, b, junk, pos):
    data = _CORPUS[min(a, b):max(a, b)]
    if data:
        p = pos % len(data)
        data = data[:p] + junk + data[p:]
    t0 = time.process_time()
    res = reader.read(InputFile("fuzz", data))
    reader.conclude([res])
    assert time.process_time() - t0 < 2
