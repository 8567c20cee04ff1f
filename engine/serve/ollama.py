"""Ollama in its own words: its native ``/api/chat`` and ``/api/generate`` stream newline-delimited JSON, and the
last object of each answer carries Ollama's own split of the work (the seed's two phases, as llama.cpp reports
them): ``prompt_eval_count`` tokens in ``prompt_eval_duration`` (the prefill), ``eval_count`` tokens in
``eval_duration`` (the decode), ``load_duration`` and ``total_duration``, every duration in nanoseconds. Its
OpenAI-compatible endpoint drops them, so a run on Ollama goes through the native API.

The shapes are Ollama's API documentation's and its official Python client's (``ollama._types.ChatResponse``):
``{"model", "created_at", "message": {"role", "content"}, "done": false}`` per piece, then ``"done": true`` with
``done_reason`` and the figures."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from engine.facts.params import GenerationParams
from engine.serve.client import stream_line

STREAM_TYPES = ("application/x-ndjson", "application/json")
FIGURES = ("prompt_eval_count", "prompt_eval_duration", "eval_count", "eval_duration", "load_duration",
           "total_duration")
NS_PER_MS = 1e6


def request(model: str, messages: list[dict] | None, prompt: str, params: GenerationParams) -> tuple[str, dict]:
    """The path and body of one streamed answer: ``/api/chat`` with messages, else ``/api/generate`` raw (the
    text as it is, no template: what a raw run means)."""
    options: dict[str, Any] = {"num_predict": params.max_new_tokens, "temperature": params.temperature,
                               "top_p": params.top_p, "top_k": params.top_k}
    if params.seed is not None:
        options["seed"] = params.seed
    body: dict[str, Any] = {"model": model, "stream": True, "options": options}
    if messages is not None:
        return "/api/chat", {**body, "messages": messages}
    return "/api/generate", {**body, "prompt": prompt, "raw": True}


def payloads(response: Any) -> Iterator[str]:
    """Each line of a newline-delimited JSON stream, bounded like a server-sent event; a last line the connection
    cut before its newline is dropped (the caller sees the stream end without ``done`` and says so)."""
    while (line := stream_line(response)) is not None:
        if line.strip():
            yield line.strip()


def text_of(chunk: dict) -> str | None:
    """The piece of the answer a chunk carries (a chat's ``message.content``, a generate's ``response``)."""
    message = chunk.get("message")
    text = message.get("content") if isinstance(message, dict) else chunk.get("response")
    return text if isinstance(text, str) else None


def finish_of(chunk: dict) -> str | None:
    if chunk.get("done") is not True:
        return None
    return {"stop": "eos", "length": "max_tokens"}.get(chunk.get("done_reason"), "eos")


def figures_of(chunk: dict) -> dict[str, object]:
    """Ollama's own figures in a chunk, under its names (``ollama.`` before each)."""
    if chunk.get("done") is not True:
        return {}
    return {f"ollama.{name}": chunk[name] for name in FIGURES if name in chunk}
