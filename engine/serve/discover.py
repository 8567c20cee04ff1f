"""The serving engines running on this computer, found by asking 127.0.0.1 only, briefly and all at once, at the
default ports of llama-server (8080), Ollama (11434), vLLM (8000), SGLang (30000), LM Studio (1234) and TGI
(3000, and 8080).

An engine is told by its own endpoints, never by its port (two engines share 8080's habit): Ollama answers
``/api/version`` and ``/api/ps``; LM Studio ``/api/v0/models``; TGI ``/info``; SGLang ``/get_server_info``;
llama-server ``/props`` with its build; vLLM ``/version`` beside ``/v1/models``; anything else that lists models
at ``/v1/models`` is an OpenAI-compatible server whose engine is not said. A port that answers with something
else is "not a known engine" and is never attached; one that does not answer is left out. Every request goes
through KVScope's bounded client (status line, headers and body each within ``DEADLINE_S``).
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from engine.facts.textstream import clean_text
from engine.serve import client

PORTS = (8080, 11434, 8000, 30000, 1234, 3000)
DEADLINE_S = 1.5
MAX_MODELS = 16                      # models listed per server (the rest counted)


@dataclass(frozen=True)
class FoundServer:
    port: int
    url: str
    engine: str                       # "Ollama", "LM Studio", "TGI", "SGLang", "llama.cpp", "vLLM",
    #                                   "OpenAI-compatible server", or "not a known engine"
    version: str = ""
    models: tuple[str, ...] = ()      # loaded, as the server names them
    attachable: bool = False          # KVScope can attach to it (its OpenAI-compatible API answered)
    notes: tuple[str, ...] = field(default_factory=tuple)
    loaded: tuple[str, ...] = ()      # what the engine says of each model it holds (Ollama's /api/ps), one line each

    def as_dict(self) -> dict:
        return asdict(self)


def find_servers(ports: Iterable[int] = PORTS, host: str = "127.0.0.1",
                 deadline_s: float = DEADLINE_S) -> list[FoundServer]:
    """The servers answering on ``ports`` of ``host`` (this machine unless a test says otherwise), in port order."""
    ports = sorted(set(ports))
    with ThreadPoolExecutor(max_workers=max(len(ports), 1)) as pool:
        found = list(pool.map(lambda port: identify(f"http://{host}:{port}", port, deadline_s), ports))
    return [f for f in found if f is not None]


def identify(url: str, port: int, deadline_s: float = DEADLINE_S) -> FoundServer | None:
    """What answers at ``url``: None when nothing does."""
    where = client.address(url)

    def get(path: str) -> object:
        try:
            return client.get_json(where, path, deadline_s)
        except client.RemoteError:
            return None

    try:                                            # the first answer says whether anything is there at all
        first = client.get_text(where, "/v1/models", deadline_s, client.MAX_LINE)
    except client.Unreachable:
        return None
    except client.TooSlow:
        return FoundServer(port, where.url, "not a known engine",
                           notes=(f"it took a connection but did not answer within {deadline_s:g} s",))
    except client.RemoteError:                      # an error status, a broken answer: someone is there
        first = ""
    try:
        listed = client.loads(first) if first else None
    except (ValueError, RecursionError, client.RemoteError):
        listed = None
    entries = listed.get("data") if isinstance(listed, dict) else None
    openai = isinstance(entries, list)
    names = tuple(_name(e.get("id")) for e in entries[:MAX_MODELS] if isinstance(e, dict)) if openai else ()
    owner = str(entries[0].get("owned_by", "")).lower() if openai and entries and isinstance(entries[0], dict) else ""

    version = get("/api/version")
    if isinstance(version, dict) and isinstance(version.get("version"), str):
        ps = get("/api/ps")
        loaded = ps.get("models") if isinstance(ps, dict) else None
        held = [m for m in (loaded or [])[:MAX_MODELS] if isinstance(m, dict)] if isinstance(loaded, list) else []
        models = tuple(_name(m.get("name")) for m in held)
        return FoundServer(port, where.url, "Ollama", _name(version["version"]), models, openai,
                           loaded=tuple(_ollama_line(m) for m in held))
    studio = get("/api/v0/models")
    if isinstance(studio, dict) and isinstance(studio.get("data"), list) and any(
            isinstance(m, dict) and "state" in m for m in studio["data"]):
        models = tuple(_name(m.get("id")) for m in studio["data"][:MAX_MODELS]
                       if isinstance(m, dict) and m.get("state") == "loaded")
        return FoundServer(port, where.url, "LM Studio", "", models, openai)
    info = get("/info")
    if isinstance(info, dict) and "model_id" in info and ("max_input_tokens" in info or "router" in info):
        return FoundServer(port, where.url, "TGI", _name(info.get("version")), (_name(info["model_id"]),), openai)
    sglang = get("/get_server_info")
    if isinstance(sglang, dict) and ("model_path" in sglang or owner == "sglang"):
        return FoundServer(port, where.url, "SGLang", _name(sglang.get("version")), names, openai)
    props = get("/props")
    if isinstance(props, dict) and ("build_info" in props or "default_generation_settings" in props):
        return FoundServer(port, where.url, "llama.cpp", _name(props.get("build_info")), names, openai)
    if owner == "vllm":
        vllm = get("/version")
        return FoundServer(port, where.url, "vLLM", _name(vllm.get("version")) if isinstance(vllm, dict) else "",
                           names, openai)
    if openai:
        return FoundServer(port, where.url, "OpenAI-compatible server", "", names, True,
                           ("the engine does not say which it is",))
    return FoundServer(port, where.url, "not a known engine",
                       notes=("it answers HTTP, but not as any serving engine KVScope knows",))


def _ollama_line(model: dict) -> str:
    """One model Ollama holds, in its own words (/api/ps): its size in memory, the share of it in GPU memory, and
    the context it was loaded with."""
    from engine.facts.kvformula import format_bytes

    size, vram, context = (model.get(k) for k in ("size", "size_vram", "context_length"))
    parts = [_name(model.get("name"))]
    if _count(size):
        parts.append(f"{format_bytes(size)} in memory")
        if _count(vram) is not None and vram <= size:
            parts.append(f"{vram / size:.0%} of it in GPU memory")
    if _count(context):
        parts.append(f"loaded with a {context:,}-position context")
    return ", ".join(parts) + " (as Ollama reports)"


def _count(value: object) -> int | None:
    return value if type(value) is int and 0 <= value < 1 << 60 else None


def _name(value: object) -> str:
    return clean_text(str(value))[0][:200] if value is not None else ""
