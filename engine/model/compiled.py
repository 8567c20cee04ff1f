"""Compiled decode graphs: one per static-cache length, built on a twin cache so decode never waits for one, and
on a CPU saved, so a later launch reads its graph instead of compiling it again.

``torch.compile`` specialises a graph on the static cache's length, and building one took 30-90 s on a 2-core
CPU the first time. Three choices follow from that. Lengths are rounded up to a power of two (at least 256), so
runs with different prompts share a graph instead of each compiling its own. A graph is built by one call on a
*twin* cache of the same length, not on the run's cache: the run can decode eagerly while the graph is built
beside it (the window does this on a CPU) and switch at the first step boundary after it is ready, or wait for
it before its first decode step (the CLI and benchmarks do, so every decode step of theirs is compiled). The
build's wall time is the compile time; it is never inside a decode step.

And on a CPU the graph is compiled ahead of time (dynamo's ``aot_compile``, what vLLM does) over
``decode_step``, a function of KVScope's own: transformers wraps its models' ``forward`` in decorators, so a
saved graph of it names a function that cannot be found again, while ``decode_step`` can. The saved graph keeps
no guards (a guard on the model object would never hold in another process); everything a guard would have
checked is in the file's name instead (``graph_key``: the model's classes, config, weights' shapes and dtypes,
the cache length, the CPU's instruction set, torch's and transformers' versions, and the code of this function,
of KVScope's own layers and of its attention function). A later launch reads it in about a second where tracing
the model again took 6 s (Sapphire Rapids, 2 vCPUs).

Nothing read from these folders runs unless this user's KVScope wrote it (``engine.store.sealed``): a saved graph is a
pickle, so it is read only with a valid seal, and inductor's cache folder (pickles and shared libraries, which
inductor trusts as they are) is checked against a sealed record of every file before the first compile of a
process; what fails is moved aside, named, and built again.

A CPU's graph calls its kernels from C++ (inductor's ``cpp_wrapper``), not from generated Python: a decode
step is some 120 products and as many small kernels, and calling each from Python cost more than the kernels
around the products (SmolLM2, 2-vCPU Sapphire Rapids, a graph's step read back from its saved file: float32
22.8 -> 21.9 ms, bfloat16 17.4 -> 16.1, int8 weights 14.0 -> 11.1). It compiles slower the first time (18 -> 62 s
on 2 cores) and reads back as fast (2.2 s).

A model whose weights fit (``engine.model.packaged``: up to 1 GiB, a copy at most a quarter of the free memory)
is saved as an AOTInductor package instead: exported, its weights folded into the graph as constants (inductor's
freezing) so that inductor packs them for its own C++ GEMM kernels, each chosen by timing at its shape; a whole
bfloat16 step went from 19.3 to 12.8 ms (SmolLM2, same VM), the package is read in about 2 s, and it is the
model's own (its name carries a digest of the weights). Dynamo's saved graphs cannot hold frozen weights, and an
in-process frozen compile is built again at every launch (71 s), so freezing has no other path. A package
whose build failed (export refused the model, a kernel did not compile) leaves its reason beside where it would
have been, and later launches take the fallback at once, saying why, instead of failing the same way for
minutes. After a graph, the same thread reads or builds the model's prefill package (``then``:
``engine.model.compiled_prefill``), which later compiled runs prefill through; a run that waits for its graph
waits for that too (compile time, in no step). On a GPU the graph is built in the calling thread (CUDA graphs
are recorded per thread), with CUDA graphs replaying a decode step as one launch.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import sys
import threading
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.model import attention, kernels, kvcache, packaged, threads  # kernels: registers a graph's operators
from engine.store import sealed
from engine.store.paths import compiled_graphs_dir

SHORTEST = 256          # the smallest static cache a compiled run allocates
# One graph per length: with powers of two from 256 a 128k-token context needs 10, past dynamo's default of 8
# (beyond which it silently decodes eagerly).
RECOMPILE_LIMIT = 32
SAVED = "kvscope-decode"     # the folder, among torch.compile's caches, of the saved graphs
PACKAGE = "package"          # a saved graph that is an AOTInductor package with the weights in it
FAILED = ".failed"           # beside a package whose build failed: the reason (``failed_build``)
SAVED_BYTES = 4 << 30        # saved graphs kept; past it the least recently used go (``_keep_within_bound``)
GRAPH = "a saved compiled graph"
FAILURE = "a failed package build's reason"
INDUCTOR = "torch.compile's cache folder"
CPU_OPTIONS = {"cpp_wrapper": True}      # inductor's options for a CPU's graph (see above); in the graph's name
_CHECKED: dict[str, str] = {}    # inductor folders checked in this process, and what the check found

Step = Callable[[Any, torch.Tensor, torch.Tensor, Any], torch.Tensor]
_READ: dict[str, Step] = {}      # graphs read or built in this process, by graph_key: a second session reuses one
_READ_LOCK = threading.Lock()


def decode_step(model: Any, token: torch.Tensor, position: torch.Tensor, cache: Any) -> torch.Tensor:
    """What a compiled graph computes: one token (``[1, 1]``) at ``position`` (``[1, 1]``) through ``model``
    over ``cache``, which it extends in place; the logits ``[1, 1, V]``."""
    return kvcache.forward(model, token, cache, positions=position, logits_to_keep=0).logits


def cache_length(needed: int, max_context: int) -> int:
    """The static cache a compiled run allocates for ``needed`` positions: the next power of two (at least
    ``SHORTEST``), never past the model's context."""
    if needed >= max_context:
        return max_context
    length = SHORTEST
    while length < needed:
        length *= 2
    return min(length, max_context)


