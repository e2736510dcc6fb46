"""Sphinx configuration of the English site (see website/common.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import settings  # noqa: E402

globals().update(settings("en"))
