"""The weight-format lesson: halve the bytes decode reads per token and decode nearly doubles, while prefill,
which is arithmetic, does not. Per format (float32, bfloat16, int8, int4 weights), on the loaded model:

- bytes read per token (the weights as stored plus the KV cache) and measured decode tok/s beside the ceiling
  this machine's measured bandwidth allows for those bytes;
- prefill tok/s on a longer prompt beside the ceiling the measured matmul peak allows;
- TTFT, the first step where greedy tokens leave float32's, and the mean negative log-likelihood (and
  perplexity) of a held paragraph, so what the smaller bytes cost in quality is on the same screen.

Each format is a fresh load of the same model (then released); medians of a few interleaved repeats.
"""

from __future__ import annotations

import gc
import math
import statistics
import threading

import torch

from engine import hardware
from engine.costmodel import Device, ModelCost
from engine.errors import ModelSourceError, ParameterError
from engine.events import ExperimentFinished, HardwarePeaks
from engine.experiments import _Experiment, filler_ids
from engine.params import GenerationParams
from engine.session import Session

FORMATS = ("float32", "bfloat16", "int8", "int4")
PROMPT = "Explain in three sentences why decoding one token at a time is limited by memory bandwidth."
HELD_PARAGRAPH = ("The cache keeps the keys and values of every token the model has already read, so that each new "
                  "token attends to them without computing them again. Its size grows with the length of the "
                  "conversation, with the number of layers, and with the width of each key and value. When many "
                  "users are served at once, the memory the caches take, not the arithmetic, decides how many of "
                  "them fit on one machine.")


def negative_log_likelihood(session: Session, text: str) -> float:
    """Mean negative log-likelihood (nats per token) of ``text`` under the model, teacher-forced, one pass."""
    ids = torch.tensor([session.encode(text, chat_template=False)], device=session.device)
    with torch.inference_mode():
        logits = session.model(input_ids=ids, use_cache=False).logits[0, :-1].float()
    return float(torch.nn.functional.cross_entropy(logits, ids[0, 1:]))


def first_divergence(reference: list[int], tokens: list[int]) -> int | None:
    """The first step where ``tokens`` leave ``reference`` (None if they never do, over the shorter)."""
    return next((i for i, (a, b) in enumerate(zip(reference, tokens)) if a != b), None)


def weight_formats(session: Session, emit, cancel: threading.Event | None = None, *,
                   formats: tuple[str, ...] = FORMATS, new_tokens: int = 48, repeats: int = 3,
                   prefill_tokens: int = 256, peaks: HardwarePeaks | None = None) -> ExperimentFinished:
    from engine.models import load

    if not formats or any(f not in FORMATS for f in formats) or new_tokens < 2 or repeats < 1:
        raise ParameterError(f"The weight-format sweep needs formats from {', '.join(FORMATS)}, at least 2 new "
                             f"tokens (got {new_tokens}) and at least one repeat (got {repeats})")
    facts = session.facts
    x = _Experiment("dtype", session, {"formats": list(formats), "new_tokens": new_tokens, "repeats": repeats,
                                       "prefill_tokens": prefill_tokens}, emit, cancel, peaks)
    reference: list[int] | None = None
    rows = []
    for i, fmt in enumerate(formats):
        if x.cancel.is_set():
            break
        x.progress(i, len(formats), f"{fmt}: loading {facts.name} and measuring")
        try:
            loaded = load(facts.source, str(session.device), fmt)
        except ModelSourceError as exc:                     # e.g. no int4 kernel for this device
            x.point("skipped", index=i)
            x.progress(i, len(formats), f"{fmt}: skipped ({exc})")
            continue
        other = Session(loaded)
        values = _measure(other, x, new_tokens, repeats, prefill_tokens)
        tokens = values.pop("tokens")
        reference = tokens if fmt == "float32" or reference is None else reference
        divergence = first_divergence(reference, tokens)
        values["diverges_at"] = float(divergence) if divergence is not None else -1.0
        values["index"] = float(i)
        x.point("format", **values)
        rows.append((fmt, values))
        del other, loaded
        gc.collect()
    x.progress(len(formats), len(formats), "done")
    summary: dict = {"formats": [fmt for fmt, _ in rows], "requested": list(formats)}
    base = next((v for fmt, v in rows if fmt == "float32"), None)
    for fmt, v in rows:
        summary[f"{fmt}_decode_tok_s"] = v["decode_tok_s"]
        summary[f"{fmt}_bytes_per_token"] = v["bytes_per_token"]
        if base is not None:
            summary[f"{fmt}_decode_x"] = v["decode_tok_s"] / base["decode_tok_s"]
            summary[f"{fmt}_bytes_x"] = v["bytes_per_token"] / base["bytes_per_token"]
    return x.finish(summary)


def _measure(session: Session, x: _Experiment, new_tokens: int, repeats: int, prefill_tokens: int) -> dict:
    facts = session.facts
    peaks = hardware.peaks(session.device, session.model.dtype)
    device = Device(peaks.device, peaks.flops_per_s, peaks.bytes_per_s)
    cost = ModelCost(facts)
    params = GenerationParams(max_new_tokens=new_tokens)
    session.run(PROMPT, GenerationParams(max_new_tokens=4))                       # warm-up
    runs = [session.run(PROMPT, params).summary for _ in range(repeats)]
    decode = statistics.median(s.decode_tok_s for s in runs)
    ttft = statistics.median(s.ttft_ms for s in runs)
    ids = torch.tensor([filler_ids(session, prefill_tokens)], device=session.device)
    times = []
    with torch.inference_mode():
        session.prefill(ids, use_cache=True)                                     # warm-up at this length
        for _ in range(repeats):
            start = session.clock.mark()
            session.prefill(ids, use_cache=True)
            times.append(session.clock.elapsed_ms(start, session.clock.mark()))
    prefill_ms = statistics.median(times)
    position = runs[0].prompt_tokens + new_tokens // 2
    step = cost.decode(position)
    nll = negative_log_likelihood(session, HELD_PARAGRAPH)
    return {"tokens": runs[0].token_ids, "weight_bytes": float(facts.weight_bytes),
            "bytes_per_token": step.bytes, "decode_tok_s": decode,
            "decode_ceiling_tok_s": device.bytes_per_s / step.bytes, "ttft_ms": ttft,
            "prefill_tok_s": prefill_tokens / (prefill_ms / 1000.0),
            "prefill_ceiling_tok_s": prefill_tokens / cost.prefill(prefill_tokens).compute_s(device),
            "nll": nll, "perplexity": math.exp(nll), "bandwidth_gb_s": peaks.bytes_per_s / 1e9,
            "peak_gflop_s": peaks.flops_per_s / 1e9,
            "lowest_cpu_share": min((s.cpu_share for s in runs if s.cpu_share is not None), default=-1.0)}