def graph_key(model: Any, length: int, package: bool | None = None, step: Callable[..., Any] = decode_step,
              tuned_rows: int | None = None) -> str:
    """What a saved graph was compiled for, as a file name: everything its skipped guards would have checked.
    Another model, cache length, instruction set, torch, transformers, KVScope's ``step`` (``decode_step``, or
    ``engine.model.compiled_prefill.prefill``, whose ``length`` is the longest prompt it takes) or the source of a
    module of KVScope's inside the model (a packed or quantized layer) gives another name; a package
    (``package``: None when the model can have one, ``engine.model.packaged``) holds the weights, so other
    weights do too; so does the number of rows a symbolic-length graph's kernels were tuned at (``tuned_rows``)."""
    import transformers

    if package is None:
        package = packaged.usable(model) is None
    params = [(name, tuple(t.shape), str(t.dtype)) for name, t in
              [*model.named_parameters(), *model.named_buffers()]]
    classes = {type(m) for m in model.modules()}
    facts = {
        "classes": sorted(f"{c.__module__}.{c.__qualname__}" for c in classes),
        "ours": sorted(_code(c) for c in classes if c.__module__.startswith("engine.")),     # they have no version
        "kernels": sorted({m.kernel.name for m in model.modules() if isinstance(m, kernels.PackedLinear)}),
        "config": model.config.to_dict(),
        "attention": [getattr(model.config, "_attn_implementation", None), *map(_code, attention.TRACED)],
        "params": params,
        "length": length,
        "isa": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version,
        "step": _code(step) + _code(kvcache.forward) + (_code(kvcache.new_cache) if step is not decode_step else ""),
        "options": {**CPU_OPTIONS, **packaged.options()} if package else CPU_OPTIONS,
        "weights": packaged.weights_digest(model) if package else None,
    }
    if tuned_rows is not None:
        facts["tuned_rows"] = tuned_rows
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:24]
    label = length if step is decode_step else f"prefill{length}"
    return f"{type(model).__name__}-{label}-{PACKAGE if package else 'graph'}-{digest}"


def _code(thing: Any) -> str:
    """A function's or a class's compiled code, as text that is the same in every process: what it does, read
    from its bytecode (a frozen app has no source files to read)."""
    return "|".join(f"{f.__qualname__}:{_bytecode(f.__code__, f.__doc__)}" for f in _functions(thing))


def _functions(thing: Any) -> list[Any]:
    """A function, or a class's own functions: its methods, static and class methods, properties' accessors."""
    if hasattr(thing, "__code__"):
        return [thing]
    found = []
    for _name, member in sorted(vars(thing).items()):
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if isinstance(member, property):
            found += [f for f in (member.fget, member.fset, member.fdel) if f is not None]
        elif hasattr(member, "__code__"):
            found.append(member)
    return found


