"""Weight formats side by side: KVScope's float32 / bfloat16 / int8 / int4, eager and compiled (torch.compile over
the static cache), against llama.cpp (llama-cpp-python, bench-only) at the nearest bit widths,
on the same weights, prompt and thread count; prefill eager and through the compiled prefill package (a compiled
run's, up to its longest prompt); and what compiling costs on a machine's first launch and later ones.

Every GGUF is made from the embedded SmolLM2 Q4_1 GGUF with llama.cpp's own ``llama_model_quantize``
(requantizing): F32, BF16, Q8_0 and Q4_0 hold the same dequantized values KVScope converts to float32, so
the formats differ in storage only. Both tools are timed the same way, from the consumer's side: when each
token reached the caller (KVScope's sink, llama.cpp's stream), over a whole run; rounds interleave the two.
Each figure is also given as a ratio to this machine's measured ceilings (bandwidth for decode, the matmul
peak for prefill). Run: ``python -m tests.benchmarks.bench_formats`` (``make bench`` does).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.benchmarks import llama_builds
from tests.benchmarks.common import copy_words, machine, save

PAIRS = (("float32", "F32", 0), ("bfloat16", "BF16", 32), ("int8", "Q8_0", 7), ("int4", "Q4_0", 2))
PROMPT = "Explain in three sentences why decoding one token at a time is limited by memory bandwidth."


def gguf_variants(folder: Path) -> dict[str, Path]:
    import llama_cpp

    from engine.model import embedded

    source = embedded.embedded_gguf()
    out = {}
    for _fmt, name, ftype in PAIRS:
        target = folder / f"smollm2-135m-{name.lower()}.gguf"
        if not target.exists():
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = ftype
            params.allow_requantize = True
            params.nthread = 2
            if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params) != 0:
                raise RuntimeError(f"llama_model_quantize could not make {name}")
        out[name] = target
    return out


def llama_cpp_run(llm, prompt: str, tokens: int) -> dict:
    llm.reset()                        # no prompt reuse from the last run: both tools prefill the whole prompt
    stamps = []
    started = time.perf_counter()
    for _chunk in llm.create_completion(prompt, max_tokens=tokens, temperature=0.0, top_k=1, stream=True):
        stamps.append(time.perf_counter())
    return {"ttft_ms": (stamps[0] - started) * 1000.0,
            "decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0,
            "tokens": len(stamps)}


COMPILED = {"static_cache": True, "compiled": True}
STATIC = {"static_cache": True}
PREFILL_LENGTHS = (32, 128, 512, 4096)
PREFILL_TEXT = " ".join([PROMPT, "The weights are read once per step whatever the batch; the keys and values grow "
                         "with every token, and the arithmetic per byte decides which limit binds."] * 100)
LLAMA_CONTEXT = max(1024, max(PREFILL_LENGTHS) + 64)     # llama.cpp's context: the longest prefill fits


def kvscope_run(session, prompt: str, tokens: int, compiled: bool = False, static: bool = False) -> dict:
    """Consumer-side token times. The session waits for its compiled graph before the first decode step, so
    the gap before step 1 is compile time when the run built a graph (``compile_ms``) and is left out."""
    from engine.facts.events import TokenStep
    from engine.facts.params import GenerationParams

    stamps: list[float] = []
    steps: list[TokenStep] = []

    def sink(event: object) -> None:
        if isinstance(event, TokenStep):
            stamps.append(time.perf_counter())
            steps.append(event)

    started = time.perf_counter()
    flags = COMPILED if compiled else STATIC if static else {}
    result = session.run(prompt, GenerationParams(max_new_tokens=tokens, chat_template=False, **flags), sink)
    s = result.summary
    decode = stamps[1:] if s.compile_ms else stamps
    return {"ttft_ms": (stamps[0] - started) * 1000.0,
            "decode_tok_s": (len(decode) - 1) / (decode[-1] - decode[0]) if len(decode) > 1 else 0.0,
            "tokens": len(stamps), "cpu_share": s.cpu_share, "compile_ms": s.compile_ms, "token_ids": s.token_ids,
            "compile_loaded": s.compile_loaded, "steps": steps, "notes": list(s.notes),
            "failed": getattr(result, "message", "")}


def compiled_verdict(fmt: str, eager: list[dict], compiled: list[dict]) -> str:
    """"" when every compiled run gave eager's tokens (or first differed at a near tie: rounding), else why the
    format's compiled decode is wrong: a failed run, a step that fell back to eager, or a difference where eager's
    first choice was well ahead."""
    from engine.facts.parity import first_divergence

    for ours, theirs in zip(eager, compiled):
        if theirs["failed"]:
            return f"the compiled run failed: {theirs['failed']}"
        fell_back = [n for n in theirs["notes"] if "not numbers" in n or "is not used" in n]
        if fell_back:
            return fell_back[0]
        divergence = first_divergence(ours["steps"], theirs["steps"], fmt)
        if divergence is not None and not divergence.near_tie:
            return divergence.words()
    return ""


def tie_words(fmt: str, eager: list[dict], compiled: list[dict]) -> str:
    """Where compiled tokens first differed at a near tie, the margin (for the table); "" where they agree."""
    from engine.facts.parity import first_divergence

    found = [d for o, c in zip(eager, compiled) if (d := first_divergence(o["steps"], c["steps"], fmt)) is not None]
    return f" (tokens: {found[0].words()})" if found else ""


def prefill_times(session, compiled_session, llm, lengths: tuple[int, ...], rounds: int) -> list[dict]:
    """One forward pass over the first ``n`` tokens of the same text, fresh cache each time: KVScope's prefill
    (``Session.timed_prefill``, the forward alone), eager and through the compiled prefill package (what a
    compiled run's prefill goes through once the package is built), beside llama.cpp's prompt processing
    (``Llama.eval`` after a reset, which computes the last position's logits), interleaved, medians of
    ``rounds``."""
    ours_ids = session.encode(PREFILL_TEXT, chat_template=False)
    theirs_ids = llm.tokenize(PREFILL_TEXT.encode(), add_bos=True) if llm is not None else []
    package = compiled_session.compiled_prefill
    if package is not None:
        package.build()
    out = []
    for n in lengths:
        if n > len(ours_ids):
            continue
        ours, packed, theirs = [], [], []
        packaged = package is not None and package.ready(n)      # else a compiled run prefills eagerly
        session.timed_prefill(ours_ids[:n])                      # warm-up at this length
        if packaged:
            compiled_session.timed_prefill(ours_ids[:n], compiled=True)
        for _ in range(rounds):
            ours.append(session.timed_prefill(ours_ids[:n])[0])
            if packaged:
                packed.append(compiled_session.timed_prefill(ours_ids[:n], compiled=True)[0])
            if llm is not None and n <= len(theirs_ids):
                llm.reset()
                started = time.perf_counter()
                llm.eval(theirs_ids[:n])
                theirs.append((time.perf_counter() - started) * 1000.0)
        row = {"tokens": n, "kvscope_ms": statistics.median(ours)}
        if packed:
            row["compiled_ms"] = statistics.median(packed)
        if theirs:
            row["llama_cpp_ms"] = statistics.median(theirs)
        out.append(row)
    return out


def prefill_cell(p: dict) -> str:
    """One length's cell: eager / compiled / llama.cpp tok/s (a figure not measured is left out) and the best
    of KVScope's over llama.cpp's."""
    rates = {k: p["tokens"] / p[k] * 1000.0 for k in ("kvscope_ms", "compiled_ms", "llama_cpp_ms") if k in p}
    cell = " / ".join(f"{rates[k]:,.0f}" if k in rates else "-" for k in ("kvscope_ms", "compiled_ms", "llama_cpp_ms"))
    if "llama_cpp_ms" in rates:
        best = max(rates.get("kvscope_ms", 0.0), rates.get("compiled_ms", 0.0))
        cell += f" ({best / rates['llama_cpp_ms']:.2f})"
    return cell


def prefill_package_said(session) -> str:
    """How the compiled session's prefill package came to be: built (how long), read, or why there is none."""
    graph = session.compiled_prefill.graph if session.compiled_prefill else None
    if graph is None:
        return "none (not a CPU)"
    if graph.step is None:
        return f"none: {graph.error}"
    return f"{'read' if graph.loaded else 'built'} in {graph.compile_ms / 1000:,.1f} s"


def compile_launches(dtype: str, launches: int = 2) -> list[dict]:
    """Compile time of a fresh process, ``launches`` times over one empty graph cache: the first launch on a
    machine compiles from nothing, later ones find torch's cached graphs. Each launch is ``launch_child``."""
    cache = tempfile.mkdtemp(prefix="kvscope-compile-")
    out = []
    for _ in range(launches):
        started = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "tests.benchmarks.bench_formats", "--launch-child", dtype],
                           capture_output=True, text=True, timeout=900,
                           env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache})
        if r.returncode != 0:
            raise RuntimeError(f"compiled run failed: {r.stderr.strip().splitlines()[-1:]}")
        out.append({**json.loads(r.stdout.strip().splitlines()[-1]), "process_s": time.perf_counter() - started})
    return out


