"""The head process: receives what the node agents ship, stores it, analyzes it live, serves it, acts on it."""
