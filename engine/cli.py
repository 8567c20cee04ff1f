"""The headless CLI: ``python -m engine --prompt ...`` streams the text and prints the llama.cpp-style report.

Bad input exits non-zero with one clear line on stderr, never a traceback. Subcommands (``costmodel``,
``sweep``) are dispatched on the first word, so the plain form needs no subcommand.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
from collections.abc import Callable

from engine import kvcache
from engine.errors import EngineError, ParameterError
from engine.events import AttentionStep, LoadProgress, RunFailed, RunStarted, TokenStep
from engine.load import busy
from engine.params import MAX_SEED, GenerationParams
from engine.textstream import clean_text

EXIT_BAD_INPUT = 2
EXIT_RUN_FAILED = 1
SUBCOMMANDS: dict[str, Callable[[list[str]], int]] = {}


class Parser(argparse.ArgumentParser):
    """argparse with one line on stderr for a bad argument (not usage plus error), exit status 2."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"error: {message} (see {self.prog} --help)\n")


def bounded(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: a whole number in ``[low, high]``, refused with the range."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value:,} is out of range: use {low:,} to {high:,}")
        return value
    parse.__name__ = "whole number"
    return parse


def prompt_text(text: str) -> str:
    """The prompt as valid Unicode; bytes that were not UTF-8 become U+FFFD, and stderr says so."""
    fixed, replaced = clean_text(text)
    if replaced:
        print(f"warning: the prompt was not valid UTF-8: {replaced} character(s) replaced with U+FFFD",
              file=sys.stderr)
    return fixed


def generate_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m engine", description=(
        "Run a prompt through a real model, streaming the text, then print prefill/decode timing and KV-cache "
        "memory. Subcommands: " + (", ".join(SUBCOMMANDS) or "none yet") + "."))
    p.add_argument("--prompt", required=True, help="the user message (or raw text with --raw)")
    add_model_arguments(p)
    p.add_argument("--max-new-tokens", type=bounded(1, 1 << 24), default=GenerationParams.max_new_tokens)
    p.add_argument("--temperature", type=float, default=GenerationParams.temperature, help="0 = greedy")
    p.add_argument("--top-k", type=bounded(0, 1 << 24), default=GenerationParams.top_k, help="0 = off")
    p.add_argument("--top-p", type=float, default=GenerationParams.top_p, help="1 = off")
    p.add_argument("--seed", type=bounded(0, MAX_SEED), default=None, help="default: a random seed, reported")
    p.add_argument("--no-kv-cache", action="store_true", help="recompute the whole sequence every step")
    p.add_argument("--static-cache", action="store_true",
                   help="allocate the KV cache for prompt + new tokens up front (what compiled decode needs)")
    p.add_argument("--compile", action="store_true",
                   help="decode through torch.compile over the static cache (CUDA graphs on a GPU; implies "
                        "--static-cache; the first step compiles and is reported apart)")
    p.add_argument("--attention", action="store_true",
                   help="record each step's newest-token attention over the cache (into --trace; the cost per "
                        "pass is reported)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--trace", metavar="FILE", help="save the run's events as JSON lines")
    p.add_argument("--json", action="store_true", help="print a machine-readable summary instead of text")
    return p


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    from engine.models import DEVICES, DTYPES

    p.add_argument("--model", default="embedded",
                   help="'embedded' (SmolLM2-135M-Instruct), a Hugging Face folder, a .gguf file or a hub id")
    p.add_argument("--server", metavar="URL",
                   help="run through a serving engine instead (llama-server, vLLM, TGI, SGLang: its OpenAI-compatible "
                        "API); an API key is read from the KVSCOPE_API_KEY environment variable")
    p.add_argument("--device", default="auto", choices=DEVICES)
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow this model's own Python code to run (off by default)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _register_subcommands()
    if argv and argv[0] in SUBCOMMANDS:
        return _guarded(lambda: SUBCOMMANDS[argv[0]](argv[1:]))
    args = generate_parser().parse_args(argv)
    return _guarded(lambda: run_generate(args))


