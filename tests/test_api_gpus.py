"""GET /api/runs/<id>/gpus: the latest sample per (node, gpu) from the head's live window."""

from __future__ import annotations

from functools import partial
import time
import urllib.error
import urllib.request

import pytest

from agent_helpers import api_get, serving
from head.api import gpu_states
from head.service import Head
from ranksight import schema

RUN = "gpu-run"
TOKEN = "gpus-test-token"
GiB = 1 << 30


def sample(node: int, gpu: int, t: float, **kw) -> schema.GpuSample:
    base = dict(node=node, host=f"node{node}", gpu=gpu, t=t, source="simulated-nvml", simulated=True,
                name="RankSight Simulated GPU", uuid=f"GPU-{node}-{gpu}", util_pct=97.0, mem_util_pct=40.0,
                mem_used_bytes=30 * GiB, mem_total_bytes=80 * GiB, power_w=650.0, power_limit_w=700.0, temp_c=71.0,
                sm_clock_mhz=1980.0, mem_clock_mhz=2619.0, max_sm_clock_mhz=1980.0, throttle_reasons=0, ecc_sbe=0,
                ecc_dbe=0, xid_total=0)
    base.update(kw)
    return schema.GpuSample(**base)


@pytest.fixture
def head(tmp_path):
    h = Head(tmp_path / "store", TOKEN, analyzer=None)
    with serving(h):
        yield h


get = partial(api_get, token=TOKEN)  # (status, JSON body) with this file's token


def feed(h: Head, now: float) -> None:
    live = h.live.run(RUN)
    live.manifest = schema.Manifest(
        run_id=RUN, created=now, start_time=now, nodes=2,
        ranks=[schema.RankPlacement(rank=r, node=r // 2, host=f"node{r // 2}", local_rank=r % 2, pp_stage=0,
                                    dp_rank=r, tp_rank=0) for r in range(4)])
    live.add("gpu", [
        sample(0, 0, now - 3.0, util_pct=10.0),  # older sample of node 0 GPU 0: replaced by the next one
        sample(0, 0, now - 1.0),
        sample(0, 1, now - 1.0, throttle_reasons=0x1),  # gpu_idle: benign
        # node 1 GPU 1: thermal throttling (sw + hw thermal), SM clock down, ECC single-bit errors, two XIDs
        sample(1, 1, now - 2.0, throttle_reasons=0x60, sm_clock_mhz=990.0, temp_c=93.0, ecc_sbe=4, xid_total=2),
        sample(1, 0, now - 1.5, throttle_reasons=0x4 | 0x1000),  # power cap and a bit NVML has no name for here
    ])
    live.add("xid", [schema.XidEvent(node=1, host="node1", gpu=1, t=now - 5.0, code=43, source="simulated-nvml",
                                     simulated=True),
                     schema.XidEvent(node=1, host="node1", gpu=1, t=now - 2.5, code=79, source="simulated-nvml",
                                     simulated=True),
                     schema.XidEvent(node=1, host="node1", gpu=1, t=now - 2.5, code=79, source="simulated-nvml",
                                     simulated=True)])  # the same event twice (a resend): counted once


def test_gpus_latest_sample_per_gpu_with_decoded_fields(head):
    now = time.time()
    feed(head, now)
    st, body = get(f"{head.url}/api/runs/{RUN}/gpus")
    assert st == 200
    assert [(g["node"], g["gpu"]) for g in body] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    g00, g01, g10, g11 = body
    assert g00["util_pct"] == 97.0 and g00["t"] == pytest.approx(now - 1.0)  # the latest sample
    assert g00["mem_used_bytes"] == 30 * GiB and g00["mem_total_bytes"] == 80 * GiB
    assert g00["power_w"] == 650.0 and g00["power_limit_w"] == 700.0 and g00["temp_c"] == 71.0
    assert g00["sm_clock_mhz"] == 1980.0 and g00["max_sm_clock_mhz"] == 1980.0 and g00["sm_clock_frac"] == 1.0
    assert g00["throttle_names"] == [] and g00["throttled"] is False
    assert g00["simulated"] is True and g00["source"] == "simulated-nvml" and g00["host"] == "node0"
    assert g00["ranks"] == [0] and g01["ranks"] == [1] and g11["ranks"] == [3]
    assert 0.5 < g00["age_s"] < 60

    assert g01["throttle_names"] == ["gpu_idle"] and g01["throttled"] is False
    assert g10["throttle_names"] == ["sw_power_cap", "0x1000"] and g10["throttled"] is True

    assert g11["throttle_reasons"] == 0x60 and g11["throttled"] is True
    assert g11["throttle_names"] == ["sw_thermal_slowdown", "hw_thermal_slowdown"]
    assert g11["sm_clock_frac"] == pytest.approx(0.5) and g11["temp_c"] == 93.0
    assert g11["ecc_sbe"] == 4 and g11["ecc_dbe"] == 0
    assert g11["xid_count"] == 2 and g11["last_xid"] == 79  # max(agent count 2, distinct events 2)
    assert g00["xid_count"] == 0 and g00["last_xid"] is None


def test_gpus_xid_events_count_without_samples_and_beyond_the_agent_count(head):
    now = time.time()
    live = head.live.run(RUN)
    live.add("xid", [schema.XidEvent(node=2, host="node2", gpu=0, t=now - k, code=48, source="nvml",
                                     simulated=False) for k in (1.0, 2.0, 3.0)])
    (g,) = gpu_states(live, now=now)
    assert (g["node"], g["gpu"], g["xid_count"], g["last_xid"]) == (2, 0, 3, 48)
    assert g["t"] is None and g["util_pct"] is None and g["simulated"] is False and g["throttled"] is False
    live.add("gpu", [sample(2, 0, now, simulated=False, source="nvml", xid_total=1)])
    (g,) = gpu_states(live, now=now)
    assert g["xid_count"] == 3 and g["simulated"] is False and g["age_s"] == 0.0


def test_gpus_token_rules_and_errors(head):
    feed(head, time.time())
    # reads are open, like the other GET endpoints; a token does not hurt
    assert get(f"{head.url}/api/runs/{RUN}/gpus")[0] == 200
    assert get(f"{head.url}/api/runs/{RUN}/gpus", headers={"Authorization": f"Bearer {TOKEN}"})[0] == 200
    st, body = get(f"{head.url}/api/runs/nope/gpus")
    assert st == 404 and "unknown run" in body["error"] and "nope" not in head.live.runs  # a GET creates no run
    st, body = get(f"{head.url}/api/runs/..%2Fx/gpus")
    assert st in (400, 404)
    # nothing writes here: a POST is not an endpoint, with or without the token
    req = urllib.request.Request(f"{head.url}/api/runs/{RUN}/gpus", data=b"{}", method="POST",
                                 headers={"Authorization": f"Bearer {TOKEN}"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 404
    # a run with no GPU samples yet: an empty list
    head.live.run("empty-run")
    assert get(f"{head.url}/api/runs/empty-run/gpus") == (200, [])
