"""``ds_report``: answers "will my job run here, and if not, why" in one screen (or as JSON).

``runner`` runs checks with timeouts and turns exceptions into FAIL rows, ``checks`` holds the checks of
this machine, ``render`` prints them, ``cli`` is the command.
"""

from launcher.report.cli import build_report, main
from launcher.report.runner import Check, CheckResult, Report, Status, run_check, run_checks

__all__ = ["Check", "CheckResult", "Report", "Status", "build_report", "main", "run_check", "run_checks"]