def launch_child(dtype: str) -> None:
    """A launch as the CLI makes it (load, one compiled run that waits for its graph), printing its compile time
    and decode rate as JSON."""
    from engine.facts.params import GenerationParams
    from engine.model.models import load
    from engine.run.session import Session

    session = Session(load("embedded", "cpu", dtype))
    s = session.run(PROMPT, GenerationParams(max_new_tokens=32, **COMPILED)).summary
    print(json.dumps({"compile_ms": s.compile_ms, "decode_tok_s": s.decode_tok_s, "loaded": s.compile_loaded,
                      "prefill_package": prefill_package_said(session), "token_ids": s.token_ids}))


def all_launches() -> dict[str, list[dict]]:
    return {dtype: compile_launches(dtype) for dtype in ("float32", "bfloat16")}


def print_launches(launches: dict[str, list[dict]]) -> dict:
    for name, runs in launches.items():
        print(f"compile, fresh processes over one graph cache ({name}): "
              + ", then ".join(f"{x['compile_ms'] / 1000:,.1f} s"
                               + (" (read the saved graph)" if x.get("loaded") else " (built)") for x in runs)
              + " (first launch, then later); prefill package "
              + ", then ".join(x.get("prefill_package", "?") for x in runs)
              + "; decode " + ", ".join(f"{x['decode_tok_s']:.1f}" for x in runs)
              + " tok/s; greedy tokens "
              + ("the same in every launch" if len({tuple(x["token_ids"]) for x in runs}) == 1 else "DIFFER"))
    return {"compile_launches": launches}


