"""The TUI's widgets, one concern each."""
