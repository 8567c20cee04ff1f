"""Compiled decode: the same arithmetic as eager (float32 greedy tokens equal), a graph per cache length shared
by runs, built before the first decode step or beside an eager decode that switches when it is ready, saved
and read again by a later launch."""

from __future__ import annotations

import pytest

from engine.facts.events import RunFinished, TokenStep
from engine.facts.params import GenerationParams
from engine.facts.report import report
from engine.model.compiled import SHORTEST, cache_length
from engine.run.session import RunOptions, Session

PARAMS = dict(max_new_tokens=8, temperature=0.0, static_cache=True)


def _frames_compiled() -> int:
    from torch._dynamo.utils import counters

    return counters["frames"]["total"]


@pytest.fixture
def model(tiny_model_dir):
    """A model of its own: freezing folds its weights into graphs other tests must not find."""
    from engine.model.models import load

    return load(str(tiny_model_dir), "cpu", "float32")


def _run(session: Session, prompt: str, before_step=None, **params) -> tuple[RunFinished, list[TokenStep]]:
    events: list = []
    result = session.run(prompt, GenerationParams(**{**PARAMS, **params}), events.append, before_step=before_step)
    assert isinstance(result, RunFinished), result
    return result, [e for e in events if isinstance(e, TokenStep) and e.step > 0]


def test_cache_length_rounds_up_to_a_power_of_two_within_the_context():
    assert cache_length(1, 8192) == SHORTEST == 256
    assert cache_length(256, 8192) == 256
    assert cache_length(257, 8192) == 512
    assert cache_length(5000, 8192) == 8192
    assert cache_length(5000, 6000) == 6000             # never past the model's context
    assert cache_length(100, 200) == 200
    assert cache_length(200, 200) == 200


def test_a_package_built_without_timing_gemm_templates_is_another_file_and_a_graph_is_the_same(model, monkeypatch):
    from engine.model import compiled, packaged

    monkeypatch.delenv(packaged.AUTOTUNE_ENV, raising=False)
    timed = compiled.graph_key(model.model, SHORTEST, package=True), compiled.graph_key(model.model, SHORTEST, False)
    monkeypatch.setenv(packaged.AUTOTUNE_ENV, "0")
    assert packaged.options() == {"freezing": True}
    untimed = compiled.graph_key(model.model, SHORTEST, package=True), compiled.graph_key(model.model, SHORTEST, False)
    assert timed[0] != untimed[0] and timed[1] == untimed[1]


def test_waiting_for_the_graph_compiles_every_decode_step_with_eagers_float32_tokens_and_the_build_apart(
        model, monkeypatch, capfd):
    """The CLI's way: the graph is built before the first decode step (timed as compile, in no step), every
    decode step is compiled and its greedy tokens are eager's; the package's library is saved in KVScope's cache
    folder, and nothing it was built from is left in inductor's (the library holds a copy of the weights). The
    build writes none of inductor's autotuning tables to the terminal. Built as a user's launch builds it, with
    inductor's GEMM templates timed (the other tests build without)."""
    from engine.model import compiled, packaged
    from engine.store.paths import compiled_graphs_dir

    monkeypatch.delenv(packaged.AUTOTUNE_ENV, raising=False)
    assert packaged.options() == packaged.OPTIONS and packaged.OPTIONS["max_autotune"]
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(compiled, "_READ", {})                # nothing compiled before counts: this run builds
    compiled.configure()
    compiled.saved_graph(compiled.graph_key(model.model, SHORTEST)).unlink(missing_ok=True)
    eager, _ = _run(Session(model), "hello world")
    session = Session(model)
    session.compiled_prefill = None      # built after the graph, tested in tests/engine/test_compiled_prefill.py
    before = set(compiled_graphs_dir().rglob("*"))
    capfd.readouterr()
    result, steps = _run(session, "hello world", compiled=True)
    printed = capfd.readouterr()
    assert "AUTOTUNE" not in printed.err + printed.out and "Autotune Choices" not in printed.err + printed.out
    s = result.summary
    assert s.token_ids == eager.summary.token_ids
    assert s.compiled_from_step == 1 and s.compile_ms > 0 and not s.compile_loaded
    assert all(step.compiled for step in steps) and s.decode_runs == eager.summary.decode_runs
    assert max(step.latency_ms for step in steps) < s.compile_ms      # the build is in no step
    saved = compiled.saved_graph(compiled.graph_key(model.model, SHORTEST))
    assert saved.parent.parent == compiled_graphs_dir() and saved.stat().st_size > 0
    assert saved.suffix == ".so" and saved.read_bytes()[:4] == b"\x7fELF"        # the package's library alone
    # what it was built from (AOTInductor's wrapper code and library, which holds a copy of the weights) is not
    # left behind, nor the package
    left = [f for f in set(compiled_graphs_dir().rglob("*")) - before if f.is_file() and f.parent != saved.parent
            and ".wrapper" in f.name]
    assert left == [] and [f.name for f in saved.parent.iterdir() if ".pt2" in f.name] == []
    text = report(session.facts, s)
    assert f"building the compiled decode graph took {s.compile_ms:,.0f} ms, before the first decode step" in text
    assert "decode compiled from step 1" in text.splitlines()