def _bytecode(code: Any, doc: str | None = None) -> str:
    """The bytecode with the names it refers to and its constants. The names, because the bytecode holds only
    their indices: ``torch.matmul`` and ``torch.bmm``, ``self.up`` and ``self.down``, read the same bytes. Not the
    docstring ``doc`` (a function's first constant): editing it changes nothing a graph computes, and a graph
    under a new name is built again, minutes on every user's machine."""
    consts = list(code.co_consts)
    if doc is not None and consts and consts[0] == doc:
        consts = consts[1:]
    names = ",".join((*code.co_names, *code.co_varnames, *code.co_freevars, *code.co_cellvars))
    values = ",".join(_bytecode(c) if hasattr(c, "co_code") else repr(c) for c in consts)
    return f"{code.co_code.hex()}[{names}]({values})"


def saved_graph(key: str) -> Path:
    """Beside inductor's caches (``TORCHINDUCTOR_CACHE_DIR``), which a saved graph reads its kernels from (without
    them reading it compiles its C++ again: 12 s instead of 1); a package's shared library holds its own."""
    return inductor_dir() / SAVED / f"{key}{'.so' if _is_package(key) else '.bin'}"


def _is_package(key: str) -> bool:
    return key.rsplit("-", 2)[-2] == PACKAGE


def inductor_dir() -> Path:
    return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or compiled_graphs_dir())


def trusted_inductor_cache() -> str:
    """Check inductor's cache folder once per process, before anything is compiled or read from it: every file
    one KVScope sealed after its last compile (else the folder is moved aside and said, and inductor starts an
    empty one). Returns what the check said ("" when all was well)."""
    folder = inductor_dir()
    key = str(folder)
    if key in _CHECKED:
        return ""                               # said once, by the compile that found it
    _CHECKED[key] = sealed.check_folder(folder, INDUCTOR, skip=(SAVED,)) or ""
    sealed.private_folder(folder)
    return _CHECKED[key]


def seal_inductor_cache() -> None:
    """After a compile in this process: record what inductor wrote, so the next launch trusts it."""
    try:
        sealed.seal_folder(inductor_dir(), INDUCTOR, skip=(SAVED,))
    except OSError:
        pass                                  # a cache that cannot be sealed is checked, refused and rebuilt


@dataclass
class Graph:
    """A compiled decode graph for one cache length: ``ready`` is set once it is built or its build failed.
    ``loaded``: built earlier, read from the file an earlier launch saved or from another session of this
    process (``compile_ms`` is then the reading, not a build)."""

    length: int
    ready: threading.Event = field(default_factory=threading.Event)
    compile_ms: float = 0.0
    error: str | None = None        # why the build failed (decode then stays eager), first line
    step: Step | None = None
    loaded: bool = False
    note: str = ""                  # why it was built although one was saved, or why it is not saved
    key: str = ""                   # the saved graph it is (``graph_key``), "" for one compiled in this process
    refused: str = ""               # why it is not used although it was built (``CompiledDecode.refuse``)


