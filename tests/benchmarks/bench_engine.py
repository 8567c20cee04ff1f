"""Does instrumenting cost anything? Whole runs, by the wall clock, with the sinks users really have.

The instrumented session and plain ``model.generate`` produce the same greedy tokens on the same model and
prompt, interleaved round by round (the order rotates, so drift in machine load hits every variant alike).
Each run is timed from the call to its return, so everything the instruments do between forward passes
(events, text pieces, KV bytes and positions, norms, the sink) is inside the figure. Sinks: the window's own
(``EngineWorker.push``: the outbox deque, the coalesced signal, memory notes), the trace writer (including
writing the file), and none. Decode tok/s is also timed from the consumer's side: when each token reached
the sink (session) or the stopping criterion (``generate``). Per-instrument costs are timed on their own.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from tests.benchmarks.common import machine, median, save

PROMPT = "Write a long story about a dragon who learns to bake bread. Describe every step."


class _Stamps:
    """A stopping criterion that never stops, only timestamps each new token (after a device sync)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.times = cuda, []

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _rate(stamps: list[float]) -> float:
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0


def generate_once(loaded, ids: list[int], n: int) -> dict:
    import torch
    from transformers import StoppingCriteriaList

    stamps = _Stamps(loaded.device.type == "cuda")
    x = torch.tensor([ids], device=loaded.device)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = loaded.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                                    stopping_criteria=StoppingCriteriaList([stamps]))
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "decode_tok_s": _rate(stamps.times), "tokens": out[0, len(ids):].tolist()}


def bare_compiled_once(session, ids: list[int], n: int) -> dict:
    """The compiled path with nothing around it: the session's own compiled graph (same graph, same static cache
    size, so nothing recompiles), an eager prefill as the session makes it, greedy argmax, no events, no reads."""
    import torch

    from engine.model import kvcache
    from engine.model.compiled import cache_length

    device = session.device
    length = cache_length(min(len(ids) + n, session.facts.max_context), session.facts.max_context)
    graph = session.compiled.graph(length, background=False)[0]
    stamps: list[float] = []
    tokens: list[int] = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        cache = kvcache.new_cache(session.model, length)
        logits = kvcache.forward(session.model, torch.tensor([ids], device=device), cache).logits
        for i in range(n):
            token = int(logits[0, -1].argmax())
            tokens.append(token)
            stamps.append(time.perf_counter())
            if i == n - 1 or token in session.eos_ids:
                break
            logits = session.compiled.run(graph, torch.tensor([[token]], device=device),
                                          torch.tensor([[len(ids) + i]], device=device), cache)
    return {"wall_s": time.perf_counter() - t0, "decode_tok_s": _rate(stamps), "tokens": tokens}


def window_sink():
    """The sink the window uses: the worker's push (no thread, no GUI: the GUI's own cost is bench_gui's)."""
    from app.link.worker import EngineWorker
    from app.state.run_control import RunControl

    worker = EngineWorker(RunControl())
    return worker, worker.push


def session_once(session, n: int, sink_name: str, compiled: bool = False) -> dict:
    from engine.facts.events import TokenStep
    from engine.facts.params import GenerationParams
    from engine.output.trace import TraceWriter

    stamps: list[float] = []
    writer = None
    if sink_name == "window":
        worker, push = window_sink()

        def sink(event: object) -> None:
            push(event)
            if isinstance(event, TokenStep):
                stamps.append(time.perf_counter())
    elif sink_name == "trace":
        folder = tempfile.mkdtemp(prefix="kvscope-bench-")
        writer = TraceWriter(os.path.join(folder, "run.jsonl"))

        def sink(event: object) -> None:
            writer(event)
            if isinstance(event, TokenStep):
                stamps.append(time.perf_counter())
    else:
        def sink(event: object) -> None:
            if isinstance(event, TokenStep):
                stamps.append(time.perf_counter())

    t0 = time.perf_counter()
    flags = {"static_cache": True, "compiled": True} if compiled else {}
    result = session.run(PROMPT, GenerationParams(max_new_tokens=n, **flags), sink)
    if writer is not None:
        writer.close()
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "decode_tok_s": _rate(stamps), "tokens": result.summary.token_ids,
            "cpu_share": result.summary.cpu_share}


