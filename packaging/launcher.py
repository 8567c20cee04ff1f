"""Entry point of the bundled app: the same ``app.main.main`` that ``kvscope`` and ``python -m app`` run; started
as ``kvscope --prefill-worker ...`` it is the disaggregation lesson's prefill worker instead (a bundle has no
``python -m``)."""

import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["--prefill-worker"]:
        from engine.run.disaggregation import worker_entry

        worker_entry(sys.argv[2:])
        sys.exit(0)
    from app.main import main

    sys.exit(main())