class CompiledDecode:
    """The model's decode step compiled once per cache length, and the graphs built for it."""

    def __init__(self, model: Any, device: torch.device) -> None:
        self.model, self.device = model, device
        self._forward: Any = None
        self._graphs: dict[int, Graph] = {}
        self._lock = threading.Lock()           # guards _graphs
        self.build_lock = threading.Lock()      # one build at a time (held while a graph is built)

    @property
    def saves(self) -> bool:
        """Whether graphs are compiled ahead of time and saved (on a CPU)."""
        return self.device.type == "cpu"

    def forward(self) -> Step:
        """``decode_step`` compiled in this process (a GPU's graphs, or a model dynamo cannot trace whole): dynamo
        keeps one graph per cache length and checks its guards at every call."""
        if self._forward is None:
            configure()
            if self.device.type == "cuda":
                self._forward = torch.compile(decode_step, mode="reduce-overhead", dynamic=False)
            else:
                self._forward = torch.compile(decode_step, dynamic=False, options=CPU_OPTIONS)
        return self._forward

    def graph(self, length: int, background: bool, then: Callable[[], Any] | None = None) -> tuple[Graph, bool]:
        """The graph for ``length``, and whether this call started its build. A new one is built now, or
        beside the caller when ``background`` on a CPU (CUDA graphs are recorded per thread); ``then`` is done
        after the build, in its thread, with the graph ready meanwhile (a CPU's prefill package)."""
        with self._lock:
            graph = self._graphs.get(length)
            if graph is not None:
                return graph, False
            graph = self._graphs[length] = Graph(length)
        if background and self.device.type == "cpu":
            threading.Thread(target=self._build, args=(graph, then), name=f"kvscope-compile-{length}",
                             daemon=True).start()
        else:
            self._build(graph, then)
        return graph, True

    def graphs(self) -> list[Graph]:
        """The graphs built or being built, shortest cache first."""
        with self._lock:
            return [self._graphs[length] for length in sorted(self._graphs)]

    def run(self, graph: Graph, token: torch.Tensor, position: torch.Tensor, cache: Any) -> torch.Tensor:
        """One decode step through ``graph`` (built, without error) over the run's own cache."""
        assert graph.step is not None, "the graph is not built"
        return graph.step(self.model, token, position, cache)

    def refuse(self, graph: Graph, reason: str) -> str:
        """``graph`` computed what eager does not (scores that were not numbers): no run of this process decodes
        through it again, and a later launch does not read it (a package is marked failed, so the graph whose
        weights are inputs is built instead; a graph of those is put aside and built again). Returns where the
        reason was left ("" where nothing was saved)."""
        with self._lock:
            graph.step, graph.error, graph.refused = None, reason, reason
        if not graph.key:
            return ""
        with _READ_LOCK:
            _READ.pop(graph.key, None)
        try:
            if _is_package(graph.key):
                marker = failed_build(graph.key)
                sealed.write_sealed(marker, FAILURE, reason.encode())
                return f"the reason is kept in {marker}; delete it to try the package again"
            return sealed.put_aside(saved_graph(graph.key), reason)
        except (OSError, sealed.Refused):
            return ""

    def _build(self, graph: Graph, then: Callable[[], Any] | None = None) -> None:
        """The graph for its length, read or compiled, then called once on a twin cache of that length (laid out
        by an eager first step) with the arguments every compiled decode step passes."""
        with self.build_lock:
            started = time.perf_counter()
            try:
                with torch.inference_mode(), threads.governor().building():
                    twin = kvcache.new_cache(self.model, graph.length)
                    token = torch.zeros((1, 1), dtype=torch.long, device=self.device)
                    kvcache.forward(self.model, token, twin)
                    args = (self.model, token, torch.ones((1, 1), dtype=torch.long, device=self.device), twin)
                    if self.saves:
                        graph.step, graph.loaded, graph.note, graph.key = _ahead_of_time(args, graph.length)
                    if graph.step is None:                  # a GPU, or not compiled ahead of time
                        refused = configure()
                        graph.step = self.forward()
                        graph.note = "; ".join(n for n in (graph.note, refused) if n)
                    graph.step(*args)
                    del twin
                seal_inductor_cache()
            except Exception as exc:  # noqa: BLE001  (a failed build leaves decode eager; the run says why)
                graph.step, graph.error = None, first_line(exc)
            finally:
                graph.compile_ms = (time.perf_counter() - started) * 1000.0
                graph.ready.set()
            if then is not None:                        # decode goes on through its graph meanwhile
                then()


def configure() -> str:
    """Point inductor at KVScope's cache folder, once it is checked; what the check said ("" when all was well).
    A folder the user chose is kept; torch's own default is not a choice: importing ``torch._dynamo`` (which
    transformers' cache utilities do, through hqq) writes it into the environment, and there the graphs were
    shared with every torch program on the machine (whose writes broke the folder's seal, so it was put aside and
    every graph built again) and lost at reboot."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, os.path.abspath(default_cache_dir())):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(compiled_graphs_dir())
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return trusted_inductor_cache()


def first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def _ahead_of_time(args: tuple, length: int) -> tuple[Step | None, bool, str, str]:
    """``decode_step`` for this model and length: already read or built in this process, or read from the file
    an earlier launch saved (both ``loaded``), or compiled ahead of time and saved: a package with the weights
    folded in where the model can have one (``engine.model.packaged``), else a graph whose weights are inputs. A
    saved file that cannot be read or run is compiled again; a package that cannot be built falls back to the
    graph; a model dynamo cannot trace as one graph gives None and why (the caller compiles in-process, not
    saved). The last: the saved graph's name ("" for none)."""
    note = configure()
    model = args[0]
    package = packaged.usable(model) is None
    if package:
        key = graph_key(model, length, package=True)
        step, loaded, said = _saved_or_compiled(args, key)
        if step is not None:
            return step, loaded, _joined(note, said), key
        note = _joined(note, said)
    key = graph_key(model, length, package=False)
    step, loaded, said = _saved_or_compiled(args, key)
    return step, loaded, _joined(note, said), key if step is not None else ""


