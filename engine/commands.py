"""The CLI's subcommands: ``costmodel`` (the analytic model, and the seed's worked example) and ``sweep``
(the experiments, printing the tables the window draws)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from engine import costmodel
from engine.cli import Parser
from engine.events import ExperimentFinished, ExperimentPoint, ExperimentProgress, ModelFacts
from engine.load import busy_note


def _fmt(v: float) -> str:
    if abs(v) >= 1e9:
        return f"{v / 1e9:,.2f} G"
    if abs(v) >= 1e6:
        return f"{v / 1e6:,.2f} M"
    return f"{v:,.1f}"


def costmodel_parser() -> argparse.ArgumentParser:
    from engine.cli import add_model_arguments

    p = Parser(prog="python -m engine costmodel", description=(
        "FLOPs and bytes of prefill and decode. --seed-example prints the course module's worked example; "
        "otherwise the whole-model estimate for --model on this machine's measured ceilings."))
    p.add_argument("--seed-example", action="store_true", help="the attention-only example, exactly as the seed")
    p.add_argument("--remeasure", action="store_true",
                   help="measure this machine's peak FLOP/s and bandwidth again instead of using the cached ones")
    add_model_arguments(p)
    return p


def costmodel_main(argv: list[str]) -> int:
    from engine.cli import load_for_cli

    args = costmodel_parser().parse_args(argv)
    if args.seed_example:
        print(costmodel.seed_example())
        return 0
    loaded = load_for_cli(args)
    from engine.hardware import peaks_event

    peaks = peaks_event(loaded, remeasure=args.remeasure)
    device = costmodel.Device(peaks.device, peaks.flops_per_s, peaks.bytes_per_s)
    print(whole_model_table(loaded.facts, device))
    when = f"cached, measured {peaks.measured}" if peaks.cached else "measured now"
    print(f"\nPeaks: {when}" + (f"; {busy_note(peaks.cpu_share)}" if busy_note(peaks.cpu_share) else ""))
    return 0


def whole_model_table(m: ModelFacts, device: costmodel.Device) -> str:
    cost = costmodel.ModelCost(m)
    lines = [f"{m.name}: {m.num_params / 1e6:,.1f}M parameters ({cost.body_params / 1e6:,.1f}M in the layers), "
             f"{m.dtype}; {device.name}: peak {device.flops_per_s / 1e9:,.1f} GFLOP/s, "
             f"{device.bytes_per_s / 1e9:,.1f} GB/s (measured)",
             "All other figures are computed by the cost model.", "",
             "prefill  tokens |      FLOPs |      bytes | FLOP/byte | compute ms | memory ms | bound",
             "----------------+------------+------------+-----------+------------+-----------+----------"]
    n = 16
    while n < m.max_context:
        c = cost.prefill(n)
        lines.append(f"{n:15,d} | {_fmt(c.flops):>10} | {_fmt(c.bytes):>10} | {c.intensity:9,.1f} | "
                     f"{c.compute_s(device) * 1e3:10.2f} | {c.memory_s(device) * 1e3:9.2f} | {c.bound(device)}")
        n *= 4
    lines += ["", "decode position |      FLOPs |      bytes | FLOP/byte | compute ms | memory ms | max tok/s",
              "----------------+------------+------------+-----------+------------+-----------+----------"]
    for p in (16, 256, 1024, m.max_context - 1):
        c = cost.decode(p)
        lines.append(f"{p:15,d} | {_fmt(c.flops):>10} | {_fmt(c.bytes):>10} | {c.intensity:9,.2f} | "
                     f"{c.compute_s(device) * 1e3:10.3f} | {c.memory_s(device) * 1e3:9.3f} | "
                     f"{1.0 / c.predicted_s(device):9,.1f}")
    return "\n".join(lines)


def sweep_main(argv: list[str]) -> int:
    from engine.cli import load_for_cli
    from engine.trace import TraceWriter

    p = sweep_parser()
    args = p.parse_args(argv)
    settings = sweep_settings(p, args)
    writer = TraceWriter(args.trace) if args.trace else None            # a bad path fails before the load
    loaded = load_for_cli(args)
    from engine.experiments import run_experiment
    from engine.hardware import peaks_event
    from engine.session import Session

    events, sink = collecting_sink(writer, quiet=args.json)

    peaks = peaks_event(loaded)
    finished = run_experiment(args.kind, Session(loaded), sink, peaks=peaks, **settings)
    if writer is not None:
        writer.close()
    points = [e for e in events if isinstance(e, ExperimentPoint)]
    if args.json:
        print(json.dumps({"kind": args.kind, "model": loaded.facts.name, "device": peaks.device,
                          "points": [dict(series=p.series, **p.values) for p in points],
                          "summary": finished.summary}, indent=1))
    else:
        print(experiment_table(args.kind, points, finished))
    return 0 if finished.reason == "done" else 1


def collecting_sink(writer, quiet: bool) -> tuple[list[object], Callable[[object], None]]:
    """A sink that keeps every event (and writes it to the trace, if any), with progress on stderr unless the
    output is JSON."""
    events: list[object] = []

    def sink(event: object) -> None:
        events.append(event)
        if writer is not None:
            writer(event)
        if isinstance(event, ExperimentProgress) and not quiet:
            print(f"[{event.done}/{event.total}] {event.message}", file=sys.stderr, flush=True)

    return events, sink


def perfetto_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m engine perfetto", description=(
        "Convert KVScope traces to one Chrome/Perfetto trace (open it in ui.perfetto.dev or chrome://tracing)."))
    p.add_argument("traces", nargs="+", metavar="TRACE", help="KVScope traces (.jsonl)")
    p.add_argument("--out", required=True, metavar="FILE", help="the Perfetto trace to write (.json)")
    return p


def perfetto_main(argv: list[str]) -> int:
    args = perfetto_parser().parse_args(argv)
    from engine.perfetto import write_perfetto
    from engine.trace import check_writable, read_trace

    check_writable(args.out)
    events = [e for path in args.traces for e in read_trace(path)]
    target = write_perfetto(args.out, events)
    print(f"wrote {target} ({len(events):,} events from {len(args.traces)} trace(s))")
    return 0


def load_parser() -> argparse.ArgumentParser:
    from engine.cli import Parser, bounded
    from engine.serverload import MAX_REQUESTS

    p = Parser(prog="python -m engine load", description=(
        "Fire N streamed requests at a serving engine (one every --every seconds), time each from this client, and "
        "poll its /metrics. Bounded: at most 64 requests, and it stops by itself after --limit seconds."))
    p.add_argument("--server", required=True, metavar="URL", help="the server (its OpenAI-compatible API)")
    p.add_argument("--requests", type=bounded(1, MAX_REQUESTS), default=4)
    p.add_argument("--every", type=float, default=0.5, help="seconds between requests (0 to 60, default 0.5)")
    p.add_argument("--tokens", type=bounded(1, 4096), default=48, help="new tokens per request (default 48)")
    p.add_argument("--poll", type=float, default=0.5, help="seconds between /metrics polls (0.1 to 10)")
    p.add_argument("--limit", type=float, default=300.0, help="stop after this many seconds (1 to 600)")
    p.add_argument("--trace", metavar="FILE", help="save the load test's events as JSON lines")
    p.add_argument("--json", action="store_true", help="print the points and summary as JSON")
    return p


def load_main(argv: list[str]) -> int:
    """A load test against a server: N streamed requests and /metrics polled, printed as a table."""
    p = load_parser()
    args = p.parse_args(argv)
    if not 0 <= args.every <= 60 or not 0.1 <= args.poll <= 10 or not 1 <= args.limit <= 600:
        p.error("--every must be 0 to 60, --poll 0.1 to 10 and --limit 1 to 600 seconds")
    from engine.experiments import run_experiment
    from engine.remote import RemoteSession, probe
    from engine.trace import TraceWriter

    writer = TraceWriter(args.trace) if args.trace else None
    facts = probe(args.server)
    events, sink = collecting_sink(writer, quiet=args.json)

    finished = run_experiment("server load", RemoteSession(facts), sink, requests=args.requests, every_s=args.every,
                              new_tokens=args.tokens, poll_s=args.poll, limit_s=args.limit)
    if writer is not None:
        writer.close()
    points = [e for e in events if isinstance(e, ExperimentPoint)]
    if args.json:
        print(json.dumps({"kind": "server load", "server": facts.url, "engine": facts.engine,
                          "points": [dict(series=p.series, **p.values) for p in points],
                          "summary": finished.summary}, indent=1))
    else:
        print(experiment_table("server load", points, finished))
    return 0 if finished.reason == "done" else 1


def sweep_parser() -> argparse.ArgumentParser:
    from engine.cli import Parser, add_model_arguments, bounded

    p = Parser(prog="python -m engine sweep", description="Run an experiment and print its table.")
    p.add_argument("kind", choices=("prefill", "cache", "batch", "chat", "continuous", "dtype", "speculative", "paged"))
    add_model_arguments(p)
    p.add_argument("--max-length", type=bounded(2, 1 << 24),
                   help="prefill: longest prompt (default: the whole context, 8,192 tokens on the embedded model)")
    p.add_argument("--start", type=bounded(1, 1 << 24), default=16, help="prefill: shortest prompt (default 16)")
    p.add_argument("--repeats", type=bounded(1, 100), default=3,
                   help="prefill: timed repeats per length, after 1 warm-up; chat: how many times the comparison "
                        "runs, order alternating (default 3)")
    p.add_argument("--tokens", type=bounded(2, 1 << 16), default=32,
                   help="cache/batch/chat/speculative: new tokens per request (default 32)")
    p.add_argument("--prompt", help="cache: the prompt (default: the first sample prompt); speculative: the "
                                    "prompt (default: one whose answer repeats it)")
    p.add_argument("--drafter", default="prompt lookup",
                   help="speculative: 'prompt lookup' (default) or a draft model: a folder, .gguf or hub id with "
                        "the same tokenizer, or 'self' (this model, weights as --draft-dtype)")
    p.add_argument("--draft-dtype", default="int4", help="speculative: the draft model's weights (default int4)")
    p.add_argument("--guesses", type=bounded(1, 16), default=8, help="speculative: guesses per pass (default 8)")
    p.add_argument("--sizes", default="1,2,4,8,16", help="batch: comma-separated batch sizes, 1 to 1,024")
    p.add_argument("--requests", type=bounded(1, 256), default=8,
                   help="continuous/paged: how many requests arrive (paged: at most 64)")
    p.add_argument("--page-size", type=bounded(4, 1024), default=16, help="paged: positions per block (default 16)")
    p.add_argument("--arrive-every", type=bounded(0, 10_000), default=4,
                   help="continuous: decode steps between arrivals (default 4)")
    p.add_argument("--formats", default="float32,bfloat16,int8,int4",
                   help="dtype: weight formats to compare, comma-separated (default: all four)")
    p.add_argument("--trace", metavar="FILE", help="save the experiment's events as JSON lines")
    p.add_argument("--json", action="store_true", help="print the points and summary as JSON")
    return p


def sweep_settings(p: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """The experiment's settings, every range checked here, before anything loads."""
    from engine.cli import prompt_text

    if args.kind == "prefill":
        if args.max_length is not None and args.max_length < args.start:
            p.error(f"--max-length ({args.max_length:,}) must be at least --start ({args.start:,})")
        return {"max_length": args.max_length, "start": args.start, "repeats": args.repeats}
    if args.kind == "cache":
        prompt = prompt_text(args.prompt) if args.prompt is not None else None
        if prompt is not None and not prompt.strip():
            p.error("--prompt is empty")
        return {"new_tokens": args.tokens, "prompt": prompt}
    if args.kind == "chat":
        return {"new_tokens": args.tokens, "repeats": args.repeats}
    if args.kind == "speculative":
        from engine.models import DTYPES

        prompt = prompt_text(args.prompt) if args.prompt is not None else None
        if prompt is not None and not prompt.strip():
            p.error("--prompt is empty")
        if args.draft_dtype not in DTYPES:
            p.error(f"--draft-dtype must be one of {', '.join(DTYPES)}, not {args.draft_dtype!r}")
        settings = {"new_tokens": args.tokens, "repeats": args.repeats, "draft_tokens": args.guesses,
                    **({"prompt": prompt} if prompt else {})}
        if args.drafter == "prompt lookup":
            return {**settings, "drafter": "prompt lookup"}
        return {**settings, "drafter": "draft model", "draft_dtype": args.draft_dtype,
                "draft_model": "" if args.drafter == "self" else args.drafter}
    if args.kind == "continuous":
        return {"requests": args.requests, "arrive_every": args.arrive_every}
    if args.kind == "paged":
        if args.requests > 64:
            p.error(f"--requests must be at most 64 for the paged lesson, not {args.requests}")
        return {"requests": args.requests, "arrive_every": args.arrive_every, "new_tokens": args.tokens,
                "page_size": args.page_size}
    if args.kind == "dtype":
        from engine.formats import FORMATS

        formats = tuple(f.strip() for f in args.formats.split(",") if f.strip())
        if not formats or any(f not in FORMATS for f in formats):
            p.error(f"--formats must name some of {', '.join(FORMATS)}, not {args.formats!r}")
        return {"formats": formats, "new_tokens": args.tokens, "repeats": args.repeats}
    parts = [s.strip() for s in args.sizes.split(",")]
    if not all(s.isdigit() and 1 <= int(s) <= 1024 for s in parts):
        p.error(f"--sizes must be whole numbers from 1 to 1,024 separated by commas, not {args.sizes!r}")
    return {"sizes": tuple(int(s) for s in parts), "new_tokens": args.tokens}


