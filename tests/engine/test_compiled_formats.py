"""Compiled decode on the real embedded model, in every weight format: 32 greedy tokens with finite scores, each
through the compiled graph, and eager's tokens, or a first difference where eager's top two were within rounding
(the margin is in the failure's words). The graphs are built as the tests build them (no GEMM autotuning), and
still take minutes and gigabytes each on two cores: ``make test-slow`` runs them (CI does), not ``make test``. The
bench (``make bench``) holds the autotuned graphs to the same rule."""

from __future__ import annotations

import pytest

from engine.facts.events import RunFinished, TokenStep
from engine.facts.params import GenerationParams
from engine.facts.parity import first_divergence
from engine.run.session import Session

PROMPT = "The history of the printing press in Europe"
TOKENS = 32


def _steps(session: Session, **flags) -> tuple[RunFinished, list[TokenStep]]:
    events: list = []
    params = GenerationParams(max_new_tokens=TOKENS, chat_template=False, **flags)
    result = session.run(PROMPT, params, events.append)
    assert isinstance(result, RunFinished), getattr(result, "message", result)      # a failure's own words
    return result, [e for e in events if isinstance(e, TokenStep)]


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "int4"])
def test_a_compiled_run_decodes_32_greedy_tokens_with_finite_scores_and_eagers_tokens_or_a_near_tie(cache_root,
                                                                                                    fmt):
    from engine.model.models import load

    loaded = load("embedded", "cpu", fmt)
    eager, eager_steps = _steps(Session(loaded))
    compiled, compiled_steps = _steps(Session(load("embedded", "cpu", fmt)), static_cache=True, compiled=True)
    assert len(compiled_steps) == len(eager_steps) == TOKENS and compiled.summary.compiled_from_step == 1
    assert all(step.compiled for step in compiled_steps[1:]), compiled.summary.notes   # no step fell back to eager
    divergence = first_divergence(eager_steps, compiled_steps, fmt)
    assert divergence is None or divergence.near_tie, divergence.words()
