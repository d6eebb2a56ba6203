"""``ranksight logs``' frame: inputs (directories, .gz, unreadable files), readers claiming lines, unknown lines
counted, a failing reader recorded without costing the others, the verdict and exit code, the JSON shape."""

from __future__ import annotations

import gzip
import json
import sys
import types

import pytest

from logs import analyze
from logs.model import ReadResult, log_finding
from logs.report import as_dict, exit_code, render_html, verdict


def _reader(name: str, word: bytes, severity: str | None = "warning", boom: bool = False) -> types.ModuleType:
    m = types.ModuleType(f"logs.readers.fake_{name}")
    m.NAME = name

    def sniff(data: bytes) -> bool:
        return word in data

    def read(inp):
        if boom:
            raise RuntimeError("reader bug")
        lines = inp.data.split(b"\n")
        hit = {i for i, ln in enumerate(lines) if word in ln}
        return ReadResult(reader=name, source=inp.path, events=[{"line": i} for i in sorted(hit)], claimed_lines=hit)

    def conclude(results):
        n = sum(len(r.events) for r in results)
        if severity is None:
            return []
        return [log_finding(name, "nccl_error", severity, f"{n} {name} lines", inputs=[r.source for r in results],
                            evidence={"lines": n}, hosts=["h1"], ranks=[3, 1])]

    m.sniff, m.read, m.conclude = sniff, read, conclude
    return m


@pytest.fixture
def fake_readers(monkeypatch):
    def install(*mods):
        for m in mods:
            monkeypatch.setitem(sys.modules, m.__name__, m)
        monkeypatch.setattr("logs.analysis.readers", lambda: (list(mods), {}))
    return install


def test_directories_gzip_and_unknown_lines(tmp_path, fake_readers):
    fake_readers(_reader("alpha", b"ALPHA"), _reader("beta", b"BETA", severity="critical"))
    d = tmp_path / "job" / "sub"
    d.mkdir(parents=True)
    (d / "a.log").write_bytes(b"ALPHA one\nnoise\nALPHA BETA both\n")
    (tmp_path / "job" / "b.log.gz").write_bytes(gzip.compress(b"BETA x\n\xff\xfe garbage\nlast line no newline"))
    (tmp_path / "job" / ".hidden").write_bytes(b"ALPHA")
    r = analyze([str(tmp_path / "job"), str(tmp_path / "missing.log")])
    by = {i.path.rsplit("/", 1)[-1]: i for i in r.inputs}
    assert set(by) == {"a.log", "b.log.gz", "missing.log"}
    assert by["a.log"].formats == {"alpha": 2, "beta": 1} and by["a.log"].unknown_lines == 1
    assert by["b.log.gz"].lines == 3 and by["b.log.gz"].unknown_lines == 2
    assert by["missing.log"].error == "no such file or directory"
    assert [f.severity for f in r.findings] == ["critical", "warning"]  # worst first
    assert r.findings[0].inputs == sorted({str(d / "a.log"), str(tmp_path / "job" / "b.log.gz")})
    assert r.findings[0].ranks == [1, 3] and r.findings[0].analyzer == "logs.beta"
    assert exit_code(r) == 30 and verdict(r).startswith("CRITICAL: 2 beta lines")
    d = json.loads(json.dumps(as_dict(r), default=str))
    assert set(d) >= {"verdict", "inputs", "findings"} and d["findings"][0]["hosts"] == ["h1"]
    assert "CRITICAL" in render_html(r)


def test_a_failing_reader_is_recorded_and_the_others_stand(tmp_path, fake_readers):
    fake_readers(_reader("alpha", b"ALPHA", severity=None), _reader("bad", b"ALPHA", boom=True))
    (tmp_path / "a.log").write_bytes(b"ALPHA\n")
    r = analyze([str(tmp_path)])
    assert any("reader bad failed" in e and "reader bug" in e for e in r.errors)
    assert r.inputs[0].formats == {"alpha": 1}
    assert exit_code(r) == 10 and verdict(r).startswith("INCOMPLETE")


def test_nothing_readable_and_nothing_recognised(tmp_path, fake_readers):
    fake_readers(_reader("alpha", b"ALPHA"))
    r = analyze([str(tmp_path / "nope")])
    assert exit_code(r) == 40 and verdict(r).startswith("NOTHING READ")
    (tmp_path / "x.log").write_bytes(b"hello\n")
    r = analyze([str(tmp_path / "x.log")])
    assert exit_code(r) == 10 and verdict(r).startswith("NOTHING RECOGNISED") and r.inputs[0].unknown_lines == 1


def test_torn_gzip_is_read_up_to_the_tear(tmp_path, fake_readers):
    fake_readers(_reader("alpha", b"ALPHA", severity=None))
    blob = gzip.compress(b"ALPHA line\n" * 2000)
    (tmp_path / "t.log.gz").write_bytes(blob[: len(blob) // 2])
    r = analyze([str(tmp_path)])
    (inp,) = r.inputs
    assert inp.error is None and 0 < inp.formats["alpha"] < 2000 and any("gzip" in n for n in inp.notes)
