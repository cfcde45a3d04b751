"""The XPU backend: Intel GPUs (and any Level Zero GPU driver) through oneAPI Level Zero.

Importing this package loads nothing; :func:`load` dlopens the Level Zero
loader (``ACCEL_ZE_LOADER``, else ``libze_loader.so.1``), initializes it and
picks the GPU devices of the first driver that has any. See
docs/backends/xpu.md for how streams, events and graphs map onto Level Zero.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from accel._errors import AccelError, BackendUnavailableError
from accel.backends.base import Backend

if TYPE_CHECKING:
    from accel.backends.xpu._bindings import ZeLoader

__all__ = ["load"]


def load() -> Backend:
    """Load the Level Zero loader and return the XPU backend.

    Raises :class:`~accel.BackendUnavailableError` whose ``reason`` is one
    line: the loader is missing, ``zeInit`` failed (with the ``ze_result_t``
    name and code), or no driver presents a GPU.

    >>> from accel.backends.xpu import load
    >>> load().name  # doctest: +SKIP
    'xpu'
    """
    from accel.backends.xpu._library import describe_result, first_init, loader_path

    path, from_env = loader_path()
    first_init(path, from_env)  # before cffi and the declarations are loaded: they cost ~50 ms
    from accel.backends.xpu._backend import XpuBackend
    from accel.backends.xpu._bindings import open_loader

    ze = open_loader(path, from_env=from_env)
    ffi, lib = ze.ffi, ze.lib
    code = lib.zeInit(lib.ZE_INIT_FLAG_GPU_ONLY)
    if code != 0:
        raise BackendUnavailableError("xpu", f"zeInit failed: {describe_result(code)}")
    count = ffi.new("uint32_t *", 0)
    code = lib.zeDriverGet(count, ffi.NULL)
    if code != 0:
        raise BackendUnavailableError("xpu", f"zeDriverGet failed: {describe_result(code)}")
    drivers = ffi.new("ze_driver_handle_t[]", count[0])
    if count[0]:
        code = lib.zeDriverGet(count, drivers)
        if code != 0:
            raise BackendUnavailableError("xpu", f"zeDriverGet failed: {describe_result(code)}")
    for i in range(count[0]):
        gpus = _gpu_devices(ze, drivers[i])
        if gpus:
            try:
                return XpuBackend(ze, drivers[i], gpus, loader_version=_loader_version(ze))
            except AccelError as exc:
                reason = str(exc).splitlines()[0]
                raise BackendUnavailableError("xpu", f"setting up the Level Zero driver failed: {reason}") from exc
    raise BackendUnavailableError(
        "xpu", f"no GPU device: {count[0]} Level Zero driver(s) loaded, none presents a GPU-type device"
    )


def _gpu_devices(ze: ZeLoader, driver: object) -> list[object]:
    from accel.backends.xpu._library import describe_result

    ffi, lib = ze.ffi, ze.lib
    count = ffi.new("uint32_t *", 0)
    code = lib.zeDeviceGet(driver, count, ffi.NULL)
    if code != 0:
        raise BackendUnavailableError("xpu", f"zeDeviceGet failed: {describe_result(code)}")
    devices = ffi.new("ze_device_handle_t[]", count[0])
    if count[0]:
        code = lib.zeDeviceGet(driver, count, devices)
        if code != 0:
            raise BackendUnavailableError("xpu", f"zeDeviceGet failed: {describe_result(code)}")
    gpus: list[object] = []
    for i in range(count[0]):
        props = ffi.new("ze_device_properties_t *", {"stype": lib.ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES})
        code = lib.zeDeviceGetProperties(devices[i], props)
        if code != 0:
            raise BackendUnavailableError("xpu", f"zeDeviceGetProperties failed: {describe_result(code)}")
        if props.type == lib.ZE_DEVICE_TYPE_GPU:
            gpus.append(devices[i])
    return gpus


def _loader_version(ze: ZeLoader) -> str:
    """``"loader 1.8.0"``, or "unknown" when the loader cannot say."""
    ffi, lib = ze.ffi, ze.lib
    if not ze.has("zelLoaderGetVersions"):
        return "unknown"
    count = ffi.new("size_t *", 0)
    if lib.zelLoaderGetVersions(count, ffi.NULL) != 0 or count[0] == 0:
        return "unknown"
    versions = ffi.new("zel_component_version_t[]", count[0])
    if lib.zelLoaderGetVersions(count, versions) != 0:
        return "unknown"
    for i in range(count[0]):
        name = ffi.string(versions[i].component_name).decode(errors="replace")
        if name == "loader":
            v = versions[i].component_lib_version
            return f"{v.major}.{v.minor}.{v.patch}"
    return "unknown"
