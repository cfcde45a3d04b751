"""The host backend (``cpu``): the embedded default, and accel's test bed."""

from accel.backends.cpu._backend import CpuBackend, load

__all__ = ["CpuBackend", "load"]
