"""The agent's OTLP metrics under OpenTelemetry's semantic-convention names and units (hw.gpu.utilization as a ratio,
hw.gpu.memory.usage in bytes, ...), checked against the names of the installed opentelemetry-semantic-conventions
package and as the head's receiver gets them."""

from __future__ import annotations

import threading

from opentelemetry.sdk.resources import Resource
from opentelemetry.semconv._incubating.metrics import hw_metrics, system_metrics

from agent_helpers import TOKEN, wait_for
from head.api import make_server
from head.service import Head
from node.shipping import OtlpMetrics
from ranksight import schema


def test_gpu_and_host_metrics_reach_the_head_under_semconv_names(tmp_path):
    h = Head(tmp_path / "store", TOKEN, analyzer=None)
    srv = make_server(h, "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    om = OtlpMetrics(f"http://127.0.0.1:{srv.server_address[1]}", {"Authorization": f"Bearer {TOKEN}"}, 5)
    try:
        om.start(Resource.create({}))
        s = schema.GpuSample(node=0, host="h", gpu=1, t=1.0, source="nvml", simulated=False, uuid="GPU-x",
                             util_pct=87.0, temp_c=70.0, power_w=500.0, sm_clock_mhz=1980.0, mem_used_bytes=3 << 30,
                             mem_total_bytes=80 << 30)
        om.set_gpu(s, 0)
        om.set_gpu(schema.GpuSample(node=0, host="h", gpu=1, t=2.0, source="nvml", simulated=False, uuid="GPU-x",
                                    util_pct=90.0, mem_used_bytes=5 << 30, mem_total_bytes=80 << 30), 0)
        om.set_host(schema.HostSample(node=0, host="h", t=1.0, cpu_pct=25.0, load1=1, mem_used_bytes=1,
                                      mem_total_bytes=2, net_rx_bytes=0, net_tx_bytes=0, disk_read_bytes=0,
                                      disk_write_bytes=0), 0)
        om.provider.force_flush()
        got = wait_for(lambda: {k[1]: (v, dict(k[2])) for k, v in h.ingest.metrics_latest.items()}, 10, 0.2, "metrics")
    finally:
        om.shutdown()
        srv.shutdown()
        srv.server_close()
        h.close()
    assert got[hw_metrics.HW_GPU_UTILIZATION][0] == 0.9  # a ratio, unit "1", not 90 %
    v, attrs = got[hw_metrics.HW_GPU_UTILIZATION]
    assert attrs["hw.type"] == "gpu" and attrs["hw.id"] == "GPU-x"
    assert got[hw_metrics.HW_GPU_MEMORY_USAGE][0] == 5 << 30  # the UpDownCounter's sum is the latest usage
    assert got[hw_metrics.HW_GPU_MEMORY_LIMIT][0] == 80 << 30
    assert got[hw_metrics.HW_TEMPERATURE][0] == 70.0 and got[hw_metrics.HW_POWER][0] == 500.0
    assert got[system_metrics.SYSTEM_CPU_UTILIZATION][0] == 0.25
    assert got["ranksight.gpu.clock.sm"][0] == 1980e6
    assert not [n for n in got if n.startswith("gpu.") or n == "host.cpu.utilization"]  # the old names are gone
