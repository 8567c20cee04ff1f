"""The CLI's subcommands: ``costmodel`` (the analytic model, and the seed's worked example), ``sweep <lesson>``
and ``load`` (the lessons of ``engine.lessons``, each printing the table the window draws, their flags taken
from the lesson's settings), ``perfetto`` (traces to a Chrome/Perfetto trace) and ``where`` (the folder another
engine loads for the same model: a GGUF's converted copy, made first if it is not there yet) and ``otlp`` (runs as
OpenTelemetry spans).

Every argument is checked before anything loads. Ctrl+C, SIGTERM and SIGHUP during a sweep or a load test
keep what was measured: the trace is written, its experiment unfinished.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sqlite3
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engine import lessons
from engine.facts import config_facts, costmodel, kvformula
from engine.facts.contention import busy, busy_note
from engine.facts.errors import EngineError, ParameterError
from engine.facts.events import ExperimentFinished, ExperimentPoint, ExperimentProgress, ModelFacts, plain
from engine.facts.fields import MAX_CONTEXT
from engine.facts.kvformula import format_bytes
from engine.facts.report import quantity
from engine.facts.textstream import safe, safe_line
from engine.output.perfetto import write_perfetto
from engine.output.trace import check_writable, iter_trace
from engine.run.experiment import Lesson, run_lesson
from engine.serve.block_events import PrefixMiss
from engine.terminal.command_line import (
    EXIT_BAD_INPUT,
    Parser,
    add_model_arguments,
    add_server_arguments,
    add_settings_flags,
    bounded,
    close_writer,
    keep_partial,
    load_with_progress,
    program,
    settings_from,
    trace_writer,
)


# --- models and servers already here -------------------------------------------------------------------------------
def models_parser() -> argparse.ArgumentParser:
    p = Parser(prog=program("models"), description=(
        "List the models already on this computer, found without network: the Hugging Face cache (HF_HOME, "
        "HF_HUB_CACHE), Ollama's store (OLLAMA_MODELS), LM Studio's models folders and llama.cpp's cache "
        "(LLAMA_CACHE). Each from its own config or GGUF header, nothing loaded: format, size, parameters, "
        "context, KV bytes per position and weights at --format (computed), and whether KVScope runs it here."))
    p.add_argument("--format", default="bfloat16", choices=sorted(config_facts.FORMATS),
                   help="the weight format the memory column is computed for (default bfloat16)")
    p.add_argument("--add", action="append", default=[], metavar="FOLDER",
                   help="a folder of models to look in as well (repeatable)")
    p.add_argument("--json", action="store_true", help="one JSON object: the models and notes")
    return p


def models_main(argv: list[str]) -> int:
    args = models_parser().parse_args(argv)
    from engine.model.found import find_models

    found, notes = find_models(args.format, args.add)
    if args.json:
        print(json.dumps({"format": args.format, "models": [m.as_dict() for m in found], "notes": notes}, indent=1))
        return 0
    if not found:
        print("no models found in the Hugging Face cache, Ollama's store, LM Studio's folders or llama.cpp's cache "
              "(--add FOLDER looks in another)")
    for m in found:
        facts = " · ".join(p for p in (
            f"{m.parameters / 1e9:,.2f}B parameters" if m.parameters else "",
            f"{m.context:,} positions" if m.context else "",
            f"KV {format_bytes(m.kv_bytes_per_token)}/position" if m.kv_bytes_per_token else "",
            f"{format_bytes(m.memory_bytes)} of weights in {args.format}" if m.memory_bytes else "") if p)
        print(f"{safe_line(m.name)}  [{m.where}, {m.format}, {format_bytes(m.size_bytes)} on disk]")
        print(f"    {facts or 'sizes unknown'}")
        print(f"    {'runs here' if m.runs_here else 'cannot run here: ' + safe_line(m.why_not)}: "
              f"--model {safe_line(m.load)}")
    for note in notes:
        print(f"note: {safe_line(note)}", file=sys.stderr)
    return 0


def servers_parser() -> argparse.ArgumentParser:
    p = Parser(prog=program("servers"), description=(
        "List the serving engines running on this computer: 127.0.0.1 only, asked briefly and all at once at the "
        "default ports of llama-server (8080), Ollama (11434), vLLM (8000), SGLang (30000), LM Studio (1234) and "
        "TGI (3000), each engine told by its own endpoints, never by its port."))
    p.add_argument("--ports", type=lambda text: [int(p) for p in text.split(",") if p.strip()], default=None,
                   metavar="P,P,...", help="the ports to ask instead (e.g. 8081,8082)")
    p.add_argument("--json", action="store_true", help="one JSON object: the servers found")
    return p


def servers_main(argv: list[str]) -> int:
    args = servers_parser().parse_args(argv)
    from engine.serve import discover

    ports = args.ports if args.ports is not None else discover.PORTS
    if any(not 0 < p < 65536 for p in ports):
        raise ParameterError("--ports: each port is a number from 1 to 65535")
    found = discover.find_servers(ports)
    if args.json:
        print(json.dumps({"ports": list(ports), "servers": [s.as_dict() for s in found]}, indent=1))
        return 0
    if not found:
        print(f"no server answers on 127.0.0.1 at ports {', '.join(map(str, ports))}")
    for s in found:
        version = f" {s.version}" if s.version else ""
        models = ", ".join(s.models) or "no model loaded"
        how = f"attach: --server {s.url}" if s.attachable else "not attached: " + "; ".join(s.notes or ("",))
        print(f"{s.port}: {s.engine}{safe_line(version)} · {safe_line(models)} · {how}")
        for line in s.loaded:
            print(f"    {safe_line(line)}")
    return 0


# --- the run history --------------------------------------------------------------------------------------------
def history_recorder(off: bool):
    """The sink that adds a run to the run history, or None with ``--no-history``; a history that cannot be
    opened as it was says so once on stderr and the run goes on."""
    if off:
        return None
    from engine.output.history import History, HistoryRecorder

    try:
        return HistoryRecorder(History())
    except (OSError, sqlite3.Error) as exc:
        print(f"note: the run history cannot be used ({exc}): this run is not remembered", file=sys.stderr)
        return None


def say_history_problem(recorder) -> None:
    if recorder is not None and recorder.problem:
        print(f"note: {safe_line(recorder.problem)}", file=sys.stderr)


def history_parser() -> argparse.ArgumentParser:
    p = Parser(prog=program("history"), description=(
        "List the runs and experiments remembered in the run history (every run of the window and of "
        "python -m engine, newest first), with the figures each measured; --steps ID prints one run's steps "
        "(context depth, step latency, KV bytes); --trace ID FILE writes its events as a trace to replay."))
    p.add_argument("--find", default="", metavar="WORDS", help="only runs whose model, engine, kind or title "
                   "holds every word")
    p.add_argument("--since", default="", metavar="DATE", help="only runs at or after this ISO date (2026-12-01)")
    p.add_argument("--limit", type=int, default=50, help="the newest N (default 50)")
    p.add_argument("--steps", type=int, metavar="ID", help="print run ID's steps instead")
    p.add_argument("--trace", nargs=2, metavar=("ID", "FILE"), help="write run ID's events as a trace file")
    p.add_argument("--json", action="store_true", help="one JSON object")
    return p


def history_main(argv: list[str]) -> int:
    args = history_parser().parse_args(argv)
    from engine.output.history import History

    if args.limit < 1:
        raise ParameterError("--limit: at least 1")
    history = History()
    try:
        if history.problem:
            print(f"note: {safe_line(history.problem)}", file=sys.stderr)
        if args.trace:
            try:
                run = int(args.trace[0])
            except ValueError:
                raise ParameterError("--trace ID FILE: ID is a run's number (the first column)") from None
            print(history.write_trace(run, args.trace[1]))
            return 0
        if args.steps is not None:
            steps = history.steps(args.steps)
            if args.json:
                print(json.dumps({"run": args.steps, "steps": [dataclasses.asdict(s) for s in steps]}, indent=1))
            else:
                print("step  context  latency (ms)  KV bytes")
                for s in steps:
                    print(f"{s.step:>4}  {s.context if s.context is not None else '-':>7}  {s.latency_ms:>12.2f}  "
                          f"{s.kv_bytes if s.kv_bytes is not None else '-'}")
            return 0
        runs = history.runs(args.find, args.since, args.limit)
        if args.json:
            print(json.dumps({"history": str(history.path), "runs": [r.as_dict() for r in runs]}, indent=1))
            return 0
        if not runs:
            print(f"no runs remembered yet in {history.path}" + (" that match" if args.find or args.since else ""))
        for r in runs:
            figures = " · ".join(p for p in (
                f"TTFT {r.ttft_ms:,.1f} ms" if r.ttft_ms is not None else "",
                f"decode {r.decode_tok_s:,.2f} tok/s (achieved)" if r.decode_tok_s is not None else "",
                f"{r.generated_tokens:,} new tokens" if r.generated_tokens is not None else "",
                "busy machine" if busy(r.cpu_share) else "") if p)
            print(f"{r.id:>5}  {r.at}  {safe_line(r.model)} [{safe_line(r.engine)}{', ' + r.format if r.format else ''}"
                  f", {safe_line(r.device)}]  {safe_line(r.kind)}: {safe_line(r.ended)}")
            if figures:
                print(f"       {figures}")
        for line in history.said:
            print(f"note: {safe_line(line)}", file=sys.stderr)
        return 0
    finally:
        history.close()


# --- where ---------------------------------------------------------------------------------------------------------
def where_parser() -> argparse.ArgumentParser:
    p = Parser(prog=program("where"), description=(
        "Print the folder another serving engine (vLLM, SGLang) loads for this model: a Hugging Face folder as it "
        "is, a .gguf file (and the embedded model) as KVScope's converted copy, converted first if needed. Only "
        "the path goes to stdout, so a shell can use it: --model \"$(python -m engine where)\"."))
    p.add_argument("--model", default="embedded",
                   help="'embedded' (SmolLM2-135M-Instruct), a Hugging Face folder, a .gguf file or a hub id")
    return p


def where_main(argv: list[str]) -> int:
    args = where_parser().parse_args(argv)
    from engine.model import gguf
    from engine.model.models import resolve_source

    source = resolve_source(args.model)
    if source.kind == "hub":
        print(f"{source.location}: a hub id, which a serving engine downloads itself", file=sys.stderr)
        print(source.location)
        return 0
    if source.kind == "folder":
        print(Path(source.location).resolve())
        return 0

    def progress(p: Any) -> None:
        print(f"[{safe_line(p.message)}]", file=sys.stderr, flush=True)

    print(gguf.ensure_converted(Path(source.location), progress))
    return 0


# --- costmodel ------------------------------------------------------------------------------------------------------
def costmodel_parser() -> argparse.ArgumentParser:
    p = Parser(prog=program("costmodel"), description=(
        "FLOPs and bytes of prefill and decode. --seed-example prints the course module's worked example; "
        "otherwise the whole-model estimate for --model on this machine's measured ceilings."))
    p.add_argument("--seed-example", action="store_true", help="the attention-only example, exactly as the seed")
    p.add_argument("--remeasure", action="store_true",
                   help="measure this machine's peak FLOP/s and bandwidth again instead of using the cached ones")
    p.add_argument("--context", type=bounded(1, MAX_CONTEXT), default=None, metavar="N",
                   help="also give the KV cache at N positions (a folder with only config.json: the arithmetic "
                        "from its config, no weights needed)")
    add_model_arguments(p)
    return p


def costmodel_main(argv: list[str]) -> int:
    args = costmodel_parser().parse_args(argv)
    if args.seed_example:
        print(costmodel.seed_example())
        print("\nWhy a real model's prefill time grows slower than this: the example counts attention alone, whose "
              "FLOPs grow as n^2. A real model also multiplies every token by all its weights (2 x parameters FLOPs "
              "per token, growing as n), which dominates until the n^2 term catches up (for SmolLM2-135M at about "
              "6,100 tokens, computed), and a short prompt's time is mostly reading the weights once. `python -m "
              "engine costmodel` computes the crossover for a model; `python -m engine sweep prefill` measures the "
              "exponent (README: about n^0.6 to n^1.1 on a CPU).")
        return 0
    folder = Path(args.model).expanduser()
    if folder.is_dir() and (folder / "config.json").is_file() and not config_facts.has_weights(folder):
        print(config_table(folder, args.context, args.memory_budget))
        return 0
    loaded = load_with_progress(args)
    if args.context:
        m = loaded.facts
        print(f"KV cache at {args.context:,} positions: "
              f"{kvformula.format_bytes(kvformula.predicted_kv_bytes(m, args.context))} (computed)\n")
    from engine.model.hardware import peaks_event  # torch: only for a command that measures

    peaks = peaks_event(loaded, remeasure=args.remeasure)
    device = costmodel.Device.of(peaks)
    print(whole_model_table(loaded.facts, device))
    when = f"cached, measured {peaks.measured}" if peaks.cached else "measured now"
    print(f"\nPeaks: {when}" + (f"; {busy_note(peaks.cpu_share)}" if busy_note(peaks.cpu_share) else ""))
    return 0


def config_table(folder: Path, context: int | None, budget: int) -> str:
    """A folder with only ``config.json``: the cache and weight arithmetic its config is enough for, computed
    (16-bit cache, as such models serve)."""
    cfg = config_facts.read(folder)
    why = config_facts.refusal(cfg)
    if why is not None:
        raise EngineError(f"{folder.name}: {why}")
    sizes = config_facts.sizes(cfg)
    m = config_facts.model_facts(folder, cfg, "bfloat16")
    fmt = kvformula.format_bytes
    per_token = kvformula.bytes_per_token(m)
    lines = [f"{safe_line(folder.name)} ({safe_line(m.architecture)}): computed from config.json alone (no weights); "
             "every figure below is computed, none measured", "",
             f"KV cache: {kvformula.formula_text(m)} ({fmt(per_token)} per position)", f"  {kvformula.heads_text(m)}"]
    if m.context_declared:
        lines.append(f"  at its context ({kvformula.full_context_positions(m):,} positions, from "
                     f"{sizes.context_key}): {fmt(kvformula.full_context_kv_bytes(m))}")
    else:
        lines.append("  its context: not declared by the config")
    if context:
        lines.append(f"  at {context:,} positions: {fmt(kvformula.predicted_kv_bytes(m, context))}")
    lines += ["", f"weights (about {sizes.parameters() / 1e9:,.2f}B parameters, estimated from the config's sizes): "
              + " · ".join(f"{name} {fmt(sizes.weight_bytes(name))}" for name in ("float32", "bfloat16", "int8",
                                                                                   "int4"))]
    if budget:
        positions = context or (kvformula.full_context_positions(m) if m.context_declared else 0)
        kv = kvformula.predicted_kv_bytes(m, positions) if positions else 0
        for name in ("bfloat16", "int8", "int4"):
            need = sizes.weight_bytes(name) + kv
            lines.append(f"memory budget {fmt(budget)}: {name} weights + KV at {positions:,} positions = {fmt(need)}: "
                         + ("fits" if need <= budget else "does not fit"))
    return "\n".join(lines)


def whole_model_table(m: ModelFacts, device: costmodel.Device) -> str:
    cost = costmodel.ModelCost(m)
    lines = [f"{safe_line(m.name)}: {m.num_params / 1e6:,.1f}M parameters ({cost.body_params / 1e6:,.1f}M in the "
             f"layers), {m.dtype}; {safe_line(device.name)}: peak {device.flops_per_s / 1e9:,.1f} GFLOP/s"
             + (f" ({device.wide_rows} rows or more: widened to float32, {device.wide_flops_per_s / 1e9:,.1f})"
                if device.wide_flops_per_s else "") + f", {device.bytes_per_s / 1e9:,.1f} GB/s (measured)",
             "All other figures are computed by the cost model.", "",
             "prefill  tokens |      FLOPs |      bytes | FLOP/byte | compute ms | memory ms | bound",
             "----------------+------------+------------+-----------+------------+-----------+----------"]
    n = 16
    while n < m.max_context:
        c = cost.prefill(n)
        lines.append(f"{n:15,d} | {quantity(c.flops):>10} | {quantity(c.bytes):>10} | {c.intensity:9,.1f} | "
                     f"{c.compute_s(device) * 1e3:10.2f} | {c.memory_s(device) * 1e3:9.2f} | {c.bound(device)}")
        n *= 4
    lines += ["", "decode position |      FLOPs |      bytes | FLOP/byte | compute ms | memory ms | max tok/s",
              "----------------+------------+------------+-----------+------------+-----------+----------"]
    for p in (16, 256, 1024, m.max_context - 1):
        c = cost.decode(p)
        lines.append(f"{p:15,d} | {quantity(c.flops):>10} | {quantity(c.bytes):>10} | {c.intensity:9,.2f} | "
                     f"{c.compute_s(device) * 1e3:10.3f} | {c.memory_s(device) * 1e3:9.3f} | "
                     f"{1.0 / c.predicted_s(device):9,.1f}")
    lines += ["", costmodel.scaling_note(cost)]
    return "\n".join(lines)


# --- sweep <lesson> and load: the lessons --------------------------------------------------------------------------
def sweep_parser() -> argparse.ArgumentParser:
    p = Parser(prog=program("sweep"), description=(
        "Run a lesson's experiment on a model loaded here and print its table (python -m engine sweep KIND --help "
        "lists a lesson's settings)."))
    kinds = p.add_subparsers(dest="kind", required=True, metavar="KIND", parser_class=Parser)
    for lesson in lessons.sweeps():
        sub = kinds.add_parser(lesson.kind, help=lesson.title, description=f"{lesson.title}: "
                               f"{(sys.modules[lesson.run.__module__].__doc__ or '').strip().splitlines()[0]}")
        add_model_arguments(sub)
        add_settings_flags(sub, lesson.settings)
        _add_output_arguments(sub)
    return p


def load_parser() -> argparse.ArgumentParser:
    lesson = lessons.server_lesson()
    p = Parser(prog=program("load"), description=(
        "Fire N streamed requests at a serving engine (one every --every seconds), time each from this client, and "
        "poll its /metrics. Bounded: at most 64 requests, and it stops by itself after --limit seconds."))
    add_server_arguments(p, required=True)
    add_settings_flags(p, lesson.settings)
    _add_output_arguments(p)
    return p


def _add_output_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", metavar="FILE", help="save the experiment's events as JSON lines")
    p.add_argument("--json", action="store_true", help="print the points and the result as JSON")
    p.add_argument("--no-history", action="store_true", help="do not add the experiment to the run history")


def sweep_main(argv: list[str]) -> int:
    p = sweep_parser()
    args = p.parse_args(argv)
    lesson = lessons.lesson(args.kind)
    settings = settings_from(lesson.settings, args, p)
    writer = trace_writer(args.trace, [args.model])      # a bad path fails before the load
    loaded = load_with_progress(args)
    from engine.model.hardware import peaks_event  # torch: only for a command that measures
    from engine.run.session import Session

    return _run(lesson, Session(loaded), settings, args, writer, peaks_event(loaded))


def load_main(argv: list[str]) -> int:
    p = load_parser()
    args = p.parse_args(argv)
    lesson = lessons.server_lesson()
    settings = settings_from(lesson.settings, args, p)
    from engine.serve.remote import RemoteSession, probe

    writer = trace_writer(args.trace, [settings.workload])
    facts = probe(args.server, deadline_s=args.deadline_s)
    return _run(lesson, RemoteSession(facts, deadline_s=args.deadline_s), settings, args, writer, None)


def _run(lesson: Lesson, target: Any, settings: Any, args: argparse.Namespace, writer: Any, peaks: Any) -> int:
    """Run the lesson with progress on stderr, print its table (or JSON), write its trace."""
    events: list[object] = []
    remember = history_recorder(args.no_history)

    def sink(event: object) -> None:
        events.append(event)
        if writer is not None:
            writer(event)
        if remember is not None:
            remember(event)
        if isinstance(event, ExperimentProgress) and not args.json:
            print(f"[{event.done}/{event.total}] {safe_line(event.message)}", file=sys.stderr, flush=True)

    cancel = threading.Event()
    try:
        finished = run_lesson(lesson, target, settings, sink, cancel, peaks)
    except KeyboardInterrupt:
        cancel.set()
        keep_partial(writer)
        raise
    except BaseException:
        keep_partial(writer)                            # the experiment's failure is in the trace too
        raise
    points = [e for e in events if isinstance(e, ExperimentPoint)]
    misses = [e for e in events if isinstance(e, PrefixMiss)]
    if args.json:
        out = experiment_json(lesson, target, points, finished)
        if misses:
            out["requests"] = [miss_record(m) for m in misses]
        print(json.dumps(out, indent=1))
    else:
        print(safe(lesson.report(points, finished.result)))
        for m in misses:
            print(f"request {m.request}: {m.cached_tokens:,} of {m.prompt_tokens:,} prompt tokens cached, "
                  f"{m.computed_tokens:,} computed: {m.reason}: {safe_line(m.words)}")
        if finished.result.tokens_note:
            print(f"why the tokens differ: {finished.result.tokens_note}")
        if finished.reason != "done":
            print(f"({finished.reason})")
    say_history_problem(remember)
    if not close_writer(writer):
        return EXIT_BAD_INPUT
    # Stopped, or ended early (a worker that died, requests that failed): what was measured is printed and kept,
    # and the status says it is not the whole experiment.
    return 0 if finished.reason == "done" and not finished.result.incomplete else 1


def miss_record(m: PrefixMiss) -> dict:
    """One request's prompt as the prefix cache served it: cached and computed tokens and why (the allocator's)."""
    record = {"request": m.request, "prompt_tokens": m.prompt_tokens, "cached_tokens": m.cached_tokens,
              "computed_tokens": m.computed_tokens, "miss_reason": m.reason, "miss_words": m.words,
              "counted_by": "the local allocator (transformers' paged cache)"}
    if m.divergent_position is not None:
        record.update(first_divergent_position=m.divergent_position, nearest_request=m.nearest_request,
                      request_token={"id": m.request_token, "text": m.request_text},
                      cached_token={"id": m.cached_token, "text": m.cached_text})
    return record


def experiment_json(lesson: Lesson, target: Any, points: list[ExperimentPoint], finished: ExperimentFinished) -> dict:
    facts = target.facts
    where = {"server": facts.url, "engine": facts.engine} if hasattr(facts, "url") else \
        {"model": facts.name, "device": facts.device}
    return {"kind": lesson.kind, **where, "points": [dict(series=p.series, **p.values) for p in points],
            "result": plain(finished.result), "reason": finished.reason}


# --- perfetto -----------------------------------------------------------------------------------------------------
def perfetto_parser() -> argparse.ArgumentParser:
    p = Parser(prog=program("perfetto"), description=(
        "Convert KVScope traces to one Chrome/Perfetto trace (open it in ui.perfetto.dev or chrome://tracing)."))
    p.add_argument("traces", nargs="+", metavar="TRACE", help="KVScope traces (.jsonl or .jsonl.gz)")
    p.add_argument("--out", required=True, metavar="FILE", help="the Perfetto trace to write (.json)")
    return p


def otlp_parser() -> argparse.ArgumentParser:
    p = Parser(prog=program("otlp"), description=(
        "Every run in KVScope traces (a local run, each request of a load test) as OpenTelemetry spans following "
        "the GenAI semantic conventions: to an OTLP/JSON file, or to a collector's OTLP/HTTP endpoint."))
    p.add_argument("traces", nargs="+", metavar="TRACE", help="KVScope traces (.jsonl or .jsonl.gz)")
    p.add_argument("--out", metavar="FILE", help="the OTLP/JSON file to write (.json)")
    p.add_argument("--endpoint", metavar="URL", help="a collector's OTLP/HTTP traces endpoint, e.g. "
                   "http://127.0.0.1:4318/v1/traces")
    return p


def otlp_main(argv: list[str]) -> int:
    p = otlp_parser()
    args = p.parse_args(argv)
    if not args.out and not args.endpoint:
        p.error("give --out FILE, --endpoint URL or both")
    from engine.output.otlp import send_spans, spans, write_spans

    if args.out:
        check_writable(args.out, args.traces)
    kept = spans(e for path in args.traces for e in iter_trace(path))   # made once, for the file and the send
    if args.out:
        target, count = write_spans(args.out, kept)
        print(f"wrote {safe_line(target)} ({count:,} spans, {target.stat().st_size:,} bytes)")
    if args.endpoint:
        print(f"sent {send_spans(args.endpoint, kept):,} spans to {safe_line(args.endpoint)}")
    return 0


def perfetto_main(argv: list[str]) -> int:
    args = perfetto_parser().parse_args(argv)
    check_writable(args.out, args.traces)
    read = 0

    def events() -> Iterator[object]:                       # streamed: a long trace is never held whole
        nonlocal read
        for path in args.traces:
            for event in iter_trace(path):
                read += 1
                yield event

    target = write_perfetto(args.out, events())
    print(f"wrote {safe_line(target)} ({read:,} events from {len(args.traces)} trace(s))")
    return 0
