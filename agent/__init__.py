"""Long-running processes: the node agent and the head service."""
