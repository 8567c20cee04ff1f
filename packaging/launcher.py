"""Entry point of the bundled app: the same ``app.main.main`` that ``kvscope`` and ``python -m app`` run; started
as ``kvscope --worker NAME ...`` it is the process a lesson declares under that name instead (a bundle has no
``python -m engine worker``)."""

import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        from engine.lessons import run_worker

        run_worker(sys.argv[2], sys.argv[3:])
        sys.exit(0)
    from app.main import main

    sys.exit(main())