def test_runs_whose_caches_round_to_one_length_share_one_graph(model):
    """Prompts of different lengths allocate the same rounded cache, so the second run compiles nothing."""
    session = Session(model)
    first, _ = _run(session, "hello world", compiled=True)
    frames = _frames_compiled()
    second, steps = _run(session, "a rather longer prompt than the first one was", compiled=True, max_new_tokens=20)
    assert first.summary.compile_ms > 0 and second.summary.compile_ms == 0
    assert _frames_compiled() == frames
    assert second.summary.compiled_from_step == 1 and all(step.compiled for step in steps)


def test_built_in_the_background_decode_starts_eager_and_switches_at_the_boundary_after_the_graph_is_ready(model):
    """The window's way: decode does not wait. The build is held back until step 3 is about to run, so steps 1
    and 2 are eager and step 3 is the first compiled one; tokens stay eager's, and the run says which steps
    ran beside the build."""
    eager, _ = _run(Session(model), "hello world")
    session = Session(model, RunOptions(compile_in_background=True))

    def before_step(step: int) -> None:
        if step == 3:
            session.compiled.build_lock.release()
            [graph] = session.compiled.graphs()
            assert graph.ready.wait(300)

    session.compiled.build_lock.acquire()
    result, steps = _run(session, "hello world", before_step=before_step, compiled=True)
    s = result.summary
    assert [step.compiled for step in steps] == [False, False] + [True] * (len(steps) - 2)
    assert s.compiled_from_step == 3 and s.compile_ms > 0
    assert s.token_ids == eager.summary.token_ids
    assert any("steps 1-2 decoded eagerly while the compiled graph was built" in n for n in s.notes)


def test_a_graph_that_cannot_be_built_leaves_decode_eager_and_the_run_says_why(model, monkeypatch):
    from engine.model import compiled

    def broken(_args, _length):
        raise RuntimeError("no C++ compiler on this machine")

    monkeypatch.setattr(compiled, "_ahead_of_time", broken)
    eager, _ = _run(Session(model), "hello world")
    result, steps = _run(Session(model), "hello world", compiled=True)
    s = result.summary
    assert s.token_ids == eager.summary.token_ids and s.compiled_from_step == 0
    assert not any(step.compiled for step in steps)
    assert any("could not be built (RuntimeError: no C++ compiler on this machine): decoded eagerly" in n
               for n in s.notes)


