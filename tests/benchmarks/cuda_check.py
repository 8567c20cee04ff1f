"""One prepared run on a CUDA GPU: the engine's CUDA path checked and measured (not part of ``make test``:
CI has no GPU). Prints everything and writes JSON into ``$OUT`` (or ``bench-results/``).

1. load the embedded model with device ``auto`` (CUDA, bf16) and ``cuda`` + fp32;
2. greedy parity with ``generate()`` on the GPU, with the cache on and off;
3. KV bytes from the cache tensors against the formula and against ``torch.cuda.memory_allocated``;
4. the step clock: CUDA events vs a host clock with and without a sync (why the events);
5. decode three ways, dynamic cache, static cache, compiled over the static cache (CUDA graphs): tok/s,
   the compile time apart, and whether the tokens stay the same;
6. the engine benchmark (session vs generate) in bf16 and fp32;
7. the lessons that show most on a GPU: the prefill sweep up to the full context, the cache on/off, batch sizes
   to 64, and offloading (layers on disk, and the KV cache offloaded to the CPU: measured only on a GPU).

It ends with one table, a row per check (``checks``), and exits 1 if any check failed: greedy tokens against
``generate()``, KV bytes against the formula, static, compiled and offloaded decode against the dynamic cache's
tokens, and the instruments' ratio (the session's decode over ``generate()``'s, at least ``INSTRUMENTS_FREE``).
Goals (compiled with CUDA graphs at least 5x eager) are rows too, reported, not failed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import lessons
from engine.facts import kvformula
from engine.facts.params import GenerationParams
from engine.model import kvcache
from engine.model.hardware import peaks_event
from engine.model.models import load
from engine.run.session import Session
from tests.benchmarks import bench_engine
from tests.lessons import collect

OUT = Path(os.environ.get("OUT", "bench-results"))
PROMPT = "hey, what is continuous batching?"
INSTRUMENTS_FREE = 0.95          # the instrumented session's decode over generate()'s, at least
ALLOCATOR_SLACK = 2 << 20        # what CUDA's caching allocator may round a cache's allocation up by


def parity(loaded) -> dict:
    session = Session(loaded)
    out = {}
    for kv in (True, False):
        events = []
        result = session.run(PROMPT, GenerationParams(max_new_tokens=32, kv_cache=kv), events.append)
        ids = events[0].prompt_ids
        x = torch.tensor([ids], device=loaded.device)
        with torch.inference_mode():
            ref = loaded.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=32)
        expected = ref[0, len(ids):].tolist()
        out[f"kv_{'on' if kv else 'off'}_equal"] = result.summary.token_ids == expected
        out[f"kv_{'on' if kv else 'off'}_tokens"] = len(expected)
    return out


def kv_memory(loaded, n: int = 1024) -> dict:
    from transformers import DynamicCache

    session = Session(loaded)
    ids = (session.encode("The KV cache holds keys and values. ", chat_template=False) * n)[:n]
    x = torch.tensor([ids], device=loaded.device)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    cache = DynamicCache(config=loaded.model.config)
    with torch.inference_mode():
        out = loaded.model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=1)
    del out
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    read = sum(k + v for k, v in kvcache.held_per_layer(cache, loaded.facts.num_layers)[0])
    return {"tokens": n, "read_from_tensors": read, "formula": kvformula.predicted_kv_bytes(loaded.facts, n),
            "cuda_allocated_delta": after - before}


def clock_check(loaded, steps: int = 50) -> dict:
    """One decode step timed three ways; the host clock without a sync measures only the launch."""
    from transformers import DynamicCache

    session = Session(loaded)
    ids = torch.tensor([session.encode(PROMPT)], device=loaded.device)
    cache = DynamicCache(config=loaded.model.config)
    events, synced, unsynced = [], [], []
    with torch.inference_mode():
        logits, cache = session.prefill(ids, use_cache=True)
        token = logits.argmax(-1, keepdim=True)
        position = ids.shape[1]
        for i in range(steps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            start = session.clock.mark()
            logits = session.decode_step(token, position + i, cache, None)
            end = session.clock.mark()
            unsynced.append((time.perf_counter() - t) * 1000)
            events.append(session.clock.elapsed_ms(start, end))
            torch.cuda.synchronize()
            synced.append((time.perf_counter() - t) * 1000)
            token = logits.argmax(-1, keepdim=True)
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    return {"cuda_events_ms": med(events), "host_clock_with_sync_ms": med(synced),
            "host_clock_without_sync_ms": med(unsynced)}


def decode_modes(loaded, tokens: int = 128, repeats: int = 3) -> dict:
    """Decode tok/s with a dynamic cache, a static one, and compiled over the static one; medians of the repeats.
    The first compiled run compiles (its compile time is reported apart, never mixed into decode)."""
    session = Session(loaded)
    modes = {"dynamic": {}, "static": {"static_cache": True}, "compiled": {"static_cache": True, "compiled": True}}
    out: dict = {}
    for name, flags in modes.items():
        rates, compile_ms, ids = [], [], None
        for _ in range(repeats + (1 if name == "compiled" else 0)):
            result = session.run(PROMPT, GenerationParams(max_new_tokens=tokens, **flags), lambda _e: None)
            s = result.summary
            compile_ms.append(s.compile_ms)
            rates.append(s.decode_runs / (s.decode_ms / 1000.0) if s.decode_ms > 0 else 0.0)
            ids = s.token_ids
        kept = rates[1:] if name == "compiled" else rates         # the compiling run is not a decode figure
        out[name] = {"decode_tok_s": sorted(kept)[len(kept) // 2], "runs": rates, "compile_ms": max(compile_ms),
                     "token_ids": ids}
    for name in ("static", "compiled"):
        out[name]["same_tokens_as_dynamic"] = out[name].pop("token_ids") == out["dynamic"]["token_ids"]
    out["dynamic"].pop("token_ids")
    return out


@dataclass(frozen=True)
class Check:
    name: str
    figure: str
    ok: bool | None              # None: a goal, reported and not failed


def checks(report: dict, experiments: dict) -> list[Check]:
    """Every check the report allows, in the order of the run; a part not run gives no row."""
    rows: list[Check] = []
    for name in ("bf16", "fp32"):
        parity_of = report.get(f"parity_{name}") or {}
        for kv in ("on", "off"):
            if f"kv_{kv}_equal" in parity_of:
                rows.append(Check(f"{name}: greedy tokens, cache {kv}, vs generate()",
                                  f"{parity_of[f'kv_{kv}_tokens']} tokens", bool(parity_of[f"kv_{kv}_equal"])))
        memory = report.get(f"kv_memory_{name}")
        if memory:
            read, formula, delta = memory["read_from_tensors"], memory["formula"], memory["cuda_allocated_delta"]
            rows.append(Check(f"{name}: KV bytes in the tensors vs the formula ({memory['tokens']:,} tokens)",
                              f"{read:,} / {formula:,} B", read == formula))
            rows.append(Check(f"{name}: torch.cuda.memory_allocated growth vs the formula",
                              f"{delta:,} B", formula <= delta <= formula + ALLOCATOR_SLACK))
        modes = report.get(f"decode_modes_{name}")
        if modes:
            eager = modes["dynamic"]["decode_tok_s"]
            for mode, words in (("static", "static cache"),
                                ("compiled", "compiled over the static cache, CUDA graphs")):
                rate = modes[mode]["decode_tok_s"]
                rows.append(Check(f"{name}: {words}: tokens vs the dynamic cache's",
                                  f"{rate:,.1f} tok/s ({rate / eager:.2f}x eager)",
                                  bool(modes[mode]["same_tokens_as_dynamic"])))
            ratio = modes["compiled"]["decode_tok_s"] / eager if eager else 0.0
            rows.append(Check(f"{name}: goal, compiled with CUDA graphs at least 5x eager", f"{ratio:.2f}x", None))
    for dtype, ratio in (report.get("instruments") or {}).items():
        rows.append(Check(f"{dtype}: the instruments' ratio, session / generate() decode", f"{ratio:.3f}",
                          ratio >= INSTRUMENTS_FREE))
    offload = (experiments.get("offload") or {}).get("result") or {}
    for split in offload.get("splits", ()):
        rows.append(Check(f"offloading: {split.get('disk_layers', '?')} layers on disk: tokens vs all in memory",
                          f"{split.get('decode_tok_s', 0):,.1f} tok/s", bool(split.get("tokens_match"))))
    if "kv_offload_tokens_match" in offload:
        rows.append(Check("offloading: the KV cache on the CPU between uses: tokens vs on the GPU",
                          f"{offload.get('kv_offload_decode_tok_s', 0):,.1f} tok/s",
                          bool(offload["kv_offload_tokens_match"])))
    return rows


def check_table(rows: list[Check]) -> str:
    width = max((len(r.name) for r in rows), default=10)
    verdict = {True: "ok", False: "MISMATCH", None: "goal"}
    lines = [f"{'check':<{width}} | {'figure':<34} | verdict", "-" * (width + 48)]
    lines += [f"{r.name:<{width}} | {r.figure:<34} | {verdict[r.ok]}" for r in rows]
    failed = [r for r in rows if r.ok is False]
    lines.append(f"{len(rows) - len(failed)} of {len(rows)} rows ok or reported; "
                 + (f"{len(failed)} MISMATCH" if failed else "no mismatch"))
    return "\n".join(lines)


def main() -> None:
    import sys

    only = set(sys.argv[1].split(",")) if len(sys.argv) > 1 else None   # e.g. "parity,batch" for a re-check
    OUT.mkdir(parents=True, exist_ok=True)
    report: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    t = time.perf_counter()
    auto = load("embedded", "auto", "auto")
    report["load_auto_s"] = time.perf_counter() - t
    report["auto"] = {"device": auto.facts.device, "dtype": auto.facts.dtype,
                      "layer_devices": sorted(set(auto.facts.layer_devices))}
    print(json.dumps(report, indent=1), flush=True)
    fp32 = load("embedded", "cuda", "float32")
    for name, loaded in (("bf16", auto), ("fp32", fp32)):
        report[f"parity_{name}"] = parity(loaded)
        if only is not None:
            continue
        report[f"kv_memory_{name}"] = kv_memory(loaded)
        report[f"clock_{name}"] = clock_check(loaded)
        report[f"decode_modes_{name}"] = decode_modes(loaded)
        report[f"peaks_{name}"] = vars(peaks_event(loaded))
        print(name, json.dumps({k: v for k, v in report.items() if k.endswith(name)}, indent=1), flush=True)
    (OUT / ("cuda-report.json" if only is None else "cuda-recheck.json")).write_text(json.dumps(report, indent=1))
    del fp32
    torch.cuda.empty_cache()
    report["instruments"] = {}
    for dtype in ("bfloat16", "float32") if only is None else ():
        engine_figures = bench_engine.main(["--device", "cuda", "--dtype", dtype, "--rounds", "5"])
        report["instruments"][dtype] = min(engine_figures["throughput_ratio_vs_reference"].values())
    session = Session(auto)
    experiments = {}
    for kind, settings in (("prefill", {"max_length": 8192, "repeats": 5}), ("cache", {"new_tokens": 128}),
                           ("batch", {"sizes": (1, 2, 4, 8, 16, 32, 64), "new_tokens": 64}),
                           ("offload", {"disk_shares": (0.0, 0.25, 0.5), "new_tokens": 64})):
        if only is not None and kind not in only:
            continue
        from engine.facts.events import ExperimentPoint

        events, finished = collect(kind, session, **settings)
        points = [e for e in events if isinstance(e, ExperimentPoint)]
        table = lessons.lesson(kind).table(points, finished.result)
        print(f"\n== {kind} on {report['gpu']} (bf16) ==\n{table}", flush=True)
        experiments[kind] = {"points": [p.values for p in points], "result": dataclasses.asdict(finished.result)}
    (OUT / ("cuda-experiments.json" if only is None else "cuda-recheck-experiments.json")).write_text(
        json.dumps(experiments, indent=1))
    rows = checks(report, experiments)
    print(f"\n== checks on {report['gpu']}, torch {report['torch']} ==\n{check_table(rows)}", flush=True)
    sys.exit(1 if any(r.ok is False for r in rows) else 0)


if __name__ == "__main__":
    main()
