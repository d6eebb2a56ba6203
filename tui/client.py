"""A small typed client for the head's JSON API (stdlib ``urllib`` only).

Every call either returns parsed, typed data or raises a :class:`ClientError`
subclass with a message a person can read:

- :class:`HeadUnreachable`: nothing answered (refused, timed out, DNS, reset);
- :class:`HeadError`: the head answered with an HTTP error (its ``{"error": ...}`` text);
- :class:`MalformedResponse`: it answered, but not with what the API documents.

Lists whose items are individually broken (a finding with a non-numeric step, say)
are not thrown away whole: the good items come back and the broken ones are counted
in ``Fetched.skipped`` so the TUI can say so.

Every request sends ``Authorization: Bearer <token>`` when a token is set (the head requires it on every endpoint
but ``/api/health``).
"""

from __future__ import annotations

import json
import os
import socket
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import msgspec

from ranksight import schema
from ranksight.tls import ClientTls, client_tls_from_env

DEFAULT_HEAD = "http://127.0.0.1:4318"
T = TypeVar("T")


class ClientError(Exception):
    """Anything that kept a call from returning good data."""


class HeadUnreachable(ClientError):
    pass


class HeadError(ClientError):
    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class MalformedResponse(ClientError):
    pass


@dataclass(frozen=True)
class RunSummary:
    run_id: str
    status: str = "unknown"
    start_time: float | None = None
    world_size: int | None = None
    layout: dict[str, Any] = field(default_factory=dict)
    nodes: int | None = None
    last_step: int | None = None
    last_seen: float | None = None
    ranks_live: int = 0
    steps_stored: int | None = None
    # Manifest facts the head may add to the summary (MFU peak, device). Absent -> None.
    peak_flops: float | None = None
    peak_source: str = ""
    peak_simulated: bool | None = None
    device: str = ""
    gpu_simulated: bool | None = None


@dataclass(frozen=True)
class RankState:
    rank: int
    node: int | None = None
    host: str = ""
    step: int | None = None
    attempt: int = 0
    step_ms: float | None = None
    last_seen: float | None = None
    age_s: float | None = None
    state: str = "unknown"  # the head's: waiting | running | stalled | finished
    exit_reason: str | None = None  # a finished rank's ``exit`` event reason ("finished", "evicted", an error)


@dataclass(frozen=True)
class GpuState:
    """One GPU's latest sample, as ``GET /api/runs/<id>/gpus`` serves it."""

    node: int
    gpu: int
    host: str = ""
    ranks: tuple[int, ...] = ()
    name: str = ""
    simulated: bool = False
    t: float | None = None
    age_s: float | None = None
    util_pct: float | None = None
    mem_used_bytes: float | None = None
    mem_total_bytes: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    temp_c: float | None = None
    sm_clock_mhz: float | None = None
    max_sm_clock_mhz: float | None = None
    throttle_reasons: int = 0
    throttle_names: tuple[str, ...] = ()
    throttled: bool = False  # a harmful reason (power cap, HW slowdown, thermal, power brake) is set
    ecc_sbe: int | None = None
    ecc_dbe: int | None = None
    xid_count: int = 0
    last_xid: int | None = None


@dataclass(frozen=True)
class TraceRow:
    """One rank's profiler summary of one capture window, as ``GET /api/runs/<id>/traces`` serves it. Per-step
    figures are None when the trace had no ProfilerStep annotations (no step count). On a CPU trace ``kernel_ms``
    is host op time and ``nccl_ms`` gloo/c10d time: ``device`` says which."""

    rank: int
    node: int | None = None
    step_start: int = -1
    step_end: int = -1
    steps: int | None = None
    kind: str = "periodic"  # or "ondemand" (a profile action)
    device: str = "unknown"
    wall_ms: float | None = None
    kernel_ms: float | None = None
    nccl_ms: float | None = None
    exposed_comm_ms: float | None = None
    kernel_ms_per_step: float | None = None
    nccl_ms_per_step: float | None = None
    exposed_comm_ms_per_step: float | None = None
    copy_ms_per_step: float | None = None
    idle_ms_per_step: float | None = None
    idle_share: float | None = None
    top_ops: tuple[str, ...] = ()
    truncated: bool = False
    notes: tuple[str, ...] = ()
    trace_file: str = ""

    @property
    def window(self) -> tuple:
        """The capture this row belongs to (rows of one window share it)."""
        return (self.step_start, self.step_end, self.kind)