def test_a_saved_graph_is_named_by_what_it_was_compiled_for_without_reading_source_files(
        tiny_model_dir, model, monkeypatch):
    import inspect

    from engine.model import attention
    from engine.model.compiled import graph_key
    from engine.model.models import load

    def no_source(_thing):
        raise OSError("could not get source code")          # as in a frozen app

    monkeypatch.setattr(inspect, "getsource", no_source)

    again = load(str(tiny_model_dir), "cpu", "float32")
    halved = load(str(tiny_model_dir), "cpu", "bfloat16")
    assert graph_key(model.model, 256) == graph_key(again.model, 256)       # another load of the same model
    assert graph_key(model.model, 256) != graph_key(model.model, 512)
    assert graph_key(model.model, 256) != graph_key(halved.model, 256)
    before = graph_key(model.model, 256)
    monkeypatch.setattr(attention, "TRACED", (*attention.TRACED[:1], no_source, *attention.TRACED[2:]))
    assert graph_key(model.model, 256) != before          # a graph traced through other attention code


LAUNCH = """
import json, sys
from engine.model.models import load
from engine.facts.params import GenerationParams
from engine.run.session import Session
params = GenerationParams(max_new_tokens=8, temperature=0.0, static_cache=True, compiled=True)
s = Session(load(sys.argv[1], "cpu", "float32")).run("hello world", params).summary
print(json.dumps({"loaded": s.compile_loaded, "tokens": s.token_ids, "from": s.compiled_from_step,
                  "notes": s.notes}))
"""


class Planted:
    """A pickle that writes a file when it is unpickled: what an attacker would put where a graph is read."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_crafted_saved_graph_never_runs_is_kept_aside_and_a_later_launch_reads_the_rebuilt_one(
        model, tiny_model_dir, monkeypatch, tmp_path):
    """The graph a run compiles is saved and sealed; a file replaced by a crafted pickle is refused before any
    byte of it is unpickled (nothing it asks for runs), kept aside and named, and the graph is compiled again and
    saved; a fresh process then reads that one instead of compiling, and decodes eager's greedy tokens."""
    import json
    import os
    import pickle
    import subprocess
    import sys

    from engine.model import compiled
    from engine.store.paths import compiled_graphs_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(compiled_graphs_dir()))
    monkeypatch.setattr(compiled, "_READ", {})
    eager, _ = _run(Session(model), "hello world")
    _run(Session(model), "hello world", compiled=True)          # read, or built and saved
    path = compiled.saved_graph(compiled.graph_key(model.model, SHORTEST))
    assert path.stat().st_size > 0 and path.with_name(path.name + ".seal").exists()
    marker = tmp_path / "the planted pickle ran"
    crafted = pickle.dumps(Planted(str(marker)))
    planted = path.with_name("planted")
    planted.write_bytes(crafted)
    os.replace(planted, path)          # not written in place: this process has the package's library mapped from it
    monkeypatch.setattr(compiled, "_READ", {})                # as a new process: nothing read yet
    result, steps = _run(Session(model), "hello world", compiled=True)
    s = result.summary
    assert not marker.exists()                               # never unpickled
    assert not s.compile_loaded and s.token_ids == eager.summary.token_ids and all(x.compiled for x in steps)
    said = [n for n in s.notes if "is refused" in n]
    assert said and said[0].startswith(f"a saved compiled graph {path} is refused: its seal does not match")
    assert said[0].endswith(f"kept aside as {path}.refused: compiled again")
    assert path.with_name(path.name + ".refused").read_bytes() == crafted        # kept for inspection
    assert path.read_bytes() != crafted
    child = subprocess.run([sys.executable, "-c", LAUNCH, str(tiny_model_dir)], capture_output=True, text=True,
                           timeout=600, env=dict(os.environ))
    assert child.returncode == 0, child.stderr[-2000:]
    launch = json.loads(child.stdout.strip().splitlines()[-1])
    notes = launch.pop("notes")
    assert launch == {"loaded": True, "tokens": eager.summary.token_ids, "from": 1}
    assert len(notes) == 1 and notes[0].startswith("the compiled prefill package, saved by an earlier launch, "
                                                   "was read in ")
    assert notes[0].endswith("(compile time); the prompt went through it")
    text = report(model.facts, s)
    assert "compile: building the compiled decode graph took" in text