def _joined(*notes: str) -> str:
    return "; ".join(n for n in notes if n)


def _saved_or_compiled(args: tuple, key: str) -> tuple[Step | None, bool, str]:
    """The step ``key`` names: read in this process, read from its sealed file, or compiled and saved."""
    if _is_package(key):
        return saved_package(key, lambda path: packaged.build(decode_step, args, path, inductor_dir()),
                             packaged.decode_step, lambda step: step(*args))
    step, note = _read_saved(key, lambda path: sealed.read_sealed(path, GRAPH),      # before any byte is unpickled
                             lambda _path, data: torch.compiler.load_compiled_function(io.BytesIO(data),
                                                                                       f_globals=globals()),
                             lambda step: step(*args))
    if step is not None:
        return step, True, note
    path = saved_graph(key)
    try:
        with torch._dynamo.config.patch(enable_aot_compile=True):
            compiling = torch.compile(decode_step, fullgraph=True, dynamic=False,
                                      options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe,
                                               **CPU_OPTIONS})
        step = compiling.aot_compile((args, {}))
    except Exception as exc:  # noqa: BLE001  (graph breaks, or a torch without it: compiled in this process only)
        return None, False, _joined(note, f"compiled for this launch only, not saved ({first_line(exc)})")
    try:
        step.save_compiled_function(str(path))              # written atomically
        sealed.seal(path, GRAPH)
        _keep_within_bound(path)
    except (OSError, sealed.Refused) as exc:
        note = _joined(note, f"the graph could not be saved for a later launch "
                             f"({getattr(exc, 'strerror', None) or exc})")
    _remember(key, step)
    return step, False, note


def saved_package(key: str, build: Callable[[Path], None], wrap: Callable[[Any], Any],
                  probe: Callable[[Any], Any]) -> tuple[Any, bool, str]:
    """The package ``key`` names, as ``wrap`` makes it callable: read in this process, read from its sealed file
    (checked, then loaded from the path checked, and called once by ``probe``), or built by ``build(path)``,
    sealed and read; and whether it was read, and what happened on the way. A package that cannot be built
    gives None and why (the caller falls back)."""
    note = _from_whole_package(key)
    step, read_note = _read_saved(key, lambda path: sealed.check_sealed(path, GRAPH),
                                  lambda path, _checked: wrap(packaged.load(path)), probe)
    note = _joined(note, read_note)
    if step is not None:
        return step, True, note
    path = saved_graph(key)
    marker = failed_build(key)
    earlier = _earlier_failure(marker)
    if earlier is not None:
        return None, False, _joined(note, f"not packaged with its weights: its build failed on an earlier launch "
                                          f"({earlier}); delete {marker} to try again")
    try:
        build(path)
        sealed.seal(path, GRAPH)
        _keep_within_bound(path)
        step = wrap(packaged.load(path))
    except Exception as exc:  # noqa: BLE001  (export or AOTInductor refused the model: the caller's fallback)
        path.unlink(missing_ok=True)
        reason = first_line(exc)
        if _lasting(exc):
            try:
                sealed.write_sealed(marker, FAILURE, reason.encode())
            except (OSError, sealed.Refused):
                pass                            # not remembered: the next launch tries again
        return None, False, _joined(note, f"not packaged with its weights ({reason})")
    _remember(key, step)
    return step, False, note


