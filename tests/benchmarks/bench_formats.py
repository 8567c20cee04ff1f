"""Weight formats side by side: KVScope's float32 / bfloat16 / int8 / int4 against llama.cpp (llama-cpp-python,
bench-only) at the nearest bit widths, on the same weights, prompt and thread count.

Every GGUF is made from the embedded SmolLM2 Q4_1 GGUF with llama.cpp's own ``llama_model_quantize``
(requantizing): F32, BF16, Q8_0 and Q4_0 hold the same dequantized values KVScope converts to float32, so
the formats differ in storage only. Both tools are timed the same way, from the consumer's side: when each
token reached the caller (KVScope's sink, llama.cpp's stream), over a whole run; rounds interleave the two.
Each figure is also given as a ratio to this machine's measured ceilings (bandwidth for decode, the matmul
peak for prefill). Run: ``python -m tests.benchmarks.bench_formats`` (``make bench`` does).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from tests.benchmarks.common import machine, save

PAIRS = (("float32", "F32", 0), ("bfloat16", "BF16", 32), ("int8", "Q8_0", 7), ("int4", "Q4_0", 2))
PROMPT = "Explain in three sentences why decoding one token at a time is limited by memory bandwidth."


def gguf_variants(folder: Path) -> dict[str, Path]:
    import llama_cpp

    from engine import embedded

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


def kvscope_run(session, prompt: str, tokens: int) -> dict:
    from engine.events import TokenStep
    from engine.params import GenerationParams

    stamps: list[float] = []
    started = time.perf_counter()
    result = session.run(prompt, GenerationParams(max_new_tokens=tokens, chat_template=False),
                         lambda e: stamps.append(time.perf_counter()) if isinstance(e, TokenStep) else None)
    return {"ttft_ms": (stamps[0] - started) * 1000.0,
            "decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0,
            "tokens": len(stamps), "cpu_share": result.summary.cpu_share}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python is not installed: pip install llama-cpp-python (builds from source, minutes); "
              "the llama.cpp rows are left out")
        llama_cpp = None

    import torch

    from engine import hardware
    from engine.costmodel import ModelCost
    from engine.models import load
    from engine.session import Session

    torch.set_num_threads(args.threads)
    folder = Path(os.environ.get("KVSCOPE_BENCH_DIR", tempfile.mkdtemp())) / "gguf"
    folder.mkdir(parents=True, exist_ok=True)
    ggufs = gguf_variants(folder) if llama_cpp is not None else {}
    rows = []
    for fmt, name, _ftype in PAIRS:
        loaded = load("embedded", "cpu", fmt)
        session = Session(loaded)
        prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                                      add_generation_prompt=True, tokenize=False)
        peaks = hardware.peaks(loaded.device, loaded.model.dtype)
        step = ModelCost(loaded.facts).decode(64)
        llm = None
        if name in ggufs:
            from llama_cpp import Llama

            llm = Llama(model_path=str(ggufs[name]), n_threads=args.threads, n_ctx=1024, verbose=False,
                        logits_all=False)
        kvscope_run(session, prompt, 4)                                # warm-up both
        if llm is not None:
            llama_cpp_run(llm, prompt, 4)
        ours, theirs = [], []
        for _ in range(args.rounds):
            ours.append(kvscope_run(session, prompt, args.tokens))
            if llm is not None:
                theirs.append(llama_cpp_run(llm, prompt, args.tokens))
        row = {"kvscope": fmt, "weights_mib": loaded.facts.weight_bytes / 2**20,
               "kvscope_decode_tok_s": statistics.median(r["decode_tok_s"] for r in ours),
               "kvscope_ttft_ms": statistics.median(r["ttft_ms"] for r in ours),
               "decode_ceiling_tok_s": peaks.bytes_per_s / step.bytes, "bandwidth_gb_s": peaks.bytes_per_s / 1e9,
               "lowest_cpu_share": min((r["cpu_share"] for r in ours if r["cpu_share"]), default=None)}
        if theirs:
            row.update({"llama_cpp": name, "gguf_mib": ggufs[name].stat().st_size / 2**20,
                        "llama_cpp_decode_tok_s": statistics.median(r["decode_tok_s"] for r in theirs),
                        "llama_cpp_ttft_ms": statistics.median(r["ttft_ms"] for r in theirs)})
        rows.append(row)
        del session, loaded, llm
    result = {"machine": machine(), "threads": args.threads, "tokens": args.tokens, "rounds": args.rounds,
              "rows": rows}
    print(f"machine: {result['machine']}; {args.threads} threads both; {args.tokens} new tokens, greedy, "
          f"{args.rounds} interleaved rounds (medians); decode tok/s from consumer-side token times, both tools")
    print("| KVScope weights | MiB | decode tok/s | of ceiling | TTFT ms | llama.cpp | GGUF MiB | decode tok/s | "
          "TTFT ms | KVScope / llama.cpp |")
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        ours = f"| {r['kvscope']} | {r['weights_mib']:.0f} | {r['kvscope_decode_tok_s']:.1f} | " \
               f"{r['kvscope_decode_tok_s'] / r['decode_ceiling_tok_s']:.0%} | {r['kvscope_ttft_ms']:.0f} |"
        if "llama_cpp" in r:
            ours += (f" {r['llama_cpp']} | {r['gguf_mib']:.0f} | {r['llama_cpp_decode_tok_s']:.1f} | "
                     f"{r['llama_cpp_ttft_ms']:.0f} | {r['kvscope_decode_tok_s'] / r['llama_cpp_decode_tok_s']:.2f} |")
        print(ours)
    print("ceiling: the measured copy bandwidth over the bytes one decode step reads (weights + KV), computed")
    save("formats", result)
    return result


if __name__ == "__main__":
    main()
