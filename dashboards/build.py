"""Grafana dashboards for ranksight, generated with grafana-foundation-sdk builders.

One dashboard today, ``ranksight-job`` ("ranksight — job overview"), in four rows:

- **Training** (per rank, from the node agent): step time p50/p95 from the
  ``ranksight_step_duration_seconds`` histogram, tokens/s, loss, last step and the
  seconds since it, compute vs blocked communication, and each rank's compute
  relative to the job median (the straggler signal: in synchronous training every
  rank's *step* time is the same, the slow rank shows in its *compute* time).
- **GPUs**: utilization, SM clock, temperature, power, the harmful throttle-reason
  bits and XID errors, under dcgm-exporter's ``DCGM_FI_*`` names so the same panels
  work against a real dcgm-exporter. Series from simulated GPUs carry
  ``simulated="true"``; every GPU legend shows that label, a ``$simulated`` variable
  filters on it, and a text panel says so.
- **Agents**: scrape health, records shipped, lag, disk outbox, dropped records and
  failed exports.

Template variables: ``datasource``, ``run``, ``node``, ``rank`` (training panels),
``host`` and ``simulated`` (GPU panels), ``job`` (agent scrape job).

``build_all()`` returns ``{uid: dashboard dict}``; ``write_all(out_dir)`` writes
``<uid>.json`` files (what ``ranksight dashboards build`` does).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, stat, text, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import text as text_models

JSON_DIR = Path(__file__).resolve().parent / "json"
DS_VAR = "datasource"
DS = dm.DataSourceRef(type_val="prometheus", uid="${%s}" % DS_VAR)

# Label selectors shared by the panels (Grafana substitutes the variables; "All" is ".*").
RANK_SEL = 'run_id=~"$run", node=~"$node", rank=~"$rank"'
NODE_SEL = 'run_id=~"$run", node=~"$node"'  # the node agent's per-node training series (no rank label)
GPU_SEL = 'Hostname=~"$host", simulated=~"$simulated"'
AGENT_SEL = 'node=~"$node"'
GPU_LEGEND = "{{Hostname}} GPU{{gpu}} simulated={{simulated}}"

# The throttle signal from dcgm-exporter's default counters (etc/default-counters.csv has no throttle-reason field):
# each GPU's SM clock over the highest SM clock any GPU of the same model reached in the last hour. A busy GPU far
# below its model's clock is slowed down (thermal, power cap or power brake alike).
def sm_clock_ratio(sel: str) -> str:
    return ("DCGM_FI_DEV_SM_CLOCK{%s} / on (modelName) group_left () "
            "(max by (modelName) (max_over_time(DCGM_FI_DEV_SM_CLOCK{%s}[1h])) > 0)" % (sel, sel))


SIMULATED_NOTE = (
    "**Simulated GPU data is labelled.** On machines without a GPU, ranksight's node agent reports a "
    "*simulated* device whose state follows the trainer's real activity and injected faults. Those series "
    "carry `simulated=\"true\"` (see each legend); use the **simulated** variable above to show only real "
    "(`false` or no label, e.g. a real dcgm-exporter) or only simulated GPUs. Never read a simulated "
    "temperature, clock or XID as hardware evidence."
)


class _Grid:
    """Places panels left to right on Grafana's 24-column grid, rows stacked top to bottom."""

    def __init__(self) -> None:
        self.x = 0
        self.y = 0
        self.row_h = 0

    def row(self) -> dm.GridPos:
        self.newline()
        pos = dm.GridPos(h=1, w=24, x=0, y=self.y)
        self.y += 1
        return pos

    def newline(self) -> None:
        if self.x:
            self.y += self.row_h
        self.x = 0
        self.row_h = 0

    def place(self, w: int, h: int) -> dm.GridPos:
        if not 0 < w <= 24:
            raise ValueError(f"panel width must be 1..24, got {w}")
        if self.x + w > 24:
            self.newline()
        pos = dm.GridPos(h=h, w=w, x=self.x, y=self.y)
        self.x += w
        self.row_h = max(self.row_h, h)
        return pos


def _q(expr: str, legend: str, ref: str, *, instant: bool = False) -> prometheus.Dataquery:
    q = prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(DS)
    return q.instant() if instant else q.range()


def _ts(title: str, unit: str, desc: str, targets: list[prometheus.Dataquery]) -> timeseries.Panel:
    p = timeseries.Panel().title(title).description(desc).unit(unit).datasource(DS).line_width(1).fill_opacity(5)
    for t in targets:
        p = p.with_target(t)
    return p


def _stat(title: str, unit: str, desc: str, targets: list[prometheus.Dataquery]) -> stat.Panel:
    p = stat.Panel().title(title).description(desc).unit(unit).datasource(DS)
    for t in targets:
        p = p.with_target(t)
    return p


