"""Noise you can see: figures measured while other programs took the cores say so, busy peaks are not cached,
and peaks a run beats are measured again."""

import time

import pytest

from engine import contention, hardware
from engine.costmodel import Device
from engine.events import HardwarePeaks
from engine.params import GenerationParams
from engine.session import Session


def test_a_low_cpu_share_is_called_busy_and_a_high_one_is_not():
    assert contention.busy(0.4) and "busy" in contention.busy_note(0.4) and "40%" in contention.busy_note(0.4)
    assert not contention.busy(0.95) and contention.busy_note(0.95) == ""
    assert not contention.busy(None) and contention.busy_note(None) == ""


def test_the_meter_reads_a_sleeping_thread_as_busy_and_a_working_one_as_quiet():
    sleeping = contention.LoadMeter()
    sleeping.start()
    time.sleep(0.2)                       # wall time passes, no CPU time: as if other programs had the cores
    sleeping.stop()
    assert sleeping.share() < 0.2
    import torch

    a = torch.randn(512, 512)
    working = contention.LoadMeter()
    working.start()
    deadline = time.perf_counter() + 0.3
    while time.perf_counter() < deadline:        # torch's threads keep every core busy, as a forward pass does
        a @ a
    working.stop()
    assert working.share() > 0.5


def test_a_run_excludes_waits_from_decode_time_and_from_its_cpu_share(tiny):
    events: list = []
    result = Session(tiny).run("hello", GenerationParams(max_new_tokens=5), events.append,
                               before_step=lambda step: time.sleep(0.05))
    s = result.summary
    steps = [e for e in events if type(e).__name__ == "TokenStep"]
    assert [st.waited_ms >= 50 for st in steps] == [False, True, True, True, True]
    assert s.waited_ms == pytest.approx(sum(st.waited_ms for st in steps))
    assert s.decode_ms == pytest.approx(sum(st.latency_ms for st in steps[1:]))
    assert s.decode_ms < 0.5 * s.waited_ms                     # the tiny model's steps are far shorter than a wait
    assert s.total_ms > s.waited_ms
    assert s.cpu_share is None          # 200 ms of waits left too little measured time to judge the load


def test_a_long_enough_run_reports_its_cpu_share(tiny):
    result = Session(tiny).run("hello", GenerationParams(max_new_tokens=200))
    assert result.summary.total_ms > 100 and 0 < result.summary.cpu_share < 4


def test_peaks_measured_on_a_busy_machine_are_kept_once_and_marked_busy(tiny, monkeypatch, tmp_path):
    """A machine that is always busy is measured once, not at every launch; what was measured says it was busy."""
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))         # nothing cached yet
    calls = []

    def fake_measure(device, dtype):
        calls.append(1)
        return Device("cpu", 1e11, 1e10), 0.3                   # as if other programs had most of the cores

    monkeypatch.setattr(hardware, "measure", fake_measure)
    first = hardware.peaks_event(tiny)
    assert not first.cached and contention.busy(first.cpu_share)
    second = hardware.peaks_event(tiny)
    assert len(calls) == 1 and second.cached and contention.busy(second.cpu_share)
    remeasured = hardware.peaks_event(tiny, remeasure=True)                  # the user asked: measured again
    assert len(calls) == 2 and not remeasured.cached


def test_peaks_a_run_beats_are_implausible():
    peaks = HardwarePeaks("cpu", "float32", flops_per_s=100e9, bytes_per_s=20e9)
    assert hardware.implausible(peaks, achieved_flops_per_s=150e9)
    assert hardware.implausible(peaks, achieved_flops_per_s=1e9, achieved_bytes_per_s=30e9)
    assert not hardware.implausible(peaks, achieved_flops_per_s=90e9, achieved_bytes_per_s=15e9)