def test_an_earlier_versions_sealed_package_becomes_its_library_unpacking_nothing_and_an_unsealed_one_is_refused(
        model, tiny_model_dir, monkeypatch, tmp_path):
    """KVScope saved whole AOTInductor packages (a zip around the shared library) before it kept the library
    alone: a later launch reads a sealed one's library instead of building (eager's tokens), deletes the package
    and loads the library where it lies, unpacking nothing into the temporary folder; a package without a seal
    is refused, kept aside and never read."""
    import json
    import os
    import subprocess
    import sys
    import zipfile

    from engine.model import compiled
    from engine.store import sealed
    from engine.store.paths import compiled_graphs_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(compiled_graphs_dir()))
    eager, _ = _run(Session(model), "hello world")
    _run(Session(model), "hello world", compiled=True)          # read, or built and saved
    library = compiled.saved_graph(compiled.graph_key(model.model, SHORTEST))
    package = library.with_suffix(".pt2")
    with zipfile.ZipFile(package, "w") as archive:            # where AOTInductor's packages hold it
        archive.write(library, "model/data/aotinductor/model/cabc.wrapper.so")
        archive.writestr("model/data/aotinductor/model/cabc.wrapper.cpp", "")
    sealed.seal(package, compiled.GRAPH)
    for old in (library, library.with_name(library.name + sealed.SEAL)):
        old.unlink()
    temporary = tmp_path / "temporary"
    temporary.mkdir()
    child = subprocess.run([sys.executable, "-c", LAUNCH, str(tiny_model_dir)], capture_output=True, text=True,
                           timeout=600, env={**os.environ, "TMPDIR": str(temporary)})
    assert child.returncode == 0, child.stderr[-2000:]
    launch = json.loads(child.stdout.strip().splitlines()[-1])
    launch.pop("notes")
    assert launch == {"loaded": True, "tokens": eager.summary.token_ids, "from": 1}
    assert not package.exists() and not package.with_name(package.name + sealed.SEAL).exists()
    sealed.check_sealed(library, compiled.GRAPH)                 # raises if the library is not sealed
    assert list(temporary.iterdir()) == []

    unsealed = compiled.saved_graph("LlamaForCausalLM-256-package-0").with_suffix(".pt2")
    unsealed.write_bytes(package_bytes := b"PK\x05\x06" + bytes(18))
    note = compiled._from_whole_package("LlamaForCausalLM-256-package-0")
    assert note.startswith(f"a saved compiled graph {unsealed} is refused: KVScope did not write it")
    assert note.endswith(f"kept aside as {unsealed}.refused: compiled again")
    assert unsealed.with_name(unsealed.name + ".refused").read_bytes() == package_bytes
    assert not unsealed.exists() and not unsealed.with_suffix(".so").exists()


