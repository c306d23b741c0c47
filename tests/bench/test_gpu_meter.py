"""`m3lm.bench.gpu_meter`: the window arithmetic on the CPU (a scripted meter), absence without a GPU,
and the real NVML readings on a GPU (`cuda` marker)."""

import pytest
import torch

from m3lm.bench import gpu_meter
from m3lm.bench.gpu_meter import GpuMeter, Window


class Scripted:
    """A meter whose energy counter reads the given joules in turn."""

    def __init__(self, joules):
        self.readings = iter(joules)

    def joules(self):
        return next(self.readings)

    def temperature_c(self):
        return 61

    def sm_mhz(self):
        return 1605


def test_window_watts_are_joules_over_seconds(monkeypatch):
    clock = iter([100.0, 102.0])
    monkeypatch.setattr(gpu_meter.time, "perf_counter", lambda: next(clock))
    meter = Scripted([5000.0, 6400.0])
    window = Window(meter, meter.joules(), gpu_meter.time.perf_counter())
    state = window.close()
    assert state.watts == pytest.approx(700.0)
    assert (state.temperature_c, state.sm_mhz) == (61, 1605)
    assert str(state) == "700 W, 61 C, SM 1605 MHz"


def test_short_window_reports_no_watts(monkeypatch):
    clock = iter([0.0, gpu_meter.MIN_POWER_WINDOW_S / 2])
    monkeypatch.setattr(gpu_meter.time, "perf_counter", lambda: next(clock))
    meter = Scripted([1.0, 2.0])
    state = Window(meter, meter.joules(), gpu_meter.time.perf_counter()).close()
    assert state.watts is None
    assert str(state) == "61 C, SM 1605 MHz"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only answer")
def test_no_meter_without_a_gpu():
    assert GpuMeter.open() is None


@pytest.mark.cuda
def test_nvml_readings_on_the_gpu():
    meter = GpuMeter.open()
    assert meter is not None
    assert 100 <= meter.power_limit_w() <= 2000
    assert 0 < meter.temperature_c() < 120
    assert meter.sm_mhz() > 0
    x = torch.randn(4096, 4096, device="cuda")
    window = meter.window()
    before = meter.joules()
    while gpu_meter.time.perf_counter() - window.t0 < 2 * gpu_meter.MIN_POWER_WINDOW_S:
        x = x @ x
        x = x / x.norm()
        torch.cuda.synchronize()
    state = window.close()
    assert meter.joules() > before
    assert state.watts is not None and 30 < state.watts < 2000
