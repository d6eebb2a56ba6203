"""Process-group set-up and tear-down, rank identity, and the test-only hooks.

Launched by torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT in the environment);
started without torchrun it runs as a world of one process.

Self-test hooks (environment variables, for ranksight's own tests; never set them in production):

- ``NCCL_TESTS_CORRUPT_RANK=r``: rank r overwrites element 0 of its result buffer after each
  correctness-check run, so the check must count it in ``#wrong`` and the run must fail.
- ``NCCL_TESTS_DELAY_RANK=r`` with ``NCCL_TESTS_DELAY_US=us`` (default 2000): rank r sleeps
  ``us`` microseconds before each communication call it issues (every send, receive and
  collective), so the health check must name it.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Identity:
    rank: int
    world: int
    local_rank: int
    node: str  # RANKSIGHT_NODE, else torchrun's GROUP_RANK, else the host name
    host: str
    pid: int
    device: str  # "cpu" or "cuda:<i>"
    device_name: str


def env_int(name: str, default: int | None = None) -> int | None:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        return int(v)
    except ValueError:
        raise SystemExit(f"nccl_tests: environment variable {name}={v!r} is not an integer") from None


def node_label() -> str:
    if os.environ.get("RANKSIGHT_NODE"):
        return os.environ["RANKSIGHT_NODE"]
    if os.environ.get("GROUP_RANK"):
        return f"node{os.environ['GROUP_RANK']}"
    return socket.gethostname()


def choose_backend(requested: str) -> str:
    if requested and requested != "auto":
        if requested == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise SystemExit("nccl_tests: --backend nccl needs CUDA GPUs and a torch built with NCCL; none here (use gloo)")
        if requested == "gloo" and not dist.is_gloo_available():
            raise SystemExit("nccl_tests: this torch has no gloo backend")
        return requested
    if torch.cuda.is_available() and torch.cuda.device_count() > 0 and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def init(backend_request: str, timeout_s: float) -> tuple[Identity, str]:
    """Join the process group (or create a world of one); returns (identity, backend)."""
    if "RANK" not in os.environ:
        # Not under torchrun: a world of one process on a free local port.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = choose_backend(backend_request)
    local_rank = env_int("LOCAL_RANK", 0) or 0
    kwargs = {}
    if backend == "nccl":
        ndev = torch.cuda.device_count()
        torch.cuda.set_device(local_rank % ndev)
        device = f"cuda:{local_rank % ndev}"
        device_name = torch.cuda.get_device_name(local_rank % ndev)
        kwargs["device_id"] = torch.device(device)
    else:
        device, device_name = "cpu", "CPU"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    ident = Identity(
        rank=dist.get_rank(),
        world=dist.get_world_size(),
        local_rank=local_rank,
        node=node_label(),
        host=socket.gethostname(),
        pid=os.getpid(),
        device=device,
        device_name=device_name,
    )
    return ident, backend


def all_identities(me: Identity) -> list[Identity]:
    out: list = [None] * me.world
    dist.all_gather_object(out, me)
    return out


def finish(code: int) -> None:
    """Leave cleanly and exit with ``code`` (gloo ranks may abort in their destructors, so _exit)."""
    try:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except Exception as exc:  # a peer died: still report our own verdict
        print(f"nccl_tests: tear-down failed: {exc}", file=sys.stderr)
        code = code or 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Hooks:
    """The self-test hooks of this rank (see the module docstring)."""

    def __init__(self, rank: int):
        corrupt = env_int("NCCL_TESTS_CORRUPT_RANK")
        delay_rank = env_int("NCCL_TESTS_DELAY_RANK")
        self.corrupt = corrupt is not None and corrupt == rank
        self.corrupt_rank = corrupt
        self.delay_rank = delay_rank
        self.delay_s = 0.0
        if delay_rank is not None and delay_rank == rank:
            self.delay_s = (env_int("NCCL_TESTS_DELAY_US", 2000) or 0) / 1e6

    def before_comm(self) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)

    def notes(self) -> list[str]:
        out = []
        if self.corrupt_rank is not None:
            out.append(f"SELF-TEST: NCCL_TESTS_CORRUPT_RANK={self.corrupt_rank} corrupts that rank's checked results")
        if self.delay_rank is not None:
            out.append(f"SELF-TEST: NCCL_TESTS_DELAY_RANK={self.delay_rank} delays that rank's communication by "
                       f"{env_int('NCCL_TESTS_DELAY_US', 2000)} us per call")
        return out


# torch renamed the tensor forms (all_gather_into_tensor -> all_gather_single, reduce_scatter_tensor
# -> reduce_scatter_single) and deprecated the old names; use whichever this torch has.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
