"""The readers ``ranksight logs`` runs, in order. A reader is a module with ``NAME``, ``sniff``, ``read`` and
``conclude`` (see ``logs/__init__``); one whose import fails (a missing optional package) is reported, not fatal."""

from __future__ import annotations

import importlib
from types import ModuleType

READER_MODULES = (
    "logs.readers.nccl",  # NCCL_DEBUG logs, PyTorch ProcessGroupNCCL watchdog/desync lines
    "logs.readers.flight_recorder",  # Flight Recorder dumps (pickle/JSON) and fr_trace's text output
    "logs.readers.nccl_tests",  # nccl-tests stdout
    "logs.readers.kernel",  # NVRM Xid, fallen off the bus, PCIe AER
    "logs.readers.nvidia_smi",  # nvidia-smi -q, nvidia-smi dmon
    "logs.readers.dcgm_dump",  # dcgm-exporter text dumps (and the exporter's startup log before them)
    "logs.readers.loss_scale",  # DeepSpeed/fairseq/apex/Megatron loss-scale and NaN messages
    "logs.readers.iterations",  # Megatron/torchtitan/fairseq/DeepSpeed/HF per-iteration training logs
)


def readers() -> tuple[list[ModuleType], dict[str, str]]:
    """(the importable reader modules, {module: why it could not be imported})."""
    mods, errors = [], {}
    for name in READER_MODULES:
        try:
            mods.append(importlib.import_module(name))
        except ModuleNotFoundError as e:
            if e.name == name:  # not written (yet): silently absent
                continue
            errors[name] = f"{type(e).__name__}: {e}"
        except ImportError as e:
            errors[name] = f"{type(e).__name__}: {e}"
    return mods, errors