def kernel_of(loaded) -> str:
    """The kernel a loaded model's products go through: the measured choice for float weights, the quantized
    format's own packed kernel otherwise."""
    names = {"int8": "_weight_int8pack_mm", "int4": "_weight_int4pack_mm_for_cpu"}
    if loaded.facts.weight_format in names:
        return names[loaded.facts.weight_format]
    return loaded.kernel.kernel if loaded.kernel is not None else "aten"


def print_kernels(rows: list[dict]) -> None:
    """Per format: the chosen kernel and every candidate's products (achieved: the weights' bytes over the
    measured time), the best decode's bandwidth (achieved: a step's bytes times the measured rate) beside the
    copy bandwidth (measured), and llama.cpp's decode on the same values."""
    print("| KVScope weights | products' kernel: chosen (each candidate's step, achieved GB/s) | best decode tok/s | "
          "bandwidth reached | of copy bandwidth | llama.cpp tok/s | best / llama.cpp |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        best = max(r["kvscope_decode_tok_s"], r["compiled_decode_tok_s"])
        reached = best * r["step_bytes"] / 1e9
        timings = ", ".join(f"{k} {ms:.2f} ms = {r['kernel_gb_s'][k]:.1f} GB/s"
                            for k, ms in sorted(r["kernel_step_ms"].items(), key=lambda kv: kv[1]))
        copy = r["bandwidth_gb_s"]
        theirs = r.get("llama_cpp_decode_tok_s")
        print(f"| {r['kvscope']} | {r['kernel']}{f' ({timings})' if timings else ''} | {best:.1f} | "
              f"{reached:.1f} GB/s | {copy_words(reached, copy)} | "
              f"{f'{theirs:.1f}' if theirs else '-'} | {f'{best / theirs:.2f}' if theirs else '-'} |")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--formats", nargs="+", choices=[fmt for fmt, _name, _ftype in PAIRS],
                   default=[fmt for fmt, _name, _ftype in PAIRS], help="KVScope's weight formats to time (all)")
    p.add_argument("--launch-child", metavar="DTYPE", help=argparse.SUPPRESS)
    p.add_argument("--launches-only", action="store_true", help="only the fresh-process compile times")
    p.add_argument("--no-launches", dest="launches", action="store_false",
                   help="skip the first- and second-launch compile times (two fresh processes per dtype)")
    args = p.parse_args(argv)
    if args.launch_child:
        launch_child(args.launch_child)
        return {}
    if args.launches_only:
        return print_launches(all_launches())
    build = llama_builds.chosen()            # llama.cpp at its best here: python -m tests.benchmarks.llama_builds
    if build is not None:
        sys.path.insert(0, build["folder"])
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python is not built: python -m tests.benchmarks.llama_builds (make bench runs it; "
              "minutes) builds the best build that runs here; the llama.cpp rows are left out")
        llama_cpp = None

    import torch

    from engine.facts.costmodel import ModelCost
    from engine.model import hardware
    from engine.model.models import load
    from engine.run.session import Session

    torch.set_num_threads(args.threads)
    folder = Path(os.environ.get("KVSCOPE_BENCH_DIR", tempfile.mkdtemp())) / "gguf"
    folder.mkdir(parents=True, exist_ok=True)
    ggufs = gguf_variants(folder) if llama_cpp is not None else {}
    rows = []
    for fmt, name, _ftype in [pair for pair in PAIRS if pair[0] in args.formats]:
        loaded = load("embedded", "cpu", fmt)
        session = Session(loaded)
        prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                                      add_generation_prompt=True, tokenize=False)
        peaks = hardware.quiet_peaks(loaded.device, loaded.model.dtype)     # None: no quiet measurement
        step = ModelCost(loaded.facts).decode(64)
        llm = None
        if name in ggufs:
            from llama_cpp import Llama

            llm = Llama(model_path=str(ggufs[name]), n_threads=args.threads, n_ctx=LLAMA_CONTEXT, verbose=False,
                        logits_all=False)
        compiled_session = Session(load("embedded", "cpu", fmt))       # a model of its own (graphs are per model)
        kvscope_run(session, prompt, 4)                                # warm-up all of them
        first = kvscope_run(compiled_session, prompt, 4, compiled=True)
        if llm is not None:
            llama_cpp_run(llm, prompt, 4)
        ours, compiled, theirs, static = [], [], [], []
        for _ in range(args.rounds):
            ours.append(kvscope_run(session, prompt, args.tokens))
            compiled.append(kvscope_run(compiled_session, prompt, args.tokens, compiled=True))
            if fmt == "bfloat16":                     # eager over the static cache: what compiling gives
                static.append(kvscope_run(session, prompt, args.tokens, static=True))
            if llm is not None:
                theirs.append(llama_cpp_run(llm, prompt, args.tokens))
        row = {"kvscope": fmt, "weights_mib": loaded.facts.weight_bytes / 2**20,
               "kvscope_decode_tok_s": statistics.median(r["decode_tok_s"] for r in ours),
               "kvscope_ttft_ms": statistics.median(r["ttft_ms"] for r in ours),
               "compiled_decode_tok_s": statistics.median(r["decode_tok_s"] for r in compiled),
               "compiled_ttft_ms": statistics.median(r["ttft_ms"] for r in compiled),
               "compile_ms_in_process": first["compile_ms"], "compile_loaded": first["compile_loaded"],
               "compiled_same_tokens": all(r["token_ids"] == o["token_ids"] for r, o in zip(compiled, ours)),
               "compiled_wrong": compiled_verdict(fmt, ours, compiled),
               "compiled_tie": tie_words(fmt, ours, compiled),
               "decode_ceiling_tok_s": peaks.bytes_per_s / step.bytes if peaks else None,
               "bandwidth_gb_s": peaks.bytes_per_s / 1e9 if peaks else None, "step_bytes": step.bytes,
               "kernel": kernel_of(loaded), "kernel_step_ms": dict(loaded.kernel.step_ms) if loaded.kernel else {},
               "kernel_gb_s": {k: v / 1e9 for k, v in loaded.kernel.reached_bytes_per_s().items()}
               if loaded.kernel else {},
               "lowest_cpu_share": min((r["cpu_share"] for r in ours + compiled if r["cpu_share"]), default=None),
               "prefill": prefill_times(session, compiled_session, llm, PREFILL_LENGTHS, args.rounds),
               "prefill_package": prefill_package_said(compiled_session)}
        if static:
            row["static_decode_tok_s"] = statistics.median(r["decode_tok_s"] for r in static)
        if theirs:
            row.update({"llama_cpp": name, "llama_cpp_build": build["name"] if build else "installed",
                        "gguf_mib": ggufs[name].stat().st_size / 2**20,
                        "llama_cpp_decode_tok_s": statistics.median(r["decode_tok_s"] for r in theirs),
                        "llama_cpp_ttft_ms": statistics.median(r["ttft_ms"] for r in theirs)})
        rows.append(row)
        del session, compiled_session, loaded, llm
    launches = all_launches() if args.launches else {}
    result = {"machine": machine(), "threads": args.threads, "tokens": args.tokens, "rounds": args.rounds,
              "rows": rows, "compile_launches": launches, "llama_cpp_build": build}
    print(f"machine: {result['machine']}; {args.threads} threads both; {args.tokens} new tokens, greedy, "
          f"{args.rounds} interleaved rounds (medians); decode tok/s from consumer-side token times, both tools")
    if build is not None:
        print(f"llama.cpp: the {build['name']} build ({build['why']})"
              + "".join(f"; passed over {note}" for note in build["passed_over"]))
    print("| KVScope weights | MiB | eager tok/s | compiled tok/s | of ceiling (best) | TTFT ms eager / compiled | "
          "llama.cpp | GGUF MiB | decode tok/s | TTFT ms | eager / llama.cpp | compiled / llama.cpp |")
    print("|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        best = max(r["kvscope_decode_tok_s"], r["compiled_decode_tok_s"])
        same = f" (WRONG: {r['compiled_wrong']})" if r["compiled_wrong"] else r["compiled_tie"]
        line = (f"| {r['kvscope']} | {r['weights_mib']:.0f} | {r['kvscope_decode_tok_s']:.1f} | "
                f"{r['compiled_decode_tok_s']:.1f}{same} | "
                f"{hardware.share_of_ceiling(best, r['decode_ceiling_tok_s'])} | "
                f"{r['kvscope_ttft_ms']:.0f} / {r['compiled_ttft_ms']:.0f} |")
        if "llama_cpp" in r:
            theirs = r["llama_cpp_decode_tok_s"]
            line += (f" {r['llama_cpp']} ({r['llama_cpp_build']}) | {r['gguf_mib']:.0f} | {theirs:.1f} | "
                     f"{r['llama_cpp_ttft_ms']:.0f} | "
                     f"{r['kvscope_decode_tok_s'] / theirs:.2f} | {r['compiled_decode_tok_s'] / theirs:.2f} |")
        print(line)
    for r in rows:
        if "static_decode_tok_s" in r:
            theirs = r.get("llama_cpp_decode_tok_s")
            ratio = f", {r['static_decode_tok_s'] / theirs:.2f} of llama.cpp" if theirs else ""
            print(f"{r['kvscope']}, eager over the static cache: {r['static_decode_tok_s']:.1f} tok/s{ratio}")
    print_kernels(rows)
    print("prefill, one forward pass over the same text's first N tokens, tok/s: KVScope eager / compiled (the "
          "prefill package) / llama.cpp eval, and KVScope's best / llama.cpp:")
    print("| KVScope weights | llama.cpp | " + " | ".join(f"{n} tokens" for n in PREFILL_LENGTHS) + " |")
    print("|---|---|" + "---:|" * len(PREFILL_LENGTHS))
    for r in rows:
        print(f"| {r['kvscope']} | {r.get('llama_cpp', '-')} | " + " | ".join(map(prefill_cell, r["prefill"])) + " |")
    for r in rows:
        print(f"prefill package ({r['kvscope']}): {r['prefill_package']}")
    for r in rows:
        how = "read, saved by an earlier launch" if r["compile_loaded"] else "built"
        print(f"compile, in this process ({r['kvscope']}): {r['compile_ms_in_process'] / 1000:,.1f} s (the decode "
              f"graph {how}; the prefill package {r['prefill_package']})")
    print_launches(launches)
    print("ceiling: the measured copy bandwidth over the bytes one decode step reads (weights + KV), computed; "
          "a copy measured on a busy machine gives none")
    save("formats", result)
    wrong = [f"{r['kvscope']}: {r['compiled_wrong']}" for r in rows if r["compiled_wrong"]]
    if wrong:
        raise SystemExit("compiled decode is wrong in " + "; ".join(wrong))
    return result


if __name__ == "__main__":
    main()