def test_saved_graphs_past_their_bound_go_least_recently_used_first_and_a_read_counts_as_a_use(
        monkeypatch, tmp_path):
    """A package holds a copy of its model's weights, and a new model, format or torch names new files: past the
    bound the least recently saved or read go, with their seals; the one just saved stays, and a build's failure
    reason, a file kept aside and another build's partial file are not saved graphs."""
    import os

    from engine.model import compiled
    from engine.store import sealed

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compiled, "_READ", {})
    monkeypatch.setattr(compiled, "SAVED_BYTES", 250)
    keys = {name: f"LlamaForCausalLM-256-{kind}-{name}" for name, kind in
            (("a", "package"), ("b", "graph"), ("c", "package"), ("d", "package"))}
    paths = {name: compiled.saved_graph(key) for name, key in keys.items()}
    paths["a"].parent.mkdir(parents=True)
    for age, (name, path) in enumerate(sorted(paths.items())):
        path.write_bytes(bytes(100))
        sealed.seal(path, compiled.GRAPH)
        os.utime(path, (1_000_000 + age, 1_000_000 + age))         # a oldest, d newest
    others = [paths["b"].with_name(paths["b"].name + ".failed"), paths["c"].with_name(paths["c"].name + ".refused"),
              paths["c"].with_name(paths["c"].name + "x1.partial.pt2")]                # another process's build
    for other in others:
        other.write_bytes(bytes(1000))
    step, note = compiled._read_saved(keys["a"], lambda path: None, lambda path, checked: "the step", lambda s: None)
    assert (step, note) == ("the step", "")
    compiled._keep_within_bound(paths["d"])
    kept = {name for name, path in paths.items() if path.exists()}
    assert kept == {"a", "d"}                                      # read last, and saved last: 200 of 250 bytes
    assert all(path.with_name(path.name + sealed.SEAL).exists() == (name in kept) for name, path in paths.items())
    assert all(other.exists() for other in others)
    monkeypatch.setattr(compiled, "SAVED_BYTES", 0)
    compiled._keep_within_bound(paths["d"])
    assert [p.exists() for p in (paths["a"], paths["d"])] == [False, True]      # the one just saved stays


def test_a_graph_read_from_an_earlier_launch_is_reported_as_read_not_built(model):
    from engine.facts.events import RunSummary

    s = RunSummary(prompt_tokens=4, generated_tokens=3, decode_runs=2, compile_ms=1_234.0, compile_loaded=True,
                   compiled_from_step=1)
    text = report(model.facts, s)
    assert ("compile: reading the compiled decode graph built earlier took 1,234 ms, before the first "
            "decode step (not in eval time)") in text
    assert "building" not in text


def _step_against_eager(session: Session, graph) -> None:
    """One compiled step and one eager step from the same cache: the same logits, and the run's own cache updated
    in place as eager's was (a package takes the cache's tensors as inputs)."""
    import torch

    from engine.model import kvcache

    model = session.model
    with torch.inference_mode():
        cache, twin = kvcache.new_cache(model, SHORTEST), kvcache.new_cache(model, SHORTEST)
        for c in (cache, twin):
            kvcache.forward(model, torch.tensor([[1, 2, 3]]), c)
        compiled = session.compiled.run(graph, torch.tensor([[4]]), torch.tensor([[3]]), cache)
        eager = kvcache.forward(model, torch.tensor([[4]]), twin, positions=torch.tensor([[3]]),
                                logits_to_keep=0).logits
    torch.testing.assert_close(compiled, eager)
    for ours, theirs in zip(cache.layers, twin.layers):
        assert int(ours.cumulative_length) == int(theirs.cumulative_length) == 4
        torch.testing.assert_close(ours.keys[:, :, :4], theirs.keys[:, :, :4])
        torch.testing.assert_close(ours.values[:, :, :4], theirs.values[:, :, :4])


def test_a_package_holds_its_models_weights_so_other_weights_get_their_own_and_each_computes_its_own_logits(
        tiny_model_dir, model):
    """A package folds the weights in as constants: the same weights loaded again read the one already built,
    a model of the same shapes with other weights builds its own, and each computes its own model's logits
    and fills the run's cache."""
    import torch

    from engine.model import compiled
    from engine.model.models import load

    again = load(str(tiny_model_dir), "cpu", "float32")
    other = load(str(tiny_model_dir), "cpu", "float32")
    with torch.no_grad():
        for p in other.model.parameters():
            p.mul_(0.5)
    graphs = [Session(m).compiled.graph(SHORTEST, background=False)[0] for m in (model, again, other)]
    assert all(g.error is None for g in graphs), [g.error for g in graphs]
    assert graphs[1].step is graphs[0].step and graphs[1].loaded                # the same weights built nothing
    assert graphs[2].step is not graphs[0].step
    keys = [compiled.graph_key(m.model, SHORTEST) for m in (model, again, other)]
    assert keys[0] == keys[1] != keys[2] and all(compiled.saved_graph(k).suffix == ".so" for k in keys)
    for loaded, graph in zip((model, other), (graphs[0], graphs[2])):
        _step_against_eager(Session(loaded), graph)


