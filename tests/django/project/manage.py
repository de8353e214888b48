#!/usr/bin/env python
"""The test project's manage.py (the belay_worker subprocess tests run it)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here), str(here.parents[2])]  # the project, and the repository
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
