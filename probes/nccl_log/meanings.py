"""What NCCL's failures mean and what to do next: the words a finding gives a person.

IB completion statuses are ``enum ibv_wc_status`` (rdma-core's verbs.h; NCCL prints them by number, and by name
from 2.28 on: NVIDIA/nccl src/misc/ibvwrap.cc ibvWcStatusStr). The meanings follow the verbs documentation
(``ibv_poll_cq(3)``); the advice follows NCCL's own hints (src/transport/net_ib/common.h printIbWcStatusHint) and
its environment variables.
"""

from __future__ import annotations

# ibv_wc_status name -> (what it means, what to do)
IB_STATUS_MEANING: dict[str, tuple[str, str]] = {
    "IBV_WC_LOC_LEN_ERR": ("local length error: a posted message was longer than the receive buffer or the port's "
                           "maximum message size", "check NCCL/plugin versions match on every node (a mismatch changes "
                           "message sizes)"),
    "IBV_WC_LOC_QP_OP_ERR": ("local queue-pair operation error: a malformed work request or a QP in a bad state",
                             "update the NIC firmware/driver; report with the NCCL version if it persists"),
    "IBV_WC_LOC_PROT_ERR": ("local protection error: the NIC could not access the registered buffer (often GPU Direct "
                            "RDMA blocked by PCIe ACS)", "disable ACS on the PCIe switches or test with "
                            "NCCL_NET_GDR_LEVEL=0 (NCCL's own hint)"),
    "IBV_WC_WR_FLUSH_ERR": ("work request flushed: the queue pair had already gone to the error state, so this is a "
                            "consequence of an earlier error, not the cause", "look for the first completion error on "
                            "the same or the peer host; NICs on one instance that cannot reach each other also cause it"),
    "IBV_WC_MW_BIND_ERR": ("memory window bind error", "report with the NCCL and driver versions"),
    "IBV_WC_BAD_RESP_ERR": ("bad response from the remote side", "check the peer host's NIC and the fabric"),
    "IBV_WC_LOC_ACCESS_ERR": ("local access error: a protection error on a local buffer of an RDMA read/atomic",
                              "check GPU Direct RDMA (nvidia-peermem / dma-buf) on this host"),
    "IBV_WC_REM_INV_REQ_ERR": ("remote invalid request: the peer rejected the request (length, opcode or queue "
                               "state)", "check the peer's NCCL version and that it is still alive"),
    "IBV_WC_REM_ACCESS_ERR": ("remote access error: the peer's memory key or buffer was invalid (the peer freed or "
                              "re-registered it, or died)", "look at the peer host's log for an earlier failure"),
    "IBV_WC_REM_OP_ERR": ("remote operation error: the peer could not complete the operation",
                          "look at the peer host's log and NIC counters"),
    "IBV_WC_RETRY_EXC_ERR": ("transport retry counter exceeded: the peer did not acknowledge in time (a dead or "
                             "hung peer, a link down, or fabric congestion/packet loss)",
                             "check the peer host is alive and its link is up (ibstat, port error counters); raise "
                             "NCCL_IB_TIMEOUT (default 20, ~30 s) if the fabric is merely congested"),
    "IBV_WC_RNR_RETRY_EXC_ERR": ("receiver-not-ready retry counter exceeded: the peer posted no receive buffer in time",
                                 "the peer is stalled or dead: look at its log; check NCCL_IB_RETRY_CNT"),
    "IBV_WC_LOC_RDD_VIOL_ERR": ("local RDD violation", "report with the NCCL and driver versions"),
    "IBV_WC_REM_INV_RD_REQ_ERR": ("remote invalid RD request", "report with the NCCL and driver versions"),
    "IBV_WC_REM_ABORT_ERR": ("remote aborted the operation", "look at the peer host's log"),
    "IBV_WC_INV_EECN_ERR": ("invalid EE context number", "report with the NCCL and driver versions"),
    "IBV_WC_INV_EEC_STATE_ERR": ("invalid EE context state", "report with the NCCL and driver versions"),
    "IBV_WC_FATAL_ERR": ("fatal NIC error", "check the HCA (dmesg, firmware) and replace/reset it"),
    "IBV_WC_RESP_TIMEOUT_ERR": ("response timeout", "check the peer host and the fabric"),
    "IBV_WC_GENERAL_ERR": ("general NIC error", "check dmesg and the NIC firmware"),
}