def test_a_model_that_cannot_be_packaged_gets_the_graph_with_its_weights_as_inputs_and_the_run_says_why(
        model, monkeypatch):
    """Export or AOTInductor refusing a model costs the package, not the saved graph: the weights stay inputs,
    the graph is saved, decode keeps eager's tokens, and the run says why."""
    import torch

    from engine.model import compiled

    def refused(*_args, **_kwargs):
        raise RuntimeError("export refused this model")

    monkeypatch.setattr(torch.export, "export", refused)
    monkeypatch.setattr(compiled, "_READ", {})
    compiled.configure()
    plain = compiled.saved_graph(compiled.graph_key(model.model, SHORTEST, package=False))
    package = compiled.saved_graph(compiled.graph_key(model.model, SHORTEST))
    for path in (plain, package):
        path.unlink(missing_ok=True)
    try:
        eager, _ = _run(Session(model), "hello world")
        session = Session(model)
        result, steps = _run(session, "hello world", compiled=True)
        s = result.summary
        assert s.token_ids == eager.summary.token_ids and all(step.compiled for step in steps)
        assert any("not packaged with its weights (RuntimeError: export refused this model)" in n for n in s.notes)
        assert plain.exists() and not package.exists()
        [graph] = session.compiled.graphs()
        _step_against_eager(session, graph)
    finally:             # the refusal is remembered beside the package: later tests of this model build theirs
        for marker in package.parent.glob(f"*{compiled.FAILED}*"):          # and its seal
            marker.unlink()


def test_a_package_build_that_failed_is_not_tried_again_until_its_reason_is_deleted_but_a_full_disk_is(
        monkeypatch):
    """A failed build can take minutes and, with the same model, code and torch, fails the same way next launch:
    its reason is kept and said instead. A full disk, or memory that ran out, may not be there next time."""
    from engine.model import compiled

    monkeypatch.setattr(compiled, "_READ", {})
    compiled.configure()
    key = "NeverBuilt-256-package-" + "f" * 24
    builds: list = []

    def failing(error: Exception):
        def build(path):
            builds.append(path)
            raise error
        return build

    def package(build):
        return compiled.saved_package(key, build, lambda runner: runner, lambda step: None)

    refused, full = failing(RuntimeError("export refused this model")), failing(OSError(28, "No space left"))
    marker = compiled.failed_build(key)
    marker.unlink(missing_ok=True)
    step, loaded, said = package(refused)
    assert step is None and not loaded and said == "not packaged with its weights (RuntimeError: export refused " \
        "this model)" and len(builds) == 1 and marker.is_file()
    step, loaded, said = package(refused)
    assert step is None and len(builds) == 1
    assert said == (f"not packaged with its weights: its build failed on an earlier launch (RuntimeError: export "
                    f"refused this model); delete {marker} to try again")
    marker.unlink()
    package(refused)
    assert len(builds) == 2 and marker.is_file()
    marker.unlink()
    for _ in range(2):
        step, _loaded, said = package(full)
        assert step is None and "No space left" in said and not marker.exists()
    assert len(builds) == 4
    step, _loaded, said = package(failing(MemoryError()))
    assert step is None and said.startswith("not packaged with its weights (MemoryError") and not marker.exists()
    marker.write_text("RuntimeError: a reason KVScope never wrote\n")        # no seal: no marker, built again
    step, _loaded, said = package(refused)
    assert len(builds) == 6 and "never wrote" not in said


