"""The words KVScope uses that a lecturer's audience may not know, defined once: the window shows them as
tooltips where the word appears, and README's glossary prints the same definitions (a test checks both)."""

from __future__ import annotations

TERMS: dict[str, str] = {
    "prefill": "the first forward pass, which reads the whole prompt at once and fills the KV cache with its keys "
               "and values",
    "decode": "every later forward pass: one new token each, reading the KV cache instead of the whole sequence",
    "TTFT": "time to first token: from pressing Run until the first generated token exists (tokenizing, the "
            "prefill and the first sampling)",
    "tok/s": "tokens per second: generated tokens divided by the decode time that produced them",
    "KV cache": "the keys and values of every position already read, kept per layer so decode computes them only "
                "once; its size grows with the context",
    "GQA": "grouped-query attention: several query heads share one KV head, so the cache is that many times "
           "smaller",
    "MQA": "multi-query attention: every query head shares a single KV head",
    "MLA": "multi-head latent attention (DeepSeek): the cache holds one compressed vector and one rope key per "
           "position instead of keys and values per head",
    "sliding window": "a layer that attends to the last N positions only, so its cache stops growing at N",
    "GGUF": "llama.cpp's file format for model weights, often quantized; KVScope converts it once to run it",
    "quantization": "storing weights in fewer bits (Q4_1, int8, int4: 4 or 8 bits with a scale per group "
                    "instead of 16 or 32), so decode reads fewer bytes",
    "bandwidth ceiling": "the most tokens per second decode can reach if every step must read all the weights "
                         "once: memory bandwidth divided by the bytes a step reads (the roofline's memory limit)",
    "roofline": "the two limits on a computation's speed: the arithmetic the chip can do (FLOP/s) and the bytes "
                "its memory can deliver (bytes/s); the lower one for a given arithmetic intensity wins",
}


def tip(*terms: str) -> str:
    """Tooltip text for ``terms``: each word and its definition."""
    return "\n".join(f"{term}: {TERMS[term]}" for term in terms)
