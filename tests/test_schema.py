import math

import msgspec
import pytest

from ranksight import schema
from ranksight.layout import RunDir
from ranksight.simgpu import SimGpuState, THROTTLE_HW_THERMAL, throttle_names


def test_spool_roundtrip_each_kind():
    step = schema.StepRecord(run_id="r", rank=3, step=7, node=1, host="h", world_size=4,
                             t_start=1.0, t_end=2.0, step_ms=1000.0, loss=float("nan"), loss_nonfinite=True)
    coll = schema.CollectiveRecord(run_id="r", rank=3, step=7, seq=1, op="all_reduce", group="dp", t_arrive=1.5)
    ev = schema.EventRecord(run_id="r", rank=3, step=7, t=1.0, event="fault_start", detail={"kind": "slow_rank"})
    for rec in (step, coll, ev):
        back = schema.decode_spool_line(schema.encode(rec))
        assert type(back) is type(rec)
    back = schema.decode_spool_line(schema.encode(step))
    assert back.loss is None and back.loss_nonfinite  # NaN travels as null + flag


def test_spool_garbage_raises_decode_error():
    with pytest.raises(msgspec.DecodeError):
        schema.decode_spool_line(b'{"kind":"step","rank":')
    with pytest.raises(msgspec.ValidationError):
        schema.decode_spool_line(b'{"kind":"nope"}')


def test_rundir_rejects_path_tricks(tmp_path):
    assert RunDir(tmp_path, "run-1").spool(2).name == "rank-2.jsonl"
    for bad in ("", "../x", ".hidden", "a/b"):
        with pytest.raises(ValueError):
            RunDir(tmp_path, bad)


def test_simgpu_text_roundtrip():
    s = SimGpuState(util_gpu=87, throttle_reasons=THROTTLE_HW_THERMAL, xids=[(79, 1700000000123)])
    back = SimGpuState.from_text(s.to_text() + "garbage line\nutil_gpu=notanint\n")
    assert back.util_gpu == 87 and back.xids == [(79, 1700000000123)]
    assert throttle_names(back.throttle_reasons) == ["hw_thermal_slowdown"]
    assert not math.isnan(back.temp_c)


def test_atomic_write_fsyncs_only_when_durable(tmp_path, monkeypatch):
    from ranksight import layout, simgpu

    calls = []
    monkeypatch.setattr(layout.os, "fsync", lambda fd: calls.append(fd))
    path = tmp_path / "d" / "f"
    layout.atomic_write(path, b"one")
    assert path.read_bytes() == b"one" and len(calls) == 1
    layout.atomic_write(path, b"two", durable=False)
    assert path.read_bytes() == b"two" and len(calls) == 1
    # the simulated GPU state is rewritten every step: never fsynced, never half-written
    simgpu.write_state(tmp_path / "node", 0, SimGpuState(util_gpu=55))
    assert len(calls) == 1 and simgpu.read_state(tmp_path / "node", 0).util_gpu == 55
    assert sorted(p.name for p in (tmp_path / "node").iterdir()) == ["gpu-0.state"]