@dataclass
class Fetched:
    """One refresh worth of data for a run."""

    run: RunSummary | None
    ranks: list[RankState]
    steps: list[schema.StepRecord]
    findings: list[schema.Finding]
    actions: list[schema.Action]
    health: dict[str, Any]
    runs: list[RunSummary] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)  # endpoint -> malformed items dropped
    gpus: list[GpuState] | None = None  # None: the head has no GPU endpoint (an older head)
    traces: list[TraceRow] | None = None  # None: not asked for, or the head has no traces endpoint
    traces_missing: bool = False  # asked for, and the head answered "no such endpoint" (an older head)


def _num(v: Any, kind: type, name: str) -> Any:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise MalformedResponse(f"{name} is {type(v).__name__}, expected a number")
    return kind(v)


def _parse_run(d: Any) -> RunSummary:
    if not isinstance(d, dict) or not isinstance(d.get("run_id"), str):
        raise MalformedResponse("run entry without a run_id")
    m = d.get("manifest") if isinstance(d.get("manifest"), dict) else {}

    def pick(key):
        return d.get(key, m.get(key))

    layout = d.get("layout") or m.get("layout") or {}
    if not isinstance(layout, dict):
        raise MalformedResponse("run layout is not an object")
    ps = pick("peak_simulated")
    gs = pick("gpu_simulated")
    return RunSummary(
        run_id=d["run_id"], status=str(d.get("status") or "unknown"),
        start_time=_num(pick("start_time"), float, "start_time"),
        world_size=_num(d.get("world_size"), int, "world_size"), layout=layout,
        nodes=_num(pick("nodes"), int, "nodes"), last_step=_num(d.get("last_step"), int, "last_step"),
        last_seen=_num(d.get("last_seen"), float, "last_seen"), ranks_live=_num(d.get("ranks_live"), int, "ranks_live") or 0,
        steps_stored=_num(d.get("steps_stored"), int, "steps_stored"),
        peak_flops=_num(pick("peak_flops"), float, "peak_flops"), peak_source=str(pick("peak_source") or ""),
        peak_simulated=None if ps is None else bool(ps), device=str(pick("device") or ""),
        gpu_simulated=None if gs is None else bool(gs))


def _parse_rank(d: Any) -> RankState:
    if not isinstance(d, dict) or "rank" not in d:
        raise MalformedResponse("rank entry without a rank")
    return RankState(rank=_num(d["rank"], int, "rank"), node=_num(d.get("node"), int, "node"), host=str(d.get("host") or ""),
                     step=_num(d.get("step"), int, "step"), attempt=_num(d.get("attempt"), int, "attempt") or 0,
                     step_ms=_num(d.get("step_ms"), float, "step_ms"), last_seen=_num(d.get("last_seen"), float, "last_seen"),
                     age_s=_num(d.get("age_s"), float, "age_s"), state=str(d.get("state") or "unknown"),
                     exit_reason=None if d.get("exit_reason") is None else str(d["exit_reason"]))


