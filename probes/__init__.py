"""Pure readers of raw signals: step spools, NVML/DCGM, NCCL logs, profiler traces, host stats."""
