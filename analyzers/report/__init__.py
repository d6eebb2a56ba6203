"""The diagnose report: what it says (``model``: ``build_report`` -> ``DiagnoseReport``) and how it is shown
(``render_text`` on a terminal, ``render_json``, ``render_html``). The ``diagnose`` command
(``analyzers/diagnose.py``) loads a run, runs the checks, and hands the report to a renderer."""