def _variables(d: db.Dashboard) -> db.Dashboard:
    def qvar(name: str, label: str, query: str) -> db.QueryVariable:
        return (db.QueryVariable(name).label(label).datasource(DS).query(query).multi(True).include_all(True)
                .all_value(".*").refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dm.VariableSort.NUMERICAL_ASC)
                .current(dm.VariableOption(selected=True, text="All", value="$__all")))

    return (d.with_variable(db.DatasourceVariable(DS_VAR).label("Prometheus").type("prometheus"))
            .with_variable(qvar("run", "run", "label_values(ranksight_steps_total, run_id)"))
            .with_variable(qvar("node", "node", 'label_values(ranksight_steps_total{run_id=~"$run"}, node)'))
            .with_variable(qvar("rank", "rank", 'label_values(ranksight_last_step{run_id=~"$run", node=~"$node"}, rank)'))
            .with_variable(qvar("host", "GPU host", "label_values(DCGM_FI_DEV_GPU_UTIL, Hostname)"))
            .with_variable(db.CustomVariable("simulated").label("GPU data")
                           .values("all : .*,real only : false|,simulated only : true")
                           .current(dm.VariableOption(selected=True, text="all", value=".*")))
            .with_variable(qvar("job", "agent job", "label_values(ranksight_agent_local_ranks, job)")))


