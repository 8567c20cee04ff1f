"""The user's own workload for a load test: a JSON-lines file, one request a line, the shape of vLLM's ``bench serve``
custom datasets, so a team replays its traffic to see how it uses the server's prefix cache.

::

    {"prompt": "Summarise this ticket: ...", "arrival_s": 0.0, "max_tokens": 64}
    {"messages": [{"role": "system", "content": "You are ..."}, {"role": "user", "content": "..."}], "arrival_s": 0.4}

``prompt`` (a user message) or ``messages`` (a chat), ``arrival_s`` (seconds after the test starts; without it the
load test's own spacing), ``max_tokens`` or ``output_tokens`` (new tokens; without it the test's own). Bounded like
everything KVScope reads: the file, a line, a message, the count; a line that is not a request is refused in one
line naming it, before any request is sent. No torch here.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from engine.facts.errors import ParameterError

MAX_FILE_BYTES = 16 << 20
MAX_LINE_BYTES = 1 << 20
MAX_MESSAGES = 64
MAX_CONTENT = 256 << 10          # characters of one message
MAX_ARRIVAL_S = 3600.0
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class WorkloadRequest:
    messages: tuple[tuple[str, str], ...]       # (role, content)
    arrival_s: float | None = None
    max_tokens: int | None = None

    def chat(self) -> list[dict]:
        return [{"role": role, "content": content} for role, content in self.messages]


@dataclass(frozen=True)
class Workload:
    requests: tuple[WorkloadRequest, ...]
    left_out: int = 0                            # requests past ``most``, counted and said

    def note(self, most: int) -> str:
        return (f"{self.left_out:,} more request{'s' if self.left_out != 1 else ''} in the file left out: a load test "
                f"sends at most {most}") if self.left_out else ""


def read_workload(path: str | os.PathLike, most: int) -> Workload:
    """The first ``most`` requests of the file at ``path`` (the rest counted), every one checked."""
    where = Path(path).expanduser()
    try:
        if not where.is_file():
            raise ParameterError(f"--workload {where}: no such file (a JSON-lines file of requests)")
        size = where.stat().st_size
        if size > MAX_FILE_BYTES:
            raise ParameterError(f"--workload {where.name} is {size / 2**20:,.1f} MiB; a workload file holds at most "
                                 f"{MAX_FILE_BYTES >> 20} MiB")
        lines = where.read_bytes().split(b"\n")
    except OSError as exc:
        raise ParameterError(f"Cannot read the workload {where}: {exc.strerror or exc}") from None
    requests: list[WorkloadRequest] = []
    left_out = 0
    for number, raw in enumerate(lines, 1):
        if not raw.strip() or raw.lstrip().startswith(b"#"):
            continue
        if len(requests) >= most:
            left_out += 1
            continue
        requests.append(_request(raw, f"{where.name} line {number}"))
    if not requests:
        raise ParameterError(f"--workload {where.name} holds no request: one JSON object a line, with a prompt or "
                             "messages")
    return Workload(tuple(requests), left_out)


def _request(raw: bytes, where: str) -> WorkloadRequest:
    if len(raw) > MAX_LINE_BYTES:
        raise ParameterError(f"{where} is longer than {MAX_LINE_BYTES >> 20} MiB")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ParameterError(f"{where} is not a JSON object ({str(exc)[:80]})") from None
    except ValueError:              # Python's own bound on the digits of a whole number (4,300 by default)
        raise ParameterError(f"{where} holds a number with more digits than any figure of a request has") from None
    if not isinstance(data, dict):
        raise ParameterError(f"{where} is not a JSON object with a prompt or messages")
    if "messages" in data:
        messages = data["messages"]
        if not isinstance(messages, list) or not 1 <= len(messages) <= MAX_MESSAGES:
            raise ParameterError(f"{where}: messages must be a list of 1 to {MAX_MESSAGES} messages")
        pairs = []
        for m in messages:
            if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
                raise ParameterError(f"{where}: each message is {{\"role\": {'|'.join(ROLES)}, \"content\": text}}")
            pairs.append((m["role"], m["content"]))
    elif isinstance(data.get("prompt"), str):
        pairs = [("user", data["prompt"])]
    else:
        raise ParameterError(f"{where} has neither a prompt (text) nor messages")
    if any(not content.strip() for _role, content in pairs) or any(len(c) > MAX_CONTENT for _r, c in pairs):
        raise ParameterError(f"{where}: a message is empty or longer than {MAX_CONTENT:,} characters")
    arrival = data.get("arrival_s")
    if arrival is not None and (isinstance(arrival, bool) or not isinstance(arrival, (int, float))
                                or not 0.0 <= arrival <= MAX_ARRIVAL_S):
        raise ParameterError(f"{where}: arrival_s must be seconds from 0 to {MAX_ARRIVAL_S:g}")
    tokens = data.get("max_tokens", data.get("output_tokens"))
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= 4096):
        raise ParameterError(f"{where}: max_tokens must be a whole number from 1 to 4096")
    return WorkloadRequest(tuple(pairs), None if arrival is None else float(arrival), tokens)
