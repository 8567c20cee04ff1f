"""Noise you can see: figures measured while other programs took the cores say so, busy peaks are not cached,
and peaks a run beats are measured again."""

import pytest

from engine.facts import contention
from engine.facts.costmodel import Device
from engine.facts.events import HardwarePeaks
from engine.facts.params import GenerationParams
from engine.lessons import lesson
from engine.model import hardware
from engine.run.experiment import Experiment
from engine.run.session import Session


def test_a_low_cpu_share_is_called_busy_and_a_high_one_is_not():
    assert contention.busy(0.4) and "busy" in contention.busy_note(0.4) and "40%" in contention.busy_note(0.4)
    assert not contention.busy(0.95) and contention.busy_note(0.95) == ""
    assert not contention.busy(None) and contention.busy_note(None) == ""


class Clocks:
    """A wall clock and a CPU clock the test moves by hand: every read of the wall clock takes 0.1 ms, a wait
    moves the wall clock only, work moves both. The verdicts below then hold however busy the machine is."""

    def __init__(self) -> None:
        self.wall_s = self.cpu_s = 0.0

    def wall(self) -> float:
        self.wall_s += 1e-4
        return self.wall_s

    def cpu(self) -> float:
        return self.cpu_s

    def wait(self, seconds: float) -> None:
        self.wall_s += seconds

    def work(self, seconds: float, threads: int) -> None:
        self.wall_s += seconds
        self.cpu_s += seconds * threads


def test_the_meter_reads_waiting_as_busy_and_work_on_every_thread_as_quiet(monkeypatch):
    monkeypatch.setattr(contention, "compute_threads", lambda: 2)
    clocks = Clocks()
    waiting = contention.LoadMeter(clocks.cpu, clocks.wall)
    waiting.start()
    clocks.wait(0.2)                      # wall time passes, no CPU time: as if other programs had the cores
    waiting.stop()
    assert waiting.share() < 0.01 and contention.busy(waiting.share())
    working = contention.LoadMeter(clocks.cpu, clocks.wall)
    working.start()
    clocks.work(0.3, threads=2)           # both compute threads busy, as a forward pass keeps them
    working.stop()
    assert working.share() == pytest.approx(1.0, rel=1e-2) and not contention.busy(working.share())
    half = contention.LoadMeter(clocks.cpu, clocks.wall)
    half.start()
    clocks.work(0.3, threads=1)           # another program took one of the two cores
    half.stop()
    assert half.share() == pytest.approx(0.5, rel=1e-2) and contention.busy(half.share())


def test_the_meter_leaves_out_waits_it_is_told_of_and_gives_no_verdict_on_too_little_time(monkeypatch):
    monkeypatch.setattr(contention, "compute_threads", lambda: 2)
    clocks = Clocks()
    meter = contention.LoadMeter(clocks.cpu, clocks.wall)
    meter.start()
    clocks.work(0.2, threads=2)
    clocks.wait(1.0)                      # a pause the user asked for
    meter.stop()
    assert meter.share(idle_ms=1000.0) == pytest.approx(1.0, rel=1e-2)
    assert meter.share() == pytest.approx(0.2 / 1.2, rel=1e-2)
    short = contention.LoadMeter(clocks.cpu, clocks.wall)
    short.start()
    clocks.work(0.04, threads=2)
    short.stop()
    assert short.share() is None


def test_a_run_excludes_waits_from_decode_time_and_from_its_cpu_share(tiny, monkeypatch):
    """The session's clocks are the test's: each wait between steps is a second of wall time and no work."""
    import types

    from engine.model import clock
    from engine.run import session

    clocks = Clocks()
    fake_time = types.SimpleNamespace(perf_counter=clocks.wall)
    monkeypatch.setattr(session, "time", fake_time)
    monkeypatch.setattr(clock, "time", fake_time)
    monkeypatch.setattr(session, "LoadMeter", lambda: contention.LoadMeter(clocks.cpu, clocks.wall))
    events: list = []
    result = Session(tiny).run("hello", GenerationParams(max_new_tokens=5), events.append,
                               before_step=lambda step: clocks.wait(1.0))
    s = result.summary
    steps = [e for e in events if type(e).__name__ == "TokenStep"]
    assert [round(st.waited_ms) for st in steps] == [0, 1000, 1000, 1000, 1000]
    assert s.waited_ms == pytest.approx(sum(st.waited_ms for st in steps))
    assert s.decode_ms == pytest.approx(sum(st.latency_ms for st in steps[1:]))
    assert s.decode_ms < 10                       # the steps' own clock reads, none of the four seconds waited
    assert s.total_ms > s.waited_ms + s.decode_ms
    assert s.cpu_share is None          # 4 s of waits left too little measured time to judge the load


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


