"""The node agent process: one per node, between the training ranks' files and the head."""
