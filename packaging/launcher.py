"""Entry point of the bundled app: the same ``app.main.main`` that ``kvscope`` and ``python -m app`` run."""

import sys

from app.main import main

if __name__ == "__main__":
    sys.exit(main())