def test_products_widened_to_float32_are_held_to_float32s_peak_and_the_rest_to_their_own_floats(tiny):
    """On a CPU that emulates bfloat16, a prefill's products of ``WIDE_ROWS`` rows or more run in float32: a
    38-token prefill achieving 31 GFLOP/s beats bfloat16's emulated peak (26) and is far below float32's (132)."""
    from types import SimpleNamespace

    import torch

    from engine.facts.costmodel import ModelCost
    from engine.model.kernels import WIDE_ROWS, KernelChoice

    measured = {torch.bfloat16: HardwarePeaks("cpu", "bfloat16", 26e9, 34e9, cached=True, cpu_share=0.97),
                torch.float32: HardwarePeaks("cpu", "float32", 132e9, 34e9, cached=False, cpu_share=0.9)}
    widening = SimpleNamespace(model=SimpleNamespace(dtype=torch.bfloat16), kernel=KernelChoice("aten", wide="why"))
    peaks = hardware.model_peaks(widening, measured.get)
    assert (peaks.flops_per_s, peaks.wide_rows, peaks.wide_flops_per_s) == (26e9, WIDE_ROWS, 132e9)
    assert not peaks.cached and peaks.cpu_share == 0.9                     # as fresh and as busy as either
    cost, device = ModelCost(tiny.facts), Device.of(peaks)
    assert cost.prefill(WIDE_ROWS).peak_flops_per_s(device) == 132e9
    assert cost.prefill(WIDE_ROWS - 1).peak_flops_per_s(device) == cost.decode(40).peak_flops_per_s(device) == 26e9
    assert cost.decode_without_cache(WIDE_ROWS).peak_flops_per_s(device) == 132e9     # a whole prefill again
    assert not hardware.implausible(peaks, 31e9, cost=cost.prefill(38))
    assert hardware.implausible(peaks, 31e9, cost=cost.prefill(8)) and hardware.implausible(peaks, 150e9,
                                                                                            cost=cost.prefill(38))
    assert hardware.model_peaks(widening, {torch.bfloat16: measured[torch.bfloat16]}.get) is None   # no wrong roof
    own = SimpleNamespace(model=SimpleNamespace(dtype=torch.bfloat16), kernel=KernelChoice("aten"))
    assert hardware.model_peaks(own, measured.get) == measured[torch.bfloat16]
    assert hardware.model_peaks(SimpleNamespace(model=own.model, kernel=None), measured.get).wide_flops_per_s == 0


def test_a_busy_measurement_never_replaces_a_quiet_one_and_gives_no_ceiling(tiny, monkeypatch, tmp_path):
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))
    shares = iter([0.95, 0.2])                                # quiet first, then measured again while busy

    def fake_measure(device, dtype):
        return Device("cpu", 1e11, 1e10), next(shares)

    monkeypatch.setattr(hardware, "measure", fake_measure)
    quiet = hardware.peaks_event(tiny)
    assert quiet.quiet and quiet.bytes_per_s == 1e10
    again = hardware.peaks_event(tiny, remeasure=True)          # the busy figure is not kept over the quiet one
    assert again.quiet and again.cpu_share == quiet.cpu_share and again.cached
    busy = HardwarePeaks("cpu", "float32", flops_per_s=1e9, bytes_per_s=1e9, cpu_share=0.2)
    assert not busy.quiet
    assert Experiment(lesson("cache"), Session(tiny), lambda e: None, None, busy).device is None
    assert Experiment(lesson("cache"), Session(tiny), lambda e: None, None, quiet).device is not None


def test_without_leave_to_measure_only_a_cached_figure_is_given(tiny, monkeypatch, tmp_path):
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(hardware, "measure", lambda device, dtype: pytest.fail("measured in a lecture"))
    assert hardware.peaks_event(tiny, may_measure=False) is None