def _guarded(action: Callable[[], int]) -> int:
    try:
        return action()
    except (EngineError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _register_subcommands() -> None:
    """Subcommands register here; their modules load torch only when they run."""
    from engine.commands import costmodel_main, load_main, perfetto_main, sweep_main

    SUBCOMMANDS.update(costmodel=costmodel_main, sweep=sweep_main, perfetto=perfetto_main, load=load_main)


def parse_only(argv: list[str]) -> argparse.Namespace:
    """The arguments a command line would run with, without running it (README's commands are checked so)."""
    from engine.commands import costmodel_parser, load_parser, perfetto_parser, sweep_parser

    parsers = {"costmodel": costmodel_parser, "sweep": sweep_parser, "perfetto": perfetto_parser,
               "load": load_parser}
    if argv and argv[0] in parsers:
        return parsers[argv[0]]().parse_args(argv[1:])
    return generate_parser().parse_args(argv)


def run_remote(args: argparse.Namespace, params: GenerationParams, prompt: str, writer) -> int:
    """One run through a server: the text as it streams, then what this client measured beside what the server
    reported about itself."""
    from engine.remote import RemoteSession, probe

    if params.kv_cache is False or params.static_cache or params.compiled or params.capture_attention:
        raise ParameterError("--no-kv-cache, --static-cache, --compile and --attention act on a model KVScope runs; "
                             "a server decides those itself")
    facts = probe(args.server)
    print(f"[{facts.engine} at {facts.url}: {facts.name}]", file=sys.stderr, flush=True)

    def sink(event: object) -> None:
        if writer is not None:
            writer(event)
        if not args.json and isinstance(event, TokenStep):
            sys.stdout.write(event.text)
            sys.stdout.flush()

    result = RemoteSession(facts).run(prompt, params, sink)
    s = result.summary
    if args.json:
        print(json.dumps({"server": dataclasses.asdict(facts), "params": dataclasses.asdict(params),
                          "result": "failed" if isinstance(result, RunFailed) else result.reason,
                          **dataclasses.asdict(s)}, indent=2))
    else:
        print("\n")
        print(remote_report(s))
    if writer is not None:
        writer.close()
    if isinstance(result, RunFailed):
        print(f"error: {result.message}", file=sys.stderr)
        return EXIT_RUN_FAILED
    return 0


def remote_report(s) -> str:
    """Client-side figures (measured here) and the server's own (as reported), never mixed."""
    rate = f"{s.decode_runs / (s.decode_ms / 1000.0):,.2f} tokens per second" if s.decode_ms > 0 else "n/a"
    lines = [f"client: TTFT {s.ttft_ms:,.1f} ms (request sent to first token arriving); {s.generated_tokens} tokens; "
             f"decode {s.decode_ms:,.1f} ms for {s.decode_runs} tokens after the first ({rate}); "
             f"total {s.total_ms:,.1f} ms"
             " (measured by this client's clock)"]
    t = s.server_timings
    if "timings.prompt_ms" in t:
        lines.append(f"server: prompt {t.get('timings.prompt_n', '?')} tokens in {t['timings.prompt_ms']:,.1f} ms, "
                     f"{t.get('timings.predicted_n', '?')} tokens predicted in "
                     f"{t.get('timings.predicted_ms', 0):,.1f} ms, "
                     f"{t.get('timings.cache_n', 0)} prompt tokens from its cache (as reported by the server)")
    elif t:
        lines.append("server: " + ", ".join(f"{k} {v:,}" for k, v in sorted(t.items())) + " (as reported)")
    else:
        lines.append("server: reported no timings")
    return "\n".join(lines)


def load_for_cli(args: argparse.Namespace):
    from engine.models import load

    tty = sys.stderr.isatty()
    last_stage = [""]

    def progress(p: LoadProgress) -> None:
        """On a terminal one line that updates in place; in a log one line per stage."""
        pct = f"{p.fraction * 100:3.0f}% " if p.fraction is not None else ""
        if tty:
            print(f"\r[{pct}{p.message}]"[:100].ljust(100), end="\n" if p.stage == "done" else "",
                  file=sys.stderr, flush=True)
        elif p.stage != last_stage[0] or p.stage == "done":
            print(f"[{pct}{p.message}]", file=sys.stderr, flush=True)
        last_stage[0] = p.stage

    loaded = load(args.model, args.device, args.dtype, trust_remote_code=args.trust_remote_code,
                  progress=progress)
    for warning in loaded.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return loaded


def run_generate(args: argparse.Namespace) -> int:
    """Everything the user typed is checked before the model loads (seconds on a slow disk)."""
    from engine.trace import TraceWriter

    params = GenerationParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                              kv_cache=not args.no_kv_cache, chat_template=not args.raw,
                              static_cache=args.static_cache or args.compile, compiled=args.compile,
                              capture_attention=args.attention)
    prompt = prompt_text(args.prompt)
    if not prompt.strip():
        raise EngineError("The prompt is empty: pass some text with --prompt")
    writer = TraceWriter(args.trace) if args.trace else None
    if args.server:
        return run_remote(args, params, prompt, writer)
    loaded = load_for_cli(args)
    if params.top_k > loaded.facts.vocab_size:
        raise ParameterError(f"--top-k {params.top_k:,} is more than {loaded.facts.name}'s vocabulary of "
                             f"{loaded.facts.vocab_size:,} tokens (0 = off)")
    from engine.report import report
    from engine.session import Session

    out = sys.stdout
    started: list[RunStarted] = []
    attention_ms: list[float] = []

    def sink(event: object) -> None:
        if writer is not None:
            writer(event)
        if isinstance(event, RunStarted):
            started.append(event)
        elif isinstance(event, AttentionStep):
            attention_ms.append(event.capture_ms)
        elif not args.json and isinstance(event, TokenStep) and not event.special:
            out.write(event.text)
            out.flush()

    cancel = threading.Event()
    try:
        result = Session(loaded).run(prompt, params, sink, cancel)
    except KeyboardInterrupt:
        cancel.set()
        if writer is not None and writer.events:
            writer.close()                 # what was measured before Ctrl+C is kept
        raise
    summary = result.summary
    facts = loaded.facts
    if args.json:
        used = started[0].params if started else params          # the seed the session picked, if it did
        formula = kvcache.predicted_kv_bytes(facts, summary.kv_tokens) if params.kv_cache else 0
        payload = {"model": facts.name, "device": facts.device, "dtype": facts.dtype,
                   "params": dataclasses.asdict(used),
                   "result": "failed" if isinstance(result, RunFailed) else result.reason,
                   "prefill_tok_s": summary.prefill_tok_s, "decode_tok_s": summary.decode_tok_s,
                   **dataclasses.asdict(summary),
                   "kv_bytes_formula": formula, "kv_bytes_full_context": kvcache.full_context_kv_bytes(facts),
                   "kv_positions_full_context": kvcache.full_context_positions(facts),
                   "kv_layers": [dataclasses.asdict(layer) for layer in facts.kv_layers],
                   "busy": busy(summary.cpu_share)}
        print(json.dumps(payload, indent=2))
    else:
        print("\n", file=out)
        print(report(facts, summary, kv_on=params.kv_cache))
        if attention_ms:
            print(f"attention recorded on {len(attention_ms)} passes: {sum(attention_ms) / len(attention_ms):.2f} ms "
                  "per pass to record (measured by the wall clock; inside the total time above)")
    if writer is not None:
        try:
            writer.close()
        except OSError as exc:            # the disk filled or the folder went away during the run
            print(f"error: could not write the trace to {writer.path}: {exc.strerror or exc}", file=sys.stderr)
            return EXIT_RUN_FAILED
    if isinstance(result, RunFailed):
        print(f"error: {result.message}", file=sys.stderr)
        return EXIT_RUN_FAILED
    return 0
