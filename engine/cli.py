"""The headless CLI: ``python -m engine --prompt ...`` streams the text and prints the llama.cpp-style report.

Bad input exits non-zero with one clear line on stderr, never a traceback. Subcommands (``costmodel``,
``sweep``, ``load``, ``perfetto``: ``engine.terminal.commands``) are dispatched on the first word, so the plain form
needs no subcommand. SIGTERM and SIGHUP end a run as Ctrl+C does: what was measured is written to the trace,
marked incomplete, before the process exits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import threading
from collections.abc import Callable

from engine.facts import kvformula
from engine.facts.contention import busy
from engine.facts.errors import EngineError, ParameterError
from engine.facts.events import AttentionStep, RunFailed, RunStarted, TokenStep, plain
from engine.facts.params import GenerationParams
from engine.facts.provenance import run_sources
from engine.facts.report import report
from engine.facts.textstream import safe, safe_line
from engine.model import threads
from engine.serve.remote import RemoteSession, probe, remote_report
from engine.terminal import commands
from engine.terminal.command_line import (
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    EXIT_RUN_FAILED,
    Parser,
    add_model_arguments,
    add_server_arguments,
    add_settings_flags,
    close_writer,
    end_open_line,
    keep_partial,
    load_with_progress,
    program,
    prompt_text,
    settings_from,
    trace_writer,
)

SUBCOMMANDS: dict[str, Callable[[list[str]], int]] = {
    "costmodel": commands.costmodel_main, "sweep": commands.sweep_main, "load": commands.load_main,
    "perfetto": commands.perfetto_main, "otlp": commands.otlp_main, "where": commands.where_main,
    "models": commands.models_main, "servers": commands.servers_main, "history": commands.history_main}
PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "costmodel": commands.costmodel_parser, "sweep": commands.sweep_parser, "load": commands.load_parser,
    "perfetto": commands.perfetto_parser, "otlp": commands.otlp_parser, "where": commands.where_parser,
    "models": commands.models_parser, "servers": commands.servers_parser, "history": commands.history_parser}


BROKEN_MODEL = ("non_finite_logits",)       # a run that failed because of the model itself: fix it, status 2


def generate_parser() -> argparse.ArgumentParser:
    p = Parser(prog=program(), description=(
        "Run a prompt through a real model, streaming the text, then print prefill/decode timing and KV-cache "
        "memory. Subcommands: " + ", ".join(SUBCOMMANDS) + "."))
    p.add_argument("--prompt", required=True, help="the user message (or raw text with --raw)")
    add_model_arguments(p)
    add_server_arguments(p)
    add_settings_flags(p, GenerationParams)            # the run settings, declared once in engine.facts.params
    p.add_argument("--trace", metavar="FILE", help="save the run's events as JSON lines")
    p.add_argument("--json", action="store_true", help="print a machine-readable summary instead of text")
    p.add_argument("--no-history", action="store_true",
                   help="do not add this run to the run history (python -m engine history lists it)")
    return p


def worker_main(argv: list[str]) -> int:
    """``python -m engine worker NAME ARGS...``: a process a lesson starts (not for typing: its arguments are the
    lesson's, a socket's descriptor among them)."""
    from engine import lessons

    lessons.run_worker(argv[0], argv[1:])
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "worker" and len(argv) > 1:
        return worker_main(argv[1:])
    if argv and argv[0] in SUBCOMMANDS:
        return guarded(lambda: SUBCOMMANDS[argv[0]](argv[1:]))
    parser = generate_parser()
    args = parser.parse_args(argv)
    params = settings_from(GenerationParams, args, parser, **({"static_cache": True} if args.compiled else {}))
    return guarded(lambda: run_generate(args, params))


def guarded(action: Callable[[], int]) -> int:
    """Run a command: a user's mistake is one line and status 2; Ctrl+C, SIGTERM and SIGHUP status 130 (the
    command has already kept what it measured). Each of those lines starts a line of its own, even after a
    progress line left open."""
    previous = {name: _interrupt_on(name) for name in ("SIGTERM", "SIGHUP")}
    try:
        return _outcome(action)
    finally:
        for name, handler in previous.items():
            if handler is not None:
                signal.signal(getattr(signal, name), handler)


def _outcome(action: Callable[[], int]) -> int:
    try:
        return action()
    except (EngineError, ValueError) as exc:
        end_open_line()
        print(f"error: {safe_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as exc:      # the disk filled, a folder went away, no permission: one line, the user's to fix
        end_open_line()
        print(f"error: {safe_line(getattr(exc, 'strerror', None) or exc)}"
              f"{': ' + safe_line(exc.filename) if getattr(exc, 'filename', None) else ''}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except RecursionError:
        end_open_line()
        print("error: something KVScope read was nested too deeply to be what it claimed", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        end_open_line()
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _interrupt_on(name: str):
    """Make ``name`` raise KeyboardInterrupt in the main thread, so every command ends it as Ctrl+C."""
    if not hasattr(signal, name) or threading.current_thread() is not threading.main_thread():
        return None

    def interrupt(_signum, _frame) -> None:
        raise KeyboardInterrupt

    return signal.signal(getattr(signal, name), interrupt)


def parse_only(argv: list[str]) -> argparse.Namespace:
    """The arguments a command line would run with, without running it (README's commands are checked so)."""
    if argv and argv[0] in PARSERS:
        return PARSERS[argv[0]]().parse_args(argv[1:])
    return generate_parser().parse_args(argv)


def run_generate(args: argparse.Namespace, params: GenerationParams) -> int:
    """Everything the user typed is checked before the model loads (seconds on a slow disk)."""
    prompt = prompt_text(args.prompt)
    if not prompt.strip():
        raise EngineError("The prompt is empty: pass some text with --prompt")
    writer = trace_writer(args.trace)
    remember = commands.history_recorder(args.no_history)
    if args.server:
        return run_remote(args, params, prompt, writer, remember)
    loaded = load_with_progress(args)
    if params.top_k > loaded.facts.vocab_size:
        raise ParameterError(f"--top-k {params.top_k:,} is more than {loaded.facts.name}'s vocabulary of "
                             f"{loaded.facts.vocab_size:,} tokens (0 = off)")
    from engine.run.session import Session  # torch loads only for a command that runs a model here

    out = sys.stdout
    started: list[RunStarted] = []
    attention_ms: list[float] = []

    def sink(event: object) -> None:
        if writer is not None:
            writer(event)
        if remember is not None:
            remember(event)
        if isinstance(event, RunStarted):
            started.append(event)
        elif isinstance(event, AttentionStep):
            attention_ms.append(event.capture_ms)
        elif not args.json and isinstance(event, TokenStep) and not event.special:
            out.write(safe(event.text))
            out.flush()

    cancel = threading.Event()
    try:
        result = Session(loaded).run(prompt, params, sink, cancel)
    except KeyboardInterrupt:
        cancel.set()
        keep_partial(writer)
        _end_line(out, started)
        raise
    summary = result.summary
    facts = loaded.facts
    if args.json:
        used = started[0].params if started else params          # the seed the session picked, if it did
        formula = kvformula.predicted_kv_bytes(facts, summary.kv_tokens) if params.kv_cache else 0
        payload = {"model": facts.name, "device": facts.device, "dtype": facts.dtype,
                   "weights": facts.weight_format or facts.dtype, "weights_described": facts.weights,
                   "dtype_reason": loaded.dtype_reason, "params": dataclasses.asdict(used),
                   "result": "failed" if isinstance(result, RunFailed) else result.reason,
                   "prefill_tok_s": summary.prefill_tok_s, "decode_tok_s": summary.decode_tok_s,
                   **plain(summary), "kv_bytes_formula": formula,
                   "kv_bytes_full_context": kvformula.full_context_kv_bytes(facts),
                   "kv_positions_full_context": kvformula.full_context_positions(facts),
                   "state_bytes": kvformula.state_bytes(facts),
                   "kv_layers": [dataclasses.asdict(layer) for layer in facts.kv_layers],
                   "busy": busy(summary.cpu_share), "threads": threads.policy(),
                   "sources": [row.as_dict() for row in run_sources(facts, summary, kv_on=params.kv_cache)]}
        print(json.dumps(payload, indent=2))
    else:
        print("\n", file=out)
        print(report(facts, summary, kv_on=params.kv_cache, kv_method=params.kv_method))
        if attention_ms:
            print(f"attention recorded on {len(attention_ms)} passes: {_spread(attention_ms)} per pass to record "
                  "(measured by the wall clock; inside the total time above)")
    commands.say_history_problem(remember)
    if not close_writer(writer):
        return EXIT_BAD_INPUT
    if isinstance(result, RunFailed):
        print(f"error: {safe_line(result.message)}", file=sys.stderr)
        return EXIT_BAD_INPUT if result.error in BROKEN_MODEL else EXIT_RUN_FAILED
    return 0


def run_remote(args: argparse.Namespace, params: GenerationParams, prompt: str, writer, remember=None) -> int:
    """One run through a server: the text as it streams, then what this client measured beside what the server
    reported about itself. Everything the server sends is shown with control characters escaped."""
    if params.kv_cache is False or params.static_cache or params.compiled or params.capture_attention:
        raise ParameterError("--no-kv-cache, --static-cache, --compile and --attention act on a model KVScope runs; "
                             "a server decides those itself")
    facts = probe(args.server, deadline_s=args.deadline_s)
    print(f"[{safe_line(facts.engine)} at {safe_line(facts.url)}: {safe_line(facts.name)}]", file=sys.stderr,
          flush=True)

    def sink(event: object) -> None:
        if writer is not None:
            writer(event)
        if remember is not None:
            remember(event)
        if not args.json and isinstance(event, TokenStep):
            sys.stdout.write(safe(event.text))
            sys.stdout.flush()

    cancel = threading.Event()
    try:
        result = RemoteSession(facts, deadline_s=args.deadline_s).run(prompt, params, sink, cancel)
    except KeyboardInterrupt:
        cancel.set()
        keep_partial(writer)
        _end_line(sys.stdout, not args.json)
        raise
    s = result.summary
    if args.json:
        print(json.dumps({"server": plain(facts), "params": dataclasses.asdict(params),
                          "result": "failed" if isinstance(result, RunFailed) else result.reason, **plain(s),
                          "sources": [row.as_dict() for row in run_sources(facts, s)]}, indent=2))
    else:
        print("\n")
        print(safe(remote_report(s)))
    commands.say_history_problem(remember)
    if not close_writer(writer):
        return EXIT_BAD_INPUT
    if isinstance(result, RunFailed):
        print(f"error: {safe_line(result.message)}", file=sys.stderr)
        return EXIT_RUN_FAILED
    return 0


def _end_line(out, streamed: object) -> None:
    """An interrupted run ends its streamed text's line, so "interrupted" is not glued to the last token."""
    if streamed:
        out.write("\n")
        out.flush()


def _spread(values: list[float]) -> str:
    """A per-pass cost as its mean with the range of the passes: one pass is not a cost."""
    mean = sum(values) / len(values)
    return f"{mean:.2f} ms (mean; {min(values):.2f}-{max(values):.2f} ms over the passes)"


__all__ = ["EXIT_BAD_INPUT", "EXIT_RUN_FAILED", "Parser", "main", "parse_only", "run_generate"]
