"""A screenshot of a diagnose HTML page as a person sees it, taken by headless Chromium, and checked not blank.

``python -m analyzers.report.screenshot PAGE.html OUT.png [--width 1280] [--height 2200]`` (``make report-shots``
runs it on a demo run's page for the README). Exits 0 with the PNG written, 1 when the picture is blank or Chromium
failed, 2 when no Chromium is installed (Debian's package ``chromium``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_browser() -> str | None:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def take(page: Path, out: Path, width: int = 1280, height: int = 2200, browser: str | None = None,
         timeout_s: float = 120.0) -> None:
    """Render ``page`` at ``width`` x ``height`` CSS px into ``out`` (PNG). Raises RuntimeError when the browser fails."""
    browser = browser or find_browser()
    if browser is None:
        raise FileNotFoundError("no Chromium found (install Debian's package 'chromium')")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ranksight-shot-") as profile:
        cmd = [browser, "--headless", "--disable-gpu", "--hide-scrollbars", "--no-first-run", "--mute-audio",
               "--force-device-scale-factor=1", f"--user-data-dir={profile}", f"--window-size={width},{height}",
               f"--screenshot={out.resolve()}", page.resolve().as_uri()]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.insert(1, "--no-sandbox")  # Chromium refuses to run as root with its sandbox
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if r.returncode != 0 or not out.exists():
        raise RuntimeError(f"{Path(browser).name} exited {r.returncode}: {r.stderr.strip()[-500:]}")


def blank_reason(png: Path, width: int | None = None) -> str:
    """Why the screenshot is not a page worth showing ("" when it is): the wrong size, or (nearly) one colour."""
    from PIL import Image  # matplotlib's dependency

    with Image.open(png) as im:
        if width is not None and im.size[0] != width:
            return f"{im.size[0]} px wide, not {width}"
        grey = im.convert("L")
        hist = grey.histogram()
        total = sum(hist)
        background = max(hist)
        inked = 1 - background / total
        colours = len(im.convert("RGB").getcolors(maxcolors=1 << 16) or range(1 << 16))
    if inked < 0.02:
        return f"{inked:.2%} of the pixels differ from the background"
    if colours < 16:
        return f"only {colours} colours"
    return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("page", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--height", type=int, default=2200)
    a = ap.parse_args(argv)
    if not a.page.is_file():
        print(f"screenshot: no page at {a.page}", file=sys.stderr)
        return 1
    try:
        take(a.page, a.out, a.width, a.height)
    except FileNotFoundError as e:
        print(f"screenshot: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"screenshot: {e}", file=sys.stderr)
        return 1
    why = blank_reason(a.out, a.width)
    if why:
        print(f"screenshot: {a.out} looks blank: {why}", file=sys.stderr)
        return 1
    print(f"wrote {a.out} ({a.width}x{a.height} px)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