def _parse_gpu(d: Any) -> GpuState:
    if not isinstance(d, dict) or "node" not in d or "gpu" not in d:
        raise MalformedResponse("gpu entry without node and gpu")
    ranks = d.get("ranks") or []
    names = d.get("throttle_names") or []
    if not isinstance(ranks, list) or not isinstance(names, list):
        raise MalformedResponse("gpu ranks/throttle_names are not lists")
    f = lambda k: _num(d.get(k), float, k)  # noqa: E731
    return GpuState(
        node=_num(d["node"], int, "node"), gpu=_num(d["gpu"], int, "gpu"), host=str(d.get("host") or ""),
        ranks=tuple(_num(r, int, "ranks") for r in ranks), name=str(d.get("name") or ""),
        simulated=bool(d.get("simulated")), t=f("t"), age_s=f("age_s"), util_pct=f("util_pct"),
        mem_used_bytes=f("mem_used_bytes"), mem_total_bytes=f("mem_total_bytes"), power_w=f("power_w"),
        power_limit_w=f("power_limit_w"), temp_c=f("temp_c"), sm_clock_mhz=f("sm_clock_mhz"),
        max_sm_clock_mhz=f("max_sm_clock_mhz"), throttle_reasons=_num(d.get("throttle_reasons"), int, "throttle_reasons") or 0,
        throttle_names=tuple(str(n) for n in names), throttled=bool(d.get("throttled")),
        ecc_sbe=_num(d.get("ecc_sbe"), int, "ecc_sbe"), ecc_dbe=_num(d.get("ecc_dbe"), int, "ecc_dbe"),
        xid_count=_num(d.get("xid_count"), int, "xid_count") or 0, last_xid=_num(d.get("last_xid"), int, "last_xid"))


def _parse_trace(d: Any) -> TraceRow:
    if not isinstance(d, dict) or "rank" not in d:
        raise MalformedResponse("trace entry without a rank")
    ops = d.get("top_ops") or []
    notes = d.get("notes") or []
    if not isinstance(ops, list) or not isinstance(notes, list):
        raise MalformedResponse("trace top_ops/notes are not lists")
    f = lambda k: _num(d.get(k), float, k)  # noqa: E731
    i = lambda k, dflt=None: _num(d.get(k), int, k) if d.get(k) is not None else dflt  # noqa: E731
    return TraceRow(
        rank=_num(d["rank"], int, "rank"), node=i("node"), step_start=i("step_start", -1), step_end=i("step_end", -1),
        steps=i("steps"), kind=str(d.get("kind") or "periodic"), device=str(d.get("device") or "unknown"),
        wall_ms=f("wall_ms"), kernel_ms=f("kernel_ms"), nccl_ms=f("nccl_ms"), exposed_comm_ms=f("exposed_comm_ms"),
        kernel_ms_per_step=f("kernel_ms_per_step"), nccl_ms_per_step=f("nccl_ms_per_step"),
        exposed_comm_ms_per_step=f("exposed_comm_ms_per_step"), copy_ms_per_step=f("copy_ms_per_step"),
        idle_ms_per_step=f("idle_ms_per_step"), idle_share=f("idle_share"),
        top_ops=tuple(str(o.get("name", "")) if isinstance(o, dict) else str(o) for o in ops),
        truncated=bool(d.get("truncated")), notes=tuple(str(n) for n in notes), trace_file=str(d.get("trace_file") or ""))


def _json_fields(d: dict, names: tuple[str, ...]) -> dict:
    """Findings/actions read back from Parquet carry dict/list columns as JSON text."""
    out = dict(d)
    for n in names:
        v = out.get(n)
        if isinstance(v, str):
            try:
                out[n] = json.loads(v)
            except ValueError:
                pass
        elif v is None and n in out:
            out.pop(n)
    return out


def _struct(typ: type[T], json_names: tuple[str, ...] = ()) -> Callable[[Any], T]:
    def parse(d: Any) -> T:
        if not isinstance(d, dict):
            raise MalformedResponse(f"{typ.__name__} entry is not an object")
        d = _json_fields(d, json_names)
        try:
            return msgspec.convert(d, typ, strict=False)
        except (msgspec.ValidationError, TypeError):
            pass
        # JSON null where the schema has a non-optional default (the head writes NaN as null): use the default.
        try:
            return msgspec.convert({k: v for k, v in d.items() if v is not None}, typ, strict=False)
        except (msgspec.ValidationError, TypeError) as e:
            raise MalformedResponse(f"{typ.__name__}: {e}") from None

    return parse


_parse_step = _struct(schema.StepRecord)
_parse_base_finding = _struct(schema.Finding, ("evidence", "ranks", "nodes"))


