"""``python -m app``: open the window (see ``app.main``)."""

import sys

from app.main import main

sys.exit(main())
