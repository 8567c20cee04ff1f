"""Every reader of outside input, fuzzed: its first ``SUITE_INPUTS`` inputs from a fixed seed (its real seeds,
then byte mutations, hostile JSON shapes and grown inputs) each end in a result or a one-line refusal naming the
input, within the caps, with no code run and no file touched outside the run's folder. A count, not a time: the
same inputs on a busy machine as on a quiet one. ``make fuzz`` runs them for longer."""

from __future__ import annotations

import pytest

from tests.fuzz.runner import run_target
from tests.fuzz.targets import TARGETS

SUITE_SEED = 20261207
SUITE_INPUTS = 120
READERS = [name for name, target in TARGETS.items() if target.mutate]


def report(tally) -> str:
    return "\n".join([tally.line()] + [f"  input {o.index} ({o.kind}, {o.digest}): {o.why}" for o in tally.failed])


@pytest.mark.parametrize("name", READERS)
def test_a_reader_ends_every_fuzzed_input_in_a_result_or_a_one_line_refusal(name):
    tally = run_target(name, None, seed=SUITE_SEED, limit=SUITE_INPUTS, keep=False)
    assert not tally.failed, report(tally)
    assert tally.tried == SUITE_INPUTS, report(tally)
    target = TARGETS[name]
    assert tally.refused > 0 or not target.refuses, "no input reached a refusal: " + report(tally)
    assert tally.refused < tally.tried or not target.accepts, "no input reached a result: " + report(tally)
