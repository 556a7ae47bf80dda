"""The ``torshmon`` command line: one module per group of commands.

``parser`` holds the command tree, ``program`` runs it (``main``, the console entry
point); ``daemons``, ``history``, ``jobs`` and ``alerts`` hold the commands themselves,
which import what they need when they run, so that an agent-only install starts.
"""

from __future__ import annotations

from torshmon.cli.common import USAGE_ERROR
from torshmon.cli.jobs import trial_line
from torshmon.cli.parser import build_parser
from torshmon.cli.program import AGGREGATOR_PACKAGES, main

__all__ = ["AGGREGATOR_PACKAGES", "USAGE_ERROR", "build_parser", "main", "trial_line"]
