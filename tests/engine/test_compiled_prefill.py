"""Compiled prefill: one package for every prompt length, built after a compiled run's decode graph, that the
next compiled runs prefill through with eager's logits and cache, and that a run's events say it used."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.facts.events import PrefillDone, RunFinished
from engine.facts.params import GenerationParams
from engine.model import compiled, compiled_prefill, kvcache, packaged
from engine.model.compiled_prefill import SHORTEST, refused, serves_up_to
from engine.run.session import RunOptions, Session

PARAMS = dict(max_new_tokens=4, temperature=0.0, static_cache=True, compiled=True, chat_template=False)


@pytest.fixture
def model(tiny_model_dir):
    """A model of its own (its packages fold in its weights)."""
    from engine.model.models import load

    return load(str(tiny_model_dir), "cpu", "float32")


def _run(session: Session, prompt: str, before_step=None, **params) -> tuple[RunFinished, PrefillDone]:
    events: list = []
    result = session.run(prompt, GenerationParams(**{**PARAMS, **params}), events.append, before_step=before_step)
    assert isinstance(result, RunFinished), result
    [prefill] = [e for e in events if isinstance(e, PrefillDone)]
    return result, prefill


def test_a_compiled_run_prefills_eagerly_until_the_package_is_there_and_through_it_after_with_eagers_tokens(
        model, monkeypatch):
    """Before a package is built or saved a compiled run prefills eagerly (the build, held here, comes after its
    graph); once the package is built (or read: an earlier test may have saved it) the next compiled run's
    prefill goes through it, says so, and chooses eager's greedy tokens; an eager run and a one-token prompt
    never use it."""
    from engine.model.compiled_prefill import CompiledPrefill

    with monkeypatch.context() as held:
        held.setattr(CompiledPrefill, "saved", lambda _self: False)
        held.setattr(CompiledPrefill, "build", lambda _self, note="": compiled.Graph(0))    # never ready
        before, before_prefill = _run(Session(model), "the cache grows")
    assert not before_prefill.compiled
    session = Session(model)
    _run(session, "the cache grows")                    # builds the package after its graph, or reads it
    graph = session.compiled_prefill.graph
    assert graph is not None and graph.ready.is_set() and graph.error is None, graph and graph.error
    after, after_prefill = _run(session, "the cache grows")
    eager, eager_prefill = _run(session, "the cache grows", compiled=False, static_cache=False)
    assert after_prefill.compiled and not eager_prefill.compiled
    assert after.summary.token_ids == before.summary.token_ids == eager.summary.token_ids
    one_token = session.tokenizer.decode(session.encode("the", chat_template=False)[:1])
    assert len(session.encode(one_token, chat_template=False)) < SHORTEST
    assert not _run(session, one_token)[1].compiled


@pytest.mark.parametrize("length", [2, 9, 40])
def test_the_package_gives_eagers_logits_and_fills_a_static_or_growing_cache_as_eager_does(model, length):
    """One package for every length: its logits are eager's and the keys and values it writes into the run's
    cache (static, or growing) are eager's, position for position, with the cache's length where eager left it."""
    session = Session(model)
    graph = session.compiled_prefill.build()
    assert graph.error is None, graph.error
    ids = torch.randint(3, model.model.config.vocab_size, (1, length))
    with torch.inference_mode():
        for allocated in (compiled.SHORTEST, 0):
            ours_logits, ours = session.packaged_prefill(ids, allocated)
            theirs_logits, theirs = session.prefill(ids, True, None, allocated)
            torch.testing.assert_close(ours_logits, theirs_logits)
            assert ours.get_seq_length() == theirs.get_seq_length() == length
            for a, b in zip(ours.layers, theirs.layers):
                torch.testing.assert_close(a.keys[:, :, :length], b.keys[:, :, :length])
                torch.testing.assert_close(a.values[:, :, :length], b.values[:, :, :length])
            # the next decode step reads the package's cache as it reads eager's
            step = torch.tensor([[5]])
            at = torch.tensor([[length]])
            torch.testing.assert_close(
                kvcache.forward(model.model, step, ours, positions=at).logits,
                kvcache.forward(model.model, step, theirs, positions=at).logits)


def test_a_read_package_is_the_one_built_and_a_model_it_cannot_hold_prefills_eagerly_saying_why(model, monkeypatch):
    """A second session of the same weights reads the package the first built (nothing built again); a model
    over a package's bound is refused with the reason, and its compiled runs prefill eagerly."""
    built = Session(model).compiled_prefill.build()
    again = Session(model).compiled_prefill.build()
    assert built.error is None and again.loaded and again.step is built.step
    monkeypatch.setattr(packaged, "MAX_BYTES", 0)
    assert refused(model.model).startswith("its weights (")
    session = Session(model)
    graph = session.compiled_prefill.build()
    assert graph.step is None and graph.error.startswith("its weights (")
    assert not _run(session, "the cache grows")[1].compiled


