"""The run store: bounded history that never lets an experiment's runs push your own runs out."""

from app.state.store import RunStore
from engine.facts.events import ExperimentStarted, RunStarted
from engine.facts.params import GenerationParams


def started(facts, run_id: str, experiment: str = "") -> RunStarted:
    return RunStarted(run_id, "x", facts, GenerationParams(), "hi", [1, 2], ["a", "b"], "now", experiment=experiment)


def test_an_experiment_with_many_runs_keeps_them_and_your_runs(tiny):
    store = RunStore(max_runs=3)
    for i in range(5):
        store.add(started(tiny.facts, f"own{i}"))
    store.add(ExperimentStarted("e1", 0.0, "chat", tiny.facts, {}))
    for i in range(10):
        store.add(started(tiny.facts, f"e1-run{i}", experiment="e1"))
    ids = [r.run_id for r in store.runs]
    assert ids[:3] == ["own2", "own3", "own4"]                       # the newest three of your own
    assert ids[3:] == [f"e1-run{i}" for i in range(10)]              # every run of the kept experiment
    for j in range(2, 5):
        store.add(ExperimentStarted(f"e{j}", 0.0, "cache", tiny.facts, {}))
    assert [e.exp_id for e in store.experiments] == ["e2", "e3", "e4"]
    assert [r.run_id for r in store.runs] == ["own2", "own3", "own4"]  # e1 went, and its runs with it
