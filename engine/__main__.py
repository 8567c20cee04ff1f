"""``python -m engine``: the headless CLI."""

import sys

from engine.cli import main

sys.exit(main())