def test_a_model_over_the_bound_is_not_packaged_and_the_digest_follows_every_weight(tiny_model_dir, monkeypatch):
    import torch

    from engine.model import packaged
    from engine.model.models import load

    first, same, changed = (load(str(tiny_model_dir), "cpu", "float32") for _ in range(3))
    with torch.no_grad():
        next(changed.model.parameters()).view(-1)[0] += 1.0
    assert packaged.weights_digest(first.model) == packaged.weights_digest(same.model)
    assert packaged.weights_digest(first.model) != packaged.weights_digest(changed.model)
    assert packaged.usable(first.model) is None
    monkeypatch.setattr(packaged, "MAX_BYTES", 1024)
    why = packaged.usable(first.model)
    assert why is not None and why.startswith("its weights (") and "are more than a package holds" in why


def test_a_decode_step_that_cannot_be_compiled_ahead_of_time_is_compiled_for_this_launch_and_says_so(
        model, monkeypatch):
    """A model too large for a package that dynamo cannot trace as one graph, or a torch without
    ``aot_compile``: compiled as usual, in this process, with eager's tokens, and nothing saved."""
    import torch

    from engine.model import compiled, packaged

    monkeypatch.setattr(compiled, "_READ", {})
    monkeypatch.setattr(packaged, "MAX_BYTES", 0)              # a model too large for a package
    monkeypatch.delattr(torch.compiler, "skip_all_guards_unsafe")
    compiled.configure()
    saved = compiled.saved_graph(compiled.graph_key(model.model, SHORTEST))
    assert saved.suffix == ".bin"
    saved.unlink(missing_ok=True)
    eager, _ = _run(Session(model), "hello world")
    result, steps = _run(Session(model), "hello world", compiled=True)
    s = result.summary
    assert s.token_ids == eager.summary.token_ids and all(step.compiled for step in steps)
    assert any(n.startswith("compiled for this launch only, not saved (AttributeError:") for n in s.notes)
    assert not saved.exists() and not s.compile_loaded


