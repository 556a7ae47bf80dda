"""``python -m torshmon.cli``, as the ``torshmon`` command."""

from __future__ import annotations

import sys

from torshmon.cli.program import main

sys.exit(main())
