"""The MFU denominator of known accelerators: dense bf16 tensor-core peak FLOP/s per device, by device name.

Used where a device's name is known: the trainer's and ``ranksight.init``'s manifests (``torch.cuda.get_device_name``)
and the analyzers when a run has no manifest but its GPU samples name the device (NVML's name).
"""

from __future__ import annotations

# (substring of the device name, peak FLOP/s, label), most specific first: torchtitan's device table.
GPU_PEAK_FLOPS = [
    ("H200", 989e12, "H200 bf16 dense"),
    ("H100 NVL", 835e12, "H100 NVL bf16 dense"),
    ("H100 PCIe", 756e12, "H100 PCIe bf16 dense"),
    ("H100", 989e12, "H100 SXM bf16 dense"),
    ("H20", 148e12, "H20 bf16 dense"),
    ("B200", 2250e12, "B200 bf16 dense"),
    ("A100", 312e12, "A100 bf16 dense"),
    ("L40S", 362e12, "L40S bf16 dense"),
    ("A10", 125e12, "A10 bf16 dense"),
]


def gpu_peak(name: str) -> tuple[float, str] | None:
    """(peak FLOP/s, where it came from) for a device called ``name``, or None for a device not in the table."""
    for key, peak, label in GPU_PEAK_FLOPS:
        if key in name:
            return peak, f"device table: {label} ({name})"
    return None
