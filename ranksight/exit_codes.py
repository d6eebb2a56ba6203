"""The exit codes of the commands that judge something (``diagnose``, ``ranksight logs``, ``ranksight trace``): one
contract for scripts to branch on. Click (typer) exits 2 on a usage error and 1 on an uncaught exception, so none of
these is 1 or 2; they are spaced so that ``code >= EXIT_WARNING`` means "something to act on was found". Kept apart
from the report code so a light command does not import pandas to learn them."""

from __future__ import annotations

EXIT_HEALTHY = 0  # every check that applies ran; nothing worse than info
EXIT_INCOMPLETE = 10  # nothing worse than info, but some checks could not run (the fields they need are missing)
EXIT_WARNING = 20  # warning(s) found, none critical
EXIT_CRITICAL = 30  # critical finding(s)
EXIT_LOAD_ERROR = 40  # the input could not be read (unknown run id, no step records, newer schema, no readable file)
EXIT = {None: EXIT_HEALTHY, "info": EXIT_HEALTHY, "warning": EXIT_WARNING, "critical": EXIT_CRITICAL}  # by severity
EXIT_CODES_HELP = (f"Exit codes: {EXIT_HEALTHY} healthy (every check that applies ran, nothing worse than info); "
                   f"{EXIT_INCOMPLETE} incomplete (nothing found, but some checks could not run: the report says which "
                   f"and why); {EXIT_WARNING} warnings; {EXIT_CRITICAL} critical; {EXIT_LOAD_ERROR} the input could not "
                   f"be read. (1 and 2 are never these verdicts: they are a crash and a usage error.)")