class ServedFinding(schema.Finding, kw_only=True):
    """A finding as the head serves it: the schema's fields, plus its evidence in the sentences ``diagnose``'s page
    uses (the head writes them: the TUI imports no analyzers) and the evidence no sentence mentions, in words. Both
    are empty from a head older than them; the detail pane then shows the evidence as ``key=value``."""

    evidence_sentences: list[str] = []
    evidence_other: list[tuple[str, str]] = []


def _parse_finding(d: Any) -> ServedFinding:
    base = _parse_base_finding(d)
    extra = {}
    for name, typ in (("evidence_sentences", list[str]), ("evidence_other", list[tuple[str, str]])):
        try:  # malformed words cost the finding its words, not the finding
            extra[name] = msgspec.convert(d.get(name) or [], typ, strict=False)
        except (msgspec.ValidationError, TypeError):
            pass
    return ServedFinding(**msgspec.structs.asdict(base), **extra)
_parse_action = _struct(schema.Action, ("ranks",))


class HeadClient:
    """``tls``: for an https head, the CA to verify it against and the client certificate under mutual TLS (default:
    ``RANKSIGHT_TLS_CA`` / ``RANKSIGHT_TLS_CLIENT_CERT`` / ``RANKSIGHT_TLS_CLIENT_KEY``, else the system's CAs)."""

    def __init__(self, base_url: str = DEFAULT_HEAD, token: str | None = None, timeout: float = 3.0,
                 tls: ClientTls | None = None):
        if "://" not in base_url:
            base_url = "http://" + base_url
        self.base_url = base_url.rstrip("/")
        self.token = token if token is not None else os.environ.get("RANKSIGHT_TOKEN", "")
        self.timeout = timeout
        # Built once: an SSLContext loads the CA bundle, too costly for every poll. Plain http never uses it.
        self.ssl_context = (tls or client_tls_from_env()).context() if self.base_url.startswith("https://") else None

    # -- transport ----------------------------------------------------------------
    def _request(self, method: str, path: str, body: dict | None = None, auth: bool = False) -> Any:
        raw = self._fetch(method, path, body, auth)
        try:
            return json.loads(raw)
        except ValueError:
            raise MalformedResponse(f"{method} {path}: response is not JSON ({raw[:60]!r})") from None

    def _fetch(self, method: str, path: str, body: dict | None = None, auth: bool = False,
               timeout: float | None = None) -> bytes:
        """The answer's bytes; ``HeadError`` (the head's ``error`` text) or ``HeadUnreachable`` otherwise.
        ``timeout``: instead of the client's."""
        timeout = self.timeout if timeout is None else timeout
        url = self.base_url + path
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if auth or self.token:  # every read of the head needs the token too (all but /api/health)
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=self.ssl_context) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            try:
                msg = json.loads(e.read() or b"{}").get("error") or e.reason
            except (ValueError, AttributeError, OSError):
                msg = str(e.reason)
            raise HeadError(e.code, str(msg)) from None
        except urllib.error.URLError as e:
            raise HeadUnreachable(f"{self.base_url}: {e.reason}") from None
        except (socket.timeout, TimeoutError):
            raise HeadUnreachable(f"{self.base_url}: timed out after {timeout:g}s") from None
        except (ConnectionError, OSError) as e:
            raise HeadUnreachable(f"{self.base_url}: {e}") from None
        except Exception as e:  # http.client.RemoteDisconnected/BadStatusLine and friends
            raise HeadUnreachable(f"{self.base_url}: {type(e).__name__}: {e}") from None
        return raw

    def _get_list(self, path: str, parse: Callable[[Any], T], skipped: dict[str, int] | None = None) -> list[T]:
        data = self._request("GET", path)
        if not isinstance(data, list):
            raise MalformedResponse(f"GET {path}: expected a JSON list, got {type(data).__name__}")
        out = []
        for item in data:
            try:
                out.append(parse(item))
            except MalformedResponse:
                if skipped is None:
                    raise
                key = path.rsplit("/", 1)[-1].split("?")[0]
                skipped[key] = skipped.get(key, 0) + 1
        return out

    @staticmethod
    def _rid(run_id: str) -> str:
        return urllib.parse.quote(run_id, safe="")

    # -- API ------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        d = self._request("GET", "/api/health")
        if not isinstance(d, dict):
            raise MalformedResponse("GET /api/health: expected an object")
        return d

    def runs(self, skipped: dict[str, int] | None = None) -> list[RunSummary]:
        return self._get_list("/api/runs", _parse_run, skipped)

    def ranks(self, run_id: str, skipped: dict[str, int] | None = None) -> list[RankState]:
        return self._get_list(f"/api/runs/{self._rid(run_id)}/ranks", _parse_rank, skipped)

    def steps(self, run_id: str, since: int = -1, rank: int | None = None, limit: int | None = None,
              skipped: dict[str, int] | None = None) -> list[schema.StepRecord]:
        q = {"since": since}
        if rank is not None:
            q["rank"] = rank
        if limit is not None:
            q["limit"] = limit
        return self._get_list(f"/api/runs/{self._rid(run_id)}/steps?{urllib.parse.urlencode(q)}", _parse_step, skipped)

    def findings(self, run_id: str, skipped: dict[str, int] | None = None) -> list[schema.Finding]:
        return self._get_list(f"/api/runs/{self._rid(run_id)}/findings", _parse_finding, skipped)

    def actions(self, run_id: str, skipped: dict[str, int] | None = None) -> list[schema.Action]:
        return self._get_list(f"/api/runs/{self._rid(run_id)}/actions", _parse_action, skipped)

    def gpus(self, run_id: str, skipped: dict[str, int] | None = None) -> list[GpuState]:
        return self._get_list(f"/api/runs/{self._rid(run_id)}/gpus", _parse_gpu, skipped)

    def traces(self, run_id: str, rank: int | None = None, windows: int = 1,
               skipped: dict[str, int] | None = None) -> list[TraceRow]:
        """The last ``windows`` profiler capture windows, one row per rank per window (the oldest window first)."""
        q: dict[str, int] = {"windows": windows}
        if rank is not None:
            q["rank"] = rank
        return self._get_list(f"/api/runs/{self._rid(run_id)}/traces?{urllib.parse.urlencode(q)}", _parse_trace,
                              skipped)

    def request_action(self, run_id: str, action: str, node: int | None = None, steps: int | None = None,
                       ranks: list[int] | None = None, reason: str = "", dry_run: bool = False,
                       force: bool = False, by: str = "") -> schema.Action:
        """POST an action; a refused evict (the policy's limits) raises ``HeadError(409, why)``. ``force`` (with a
        ``reason``) overrides those limits, audited with ``by`` in the actions table."""
        if not self.token:
            raise ClientError("no token: pass --token or set RANKSIGHT_TOKEN to request actions")
        body: dict[str, Any] = {"action": action, "reason": reason, "dry_run": dry_run}
        if force:
            body["force"] = True
        if by:
            body["by"] = by
        if node is not None:
            body["node"] = node
        if steps is not None:
            body["steps"] = steps
        if ranks:
            body["ranks"] = list(ranks)
        d = self._request("POST", f"/api/runs/{self._rid(run_id)}/actions", body, auth=True)
        return _parse_action(d)

    def ops(self, run_id: str, params: dict[str, str], timeout: float | None = None) -> bytes:
        """``GET /api/runs/<id>/ops``: the drill-down's answer as the head passed it on (JSON bytes of a
        ``ranksight.ops_query.OpsAnswer``); ``params`` as ``OpsQuery.params`` gives them. ``timeout``: instead of
        the client's (a node's first query indexes the rank's spool)."""
        return self._fetch("GET", f"/api/runs/{self._rid(run_id)}/ops?{urllib.parse.urlencode(params)}",
                           timeout=timeout)

    def fetch(self, run_id: str, window: int = 60, cache: "StepWindow | None" = None, traces: bool = False) -> Fetched:
        """Everything one refresh of the run view needs. Raises ClientError if the head cannot be read.

        ``traces``: also read the newest profiler capture window (the TUI asks only while its traces screen is
        open: on a large job that is one row per rank).

        With a ``StepWindow`` (kept by the caller between refreshes) only step records newer than
        what every live rank already has are requested; without one, the whole window is.
        """
        skipped: dict[str, int] = {}
        runs = self.runs(skipped)
        run = next((r for r in runs if r.run_id == run_id), None)
        ranks = self.ranks(run_id, skipped)
        last = max([r.step for r in ranks if r.step is not None] + [run.last_step if run and run.last_step is not None else -1])
        if cache is None:
            steps = self.steps(run_id, since=max(-1, last - window), skipped=skipped)
        else:
            since = cache.since(run_id, last, ranks)
            cache.add(self.steps(run_id, since=since, skipped=skipped), last)
            steps = cache.records()
        findings = self.findings(run_id, skipped)
        actions = self.actions(run_id, skipped)
        try:
            gpus: list[GpuState] | None = self.gpus(run_id, skipped)
        except HeadError as e:
            if e.status != 404 or "no such endpoint" not in e.message:
                raise
            gpus = None  # a head from before the GPU endpoint: the panel says so, the rest works
        trace_rows: list[TraceRow] | None = None
        traces_missing = False
        if traces:
            try:
                trace_rows = self.traces(run_id, windows=1, skipped=skipped)
            except HeadError as e:
                if e.status != 404 or "no such endpoint" not in e.message:
                    raise
                traces_missing = True  # a head from before the traces endpoint: the screen says so
        try:
            health = self.health()
        except MalformedResponse:
            health = {}
        return Fetched(run=run, ranks=ranks, steps=steps, findings=findings, actions=actions, health=health,
                       runs=runs, skipped=skipped, gpus=gpus, traces=trace_rows, traces_missing=traces_missing)


