"""The live Textual TUI; talks to the head over HTTP only."""
