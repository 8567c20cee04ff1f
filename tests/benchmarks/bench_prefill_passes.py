"""What a prefill in passes costs against one pass: the embedded model, one long prompt, the same cache, one pass
vs passes of 512, 256 and 128 positions (a window's run goes in passes of at most half a second when one pass
would take longer, so Stop acts between them). Median of three after a warm-up, by the wall clock."""

from __future__ import annotations

import argparse
import statistics

from tests.benchmarks.common import machine


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="embedded")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    from engine.facts.events import PrefillDone
    from engine.facts.params import GenerationParams
    from engine.model.models import load
    from engine.run.session import RunOptions, Session

    loaded = load(args.model, device="cpu", dtype="auto")
    text = " ".join(["The KV cache keeps the keys and values of every position already read, so decode reads "
                     "it."] * 60)
    rows, baseline = {}, None
    print(f"{loaded.facts.name}, {loaded.facts.dtype} on {machine()}")
    print("passes of | passes | prefill ms (median) | vs one pass")
    print("----------+--------+---------------------+------------")
    for chunk in (0, 512, 256, 128):
        session = Session(loaded, RunOptions(prefill_chunk=chunk))
        times, done = [], None
        for repeat in range(1 + args.repeats):
            events: list = []
            session.run(text, GenerationParams(max_new_tokens=1, chat_template=False), events.append)
            done = next(e for e in events if isinstance(e, PrefillDone))
            if repeat:
                times.append(done.forward_ms)
        median = statistics.median(times)
        baseline = baseline or median
        rows[chunk] = {"positions": done.n_tokens, "passes": done.passes, "prefill_ms": median}
        print(f"{chunk or 'all':>9} | {done.passes:6d} | {median:19,.0f} | {median / baseline - 1:+10.0%}")
    return rows


if __name__ == "__main__":
    main()
