"""A minimal torchrun worker for testing the local cluster without the trainer.

It joins the job, all-reduces a one, reports what it saw, and either exits or
sleeps (TOY_SLEEP) so a test can kill its node.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.ones(1)
dist.all_reduce(t)
out = os.environ["TOY_OUT"]
with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
    json.dump({"rank": rank, "world": world, "sum": t.item(), "node": int(os.environ["RANKSIGHT_NODE"]),
               "host": os.environ["RANKSIGHT_HOST"], "pid": os.getpid(),
               "share_store": os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")}, f)
if os.environ.get("TOY_SLEEP"):
    time.sleep(float(os.environ["TOY_SLEEP"]))
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
