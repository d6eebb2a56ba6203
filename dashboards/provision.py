"""Provision the dashboards to a Grafana over its HTTP API (grafana-client).

``push(url, token, dashboards, folder_title=..., folder_uid=...)``:

1. ``GET /api/folders/<uid>``; on 404 ``POST /api/folders`` creates it (title + uid);
2. for each dashboard ``POST /api/dashboards/db`` with ``{"dashboard": model (id
   dropped), "folderUid": uid, "overwrite": true, "message": ...}``: re-running the push
   replaces the previous version (Grafana keeps the history).

The token is a Grafana service-account token (Editor on the folder is enough), sent
as ``Authorization: Bearer <token>``. Errors come back as ``ProvisionError`` with
Grafana's message.
"""

from __future__ import annotations

from typing import Any

DEFAULT_FOLDER_TITLE = "ranksight"
DEFAULT_FOLDER_UID = "ranksight"


class ProvisionError(RuntimeError):
    """Grafana refused (or could not be reached for) a provisioning request."""


def _client(url: str, token: str, timeout: float):
    from grafana_client import GrafanaApi

    if not url.startswith(("http://", "https://")):
        raise ProvisionError(f"Grafana URL must start with http:// or https://, got {url!r}")
    if not token:
        raise ProvisionError("a Grafana API token is required (service-account token, Editor role)")
    return GrafanaApi.from_url(url, credential=token, timeout=timeout)


def ensure_folder(api, title: str, uid: str) -> dict[str, Any]:
    from grafana_client.client import GrafanaClientError

    try:
        return api.folder.get_folder(uid)
    except GrafanaClientError as e:
        if getattr(e, "status_code", None) != 404:
            raise
    return api.folder.create_folder(title, uid=uid)


def push(url: str, token: str, dashboards: dict[str, dict[str, Any]], *, folder_title: str = DEFAULT_FOLDER_TITLE,
         folder_uid: str = DEFAULT_FOLDER_UID, message: str = "provisioned by ranksight dashboards push",
         timeout: float = 10.0) -> list[dict[str, Any]]:
    """Create/replace each dashboard in the folder; returns Grafana's answers (uid, url, version, status)."""
    from grafana_client.client import GrafanaException

    if not dashboards:
        raise ProvisionError("no dashboards to push")
    api = _client(url, token, timeout)
    try:
        ensure_folder(api, folder_title, folder_uid)
        out = []
        for uid, model in dashboards.items():
            model = dict(model)
            model.pop("id", None)  # Grafana matches on uid; a stale numeric id would be refused
            ans = api.dashboard.update_dashboard({"dashboard": model, "folderUid": folder_uid, "overwrite": True,
                                                  "message": message})
            out.append(ans)
        return out
    except GrafanaException as e:
        raise ProvisionError(f"Grafana at {url} refused: {e}") from None
    except OSError as e:
        raise ProvisionError(f"cannot reach Grafana at {url}: {e}") from None
