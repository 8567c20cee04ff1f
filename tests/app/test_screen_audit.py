"""The screen audit in the suite: the real window walked through every phase of a run, a chat turn, an experiment,
the lessons before and after they run and a replay, at 1280x720, 1600x1000 and 1920x1080, in the workbench and
the lecture scenes; every registered view keeps every rule of ``app.views.audit`` in every reading. The table (view x
phase) is printed (``make audit`` shows it)."""

from __future__ import annotations

from tests.app.screen_audit import walk_everything


def test_every_view_keeps_the_screen_rules_in_every_phase_at_three_sizes(qtbot, tiny_model_dir, lecture_trace,
                                                                        tmp_path, monkeypatch):
    walk = walk_everything(qtbot, tiny_model_dir, tmp_path, monkeypatch, lecture_trace)
    print()
    print(walk.table())
    assert not walk.findings, "\n" + walk.report()
