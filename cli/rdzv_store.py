"""The c10d rendezvous store as a process of its own.

torchrun's default is to host the rendezvous store inside one node's agent; when
that node dies (or is evicted) every other node loses the rendezvous and the job
cannot re-form. Running the store apart and passing ``is_host=false`` to every
torchrun keeps the job alive through the loss of any node.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from datetime import timedelta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()

    import torch.distributed as dist  # imported late: argument errors should be instant

    store = dist.TCPStore(args.host, args.port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=300))
    print(f"rendezvous store listening on {args.host}:{args.port}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    serve_forever(store)


def serve_forever(store) -> None:
    """The store serves from its own threads: keep the process, and a reference to the store, alive until SIGTERM."""
    while store is not None:
        time.sleep(3600)


if __name__ == "__main__":
    main()
