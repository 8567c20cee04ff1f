"""Decode and prefill on a busy machine: every format, eager and compiled, quiet and beside one and two CPU-bound
programs (started and stopped here, each bounded in time), with torch's thread count fixed (as KVScope shipped
before) and following the load (``engine.model.threads``), beside llama.cpp under the same load; each figure also
as a share of its own quiet figure. Rounds interleave the loads, medians are printed.

What it shows: the threads torch computes with spin at every barrier waiting for each other, so with as many
threads as cores and one other program, a thread the scheduler parks stalls the rest (a lecture recorded with a
screen recorder running). Run: ``python -m tests.benchmarks.bench_contention`` (``make bench`` does).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

from tests.benchmarks import llama_builds
from tests.benchmarks.common import machine, save

FORMATS = ("float32", "bfloat16", "int8", "int4")
LOADS = (0, 1, 2)                # CPU-bound programs beside the run
SETTLE_S = 0.8                   # a program already running when the run starts: the governor has seen it
HOG_S = 120                      # the most a load program lives, should this bench die before stopping it
PROMPT = "Explain in three sentences why decoding one token at a time is limited by memory bandwidth."
POLICIES = (("fixed", False), ("follows load", True))


@contextlib.contextmanager
def busy_programs(count: int) -> Iterator[None]:
    """``count`` processes that each keep a core busy (a loop on the clock), stopped on the way out."""
    code = f"import time\nend = time.monotonic() + {HOG_S}\nwhile time.monotonic() < end: pass\n"
    hogs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(count)]
    try:
        if count:
            time.sleep(SETTLE_S)
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def kvscope_run(session, prompt: str, tokens: int, compiled: bool) -> dict:
    from engine.facts.params import GenerationParams

    flags = {"static_cache": True, "compiled": True} if compiled else {}
    result = session.run(prompt, GenerationParams(max_new_tokens=tokens, chat_template=False, **flags))
    s = result.summary
    return {"decode_tok_s": s.decode_tok_s, "prefill_tok_s": s.prefill_tok_s or 0.0, "cpu_share": s.cpu_share,
            "notes": list(s.notes)}


def llama_cpp_run(llm, prompt: str, tokens: int) -> dict:
    llm.reset()
    stamps = []
    started = time.perf_counter()
    for _chunk in llm.create_completion(prompt, max_tokens=tokens, temperature=0.0, top_k=1, stream=True):
        stamps.append(time.perf_counter())
    prompt_tokens = len(llm.tokenize(prompt.encode()))
    return {"decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0,
            "prefill_tok_s": prompt_tokens / (stamps[0] - started)}


def share_words(values: list[float], quiet: float) -> str:
    figure = statistics.median(values)
    return f"{figure:6.1f} ({figure / quiet:4.0%})" if quiet else f"{figure:6.1f}"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    p.add_argument("--no-compiled", dest="compiled", action="store_false", help="eager runs only")
    args = p.parse_args(argv)
    build = llama_builds.chosen()
    if build is not None:
        sys.path.insert(0, build["folder"])
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        llama_cpp = None
        print("llama-cpp-python is not built (python -m tests.benchmarks.llama_builds): no llama.cpp rows")

    import torch

    from engine.model import threads
    from engine.model.models import load
    from engine.run.session import Session
    from tests.benchmarks.bench_formats import LLAMA_CONTEXT, PAIRS, gguf_variants

    gov = threads.governor()
    ceiling = torch.get_num_threads()
    print(f"{machine()}; {os.cpu_count()} cores; loads: {', '.join(str(n) for n in LOADS)} busy loops beside the run; "
          f"{args.tokens} tokens, {args.rounds} interleaved rounds, medians; tok/s (share of its quiet figure)")
    ggufs = {}
    if llama_cpp is not None:
        folder = llama_builds.BUILDS / "gguf"
        folder.mkdir(parents=True, exist_ok=True)
        ggufs = gguf_variants(folder)
    rows = []
    llama_threads = None
    for fmt in args.formats:
        loaded = load("embedded", "cpu", fmt)
        runners = {"eager": (Session(loaded), False)}
        if args.compiled:
            runners["compiled"] = (Session(load("embedded", "cpu", fmt)), True)
        prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                                      add_generation_prompt=True, tokenize=False)
        llm = None
        gguf = ggufs.get(next(name for f, name, _t in PAIRS if f == fmt))
        if gguf is not None:
            from llama_cpp import Llama

            llm = Llama(model_path=str(gguf), n_ctx=LLAMA_CONTEXT, verbose=False)   # its default threads
            llama_threads = llm.n_threads
            llama_cpp_run(llm, prompt, 4)
        for session, compiled in runners.values():
            kvscope_run(session, prompt, 4, compiled)              # warm-up; a compiled one builds its graph here
        figures: dict[tuple[str, str, int], list[dict]] = {}
        for _ in range(args.rounds):
            for load_count in LOADS:
                with busy_programs(load_count):
                    for mode, (session, compiled) in runners.items():
                        for policy, follows in POLICIES:
                            gov.enabled = follows
                            torch.set_num_threads(ceiling)           # each run starts from every thread
                            figures.setdefault((mode, policy, load_count), []).append(
                                kvscope_run(session, prompt, args.tokens, compiled))
                    if llm is not None:
                        figures.setdefault(("llama.cpp", "its own", load_count), []).append(
                            llama_cpp_run(llm, prompt, args.tokens))
        gov.enabled = True
        torch.set_num_threads(ceiling)
        for (mode, policy) in sorted({(m, p) for m, p, _n in figures}):
            row = {"format": fmt, "mode": mode, "policy": policy}
            for what in ("decode_tok_s", "prefill_tok_s"):
                quiet = statistics.median(r[what] for r in figures[(mode, policy, 0)])
                row[what] = {str(n): [r[what] for r in figures[(mode, policy, n)]] for n in LOADS}
                row[f"{what}_share"] = {str(n): statistics.median(r[what] for r in figures[(mode, policy, n)]) / quiet
                                        if quiet else None for n in LOADS}
            row["notes"] = sorted({n for r in figures[(mode, policy, 1)] for n in r.get("notes", ())
                                   if "thread" in n})
            rows.append(row)
    print(f"\n{'format':9} {'run':10} {'threads':13} | {'decode quiet':>12} {'1 busy':>14} {'2 busy':>14} | "
          f"{'prefill quiet':>13} {'1 busy':>14} {'2 busy':>14}")
    for row in rows:
        cells = []
        for what in ("decode_tok_s", "prefill_tok_s"):
            quiet = statistics.median(row[what]["0"])
            cells.append(f"{quiet:12.1f} " + " ".join(f"{share_words(row[what][str(n)], quiet):>14}"
                                                       for n in LOADS[1:]))
        print(f"{row['format']:9} {row['mode']:10} {row['policy']:13} | {cells[0]} | {cells[1]}")
    if llama_threads is not None:
        print(f"llama.cpp: llama-cpp-python's defaults, {llama_threads} thread(s) here (half the cores), and its "
              "own wait (its Python binding sets no polling)")
    save("contention", {"machine": machine(), "rows": rows, "tokens": args.tokens, "rounds": args.rounds,
                        "llama_cpp_threads": llama_threads})
    return {"rows": rows}


if __name__ == "__main__":
    main()