def instrument_costs(session, reps: int = 300) -> dict[str, float]:
    """Microseconds per call of each instrument on a real cache (KV norms run once every 8 decode steps)."""
    import torch

    from engine.facts.events import to_dict
    from engine.facts.params import GenerationParams
    from engine.facts.textstream import TextStream
    from engine.model import kvcache

    ids = torch.tensor([session.encode(PROMPT)], device=session.device)
    cache = kvcache.new_cache(session.model)
    events: list = []
    session.run(PROMPT, GenerationParams(max_new_tokens=4), events.append)
    step = next(e for e in events if type(e).__name__ == "TokenStep")
    _worker, push = window_sink()
    with torch.inference_mode():
        kvcache.forward(session.model, ids, cache)

        def per_call(fn) -> float:
            fn()
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            return (time.perf_counter() - t) / reps * 1e6

        layers = session.facts.num_layers
        clock = session.clock
        stream = TextStream(session.tokenizer)
        return {
            "kv_bytes_and_positions_per_layer_us": per_call(lambda: kvcache.held_per_layer(cache, layers)),
            "clock_marks_us": per_call(lambda: clock.elapsed_ms(clock.mark(), clock.mark())),
            "kv_norms_batch_of_8_us": per_call(lambda: kvcache.norms(cache, ids.shape[1] - 8, ids.shape[1])),
            "text_piece_us": per_call(lambda: stream.step(1234)),
            "window_sink_push_us": per_call(lambda: push(step)),
            "trace_event_to_json_us": per_call(lambda: to_dict(step)),
        }


VARIANTS = ("generate", "window", "trace", "none")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="embedded")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--compiled", action="store_true",
                   help="the compiled path: the session compiled with each sink against the bare compiled loop")
    args = p.parse_args(argv)

    from engine.facts.contention import busy_note
    from engine.model.models import load
    from engine.run.session import Session

    loaded = load(args.model, args.device, args.dtype)
    session = Session(loaded)
    ids = session.encode(PROMPT)
    compiled = args.compiled

    def reference() -> dict:
        return bare_compiled_once(session, ids, args.tokens) if compiled else generate_once(loaded, ids, args.tokens)

    session_once(session, args.tokens if compiled else 8, "none", compiled)    # warm-up (compiles), not measured
    reference() if compiled else generate_once(loaded, ids, 8)
    rows: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        for variant in order:
            rows[variant].append(reference() if variant == "generate"
                                 else session_once(session, args.tokens, variant, compiled))
    reference = rows["generate"][0]["tokens"]
    same = all(row["tokens"] == reference for variant in VARIANTS for row in rows[variant])
    med = {v: {"wall_s": median([r["wall_s"] for r in rows[v]]),
               "decode_tok_s": median([r["decode_tok_s"] for r in rows[v]]),
               "wall_s_min": min(r["wall_s"] for r in rows[v]), "wall_s_max": max(r["wall_s"] for r in rows[v])}
           for v in VARIANTS}
    # Per round, generate()'s time over the variant's (the two ran minutes apart at most), then the median:
    # slow drift in the machine's load cancels out of each pair.
    ratios = {v: median([g["wall_s"] / r["wall_s"] for g, r in zip(rows["generate"], rows[v])])
              for v in VARIANTS if v != "generate"}
    shares = [r["cpu_share"] for v in VARIANTS if v != "generate" for r in rows[v] if r.get("cpu_share")]
    costs = instrument_costs(session)
    result = {
        "machine": machine(), "model": loaded.facts.name, "device": loaded.facts.device,
        "dtype": loaded.facts.dtype, "prompt_tokens": len(ids), "new_tokens": args.tokens, "rounds": args.rounds,
        "compiled": compiled, "same_tokens": same, "medians": med, "throughput_ratio_vs_reference": ratios,
        "lowest_cpu_share": min(shares) if shares else None, "instrument_us": costs,
        "raw": {v: [{k: r[k] for k in ("wall_s", "decode_tok_s")} for r in rows[v]] for v in VARIANTS},
    }
    print(f"machine: {result['machine']}")
    print(f"model: {result['model']} on {result['device']} ({result['dtype']}), prompt {len(ids)} tokens, "
          f"{args.tokens} new tokens, greedy, {args.rounds} interleaved rounds (medians); whole runs by the wall "
          "clock, call to return")
    print("| variant | whole run (s) | min-max (s) | throughput vs the reference (median of rounds) | "
          "decode tok/s (consumer side) |")
    print("|---|---:|---:|---:|---:|")
    for v in VARIANTS:
        ratio = "1 (reference)" if v == "generate" else f"{ratios[v]:.3f}"
        reference_name = "compiled forward alone (no instruments)" if compiled else "model.generate()"
        name = reference_name if v == "generate" else f"session{', compiled' if compiled else ''}, sink: {v}"
        print(f"| {name} | {med[v]['wall_s']:.3f} | {med[v]['wall_s_min']:.3f}-{med[v]['wall_s_max']:.3f} | "
              f"{ratio} | {med[v]['decode_tok_s']:.2f} |")
    print(f"same greedy tokens in every run: {'yes' if same else 'NO'}")
    note = busy_note(result["lowest_cpu_share"])
    if note:
        print(f"note: at least one run was {note}")
    print("instrument cost per call: " + ", ".join(f"{k} {v:.1f} us" for k, v in costs.items()))
    save(f"engine-{loaded.facts.device.split(':')[0]}-{loaded.facts.dtype}{'-compiled' if compiled else ''}", result)
    return result


if __name__ == "__main__":
    main()
