"""The memory and speed scaling report (``csattn report``)."""

from .run import add_report_args, plan_groups, run_report
from .worker import Job, ragged_lengths, report_config

__all__ = ["Job", "add_report_args", "plan_groups", "ragged_lengths", "report_config", "run_report"]
