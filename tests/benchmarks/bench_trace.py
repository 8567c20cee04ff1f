"""Reading traces with validation on: MB/s for a full-context run of the embedded model and for a 200 MB file,
and how long the window takes to open the full-context run and a run with a 100k-token prompt, with no space in
it and as words (instant replay, until every panel has drawn).

The full-context run is built from a real run of the embedded model (its first 64 tokens, with the model's
real facts, candidates and norms) extended step by step to the end of the context: positions, times and the
bytes each layer holds continue as the real run would (bytes by the formula the engine's own tests check
against the tensors). Running the real thing takes about 18 minutes on 2 cores (``bench_long``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time

from tests.benchmarks.common import machine, save

PROMPT = "Write a long story about a dragon who learns to bake bread. Describe every step."


def full_context_events(session) -> list:
    from engine.facts import kvformula
    from engine.facts.events import KVNorms, RunFinished, TokenStep
    from engine.facts.params import GenerationParams

    events: list = []
    session.run(PROMPT, GenerationParams(max_new_tokens=64), events.append)
    facts = events[0].model
    steps = [e for e in events if isinstance(e, TokenStep)]
    norms = [e for e in events if isinstance(e, KVNorms)]
    out = [e for e in events if not isinstance(e, RunFinished)]
    last, template = steps[-1], steps[-2]
    step_ms = template.latency_ms
    t, norms_end = last.t_ms, norms[-1].first_position + len(norms[-1].k_norms[0])
    column = [[row[-1]] for row in norms[-1].k_norms]
    for step in range(last.step + 1, kvformula.full_context_positions(facts) - last.position + last.step + 1):
        position = last.position + step - last.step
        t += step_ms
        sizes = [[b // 2, b // 2] for b in kvformula.predicted_kv_bytes_per_layer(facts, position)]
        held = [kvformula.held_positions(layer, position) for layer in facts.kv_layers]
        out.append(dataclasses.replace(template, t_ms=t, step=step, position=position, kv_bytes_per_layer=sizes,
                                       kv_positions_per_layer=held))
        if step % 8 == 0:
            span = position - norms_end
            out.append(KVNorms(last.run_id, t, norms_end, [c * span for c in column], [c * span for c in column]))
            norms_end = position
    summary = dataclasses.replace(events[-1].summary, generated_tokens=step + 1, decode_runs=step,
                                  kv_tokens=position, kv_bytes=sum(map(sum, sizes)), token_ids=[], text="")
    out.append(RunFinished(last.run_id, t, "context_full", summary))
    return out


def long_prompt_events(session, tokens: int, spaced: bool) -> list:
    """A run whose prompt is ``tokens`` tokens of base64 (no space anywhere) or of words, built from a real run
    of the embedded model: the prompt, its prefill and the cache bytes scaled to that length by the formula, the
    model's context raised to hold it (a model of 128k context, as the window would meet one)."""
    from engine.facts import kvformula
    from engine.facts.events import KVNorms, PrefillDone, RunFinished, RunStarted, TokenStep
    from engine.facts.params import GenerationParams

    events: list = []
    session.run(PROMPT, GenerationParams(max_new_tokens=8), events.append)
    started = events[0]
    facts = dataclasses.replace(started.model, max_context=1 << 17)
    pieces = ([" the", " cache", " keeps"] if spaced else ["QUJD", "REVG", "R0hJ"]) * (tokens // 3 + 1)
    pieces = pieces[:tokens]
    shift = tokens - len(started.prompt_ids)

    def bytes_at(positions: int) -> list[list[int]]:
        return [[b // 2, b // 2] for b in kvformula.predicted_kv_bytes_per_layer(facts, positions)]

    out: list = []
    for e in events:
        if isinstance(e, RunStarted):
            out.append(dataclasses.replace(e, model=facts, prompt="".join(pieces)[:1_000_000],
                                           prompt_ids=[1] * tokens, prompt_pieces=pieces))
        elif isinstance(e, PrefillDone):
            out.append(dataclasses.replace(e, n_tokens=tokens, kv_bytes_per_layer=bytes_at(tokens),
                                           kv_positions_per_layer=[tokens] * facts.num_layers))
        elif isinstance(e, TokenStep):
            held = e.kv_positions_per_layer[0] + shift
            out.append(dataclasses.replace(e, position=e.position + shift, kv_bytes_per_layer=bytes_at(held),
                                           kv_positions_per_layer=[held] * facts.num_layers))
        elif isinstance(e, RunFinished):
            s = e.summary
            out.append(dataclasses.replace(e, summary=dataclasses.replace(
                s, prompt_tokens=tokens, kv_tokens=s.kv_tokens + shift,
                kv_bytes=sum(map(sum, bytes_at(s.kv_tokens + shift))))))
        elif not isinstance(e, KVNorms):
            out.append(e)
    return out


def renamed(events: list, suffix: str) -> list:
    return [dataclasses.replace(e, run_id=e.run_id + suffix) if hasattr(e, "run_id") else e for e in events]


def read_rate(path: str, repeats: int = 3) -> tuple[float, float, int]:
    from engine.output.trace import read_trace

    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        events = read_trace(path)
        best = min(best, time.perf_counter() - started)
    size = os.path.getsize(path)
    return size / best / 1e6, best, len(events)


def window_open_seconds(path: str) -> float:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtCore import QEventLoop, QTimer

    from app.main import build, dispose, parse_args

    app, window = build(parse_args(["--no-load"]))
    window.show()
    window.controller.replay_speed = 0.0
    started = time.perf_counter()
    window.files.open_trace(path)
    while window.client.busy is not None or window.store.current is None or not window.store.current.finished:
        loop = QEventLoop()
        QTimer.singleShot(5, loop.quit)
        loop.exec()
    window.refresh(force=True)
    while window.tokens.behind:                           # a long text fills in over a few refreshes
        loop = QEventLoop()
        QTimer.singleShot(5, loop.quit)
        loop.exec()
    app.processEvents()
    seconds = time.perf_counter() - started
    window.close()
    dispose(app, window)
    return seconds


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--big-mb", type=int, default=200, help="size of the large trace to read (MB)")
    p.add_argument("--long-prompt", type=int, default=100_000, help="tokens in the long-prompt run to open")
    args = p.parse_args(argv)
    os.environ.setdefault("KVSCOPE_SETTINGS", os.path.join(tempfile.mkdtemp(), "settings.ini"))

    from engine.model.models import load
    from engine.output.trace import write_trace
    from engine.run.session import Session

    session = Session(load("embedded", "cpu", "float32"))
    events = full_context_events(session)
    folder = tempfile.mkdtemp(prefix="kvscope-bench-trace-")
    one = str(write_trace(os.path.join(folder, "full-context.jsonl"), events))
    one_mb = os.path.getsize(one) / 1e6
    copies = max(1, round(args.big_mb / one_mb))
    big = str(write_trace(os.path.join(folder, "big.jsonl"),
                          (e for i in range(copies) for e in renamed(events, f"-{i}"))))
    rate_one, seconds_one, n_one = read_rate(one)
    rate_big, seconds_big, n_big = read_rate(big, repeats=1)
    opened = window_open_seconds(one)
    long_prompt = {}
    for spaced in (False, True):
        path = str(write_trace(os.path.join(folder, f"long-prompt-{'words' if spaced else 'base64'}.jsonl"),
                               long_prompt_events(session, args.long_prompt, spaced)))
        long_prompt["words" if spaced else "base64"] = window_open_seconds(path)
    result = {"machine": machine(), "full_context_trace_mb": one_mb, "full_context_events": n_one,
              "full_context_read_mb_s": rate_one, "big_trace_mb": os.path.getsize(big) / 1e6, "big_events": n_big,
              "big_read_mb_s": rate_big, "big_read_s": seconds_big, "window_open_s": opened,
              "long_prompt_tokens": args.long_prompt, "long_prompt_open_s": long_prompt}
    print(f"machine: {result['machine']}")
    print(f"full-context run of the embedded model: {one_mb:,.1f} MB, {n_one:,} events, read with validation at "
          f"{rate_one:,.1f} MB/s ({seconds_one:.2f} s)")
    print(f"{result['big_trace_mb']:,.0f} MB trace ({copies} such runs, {n_big:,} events): read at {rate_big:,.1f} "
          f"MB/s ({seconds_big:.1f} s)")
    print(f"the window opens the full-context run (instant replay, every panel drawn) in {opened:.2f} s")
    print(f"the window opens a run with a {args.long_prompt:,}-token prompt in {long_prompt['base64']:.2f} s with no "
          f"space in it (base64), {long_prompt['words']:.2f} s as words")
    save("trace", result)
    return result


if __name__ == "__main__":
    main()
