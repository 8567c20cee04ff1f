"""Does instrumenting cost anything? The session and plain ``model.generate`` alternate on the same model,
prompt and settings (greedy, 128 new tokens); medians of TTFT and decode tok/s are compared, and the per-step
cost of each instrument is timed on its own."""

from __future__ import annotations

import argparse
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


def generate_once(loaded, ids: list[int], n: int) -> tuple[float, float, int]:
    import torch
    from transformers import StoppingCriteriaList

    stamps = _Stamps(loaded.device.type == "cuda")
    x = torch.tensor([ids], device=loaded.device)
    with torch.inference_mode():
        if stamps.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = loaded.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                                    stopping_criteria=StoppingCriteriaList([stamps]))
    generated = out.shape[1] - len(ids)
    ttft = (stamps.times[0] - t0) * 1000.0
    decode = (len(stamps.times) - 1) / (stamps.times[-1] - stamps.times[0]) if len(stamps.times) > 1 else 0.0
    return ttft, decode, generated


def session_once(session, n: int) -> tuple[float, float, int]:
    from engine.params import GenerationParams

    s = session.run(PROMPT, GenerationParams(max_new_tokens=n)).summary
    return s.ttft_ms - s.tokenize_ms, s.decode_tok_s, s.generated_tokens


def instrument_costs(session, reps: int = 300) -> dict[str, float]:
    """Microseconds per call of each instrument on a real cache (KV norms run once every 8 decode steps)."""
    import torch
    from transformers import DynamicCache

    from engine import kvcache
    from engine.session import kv_norms
    from engine.textstream import TextStream

    ids = torch.tensor([session.encode(PROMPT)], device=session.device)
    cache = DynamicCache(config=session.model.config)
    with torch.inference_mode():
        session.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)

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
            "kv_bytes_per_layer_us": per_call(lambda: kvcache.kv_bytes_per_layer(cache, layers)),
            "clock_marks_us": per_call(lambda: clock.elapsed_ms(clock.mark(), clock.mark())),
            "kv_norms_batch_of_8_us": per_call(lambda: kv_norms(cache, ids.shape[1] - 8, ids.shape[1])),
            "text_piece_us": per_call(lambda: stream.step(1234)),
        }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="embedded")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128)
    args = p.parse_args(argv)

    from engine.models import load
    from engine.session import Session

    loaded = load(args.model, args.device, args.dtype)
    session = Session(loaded)
    ids = session.encode(PROMPT)
    session_once(session, 8)                     # warm-up, reported separately from the measured runs
    generate_once(loaded, ids, 8)
    rows = {"session": [], "generate": []}
    for _ in range(args.runs):                   # interleaved, so drift in machine load hits both alike
        rows["session"].append(session_once(session, args.tokens))
        rows["generate"].append(generate_once(loaded, ids, args.tokens))
    med = {k: {"ttft_ms": median([r[0] for r in v]), "decode_tok_s": median([r[1] for r in v]),
               "tokens": [r[2] for r in v]} for k, v in rows.items()}
    costs = instrument_costs(session)
    result = {
        "machine": machine(), "model": loaded.facts.name, "device": loaded.facts.device,
        "dtype": loaded.facts.dtype, "prompt_tokens": len(ids), "new_tokens": args.tokens, "runs": args.runs,
        "medians": med, "decode_ratio": med["session"]["decode_tok_s"] / med["generate"]["decode_tok_s"],
        "ttft_ratio": med["session"]["ttft_ms"] / med["generate"]["ttft_ms"], "instrument_us": costs,
        "raw": rows,
    }
    print(f"machine: {result['machine']}")
    print(f"model: {result['model']} on {result['device']} ({result['dtype']}), prompt {len(ids)} tokens, "
          f"{args.tokens} new tokens, greedy, {args.runs} interleaved runs each (medians)")
    print("| | TTFT (ms) | decode (tok/s) | tokens |")
    print("|---|---:|---:|---:|")
    for k, v in med.items():
        print(f"| {k} | {v['ttft_ms']:.1f} | {v['decode_tok_s']:.2f} | {v['tokens'][0]} |")
    print(f"decode tok/s ratio session/generate = {result['decode_ratio']:.3f}; "
          f"TTFT ratio = {result['ttft_ratio']:.3f}")
    print("instrument cost per decode step: " + ", ".join(f"{k} {v:.1f} us" for k, v in costs.items()))
    save(f"engine-{loaded.facts.device.split(':')[0]}-{loaded.facts.dtype}", result)
    return result


if __name__ == "__main__":
    main()