def _from_whole_package(key: str) -> str:
    """KVScope saved whole packages (``KEY.pt2``) before it kept their libraries: a sealed one becomes its
    library (read in a second or two, where a build takes minutes) and is deleted. Returns what went wrong, or
    "" (a package refused or unreadable is left to the build, and said)."""
    library = saved_graph(key)
    package = library.with_suffix(".pt2")
    if library.exists() or not package.exists():
        return ""
    try:
        sealed.check_sealed(package, GRAPH)
        packaged.library_from(package, library)
        sealed.seal(library, GRAPH)
    except sealed.Refused as exc:
        return f"{exc}: compiled again"
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        library.unlink(missing_ok=True)
        return f"the saved package {package} could not be read ({first_line(exc)}): compiled again"
    for old in (package, package.with_name(package.name + sealed.SEAL)):
        old.unlink(missing_ok=True)
    return ""


def _keep_within_bound(saved: Path) -> None:
    """Keep the saved graphs under ``SAVED_BYTES``, the least recently used (saved or read) going first, the one
    just ``saved`` staying whatever its size. Why: a package holds a copy of its model's weights (146-657 MiB for
    SmolLM2's formats), and every other model, format, torch or KVScope version names new files while nothing
    reads the old ones again, so the folder grew by gigabytes with nothing to stop it. A build's partial file
    (another process's build) is never counted or removed."""
    with contextlib.suppress(OSError):
        files = [(f.stat(), f) for f in saved.parent.iterdir()
                 if f.suffix in (".so", ".bin", ".pt2") and ".partial" not in f.name]     # not a build's own
        total = 0
        for info, file in sorted(files, key=lambda pair: pair[0].st_mtime, reverse=True):
            total += info.st_size
            if file != saved and total > SAVED_BYTES:
                for gone in (file, file.with_name(file.name + sealed.SEAL)):
                    gone.unlink(missing_ok=True)


def failed_build(key: str) -> Path:
    """Where a package build that failed leaves its reason: a failed build can take minutes (export, then a C++
    compile per product), and with the same ``key`` (the same model, code, torch and CPU) it fails the same way
    at every launch, so later launches read the reason instead of trying again."""
    path = saved_graph(key)
    return path.with_name(path.name + FAILED)


def _earlier_failure(marker: Path) -> str | None:
    """The reason an earlier launch's build failed, or None: sealed like every file KVScope reads back, so a
    marker it did not write (refused, put aside) or cannot read is no marker, and the build is tried."""
    if not marker.exists():
        return None
    try:
        return sealed.read_sealed(marker, FAILURE).decode(errors="replace").strip()[:300] or "no reason given"
    except (OSError, sealed.Refused):
        return None


def _lasting(exc: BaseException) -> bool:
    """Whether a failed build would fail again with the same key: not for a full disk, a file that could not be
    written or a compiler not found (``OSError``), nor for memory that ran out, which another launch may have."""
    return not isinstance(exc, (OSError, MemoryError)) and "out of memory" not in str(exc).lower()


def _read_saved(key: str, check: Callable[[Path], Any], read: Callable[[Path, Any], Any],
                probe: Callable[[Any], Any]) -> tuple[Any, str]:
    """The step ``key`` names, read in this process or from its file (``check``ed by its seal before ``read``,
    then called once by ``probe``), or None; and what happened on the way. A file that fails its seal, or is
    sealed but no longer loads or runs, is put aside, said, and left for the caller to build again; the folder
    is made private for that build."""
    with _READ_LOCK:
        known = _READ.get(key)
    if known is not None:
        return known, ""
    path, note = saved_graph(key), ""
    if path.exists():
        try:
            checked = check(path)
        except sealed.Refused as exc:
            note = f"{exc}: compiled again"
        else:
            try:
                step = read(path, checked)
                probe(step)
                _remember(key, step)
                with contextlib.suppress(OSError):
                    os.utime(path)                     # used now: the bound removes the least recently used first
                return step, note
            except Exception as exc:  # noqa: BLE001  (sealed, but it no longer loads: kept aside, compiled again)
                note = sealed.put_aside(path, f"the saved graph {path} could not be used ({first_line(exc)})") \
                    + ": compiled again"
    sealed.private_folder(path.parent)
    return None, note


def known(key: str) -> bool:
    """Whether the step ``key`` names was read or built in this process."""
    with _READ_LOCK:
        return key in _READ


def _remember(key: str, step: Any) -> None:
    with _READ_LOCK:
        _READ[key] = step