def job_overview() -> db.Dashboard:
    g = _Grid()
    d = (db.Dashboard("ranksight — job overview").uid("ranksight-job")
         .description("Per-rank training progress, GPU health (DCGM names) and node-agent health for ranksight runs.")
         .tags(["ranksight", "training", "gpu"]).refresh("10s").time("now-30m", "now").timezone("browser").editable())
    d = _variables(d)

    # -- Training -------------------------------------------------------------------
    d = d.with_row(db.Row("Training (per node and per rank)").grid_pos(g.row()))
    step = "ranksight_step_duration_seconds_bucket{%s}" % NODE_SEL
    d = d.with_panel(_ts(
        "Step time p50 / p95 per node", "s",
        "histogram_quantile over ranksight_step_duration_seconds, one histogram per node (all its ranks; the "
        "buckets' exemplars name the rank and step). In synchronous training all ranks show about the same step "
        "time (fast ranks wait in the collective); look at compute time to find the slow rank.",
        [_q(f"histogram_quantile(0.5, sum by (le, run_id, node) (rate({step}[$__rate_interval])))", "node {{node}} p50", "A"),
         _q(f"histogram_quantile(0.95, sum by (le, run_id, node) (rate({step}[$__rate_interval])))", "node {{node}} p95", "B")],
    ).grid_pos(g.place(12, 8)))
    d = d.with_panel(_ts(
        "Tokens/s", "suffix: tok/s", "Tokens processed per second: the job total and each node.",
        [_q("sum by (run_id) (rate(ranksight_tokens_total{%s}[$__rate_interval]))" % NODE_SEL, "{{run_id}} total", "A"),
         _q("sum by (run_id, node) (rate(ranksight_tokens_total{%s}[$__rate_interval]))" % NODE_SEL, "node {{node}}", "B")],
    ).grid_pos(g.place(12, 8)))
    d = d.with_panel(_ts(
        "Loss per node", "none", "The last loss a rank of each node recorded (gaps: non-finite loss).",
        [_q("ranksight_loss{%s}" % NODE_SEL, "node {{node}}", "A")],
    ).grid_pos(g.place(8, 8)))
    d = d.with_panel(_stat(
        "Last step per rank", "none", "The last step each rank recorded. A rank behind the others, or not moving, is stuck.",
        [_q("max by (run_id, rank) (ranksight_last_step{%s})" % RANK_SEL, "rank {{rank}}", "A", instant=True)],
    ).grid_pos(g.place(8, 8)))
    d = d.with_panel(_ts(
        "Seconds since last step", "s",
        "Wall time since each rank's last step ended. Growing without bound = hang (alert RanksightRankStalled).",
        [_q("time() - ranksight_last_step_timestamp_seconds{%s}" % RANK_SEL, "rank {{rank}}", "A")],
    ).grid_pos(g.place(8, 8)))
    d = d.with_panel(_ts(
        "Compute vs communication per rank", "s",
        "Last step split: the rank's own compute and time blocked in collectives; the longest data-loader wait and "
        "pipeline wait among each node's ranks. A straggler has more compute and less blocked communication than "
        "its peers.",
        [_q("ranksight_step_compute_seconds{%s}" % RANK_SEL, "rank {{rank}} compute", "A"),
         _q("ranksight_step_comm_seconds{%s}" % RANK_SEL, "rank {{rank}} comm (blocked)", "B"),
         _q("ranksight_step_data_wait_seconds{%s}" % NODE_SEL, "node {{node}} data wait (max)", "C"),
         _q("ranksight_step_pipeline_wait_seconds{%s}" % NODE_SEL, "node {{node}} pipeline wait (max)", "D")],
    ).grid_pos(g.place(12, 8)))
    d = d.with_panel(_ts(
        "Compute time ÷ job median", "suffix: ×",
        "Each rank's compute time (p50 over 5m) divided by the median over the job's ranks. "
        "≥ 1.15 for 5 minutes fires RanksightStragglingRank.",
        [_q("quantile_over_time(0.5, ranksight_step_compute_seconds{%s}[5m]) / on (run_id) group_left () "
            "(quantile by (run_id) (0.5, quantile_over_time(0.5, ranksight_step_compute_seconds{%s}[5m])) > 0)"
            % (RANK_SEL, RANK_SEL), "rank {{rank}} (node {{node}})", "A")],
    ).grid_pos(g.place(12, 8)))

    # -- GPUs -------------------------------------------------------------------------
    d = d.with_row(db.Row("GPUs (dcgm-exporter names; simulated GPUs are labelled)").grid_pos(g.row()))
    d = d.with_panel(text.Panel().title("About simulated GPU data").mode(text_models.TextMode.MARKDOWN)
                     .content(SIMULATED_NOTE).grid_pos(g.place(16, 4)))
    d = d.with_panel(_stat(
        "GPUs reporting, by source", "short",
        "How many GPU series are simulated (simulated=\"true\") and how many are real.",
        [_q('count(DCGM_FI_DEV_GPU_UTIL{%s, simulated="true"})' % 'Hostname=~"$host"', "simulated", "A", instant=True),
         _q('count(DCGM_FI_DEV_GPU_UTIL{%s, simulated!="true"})' % 'Hostname=~"$host"', "real", "B", instant=True)],
    ).grid_pos(g.place(8, 4)))
    gpu_desc = " Legend shows simulated=true for simulated devices."
    d = d.with_panel(_ts("GPU utilization", "percent", "DCGM_FI_DEV_GPU_UTIL per GPU." + gpu_desc,
                         [_q("DCGM_FI_DEV_GPU_UTIL{%s}" % GPU_SEL, GPU_LEGEND, "A")]).grid_pos(g.place(12, 8)))
    d = d.with_panel(_ts("SM clock", "rotmhz", "DCGM_FI_DEV_SM_CLOCK per GPU; a drop under load with a throttle reason "
                         "means the GPU is slowed down." + gpu_desc,
                         [_q("DCGM_FI_DEV_SM_CLOCK{%s}" % GPU_SEL, GPU_LEGEND, "A")]).grid_pos(g.place(12, 8)))
    d = d.with_panel(_ts("GPU temperature", "celsius", "DCGM_FI_DEV_GPU_TEMP per GPU." + gpu_desc,
                         [_q("DCGM_FI_DEV_GPU_TEMP{%s}" % GPU_SEL, GPU_LEGEND, "A")]).grid_pos(g.place(12, 8)))
    d = d.with_panel(_ts("GPU power", "watt", "DCGM_FI_DEV_POWER_USAGE per GPU." + gpu_desc,
                         [_q("DCGM_FI_DEV_POWER_USAGE{%s}" % GPU_SEL, GPU_LEGEND, "A")]).grid_pos(g.place(12, 8)))
    d = d.with_panel(_ts(
        "SM clock ÷ the model's highest (1 h)", "percentunit",
        "Each GPU's DCGM_FI_DEV_SM_CLOCK over the highest SM clock any GPU of the same model reached in the last "
        "hour (dcgm-exporter's default counters carry no throttle reasons). Under 0.85 while the GPU is busy "
        "fires RanksightGpuClockThrottled." + gpu_desc,
        [_q(sm_clock_ratio(GPU_SEL), GPU_LEGEND, "A")],
    ).grid_pos(g.place(12, 8)))
    d = d.with_panel(_ts(
        "GPU utilization per rank", "percent",
        "dcgm-exporter's DCGM_FI_DEV_GPU_UTIL put on ranks by the agent's ranksight_rank_gpu_info (join on UUID): "
        "the agent never re-exports dcgm-exporter's series, it says which rank runs on which GPU." + gpu_desc,
        [_q("DCGM_FI_DEV_GPU_UTIL{%s} * on (UUID) group_right (simulated) ranksight_rank_gpu_info{%s}"
            % (GPU_SEL, RANK_SEL), "rank {{rank}} " + GPU_LEGEND, "A")],
    ).grid_pos(g.place(12, 8)))
    d = d.with_panel(_ts(
        "XID errors", "none",
        "A: the last XID code per GPU (dcgm-exporter semantics: 0 until one happens). "
        "B: XID events counted by the ranksight agent, by code (every event, even a repeated code)." + gpu_desc,
        [_q("DCGM_FI_DEV_XID_ERRORS{%s}" % GPU_SEL, GPU_LEGEND + " last XID", "A"),
         _q("sum by (Hostname, gpu, simulated, code) (ranksight_gpu_xid_events_total{%s})" % GPU_SEL,
            GPU_LEGEND + " XID {{code}} events", "B")],
    ).grid_pos(g.place(12, 8)))

    # -- Agents -------------------------------------------------------------------------
    d = d.with_row(db.Row("Node agents").grid_pos(g.row()))
    d = d.with_panel(_stat(
        "Agent scrape up", "bool_on_off", "Prometheus' up for the agent scrape job: 0 = the agent is down or unreachable.",
        [_q('up{job=~"$job"}', "{{instance}}", "A", instant=True)],
    ).grid_pos(g.place(6, 6)))
    d = d.with_panel(_ts(
        "Records shipped to the head", "suffix: rec/s", "Records per second the head acknowledged, per node agent.",
        [_q("sum by (node) (rate(ranksight_agent_records_shipped_total{%s}[$__rate_interval]))" % AGENT_SEL,
            "node {{node}}", "A")],
    ).grid_pos(g.place(6, 6)))
    d = d.with_panel(_ts(
        "Agent lag", "s", "Age of the oldest record not yet acknowledged by the head (0 when caught up).",
        [_q("ranksight_agent_lag_seconds{%s}" % AGENT_SEL, "node {{node}}", "A")],
    ).grid_pos(g.place(6, 6)))
    d = d.with_panel(_ts(
        "Disk outbox", "short", "Records waiting in the agent's disk outbox while the head is unreachable or behind.",
        [_q("ranksight_agent_spooled_records{%s}" % AGENT_SEL, "node {{node}} records", "A")],
    ).grid_pos(g.place(6, 6)))
    d = d.with_panel(_ts(
        "Dropped records and failed exports", "short",
        "A: records dropped because the outbox was full (data lost). B: failed OTLP exports to the head.",
        [_q("sum by (node) (increase(ranksight_agent_dropped_records_total{%s}[$__rate_interval]))" % AGENT_SEL,
            "node {{node}} dropped", "A"),
         _q("sum by (node) (increase(ranksight_agent_ship_errors_total{%s}[$__rate_interval]))" % AGENT_SEL,
            "node {{node}} failed exports", "B")],
    ).grid_pos(g.place(12, 6)))
    d = d.with_panel(_stat(
        "Ranks tailed per agent", "short", "Local ranks each node agent is tailing.",
        [_q("ranksight_agent_local_ranks{%s}" % AGENT_SEL, "node {{node}}", "A", instant=True)],
    ).grid_pos(g.place(12, 6)))
    return d