def test_a_later_launchs_first_compiled_run_prefills_through_the_package_an_earlier_one_saved(model, monkeypatch):
    """A package saved by an earlier launch is read before the first compiled run's prompt goes through, so that
    run's prefill is compiled already; the run's compile time includes the reading."""
    assert Session(model).compiled_prefill.build().error is None          # an earlier launch built and saved it
    monkeypatch.setattr(compiled, "_READ", {})                           # a new process has read nothing
    session = Session(model)
    result, prefill = _run(session, "the cache grows")
    graph = session.compiled_prefill.graph
    assert prefill.compiled and graph.loaded and graph.compile_ms > 0
    assert result.summary.compile_ms >= graph.compile_ms


def test_a_window_run_says_its_compiled_steps_ran_beside_the_prefill_packages_build(model, monkeypatch):
    """The window's way: the thread that built the decode graph goes on with the prefill package while decode
    runs through the graph, on the same cores; the run says from which step (a build that takes minutes is
    held here until the run has ended)."""
    from engine.model.compiled_prefill import CompiledPrefill

    release, built = threading.Event(), []

    def held_build(_self, note: str = "") -> compiled.Graph:
        built.append(release.wait(300))
        return compiled.Graph(0)

    monkeypatch.setattr(CompiledPrefill, "saved", lambda _self: False)        # nothing saved: it must be built
    monkeypatch.setattr(CompiledPrefill, "build", held_build)
    session = Session(model, RunOptions(compile_in_background=True))

    def before_step(step: int) -> None:
        if step == 2:
            [graph] = session.compiled.graphs()
            assert graph.ready.wait(300)

    result, _prefill = _run(session, "the cache grows", before_step=before_step)
    release.set()
    notes = result.summary.notes
    assert result.summary.compiled_from_step == 2
    assert any(n.startswith("from step 2 the compiled prefill package was built beside the decode") for n in notes)
    quiet, _ = _run(Session(model), "the cache grows")           # waiting for its graph: no decode beside a build
    assert not any("built beside the decode" in n for n in quiet.summary.notes)


@pytest.mark.parametrize(("dtype", "flags", "widened"), [("bfloat16", {"avx2"}, True),
                                                      ("bfloat16", {"avx2", "avx512_bf16"}, False),
                                                      ("float32", {"avx2"}, False)])
def test_a_prompt_the_cpu_widens_prefills_eagerly_and_a_shorter_one_through_the_package(
        tiny_model_dir, monkeypatch, dtype, flags, widened):
    """Where eager widens a half float's prefill to float32 (no units for it), the package's emulated products
    are slower from that many rows: it serves only the shorter prompts. Elsewhere it serves up to its bound."""
    from engine.model import hardware, kernels
    from engine.model.compiled_prefill import LONGEST
    from engine.model.models import load

    monkeypatch.setattr(hardware, "_cpu_flags", lambda: frozenset(flags))
    session = Session(load(str(tiny_model_dir), "cpu", dtype))
    assert kernels.widened(session.model) == widened
    graph = compiled.Graph(0)
    graph.step = lambda ids: ids          # a package stated built: only which prompts go through it is asked
    graph.ready.set()
    session.compiled_prefill.graph = graph
    longest = kernels.WIDE_ROWS - 1 if widened else min(LONGEST, session.facts.max_context)
    params = GenerationParams(**PARAMS)
    assert session.prefill_packaged(longest, params) and not session.prefill_packaged(longest + 1, params)


def test_a_package_whose_longest_prompt_is_shorter_than_its_probe_is_traced_at_its_longest(tiny_model_dir,
                                                                                          monkeypatch):
    """A CPU that emulates bfloat16 serves prompts of up to ``WIDE_ROWS - 1`` tokens through the package: traced at
    ``PROBE_TOKENS`` (32) rows, export refused the build ("32 not in range [2, 23]") and every later launch read
    that refusal. Traced at its longest, it builds and prefills as eager does."""
    from engine.model import hardware, kernels
    from engine.model.models import load

    monkeypatch.setattr(hardware, "_cpu_flags", lambda: frozenset({"avx2"}))
    session = Session(load(str(tiny_model_dir), "cpu", "bfloat16"))
    package = session.compiled_prefill
    assert kernels.widened(session.model) and package.longest == kernels.WIDE_ROWS - 1 < compiled_prefill.PROBE_TOKENS
    graph = package.build()
    assert graph.error is None and package.ready(package.longest)
    ids = torch.tensor([[(5 + 7 * i) % 300 for i in range(package.longest)]])
    eager, _cache = session.prefill(ids, use_cache=True)
    packed, _static = session.packaged_prefill(ids)
    assert torch.equal(eager.argmax(), packed.argmax())


