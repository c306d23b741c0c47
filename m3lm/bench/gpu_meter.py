"""The GPU's energy counter, temperature, SM clock and power limit from NVML (the NVIDIA driver's
management library, loaded with ctypes), for the benchmarks: a step that runs at the power limit
takes its energy over the limit's watts, so a timing means little without the state it ran in.

`GpuMeter.open()` is None where there is no NVIDIA driver (a CPU machine)."""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass

_TEMPERATURE_GPU = 0  # nvmlTemperatureSensors_t
_CLOCK_SM = 1  # nvmlClockType_t
MIN_POWER_WINDOW_S = 0.25  # the energy counter's steps make shorter windows' watts unreliable


class GpuMeter:
    """One GPU's NVML readings; `uuid` names it as CUDA does (robust to CUDA_VISIBLE_DEVICES)."""

    def __init__(self, lib: ctypes.CDLL, handle: ctypes.c_void_p):
        self._lib, self._handle = lib, handle

    @classmethod
    def open(cls, device: int | None = None) -> GpuMeter | None:
        """The meter of CUDA device `device` (default: the current one), or None without NVML."""
        import torch

        if not torch.cuda.is_available():
            return None
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError:
            return None
        if lib.nvmlInit_v2() != 0:
            return None
        index = torch.cuda.current_device() if device is None else device
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        handle = ctypes.c_void_p()
        name = (uuid if uuid.startswith("GPU-") else f"GPU-{uuid}").encode()
        if lib.nvmlDeviceGetHandleByUUID(name, ctypes.byref(handle)) != 0:
            return None
        return cls(lib, handle)

    def _read(self, fn: str, *args) -> int:
        value = ctypes.c_ulonglong() if fn == "nvmlDeviceGetTotalEnergyConsumption" else ctypes.c_uint()
        status = getattr(self._lib, fn)(self._handle, *args, ctypes.byref(value))
        if status != 0:
            raise RuntimeError(f"NVML {fn} failed with status {status}")
        return value.value

    def joules(self) -> float:
        """Energy since the driver loaded."""
        return self._read("nvmlDeviceGetTotalEnergyConsumption") / 1e3

    def temperature_c(self) -> int:
        return self._read("nvmlDeviceGetTemperature", _TEMPERATURE_GPU)

    def sm_mhz(self) -> int:
        return self._read("nvmlDeviceGetClockInfo", _CLOCK_SM)

    def power_limit_w(self) -> float:
        """The limit the driver enforces now."""
        return self._read("nvmlDeviceGetEnforcedPowerLimit") / 1e3

    def window(self) -> Window:
        return Window(self, self.joules(), time.perf_counter())


@dataclass
class Window:
    """Energy and time from its start; `close` (after the GPU's work is synchronised) reads the
    state at its end."""

    meter: GpuMeter
    joules0: float
    t0: float

    def close(self) -> GpuState:
        seconds = time.perf_counter() - self.t0
        joules = self.meter.joules() - self.joules0
        watts = joules / seconds if seconds >= MIN_POWER_WINDOW_S else None
        return GpuState(watts, self.meter.temperature_c(), self.meter.sm_mhz())


@dataclass
class GpuState:
    watts: float | None  # mean power over the window (None when it was too short to tell)
    temperature_c: int  # at the window's end
    sm_mhz: int  # at the window's end

    def __str__(self) -> str:
        power = f"{self.watts:.0f} W, " if self.watts is not None else ""
        return f"{power}{self.temperature_c} C, SM {self.sm_mhz} MHz"