DASHBOARDS = {"ranksight-job": job_overview}


def to_dict(built) -> dict[str, Any]:
    """A built foundation-sdk model as the plain JSON dict Grafana stores."""
    return json.loads(json.dumps(built, cls=JSONEncoder))


def build_all() -> dict[str, dict[str, Any]]:
    out = {}
    for uid, make in DASHBOARDS.items():
        model = to_dict(make().build())
        if model.get("uid") != uid:
            raise RuntimeError(f"dashboard builder {make.__name__} produced uid {model.get('uid')!r}, expected {uid!r}")
        out[uid] = model
    return out


def write_all(out_dir: Path | str = JSON_DIR) -> list[Path]:
    """Build, lint (refusing to write a dashboard that fails) and write ``<uid>.json`` files."""
    from dashboards.lint import LintError, lint_dashboard

    out_dir = Path(out_dir)
    models = build_all()
    problems = {uid: lint_dashboard(m) for uid, m in models.items()}
    bad = {uid: p for uid, p in problems.items() if p}
    if bad:
        raise LintError("; ".join(f"{uid}: {', '.join(p)}" for uid, p in bad.items()))
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for uid, model in models.items():
        path = out_dir / f"{uid}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(model, indent=2, sort_keys=True) + "\n")
        tmp.replace(path)
        paths.append(path)
    return paths


def load_dir(path: Path | str = JSON_DIR) -> dict[str, dict[str, Any]]:
    """Dashboards previously written by ``write_all`` (``{uid: model}``); clear error on a bad file."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no dashboard directory {path} (run `ranksight dashboards build` first)")
    out = {}
    for f in sorted(path.glob("*.json")):
        try:
            model = json.loads(f.read_text())
        except ValueError as e:
            raise ValueError(f"{f}: not valid JSON: {e}") from None
        if not isinstance(model, dict) or not model.get("uid"):
            raise ValueError(f"{f}: not a Grafana dashboard (no uid)")
        out[model["uid"]] = model
    if not out:
        raise FileNotFoundError(f"no *.json dashboards in {path} (run `ranksight dashboards build` first)")
    return out
