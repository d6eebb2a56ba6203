"""The application: the ``ranksight`` command, the local multi-node launcher and the demo."""
