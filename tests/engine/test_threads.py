"""The compute threads follow the other programs' load: fewer while they hold cores, all again once they let go,
never more than the count found, and a run says what was done. The load is the test's (``observe``), never the
machine's, so the verdicts do not depend on how busy the machine running them is."""

import pytest
import torch

from engine.facts.params import GenerationParams
from engine.model import threads
from engine.model.threads import ThreadGovernor, wanted_threads


@pytest.mark.parametrize("others, current, expected", [
    (0.02, 2, 2),        # quiet: every thread
    (1.0, 2, 1),         # one busy program on one of two cores: one thread
    (0.5, 2, 1),         # one that keeps half a core busy already costs a spinning pair more than a thread
    (0.4, 2, 2),         # below the line a core is not taken
    (0.4, 1, 1),         # ... nor given back until the load falls under the lower line (no flipping)
    (0.2, 1, 2),         # given back
    (2.0, 2, 1),         # never fewer than one
])
def test_the_thread_count_drops_a_thread_per_taken_core_and_gives_it_back_below_a_lower_line(others, current,
                                                                                              expected):
    assert wanted_threads(ceiling=2, cores=2, others=others, current=current) == expected


def test_the_thread_count_never_exceeds_the_count_found():
    assert wanted_threads(ceiling=2, cores=8, others=0.0, current=2) == 2
    assert wanted_threads(ceiling=8, cores=8, others=2.9, current=8) == 5


@pytest.fixture
def two_threads():
    kept = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(kept)


def test_the_governor_lowers_torchs_threads_while_a_core_is_taken_and_restores_them_after(two_threads):
    gov = ThreadGovernor(enabled=True)
    assert gov.adjust() == 2 and gov.changes == []           # nothing read yet: nothing changed
    gov.observe(1.0, 2)
    assert gov.adjust() == 1 and torch.get_num_threads() == 1
    gov.observe(0.05, 2)
    assert gov.adjust() == 2 and torch.get_num_threads() == 2
    assert [(c.was, c.threads) for c in gov.changes] == [(2, 1), (1, 2)]


def test_a_count_set_by_someone_else_is_the_new_ceiling_and_a_fixed_governor_changes_nothing(two_threads):
    gov = ThreadGovernor(enabled=True)
    torch.set_num_threads(1)                    # a lesson pinned one thread
    gov.observe(0.0, 2)
    assert gov.adjust() == 1 and gov.ceiling == 1 and torch.get_num_threads() == 1
    torch.set_num_threads(2)
    fixed = ThreadGovernor(enabled=False)
    fixed.observe(1.0, 2)
    assert fixed.adjust() == 2 and torch.get_num_threads() == 2 and fixed.changes == []


def test_a_graph_is_built_with_every_thread_even_on_a_busy_machine(two_threads):
    """Inductor splits each kernel's work by the count it compiles at: a graph built at one thread keeps one."""
    gov = ThreadGovernor(enabled=True)
    gov.observe(1.0, 2)
    gov.adjust()
    with gov.building():
        assert torch.get_num_threads() == 2
        assert gov.adjust() == 2                # the load does not lower it mid-build
    assert gov.adjust() == 1


def test_the_fixed_setting_turns_the_governor_off(monkeypatch):
    monkeypatch.setenv(threads.ENV, "fixed")
    assert not ThreadGovernor().enabled
    monkeypatch.setenv(threads.ENV, "auto")
    assert ThreadGovernor().enabled


def test_a_run_on_a_busy_machine_computes_with_fewer_threads_and_says_so(tiny, monkeypatch, two_threads):
    from engine.run import session as session_module

    gov = ThreadGovernor(enabled=True)
    gov.observe(1.0, 2)                          # another program holds one of two cores
    monkeypatch.setattr(session_module, "governor", lambda: gov)
    result = session_module.Session(tiny).run("hello", GenerationParams(max_new_tokens=4))
    assert not isinstance(result, session_module.RunFailed), result
    assert any("computed with 1 thread instead of 2" in n and "1.0 of this machine's 2 cores" in n
               for n in result.summary.notes), result.summary.notes
    assert torch.get_num_threads() == 1 and gov.changes[0].threads == 1
    gov.observe(0.0, 2)
    quiet = session_module.Session(tiny).run("hello", GenerationParams(max_new_tokens=4))
    assert torch.get_num_threads() == 2 and not any("thread" in n for n in quiet.summary.notes)


def test_an_experiment_on_a_busy_machine_says_it_computed_with_fewer_threads(tiny, monkeypatch, two_threads):
    from engine.lessons import lesson
    from engine.run import experiment as experiment_module
    from engine.run import session as session_module

    gov = ThreadGovernor(enabled=True)
    gov.observe(1.0, 2)
    monkeypatch.setattr(threads, "governor", lambda: gov)
    monkeypatch.setattr(session_module, "governor", lambda: gov)
    cache = lesson("cache")
    settings = cache.settings(new_tokens=4)
    finished = experiment_module.run_lesson(cache, session_module.Session(tiny), settings, lambda e: None)
    assert "computed with 1 thread instead of 2" in finished.result.threads_note