def test_the_package_serves_prompts_up_to_the_last_length_it_was_timed_faster_than_eager():
    """Counting up, the last length before the first where eager was as fast; none if eager won at the
    shortest; a later win past a loss does not count (the lengths between were not timed)."""
    assert serves_up_to({8: (10.0, 4.0), 32: (10.0, 9.0), 128: (10.0, 12.0), 256: (10.0, 3.0)}) == 32
    assert serves_up_to({8: (10.0, 4.0), 256: (50.0, 40.0)}) == 256
    assert serves_up_to({8: (4.0, 4.0), 32: (10.0, 5.0)}) == SHORTEST - 1
    assert compiled_prefill.timed_lengths(256) == [8, 32, 128, 256]
    assert compiled_prefill.timed_lengths(23) == [8, 23]


def test_a_package_timed_slower_than_eager_serves_only_the_shorter_prompts_and_a_later_launch_keeps_the_verdict(
        model, monkeypatch):
    """Timed against eager once it is ready (the timings are given here: a test's verdict must not hang on how
    busy its machine is): a package slower from 128 tokens serves up to 32, and says so; one whose kernels were
    tuned at another number of rows is another package (its own key); a later launch reads
    that verdict without timing again; ``KVSCOPE_PREFILL_PACKAGE=always`` serves every length untimed; a
    package slower at every length serves none, and a compiled run whose package was read says its prompt
    prefilled eagerly and why."""
    timed: list[list[int]] = []

    def given(times):
        def time_both(_model, step, lengths):
            timed.append(lengths)
            step(torch.zeros((1, lengths[0]), dtype=torch.long))             # the package really is called
            return {n: times(n) for n in lengths}
        return time_both

    monkeypatch.setenv(compiled_prefill.ENV, "auto")
    monkeypatch.setattr(compiled_prefill, "time_both", given(lambda n: (10.0, 5.0 if n <= 32 else 20.0)))
    package = Session(model).compiled_prefill
    longest = package.longest
    assert package.build().error is None and timed == [[8, 32, 128, longest]] and longest > 128
    assert package.ready(32) and not package.ready(33) and not package.ready(128)
    tuned_at = package.key()
    with monkeypatch.context() as other:
        other.setattr(compiled_prefill, "PROBE_TOKENS", 8)        # its kernels tuned at another number of rows
        assert package.key() != tuned_at
    assert package.serving_words().startswith(f"serves prompts of {SHORTEST}-32 tokens, where it was timed faster "
                                              "than an eager prefill (eager / package: 8 tokens 10 / 5 ms, ")
    monkeypatch.setattr(compiled, "_READ", {})                                # a new process
    later = Session(model).compiled_prefill
    assert later.build().loaded and len(timed) == 1                          # the kept verdict, not timed again
    assert later.ready(32) and not later.ready(33)
    assert package.timed_ms > 0 and later.timed_ms == 0 and "timed in" not in later.serving_words()
    monkeypatch.setenv(compiled_prefill.ENV, "always")
    untimed = Session(model).compiled_prefill
    assert untimed.build().error is None and untimed.ready(longest) and untimed.serving_words() == ""

    monkeypatch.setenv(compiled_prefill.ENV, "auto")
    monkeypatch.setattr(compiled_prefill, "TIMED_ROUNDS", 4)                 # another verdict's key: timed again
    monkeypatch.setattr(compiled_prefill, "time_both", given(lambda n: (10.0, 11.0)))
    monkeypatch.setattr(compiled, "_READ", {})
    session = Session(model)
    result, prefill = _run(session, "the cache grows")
    assert len(timed) == 2 and not prefill.compiled and not session.compiled_prefill.ready(SHORTEST)
    said = [n for n in result.summary.notes if n.startswith("the compiled prefill package, saved by an earlier")]
    assert len(said) == 1 and said[0].endswith(
        "(compile time); this prompt prefilled eagerly: the package was slower than an eager prefill at every "
        "length timed here (eager / package: 8 tokens 10 / 11 ms, 32 tokens 10 / 11 ms, 128 tokens 10 / 11 ms, "
        f"{longest} tokens 10 / 11 ms; timed in {session.compiled_prefill.timed_ms / 1000:,.1f} s)")
