"""The bundled hybrid-parallel trainer (GPT decoder; DP/FSDP2 x TP x PP), launched by torchrun."""
