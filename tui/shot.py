"""``python -m tui.shot``: the TUI's screen as an SVG (Textual's screenshot), for the README (``make tui-shot``).

Against a running head (``--head``/``RANKSIGHT_HEAD``, ``--token``/``RANKSIGHT_TOKEN``), or, with neither, against
a head this starts on the run store (``--store``, default ./runs) on a free loopback port and stops afterwards (its
token is the one it writes to <store>/.head-token). ``--run``: the run to show (default: the one seen last). The app
runs headless at ``--size`` and refreshes once before the picture is taken. The head is started as a process, not
imported: the TUI talks to it over HTTP only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from tui.client import ClientError, HeadClient


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_head(store: Path) -> tuple[subprocess.Popen, str, str]:
    """A head on ``store`` at a free loopback port; returns it, its URL and its token once it answers."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "head", "--store", str(store), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the head on {store} exited with {proc.returncode} before it answered")
        try:
            HeadClient(url, token="").health()
            token_file = store / ".head-token"
            return proc, url, token_file.read_text().strip() if token_file.exists() else ""
        except ClientError:
            time.sleep(0.3)
    proc.terminate()
    raise SystemExit(f"the head on {store} did not answer within 60 s")


async def shoot(client: HeadClient, run_id: str | None, size: tuple[int, int]) -> str:
    from tui.app import RanksightApp

    if run_id is None:
        runs = client.runs()
        if not runs:
            raise SystemExit(f"the head at {client.base_url} has no runs")
        run_id = max(runs, key=lambda r: (r.last_seen or 0, r.start_time or 0)).run_id
    app = RanksightApp(client, run_id=run_id, interval=3600)
    async with app.run_test(size=size) as pilot:
        await app.refresh_now()
        await pilot.pause()
        if app.error:
            raise SystemExit(f"reading run {run_id}: {app.error}")
        return app.export_screenshot(title=f"ranksight tui — {run_id}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tui.shot", description=__doc__.splitlines()[0])
    p.add_argument("--head", default=os.environ.get("RANKSIGHT_HEAD", ""))
    p.add_argument("--token", default=os.environ.get("RANKSIGHT_TOKEN", ""))
    p.add_argument("--store", default=os.environ.get("RANKSIGHT_STORE", "runs"))
    p.add_argument("--run", default=None)
    p.add_argument("--out", default="docs/img/tui.svg")
    p.add_argument("--size", default="160x48", help="columns x rows")
    a = p.parse_args(argv)
    cols, rows = (int(x) for x in a.size.lower().split("x"))
    proc = None
    try:
        if a.head:
            url, token = a.head, a.token
        else:
            store = Path(a.store)
            if not store.is_dir():
                raise SystemExit(f"no run store at {store}: run `make demo` first, or pass --head")
            proc, url, token = start_head(store)
        svg = asyncio.run(shoot(HeadClient(url, token=token), a.run, (cols, rows)))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(svg)
    print(f"wrote {out} ({cols}x{rows})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
