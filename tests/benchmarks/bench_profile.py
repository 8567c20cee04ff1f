"""Where a decode step's time goes, eager and compiled: a ``torch.profiler`` over decode steps of the embedded
model (after a prefill and warm-up steps that are not profiled), read as operator calls per step, matrix
products per step and the time in them, and the bandwidth those products reach over the weights they read.

The products read every weight once per step (the tied embedding as the output layer; the input embedding reads
one row), so "reached" is the weights' bytes over the measured time in products: achieved. The ceiling
beside it is this machine's copy bandwidth, measured on a quiet machine (none is shown otherwise). The
profiler's own cost slows every step a little; the step times here are for reading the split, the speed itself
is ``bench_formats``'s. A compiled step saved as a package (``engine.model.packaged``) runs inductor's own
kernels, products included, which the profiler does not see: its row gives the step and says so.
Run: ``python -m tests.benchmarks.bench_profile --dtype bfloat16`` (``make bench`` does).
"""

from __future__ import annotations

import argparse

from tests.benchmarks.common import copy_words, machine, save

PROMPT = "Explain in three sentences why decoding one token at a time is limited by memory bandwidth."
# The operators that multiply by a weight matrix, eager and compiled (inductor calls ATen's, oneDNN's or MKL's).
PRODUCTS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm",
            "aten::_weight_int4pack_mm_for_cpu", "mkldnn::_linear_pointwise", "onednn::qlinear_pointwise",
            "aten::_int_mm", "mkl::_mkl_linear")


def profile_steps(session, compiled: bool, steps: int, warmup: int = 4) -> dict:
    """Decode ``warmup`` steps, then profile ``steps`` more: totals per step."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine.model import kvcache
    from engine.model.compiled import cache_length

    ids = session.encode(PROMPT)
    length = cache_length(len(ids) + warmup + steps + 1, session.facts.max_context)
    graph = session.compiled.graph(length, background=False)[0] if compiled else None
    device = session.device
    with torch.inference_mode():
        cache = kvcache.new_cache(session.model, length)
        logits, cache = session.prefill(torch.tensor([ids], device=device), True, cache)
        position = len(ids)

        def step() -> None:
            nonlocal logits, position
            token = logits.argmax().view(1)
            logits = session.decode_step(token, position, cache, None, graph)
            position += 1

        for _ in range(warmup):
            step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            started = time.perf_counter()
            for _ in range(steps):
                step()
            wall = time.perf_counter() - started
    events = prof.key_averages()
    calls = sum(e.count for e in events)
    products = [e for e in events if e.key in PRODUCTS]
    product_us = sum(e.self_cpu_time_total for e in products)
    return {"step_ms": wall / steps * 1000.0, "operator_calls_per_step": calls / steps,
            "products_per_step": sum(e.count for e in products) / steps,
            "product_ms_per_step": product_us / steps / 1000.0,
            "products": {e.key: e.count / steps for e in products}}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)

    import torch

    from engine.model import hardware
    from engine.model.models import load
    from engine.run.session import Session

    torch.set_num_threads(args.threads)
    rows = {}
    weights = 0
    for path in ("eager", "compiled"):
        loaded = load("embedded", "cpu", args.dtype)                  # a model each (graphs are per model)
        weights = loaded.facts.weight_bytes
        rows[path] = profile_steps(Session(loaded), path == "compiled", args.steps)
        del loaded
    peaks = hardware.quiet_peaks(torch.device("cpu"), getattr(torch, args.dtype, torch.float32))
    copy = peaks.bytes_per_s if peaks is not None else None          # None: every copy measured was busy
    for row in rows.values():
        seen = row["product_ms_per_step"] > 0
        row["reached_gb_s"] = weights / (row["product_ms_per_step"] / 1000.0) / 1e9 if seen else None
    result = {"machine": machine(), "dtype": args.dtype, "steps": args.steps, "weight_bytes": weights,
              "copy_gb_s": copy / 1e9 if copy else None, "rows": rows}
    print(f"machine: {result['machine']}; {args.dtype}, {args.steps} profiled decode steps after 4 warm-up "
          f"steps; weights {weights / 2**20:,.0f} MiB")
    print("| path | step ms (profiled) | operator calls / step | matrix products / step | ms in products / step | "
          "share of step | bandwidth reached (achieved) | of the copy bandwidth (measured) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for path, r in rows.items():
        if r["reached_gb_s"] is None:          # a package: its products are inductor's kernels, unseen
            print(f"| {path} | {r['step_ms']:.1f} | {r['operator_calls_per_step']:,.0f} | not seen | not seen | - | "
                  "- | - |")
            continue
        print(f"| {path} | {r['step_ms']:.1f} | {r['operator_calls_per_step']:,.0f} | {r['products_per_step']:.0f} | "
              f"{r['product_ms_per_step']:.1f} | {r['product_ms_per_step'] / r['step_ms']:.0%} | "
              f"{r['reached_gb_s']:.1f} GB/s | {copy_words(r['reached_gb_s'], result['copy_gb_s'])} |")
    if any(r["reached_gb_s"] is None for r in rows.values()):
        print("not seen: the compiled step is a package, whose kernels (inductor's own, products included) run "
              "without the profiler's records")
    save(f"profile-{args.dtype}", result)
    return result


if __name__ == "__main__":
    main()