def test_graphs_go_to_kvscopes_folder_even_after_torch_wrote_its_default_and_a_chosen_folder_is_kept(tmp_path):
    """Importing transformers' cache utilities imports torch._dynamo, which writes torch's default folder into the
    environment; the graphs must still go to KVScope's cache, and a folder the user set must stay."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = ("import os, transformers.cache_utils\n"
              "from engine.model import compiled\n"
              "before = os.environ.get('TORCHINDUCTOR_CACHE_DIR')\n"
              "compiled.configure()\n"
              "print(before); print(compiled.inductor_dir())\n")
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["KVSCOPE_CACHE_DIR"] = str(tmp_path / "cache")
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    lines = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, cwd=root,
                           timeout=300, check=True).stdout.splitlines()[-2:]
    assert lines[0] != "None"                              # torch had written its default before KVScope looked
    assert Path(lines[1]) == tmp_path / "cache" / "torch-compile"
    chosen = tmp_path / "mine"
    lines = subprocess.run([sys.executable, "-c", script], env={**env, "TORCHINDUCTOR_CACHE_DIR": str(chosen)},
                           capture_output=True, text=True, cwd=root, timeout=300, check=True).stdout.splitlines()[-2:]
    assert Path(lines[1]) == chosen


def test_exporting_a_package_traces_a_copy_and_never_swaps_the_live_models_weights(model, compile_skipped,
                                                                                   tmp_path):
    """Export puts fake tensors in place of a module's weights while it traces; the window decodes eagerly on the
    live model while its package is built beside it, so the export must trace a copy that shares the weights."""
    import torch

    from engine.model import compiled, kvcache, packaged

    weights = list(model.model.parameters())
    live, traced = [], []

    def step(traced_model, token, position, cache):
        live.append(all(a is b for a, b in zip(model.model.parameters(), weights)))
        traced.append(any(a is not b for a, b in zip(traced_model.parameters(), weights)))
        return compiled.decode_step(traced_model, token, position, cache)

    with torch.inference_mode():
        twin = kvcache.new_cache(model.model, SHORTEST)
        token = torch.zeros((1, 1), dtype=torch.long)
        kvcache.forward(model.model, token, twin)
        packaged.build(step, (model.model, token, torch.ones((1, 1), dtype=torch.long), twin),
                       tmp_path / "step.so", tmp_path / "inductor")
    assert live and all(live) and all(traced)          # the copy's weights were swapped, the live model's never
    assert all(a is b for a, b in zip(model.model.parameters(), weights))


def test_a_saved_graphs_name_changes_with_the_functions_and_constants_a_step_uses_not_with_its_docstrings():
    """Two functions whose bytecode is the same but which call other functions or hold other constants name
    other graphs, as does a class whose property or static method does; the same code under another docstring
    names the same one."""
    import torch

    from engine.model.compiled import _code

    def defined(source: str) -> object:
        """What ``source`` defines as ``step``: one name for every variant, so only the code tells them apart."""
        namespace = {"torch": torch}
        exec(source, namespace)
        return namespace["step"]

    def function(call: str = "matmul", factor: float = 2.0, doc: str = "One docstring.") -> object:
        return defined(f'def step(a, b):\n    """{doc}"""\n    return torch.{call}(a, b) * {factor}\n')

    def nested(call: str) -> object:
        return defined(f"def step(a, b):\n    return [torch.{call}(x, b) for x in a]\n")

    def layer(scale: float, activation: str) -> object:
        return defined(f"class step:\n    @property\n    def scale(self):\n        return {scale}\n"
                       f"    @staticmethod\n    def act(x):\n        return torch.nn.functional.{activation}(x)\n")

    product, batched = function(), function(call="bmm")
    assert product.__code__.co_code == batched.__code__.co_code     # what the bytes alone could not tell apart
    assert len({_code(product), _code(batched), _code(function(factor=0.5))}) == 3
    assert _code(product) == _code(function(doc="Another docstring, longer than the first."))
    assert _code(nested("matmul")) != _code(nested("bmm"))
    assert len({_code(layer(0.5, "silu")), _code(layer(2.0, "silu")), _code(layer(0.5, "gelu"))}) == 3


def test_a_graph_whose_scores_are_not_numbers_is_refused_the_step_redone_eagerly_and_a_later_launch_skips_it(
        model, monkeypatch):
    """A compiled step that gives NaN where eager gives numbers (a kernel inductor chose for the CPU computing
    wrongly) does not end the run: the step is computed again eagerly over the cache it wrote, the run goes on
    eagerly with eager's tokens, and the package is marked failed so a later launch builds the other graph."""
    from engine.model import compiled

    key = compiled.graph_key(model.model, SHORTEST, package=True)
    calls = []

    def poisoned(model_, token, position, cache):
        calls.append(int(position))
        return compiled.decode_step(model_, token, position, cache) * float("nan")   # the cache written, as a graph

    monkeypatch.setattr(compiled, "_ahead_of_time", lambda args, length: (poisoned, False, "", key))
    marker = compiled.failed_build(key)
    marker.unlink(missing_ok=True)
    eager, _ = _run(Session(model), "hello world")
    session = Session(model)
    result, steps = _run(session, "hello world", compiled=True)
    s = result.summary
    assert s.token_ids == eager.summary.token_ids
    assert len(calls) == 2                        # the build's probe on its twin cache, then decode step 1 once
    assert not any(step.compiled for step in steps)
    assert any("the compiled graph gave scores that were not numbers (NaN or infinity) at decode step 1, where the "
               "eager step's were numbers: decoded eagerly from that step on" in n for n in s.notes), s.notes
    assert marker.exists() and "at decode step 1" in compiled._earlier_failure(marker)
    again, _ = _run(session, "hello world", compiled=True)
    assert len(calls) == 2 and again.summary.token_ids == eager.summary.token_ids
    assert any(n.startswith("the compiled graph is not used (the compiled graph gave scores")
               for n in again.summary.notes)
    marker.unlink()
