"""A torchrun worker for the per-node network namespace tests: it joins the job, all-reduces a one, and reports
its node, the network interface the launcher gave it and the address gloo connected from."""

import json
import os
import socket
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(1)
dist.all_reduce(t)
iface = os.environ.get("RANKSIGHT_NET_IFACE", "")
with open(os.path.join(os.environ["TOY_OUT"], f"rank-{rank}.json"), "w") as f:
    json.dump({"rank": rank, "sum": t.item(), "node": int(os.environ["RANKSIGHT_NODE"]), "iface": iface,
               "gloo_iface": os.environ.get("GLOO_SOCKET_IFNAME", ""), "links": sorted(n for _, n in socket.if_nameindex())},
              f)
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