# (error class, kind or "") -> (what it means, what to do). Looked up with the kind first, then the class alone.
CLASS_MEANING: dict[tuple[str, str], tuple[str, str]] = {
    ("ib_completion", ""): ("an InfiniBand/RoCE work completion came back with an error",
                            "check the NIC, the link and the peer host"),
    ("ib_async", ""): ("the NIC reported an asynchronous event (port down, catastrophic error)",
                       "check the HCA port state (ibstat) and dmesg on that host"),
    ("ibv_failure", "qp_setup"): ("creating or connecting an IB queue pair failed (a peer unreachable over IB, a GID/"
                                  "subnet mismatch, RoCE misconfiguration)", "check NCCL_IB_GID_INDEX / "
                                  "NCCL_IB_HCA and that the NICs of both hosts are on one reachable fabric"),
    ("ibv_failure", "mr_registration"): ("registering memory with the NIC failed (GPU Direct RDMA unavailable, "
                                         "locked-memory limit)", "check nvidia-peermem / dma-buf and `ulimit -l` "
                                         "(unlimited) on that host"),
    ("ibv_failure", ""): ("an ibverbs call failed", "check the NIC driver and rdma-core on that host"),
    ("socket", "wrong_magic"): ("something that is not an NCCL peer connected to NCCL's port (another job, a scanner, "
                                "a health check)", "bind NCCL to a private interface (NCCL_SOCKET_IFNAME) or firewall "
                                "the port range; make sure two jobs do not share a rendezvous port"),
    ("socket", "connection_closed"): ("a peer closed its socket: the remote process exited or crashed",
                                      "look for the first failure on the peer host; this one is a consequence"),
    ("socket", "connect_failed"): ("connecting to a peer failed (not listening yet, firewall, wrong interface)",
                                   "check NCCL_SOCKET_IFNAME picks an interface every host can reach"),
    ("socket", ""): ("a socket operation with a peer failed", "check the network between the hosts named"),
    ("cuda", "out_of_memory"): ("NCCL could not allocate GPU memory for its buffers",
                                "leave headroom for NCCL (smaller batch, PYTORCH_CUDA_ALLOC_CONF, fewer channels: "
                                "NCCL_MAX_NCHANNELS / NCCL_BUFFSIZE)"),
    ("cuda", ""): ("a CUDA call inside NCCL failed", "check the GPU (Xid in dmesg) and the driver"),
    ("system", "host_out_of_memory"): ("a host memory allocation failed", "check host memory and its limits"),
    ("system", ""): ("a system call or external library failed", "read the reason; often a resource limit "
                     "(/dev/shm size, open files) or a network error"),
    ("remote", ""): ("a remote process exited or there was a network error", "find the first failing rank"),
    ("internal", ""): ("NCCL reported an internal error", "report it with the NCCL version"),
    ("invalid_usage", ""): ("NCCL was called incorrectly (mismatched arguments, a destroyed communicator)",
                            "check every rank calls the same collectives with the same sizes"),
    ("proxy", ""): ("NCCL's proxy thread failed an operation for a peer", "look at the peer rank's log"),
    ("bootstrap", ""): ("NCCL's bootstrap (rendezvous over TCP) failed", "check NCCL_SOCKET_IFNAME and that every host "
                        "reaches the root's address"),
    ("timeout", ""): ("NCCL timed out waiting", "find the rank that did not arrive"),
    ("abort", ""): ("a communicator was aborted", "an abort follows another failure: find that one"),
    ("warn", ""): ("an NCCL warning of a kind this reader does not classify", "read the line at the location given"),
    ("ras_dead", ""): ("NCCL's RAS network considers job processes dead (unreachable)", "check those hosts/processes"),
    ("ras_error", ""): ("ranks of a communicator reported errors to RAS", "look at those ranks' logs"),
    ("ras_missing", ""): ("RAS got no data from some ranks/processes", "those processes may be hung or dead"),
}


def meaning(error_class: str, kind: str = "") -> tuple[str, str]:
    """(meaning, what to do) of a failure class (and kind: an ibv_wc_status name, a socket failure, ...)."""
    if error_class == "ib_completion" and kind in IB_STATUS_MEANING:
        return IB_STATUS_MEANING[kind]
    return CLASS_MEANING.get((error_class, kind)) or CLASS_MEANING.get((error_class, ""), ("", ""))
