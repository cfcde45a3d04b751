"""The Level Zero bindings without a driver: declarations, error names, error mapping."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

import accel
from accel.backends.xpu._bindings import ZeLoader, _get_ffi, describe_result, open_loader, result_name

STRUCTS = (
    "ze_driver_properties_t",
    "ze_device_properties_t",
    "ze_device_compute_properties_t",
    "ze_device_memory_properties_t",
    "ze_command_queue_group_properties_t",
    "ze_command_queue_desc_t",
    "ze_command_list_desc_t",
    "ze_event_pool_desc_t",
    "ze_event_desc_t",
    "ze_kernel_timestamp_result_t",
    "ze_device_mem_alloc_desc_t",
    "ze_host_mem_alloc_desc_t",
    "ze_memory_allocation_properties_t",
    "ze_physical_mem_desc_t",
    "zes_mem_properties_t",
    "zes_mem_state_t",
    "zel_component_version_t",
)


def test_struct_layouts_match_the_installed_headers(tmp_path: Path) -> None:
    """The committed cdef must agree with gcc on every structure accel passes to the driver."""
    header = Path("/usr/include/level_zero/ze_api.h")
    if shutil.which("gcc") is None or not header.is_file():
        pytest.skip("needs gcc and Debian's libze-dev headers")
    source = tmp_path / "sizes.c"
    lines = [
        "#include <stdio.h>",
        "#include <stddef.h>",
        "#include <level_zero/ze_api.h>",
        "#include <level_zero/zes_api.h>",
        "#include <level_zero/loader/ze_loader.h>",
        "int main(void) {",
    ]
    lines += [f'    printf("{name} %zu\\n", sizeof({name}));' for name in STRUCTS]
    lines += ['    printf("global %zu\\n", offsetof(ze_kernel_timestamp_result_t, global));', "    return 0;", "}"]
    source.write_text("\n".join(lines))
    binary = tmp_path / "sizes"
    subprocess.run(["gcc", "-o", str(binary), str(source)], check=True, capture_output=True)
    measured = dict(line.split() for line in subprocess.run([str(binary)], capture_output=True, text=True, check=True).stdout.splitlines())
    ffi = _get_ffi()
    for name in STRUCTS:
        assert ffi.sizeof(name) == int(measured[name]), name
    assert ffi.offsetof("ze_kernel_timestamp_result_t", "global") == int(measured["global"])


def test_result_names_come_from_the_enum() -> None:
    assert result_name(0) == "ZE_RESULT_SUCCESS"
    assert result_name(0x70000003) == "ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY"
    assert result_name(0x7123) == "ze_result_t 0x7123"
    assert describe_result(0x78000003) == (
        "ZE_RESULT_ERROR_UNSUPPORTED_FEATURE (0x78000003): the driver does not implement this call"
    )


@pytest.fixture
def loader() -> ZeLoader:
    """Error checking needs no library: a loader object with nothing loaded."""
    return ZeLoader(_get_ffi(), object(), "nothing")


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (0x70000003, accel.OutOfMemoryError),
        (0x70000002, accel.OutOfMemoryError),
        (0x78000005, accel.InvalidHandleError),
        (0x78000003, accel.NotSupportedError),
        (0x78000004, accel.DriverError),
        (0x70000001, accel.DriverError),
    ],
)
def test_every_failure_becomes_an_accel_error_naming_the_call_and_result(loader, code: int, kind: type) -> None:
    with pytest.raises(kind) as info:
        loader.check("zeSomething", code, device=1, requested=4096)
    text = str(info.value)
    assert "zeSomething" in text and result_name(code) in text and "xpu:1" in text
    if kind is accel.DriverError:
        assert (info.value.call, info.value.code, info.value.name, info.value.device) == (
            "zeSomething", code, result_name(code), 1
        )
    if kind is accel.OutOfMemoryError:
        assert info.value.requested == 4096 and info.value.device == 1


def test_success_is_silent(loader) -> None:
    loader.check("zeSomething", 0)


def test_probing_agrees_with_the_dynamic_linker() -> None:
    try:
        ze = open_loader("libze_loader.so.1")  # dlopen only: no zeInit in this process
    except accel.BackendUnavailableError as exc:
        pytest.skip(exc.reason)
    oracle = ctypes.CDLL("libze_loader.so.1")
    for name in ("zeInit", "zeVirtualMemReserve", "zeCommandListHostSynchronize"):
        assert ze.has(name) is hasattr(oracle, name), name
    assert ze.has("zeInit")


def test_a_missing_loader_is_one_line() -> None:
    with pytest.raises(accel.BackendUnavailableError) as info:
        open_loader("/nonexistent/libze_loader.so.1")
    assert info.value.reason == (
        "/nonexistent/libze_loader.so.1 not found: install Debian's libze1 (apt-get install libze1) "
        "or set ACCEL_ZE_LOADER"
    )
