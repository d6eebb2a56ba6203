"""Project checks for Grafana dashboard JSON (grafana-foundation-sdk builds models but validates nothing).

``lint_dashboard(model)`` returns a list of problems (empty = clean):

- every panel has a type, a title and a gridPos inside the 24-column grid;
- gridPos rectangles do not overlap (rows included: a row header owns its line);
- every query panel has at least one target; every target has a unique, non-empty
  ``refId`` within its panel, a datasource with a ``uid`` (a ``${var}`` uid must name
  a defined datasource variable) and a non-empty ``expr``;
- every query panel sets a unit (``fieldConfig.defaults.unit``);
- every ``$var`` a query uses is a defined template variable or a Grafana macro;
- unique panel titles (a duplicated title usually means a copy-paste mistake).

``promql_for_prometheus(expr)`` replaces Grafana's macros and template variables so an
expression can be sent to a real Prometheus; ``check_promql(prom_url, expr)`` asks that
Prometheus to parse and evaluate it (``/api/v1/query``) and returns its answer, raising
``PromQLError`` with Prometheus' message on a 400.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Iterator

# Grafana's built-in macros a Prometheus query may use, and a stand-in value each.
MACROS = {
    "__rate_interval": "10s",
    "__interval": "2s",
    "__range": "1m",
    "__range_s": "60",
    "__range_ms": "60000",
    "__interval_ms": "2000",
}
_VAR = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
_NO_QUERY_TYPES = {"row", "text", "news", "dashlist", "welcome"}


class LintError(ValueError):
    """A dashboard failed the project checks."""


class PromQLError(ValueError):
    """Prometheus refused an expression (its parse/evaluation error is the message)."""


def iter_panels(model: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, including those nested in collapsed rows."""
    for p in model.get("panels") or []:
        yield p
        for sub in p.get("panels") or []:
            yield sub


def template_variables(model: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v.get("name"): v for v in ((model.get("templating") or {}).get("list") or []) if v.get("name")}


def variables_in(expr: str) -> set[str]:
    return {a or b for a, b in _VAR.findall(expr)}


def lint_dashboard(model: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    if not isinstance(model, dict):
        return ["dashboard is not a JSON object"]
    if not model.get("uid"):
        problems.append("dashboard has no uid")
    if not model.get("title"):
        problems.append("dashboard has no title")
    variables = template_variables(model)
    ds_vars = {n for n, v in variables.items() if v.get("type") == "datasource"}
    rects: list[tuple[str, int, int, int, int]] = []
    titles: dict[str, int] = {}
    panels = list(iter_panels(model))
    if not panels:
        problems.append("dashboard has no panels")
    for i, p in enumerate(panels):
        ptype = p.get("type")
        name = f"panel {i} ({p.get('title') or ptype or '?'})"
        if not ptype:
            problems.append(f"{name}: no type")
        if not p.get("title"):
            problems.append(f"{name}: no title")
        elif ptype != "row":
            titles[p["title"]] = titles.get(p["title"], 0) + 1
        gp = p.get("gridPos")
        if not isinstance(gp, dict):
            problems.append(f"{name}: no gridPos")
        else:
            try:
                x, y, w, h = (int(gp[k]) for k in ("x", "y", "w", "h"))
                if any(not isinstance(gp[k], int) for k in ("x", "y", "w", "h")):
                    raise TypeError
            except (KeyError, TypeError, ValueError):
                problems.append(f"{name}: gridPos needs integer x, y, w, h (got {gp!r})")
            else:
                if w <= 0 or h <= 0 or x < 0 or y < 0 or x + w > 24:
                    problems.append(f"{name}: gridPos {gp} is outside the 24-column grid")
                for other, ox, oy, ow, oh in rects:
                    if x < ox + ow and ox < x + w and y < oy + oh and oy < y + h:
                        problems.append(f"{name}: gridPos {gp} overlaps {other}")
                rects.append((name, x, y, w, h))
        if ptype in _NO_QUERY_TYPES:
            if p.get("targets"):
                problems.append(f"{name}: a {ptype} panel should have no queries")
            continue
        targets = p.get("targets") or []
        if not targets:
            problems.append(f"{name}: no queries (targets)")
        unit = ((p.get("fieldConfig") or {}).get("defaults") or {}).get("unit")
        if not unit:
            problems.append(f"{name}: no unit (fieldConfig.defaults.unit)")
        refs: set[str] = set()
        for j, t in enumerate(targets):
            tname = f"{name} target {j}"
            ref = t.get("refId")
            if not ref:
                problems.append(f"{tname}: empty refId")
            elif ref in refs:
                problems.append(f"{tname}: duplicate refId {ref!r}")
            else:
                refs.add(ref)
            ds = t.get("datasource") or {}
            uid = ds.get("uid") if isinstance(ds, dict) else None
            if not uid:
                problems.append(f"{tname}: no datasource uid")
            else:
                used = variables_in(uid)
                if used and not used <= ds_vars:
                    problems.append(f"{tname}: datasource uid {uid!r} names no datasource variable")
            expr = t.get("expr")
            if not expr or not str(expr).strip():
                problems.append(f"{tname}: empty expr")
                continue
            for var in sorted(variables_in(expr)):
                if var not in variables and var not in MACROS:
                    problems.append(f"{tname}: ${var} is neither a template variable nor a Grafana macro")
    for title, n in titles.items():
        if n > 1:
            problems.append(f"panel title {title!r} is used {n} times")
    return problems


def promql_for_prometheus(expr: str, values: dict[str, str] | None = None, default: str = ".*") -> str:
    """Replace Grafana macros and template variables (``values``, else ``default``: "All")."""
    values = values or {}

    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name in MACROS:
            return MACROS[name]
        return values.get(name, default)

    return _VAR.sub(sub, expr)


def panel_queries(model: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(panel title, refId, expr) of every query in the dashboard."""
    for p in iter_panels(model):
        for t in p.get("targets") or []:
            if t.get("expr"):
                yield p.get("title", ""), t.get("refId", ""), t["expr"]


def check_promql(prom_url: str, expr: str, timeout: float = 10.0) -> dict[str, Any]:
    """Evaluate ``expr`` (already macro-free) on a Prometheus; its ``data`` on success, PromQLError otherwise."""
    url = prom_url.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            err = json.loads(e.read()).get("error", "")
        except ValueError:
            err = ""
        raise PromQLError(f"HTTP {e.code} for {expr!r}: {err or e.reason}") from None
    if body.get("status") != "success":
        raise PromQLError(f"{expr!r}: {body.get('error') or body}")
    return body["data"]
