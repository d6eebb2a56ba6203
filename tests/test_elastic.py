"""Two simulated nodes under elastic torchrun: one leaves on request, the other carries on.

This is checkpoint-and-evict end to end through `ranksight launch`: an evict request
for node 1 is written into the control channel; every rank checkpoints at the same
step, node 1's ranks leave, node 0's torchrun re-forms the job at the smaller world
size and training resumes from that checkpoint to the last step.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from ranksight import schema
from ranksight.layout import RunDir, atomic_write

STEPS = 12
EVICT_AFTER = 3


def spool_records(rd: RunDir, rank: int) -> list:
    path = rd.spool(rank)
    if not path.exists():
        return []
    return [schema.decode_spool_line(line) for line in path.read_bytes().splitlines() if line.strip()]


def test_evicted_node_leaves_and_training_resumes_on_the_other(tmp_path):
    rd = RunDir(tmp_path / "runs", "elastic")
    cmd = [sys.executable, "-m", "cli.main", "launch", "--nnodes", "2", "--nproc-per-node", "1",
           "--steps", str(STEPS), "--run-id", rd.run_id, "--store", str(rd.store), "--no-live",
           "--timeout", "400", "--no-agents", "--quiet",
           # Steps of >= 0.4 s, so the request lands mid-run however fast the machine is.
           "--inject", "data_stall:rank=0,delay_ms=400"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            steps = [r.step for r in spool_records(rd, 0) if isinstance(r, schema.StepRecord)]
            if steps and max(steps) >= EVICT_AFTER:
                break
            time.sleep(0.5)
        assert proc.poll() is None, proc.stdout.read()
        req = schema.ControlRequest(id="evict-node1", action="evict", t=time.time(), node=1, reason="test")
        atomic_write(rd.control_requests / f"{req.id}.json", schema.encode(req))
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert "node1: evicted" in out

    ack = json.loads((rd.control_acks / "evict-node1.json").read_text())
    assert ack["status"] == "applied"
    evict_step = ack["applied_step"]
    assert evict_step >= EVICT_AFTER
    assert (rd.root / "control" / "evicted" / "node-1").exists()

    # Every rank checkpointed at the evict step; the two nodes' ranks part ways there.
    by_node: dict[int, list] = {0: [], 1: []}
    for rank in (0, 1):
        for r in spool_records(rd, rank):
            if isinstance(r, (schema.StepRecord,)):
                by_node[r.node].append(r)
            elif isinstance(r, schema.EventRecord) and r.event in ("evicted", "reform", "checkpoint", "resume"):
                by_node.setdefault(-1, []).append(r)
    events = {(e.event, e.step) for e in by_node[-1]}
    assert ("checkpoint", evict_step) in events
    assert ("evicted", evict_step) in events and ("reform", evict_step) in events
    assert ("resume", evict_step) in events

    node1_steps = [r.step for r in by_node[1]]
    assert max(node1_steps) == evict_step  # node 1 did no step after it left
    after = [r for r in by_node[0] if r.step > evict_step]
    assert [r.step for r in after] == list(range(evict_step + 1, STEPS + 1))
    assert {r.world_size for r in after} == {1} and {r.attempt for r in after} == {1}
    before = [r for r in by_node[0] if r.step <= evict_step]
    assert {r.world_size for r in before} == {2}
    # Training continues from the checkpoint: the loss keeps falling across the re-form.
    assert after[-1].loss < before[0].loss

    manifest = json.loads(rd.manifest.read_text())
    assert [a["world_size"] for a in manifest["attempts"]] == [2, 1]
    assert manifest["attempts"][1]["resumed_step"] == evict_step