def test_the_peak_product_is_in_linears_layout_and_a_peak_measured_otherwise_is_measured_again(monkeypatch,
                                                                                               tmp_path):
    """The ceiling is the product a model's layers run: activations times the transposed weight (on a CPU without
    bfloat16 units the other layout ran 27x slower in bfloat16, so every run beat its "peak"). A peak kept from
    before, measured the other way, is not read."""
    import torch

    from engine.store import machine_cache

    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))
    cpu = torch.device("cpu")
    before = hardware._key(cpu, torch.float32).removesuffix(f"|{hardware.PRODUCT}")
    machine_cache.remember(hardware.CACHE, before, {"name": "cpu", "flops_per_s": 1e9, "bytes_per_s": 1e9,
                                                    "measured": "2026-12-03", "cpu_share": 0.95})
    products: list[tuple] = []
    matmul = torch.matmul

    def recorded(a, b, **kwargs):
        products.append((a.stride(), b.stride(), b.mT.is_contiguous()))
        return matmul(a, b, **kwargs)

    monkeypatch.setattr(torch, "matmul", recorded)
    found = hardware.peaks(cpu, torch.float32)
    assert not found.cached and found.flops_per_s != 1e9
    weight = torch.empty(1024, 1024)                                   # nn.Linear's weight: (out, in), contiguous
    assert set(products) == {((1024, 1), weight.mT.stride(), True)}


STAT = """cpu  900 0 300 8000 100 0 0 0 0 0
cpu0 400 0 100 4000 50 0 0 0 0 0
cpu1 500 0 200 4000 50 0 0 0 0 0
cpu2 100000 0 0 0 0 0 0 0 0 0
intr 12345
"""


def test_the_machine_reading_counts_the_usable_cores_busy_time_not_idle_or_io_wait(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text(STAT)
    reading = contention.read_machine(str(stat), cores=[0, 1], own_clock=lambda: 3.0)
    ticks = contention._TICKS
    assert reading == contention.MachineReading(busy_s=(400 + 100 + 500 + 200) / ticks, own_s=3.0, cores=2)
    assert contention.read_machine(str(tmp_path / "missing")) is None


def test_other_programs_cores_are_the_busy_time_less_this_process_own():
    before = contention.MachineReading(busy_s=10.0, own_s=1.0, cores=2)
    after = contention.MachineReading(busy_s=12.0, own_s=2.0, cores=2)      # 2 core-seconds, 1 of them ours
    assert contention.others_cores(before, after, wall_s=1.0) == pytest.approx(1.0)
    assert contention.others_cores(before, after, wall_s=0.1) is None       # shorter than the ticks can tell


def test_a_run_that_gave_a_core_away_is_busy_though_its_one_thread_was_never_short(monkeypatch):
    """One thread kept busy the whole time looks quiet to the process's own clock; the kernel's count of what
    other programs did says the machine was shared."""
    clocks = Clocks()
    readings = iter([contention.MachineReading(0.0, 0.0, 2), contention.MachineReading(0.6, 0.3, 2)])
    meter = contention.LoadMeter(clocks.cpu, clocks.wall, machine=lambda: next(readings), threads=lambda: 1)
    meter.start()
    clocks.work(0.3, threads=1)
    meter.stop()
    own = meter.cpu_s / meter.wall_s
    assert own == pytest.approx(1.0, rel=1e-2)
    assert meter.others() == pytest.approx(1.0, rel=1e-2) and meter.free_share() == pytest.approx(0.5, rel=1e-2)
    assert meter.share() == pytest.approx(0.5, rel=1e-2) and contention.busy(meter.share())


def test_the_share_weighs_each_thread_count_by_how_long_it_held():
    clocks = Clocks()
    counts = iter([2, 1, 1])
    meter = contention.LoadMeter(clocks.cpu, clocks.wall, machine=None, threads=lambda: next(counts))
    meter.start()
    clocks.work(0.3, threads=2)
    meter.share_so_far()                  # a step boundary: the count is read again (now 1)
    clocks.work(0.3, threads=1)
    meter.stop()
    assert meter.mean_threads() == pytest.approx(1.5, rel=1e-2)
    assert meter.share() == pytest.approx(1.0, rel=1e-2) and not contention.busy(meter.share())


def test_a_running_measurement_says_busy_once_the_kernel_shows_other_programs_holding_a_core():
    clocks = Clocks()
    readings = iter([contention.MachineReading(0.0, 0.0, 2), contention.MachineReading(0.6, 0.3, 2)])
    meter = contention.LoadMeter(clocks.cpu, clocks.wall, machine=lambda: next(readings), threads=lambda: 1)
    meter.start()
    clocks.work(0.3, threads=1)                       # one thread, never short of a core
    assert meter.share_so_far() == pytest.approx(0.5, rel=1e-2) and contention.busy(meter.share_so_far())