def chat_turn_line(s: dict, turn: int) -> str:
    """One turn of the chat comparison: medians, spreads, and whether the difference stands out of the noise."""
    on, off = s[f"turn{turn}_on_ms"], s[f"turn{turn}_off_ms"]
    (on_lo, on_hi), (off_lo, off_hi) = s[f"turn{turn}_on_range"], s[f"turn{turn}_off_range"]
    verdict = (f"reuse {off / on:.1f}x faster" if on < off else f"reuse {on / off:.1f}x slower") \
        if s[f"turn{turn}_clear"] else "no clear difference: the spreads overlap"
    return (f"turn {turn}: TTFT median {on:,.0f} ms with reuse ({on_lo:,.0f}-{on_hi:,.0f}), {off:,.0f} ms without "
            f"({off_lo:,.0f}-{off_hi:,.0f}) over {s['repeats']} repeats: {verdict}")


def experiment_table(kind: str, points: list[ExperimentPoint], finished: ExperimentFinished) -> str:
    s = finished.summary
    if kind == "prefill":
        lines = ["prompt tokens | prefill ms (median) | TTFT ms | predicted ms (computed) | FLOPs (computed)",
                 "--------------+---------------------+---------+-------------------------+-----------------"]
        for p in points:
            v = p.values
            pred = f"{v['predicted_ms']:.2f}" if "predicted_ms" in v else "n/a"
            lines.append(f"{int(v['tokens']):13,d} | {v['prefill_ms']:19.2f} | {v['ttft_ms']:7.2f} | {pred:>23} | "
                         f"{_fmt(v['flops']):>15}")
        if "exponent" in s:
            lines += ["", f"time ~ n^{s['exponent']:.2f} overall (n^{s['exponent_short']:.2f} for short prompts, "
                      f"n^{s['exponent_long']:.2f} for long ones), measured",
                      f"Doubling {s['last_doubling']}: {s['last_doubling_x']:.1f}x measured, "
                      f"{s['flops_doubling_x']:.1f}x FLOPs (computed)"]
    elif kind == "cache":
        lines = ["KV cache | TTFT ms | decode ms | total ms | decode tok/s | tokens",
                 "---------+---------+-----------+----------+--------------+-------"]
        for p in points:
            v = p.values
            lines.append(f"{'on' if v['kv_cache'] else 'off':>8} | {v['ttft_ms']:7.1f} | {v['decode_ms']:9.1f} | "
                         f"{v['total_ms']:8.1f} | {v['decode_tok_s']:12.2f} | {int(v['generated']):6d}")
        if "decode_speedup" in s:
            lines += ["", f"tokens identical with and without the cache: {'yes' if s['tokens_match'] else 'NO'}",
                      f"decode speedup with the cache: {s['decode_speedup']:.2f}x measured; "
                      f"{s['flops_ratio']:.1f}x fewer FLOPs (computed, whole model); "
                      f"{s['attention_flops_ratio']:.1f}x fewer attention FLOPs (computed, the seed's model)"]
    elif kind == "dtype":
        lines = ["weights | bytes/token | decode tok/s | ceiling | prefill tok/s | ceiling | TTFT ms | diverges "
                 "| NLL (ppl)",
                 "--------+-------------+--------------+---------+---------------+---------+---------+----------"
                 "+----------"]
        for p in (p for p in points if p.series == "format"):
            v = p.values
            requested = s.get("requested", [])
            name = requested[int(v["index"])] if int(v["index"]) < len(requested) else "?"
            diverges = "never" if v["diverges_at"] < 0 else f"step {int(v['diverges_at'])}"
            lines.append(f"{name:>7} | {v['bytes_per_token'] / 2**20:8.1f} MiB | {v['decode_tok_s']:12.1f} | "
                         f"{v['decode_ceiling_tok_s']:7.0f} | {v['prefill_tok_s']:13.0f} | "
                         f"{v['prefill_ceiling_tok_s']:7.0f} | {v['ttft_ms']:7.1f} | {diverges:>8} | "
                         f"{v['nll']:.3f} ({v['perplexity']:.1f})")
        if "float32_decode_tok_s" in s:
            lines += ["", *(f"{fmt}: {s[f'{fmt}_bytes_x']:.2f}x the bytes per token of float32, "
                            f"{s[f'{fmt}_decode_x']:.2f}x its decode tok/s (measured)" for fmt in s["formats"]
                            if fmt != "float32" and f"{fmt}_bytes_x" in s),
                      "ceilings: this machine's measured bandwidth over the bytes read per token (decode) and its "
                      "measured matmul peak over the FLOPs per token (prefill), computed"]
    elif kind == "chat":
        lines = ["repeat | reuse | turn | reused (cache_n) | prefilled | conversation | prefill ms | TTFT ms",
                 "-------+-------+------+------------------+-----------+--------------+------------+--------"]
        for p in points:
            v = p.values
            lines.append(f"{int(v.get('repeat', 1)):6d} | {'on' if v['reuse'] else 'off':>5} | {int(v['turn']):4d} | "
                         f"{int(v['reused_tokens']):16,d} | {int(v['prefilled_tokens']):9,d} | "
                         f"{int(v['conversation_tokens']):12,d} | {v['prefill_ms']:10.1f} | {v['ttft_ms']:7.1f}")
        if "tokens_match" in s and not s.get("incomplete"):
            lines += ["", f"replies identical with and without reuse: {'yes' if s['tokens_match'] else 'NO'}"]
            lines += [chat_turn_line(s, i) for i in range(1, int(s["turns"]) + 1)]
            if busy_note(s.get("lowest_cpu_share")):
                lines.append(f"note: some turns were {busy_note(s['lowest_cpu_share'])}")
    elif kind == "server load":
        lines = ["request | arrived ms | TTFT ms (client) | prompt ms (server) | tokens | decode tok/s | end-to-end ms",
                 "--------+------------+------------------+--------------------+--------+--------------+--------------"]
        for p in (p for p in points if p.series == "request"):
            v = p.values
            server = f"{v['server_prompt_ms']:18.1f}" if "server_prompt_ms" in v else f"{'not reported':>18}"
            lines.append(f"{int(v['index']):7d} | {v['arrival_ms']:10.1f} | {v['ttft_ms']:16.1f} | {server} | "
                         f"{int(v['generated']):6d} | {v['decode_tok_s']:12.1f} | {v['e2e_ms']:13.1f}")
        if "mean_ttft_ms" in s:
            lines += ["", f"{int(s['completed'])} of {int(s['requested'])} requests completed; mean TTFT "
                      f"{s['mean_ttft_ms']:,.1f} ms, median {s['median_ttft_ms']:,.1f} ms (client); "
                      f"{s['total_tok_s']:,.1f} tok/s in all, {s['mean_decode_tok_s']:,.1f} tok/s per request "
                      "(measured by this client)"]
            if "mean_server_prompt_ms" in s:
                lines.append(f"server-reported prompt time: mean {s['mean_server_prompt_ms']:,.1f} ms; client TTFT "
                             f"exceeds it by {s['mean_client_minus_server_ms']:,.1f} ms on average (queueing, HTTP, "
                             "the first decode step)")
            peaks = [f"{q.replace('_', ' ')} {s['peak_' + q]:g}" for q in ("running", "waiting", "kv_usage")
                     if "peak_" + q in s]
            if peaks:
                lines.append(f"/metrics ({int(s['metrics_polls'])} polls): peak " + ", ".join(peaks)
                             + (f"; {s['cached_prompt_tokens_during']:g} prompt tokens from the prefix cache"
                                if "cached_prompt_tokens_during" in s else ""))
            if "metrics_error" in s:
                lines.append(f"/metrics: {s['metrics_error']}")
    elif kind == "paged":
        lines = ["sharing | request | prompt | waited ms | TTFT ms | end-to-end ms",
                 "--------+---------+--------+-----------+---------+--------------"]
        for p in points:
            v = p.values
            lines.append(f"{'on' if v['sharing'] else 'off':>7} | {int(v['index']):7d} | "
                         f"{int(v['prompt_tokens']):6d} | {v['queue_ms']:9.1f} | "
                         f"{v['ttft_ms']:7.1f} | {v['e2e_ms']:13.1f}")
        if "peak_blocks_shared" in s:
            mib = 2**20
            lines += ["", f"blocks of {int(s['bytes_per_block']):,} B (computed); at the peak: "
                      f"{int(s['peak_blocks_shared'])} blocks = {s['peak_bytes_shared'] / mib:.2f} MiB with sharing, "
                      f"{int(s['peak_blocks_unshared'])} = {s['peak_bytes_unshared'] / mib:.2f} MiB without "
                      "(measured block counts)",
                      f"a contiguous cache reserving prompt + {int(s['reserve'])} positions per request: "
                      f"{s['contiguous_bytes_at_peak'] / mib:.2f} MiB (computed) for "
                      f"{s['used_bytes_at_peak'] / mib:.2f} MiB written",
                      f"shared system prompt: {int(s['shared_prefix_tokens'])} tokens = "
                      f"{int(s['shared_prefix_blocks'])} full blocks; tokens equal solo runs: "
                      f"{'yes' if s['tokens_match_solo'] else 'NO'}"]
            if "ours_tok_s" in s:
                lines.append(f"same arrivals: transformers' paged batching {s['transformers_tok_s']:.1f} tok/s, "
                             f"mean TTFT {s['transformers_mean_ttft_ms']:.0f} ms; KVScope's scheduler "
                             f"{s['ours_tok_s']:.1f} tok/s, "
                             f"{s['ours_mean_ttft_ms']:.0f} ms (measured); tokens "
                             f"{'identical' if s['same_tokens_as_ours'] else 'different'}")
    elif kind == "speculative":
        lines = ["decode      | repeat | decode ms | tok/s  | forward passes | guessed | kept",
                 "------------+--------+-----------+--------+----------------+---------+-----"]
        for p in points:
            v = p.values
            lines.append(f"{p.series:11} | {int(v['repeat']) + 1:6d} | {v['decode_ms']:9.0f} | "
                         f"{v['decode_tok_s']:6.1f} | {int(v['passes']):14d} | "
                         f"{int(v['drafted']):7d} | {int(v['accepted']):4d}")
        if "speedup" in s:
            lines += ["", f"{s['drafter']}: {int(s['accepted'])} of {int(s['drafted'])} guesses kept "
                      f"({s['acceptance']:.0%}), {s['tokens_per_pass']:.2f} tokens per forward pass, decode "
                      f"{s['speedup']:.2f}x as fast (median of the repeats, measured; drafting "
                      f"{s['draft_share']:.0%} of the speculative time)",
                      "same tokens as plain greedy decode: " + ("yes" if s["tokens_match"] else
                                                                f"NO, from token {int(s['first_difference'])}")]
            if busy_note(s.get("lowest_cpu_share")):
                lines.append(f"note: {busy_note(s['lowest_cpu_share'])}")
    elif kind == "continuous":
        lines = ["policy     | request | prompt | new | arrived ms | waited ms | TTFT ms | end-to-end ms",
                 "-----------+---------+--------+-----+------------+-----------+---------+--------------"]
        for p in (p for p in points if p.series == "request"):
            v = p.values
            lines.append(f"{'continuous' if v['policy'] else 'static':10} | {int(v['index']):7d} | "
                         f"{int(v['prompt_tokens']):6d} | {int(v['new_tokens']):3d} | {v['arrival_ms']:10.1f} | "
                         f"{v['queue_ms']:9.1f} | {v['ttft_ms']:7.1f} | {v['e2e_ms']:13.1f}")
        if "continuous_tok_s" in s:
            lines += ["", *(f"{pol:10}: {s[pol + '_tok_s']:8.1f} tok/s in all, mean TTFT "
                            f"{s[pol + '_mean_ttft_ms']:8.1f} ms, mean end-to-end {s[pol + '_mean_e2e_ms']:8.1f} ms "
                            "(measured)" for pol in ("continuous", "static")),
                      f"each request's tokens equal its solo run: {'yes' if s.get('tokens_match_solo') else 'NO'}"]
    else:
        lines = ["batch | TTFT ms | per-token ms | decode tok/s (all requests) | request latency ms",
                 "------+---------+--------------+-----------------------------+-------------------"]
        for p in points:
            v = p.values
            lines.append(f"{int(v['batch']):5d} | {v['ttft_ms']:7.1f} | {v['per_token_ms']:12.2f} | "
                         f"{v['decode_tok_s']:27.1f} | {v['request_latency_ms']:18.1f}")
        if "throughput_gain" in s:
            lines += ["", f"batch {s['largest_batch']}: {s['throughput_gain']:.1f}x the tokens/s of batch 1, each "
                      f"token {s['latency_growth']:.2f}x slower per request (measured)"]
    if s.get("tokens_note"):
        lines.append(f"why the tokens differ: {s['tokens_note']}")
    if finished.reason != "done":
        lines.append(f"({finished.reason})")
    return "\n".join(lines)