class StepWindow:
    """The last ``window`` steps of every rank, fetched incrementally.

    Each refresh asks only for steps after the oldest "newest step" among the ranks the head
    reports running (agents ship per node, so ranks arrive at different paces), never before
    the window. A stalled or finished rank does not hold the window back. A restart (a rank's
    attempt grows, or the head's newest step goes backwards) drops the cache and starts over.
    """

    def __init__(self, window: int = 60):
        self.window = window
        self.run_id: str | None = None
        self.recs: dict[tuple[int, int], schema.StepRecord] = {}
        self.newest: dict[int, int] = {}  # rank -> newest step held
        self.attempt: dict[int, int] = {}
        self.last = -1

    def reset(self, run_id: str | None = None) -> None:
        self.run_id = run_id
        self.recs.clear()
        self.newest.clear()
        self.attempt.clear()
        self.last = -1

    def since(self, run_id: str, last: int, ranks: list[RankState]) -> int:
        if run_id != self.run_id or last < self.last or any(r.attempt > self.attempt.get(r.rank, r.attempt)
                                                             for r in ranks):
            self.reset(run_id)
        lo = max(-1, last - self.window)
        live = [r.rank for r in ranks if r.state == "running"]
        if not self.recs or not live or any(r not in self.newest for r in live):
            return lo
        return max(lo, min(self.newest[r] for r in live))

    def add(self, recs: list[schema.StepRecord], last: int) -> None:
        self.last = max(self.last, last)
        for s in recs:
            prev = self.recs.get((s.rank, s.step))
            if prev is None or s.attempt >= prev.attempt:
                self.recs[(s.rank, s.step)] = s
            self.newest[s.rank] = max(self.newest.get(s.rank, -1), s.step)
            self.attempt[s.rank] = max(self.attempt.get(s.rank, 0), s.attempt)
        floor = self.last - self.window
        if any(k[1] <= floor for k in self.recs):
            self.recs = {k: v for k, v in self.recs.items() if k[1] > floor}

    def records(self) -> list[schema.StepRecord]:
        return sorted(self.recs.values(), key=lambda s: (s.step, s.rank))
