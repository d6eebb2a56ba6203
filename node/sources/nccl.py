"""This host's NCCL debug logs (``RunDir.nccl_dir``, one ``NCCL_DEBUG_FILE`` per process): new complete lines,
parsed by ``probes.nccl_log.NcclLogParser`` into ``nccl`` records."""

from __future__ import annotations

import logging
import socket
import time

import msgspec

from node.outbox import Item
from node.state import AgentState
from probes.nccl_log import NcclLogParser, host_pid_from_filename
from ranksight import schema
from ranksight.layout import RunDir

log = logging.getLogger("ranksight.agent")

READ_BYTES_PER_FILE = 1024 * 1024  # per cycle, as for a spool: keeps one OTLP request well under the head's limit


class NcclLogSource:
    """Reads each of this host's logs from its committed ``[offset, line_no, inode]`` (``AgentState.nccl``), at
    most ``READ_BYTES_PER_FILE`` per file and cycle. Line numbers are part of the head's dedupe key, so they are
    saved with the offset and stay stable across restarts; a file rotated or truncated is read again from the
    start (the head drops what it already has). Logs named after another host (a shared file system) are
    skipped: this node's hosts are the agent's, this machine's and the manifest's for this node."""

    def __init__(self, rd: RunDir, node: int, host: str, state: AgentState):
        self.rd = rd
        self.node = node
        self.host = host
        self.state = state
        self._parsers: dict[str, NcclLogParser] = {}  # file name -> its parser, kept for the state it carries
        self._pending: dict[str, list[int]] = {}

    def _local_hosts(self) -> set[str]:
        hosts = {self.host, socket.gethostname()}
        m = schema.read_manifest(self.rd.manifest)
        if m is not None:
            hosts |= {p.host for p in m.ranks if p.node == self.node}
        return hosts

    def collect(self) -> list[Item]:
        self._pending = {}
        d = self.rd.nccl_dir
        if not d.is_dir():
            return []
        hosts = self._local_hosts()
        events = []
        for p in sorted(d.iterdir()):
            if p.name.startswith(".") or not p.is_file():
                continue
            fhost, _ = host_pid_from_filename(p.name)
            if fhost and fhost not in hosts:
                continue  # another node's log (a shared file system)
            off, line_no, ino = (list(self.state.nccl.get(p.name) or []) + [0, 0, 0])[:3]
            try:
                st = p.stat()
                if ino and (st.st_ino != ino or st.st_size < off):
                    off, line_no = 0, 0  # rotated or truncated: read it again (the head dedupes)
                if st.st_size <= off:
                    continue
                with open(p, "rb") as f:
                    f.seek(off)
                    data = f.read(READ_BYTES_PER_FILE)
            except OSError as e:
                log.warning("agent: cannot read NCCL log %s: %s", p, e)
                continue
            end = data.rfind(b"\n")
            if end < 0:
                continue
            parser = self._parsers.get(p.name)
            if parser is None or parser.line_no != line_no:
                parser = self._parsers[p.name] = NcclLogParser(source_file=p.name)
                parser.line_no = line_no  # line numbers are part of the dedupe key: keep them stable
            try:
                evs = parser.feed(data[: end + 1])
            except Exception as e:  # the parser promises not to raise; never let it stop shipping
                log.error("agent: NCCL parser failed on %s: %s", p, e)
                evs = []
            events.extend(evs)
            self._pending[p.name] = [off + end + 1, parser.line_no, st.st_ino]
        if not events:
            return []
        return [Item(kind="nccl", body=msgspec.json.encode(events), count=len(events), t_first=time.time())]

    def commit(self, acknowledged: bool) -> bool:
        had = bool(self._pending)
        self.state.nccl.update(self._pending)
        self._pending = {}
        return had
