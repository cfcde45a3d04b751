"""What device-agnostic torch code expects of accel, on every backend: the default
stream, page-locked memory as a tensor, and whether torch work runs inline."""

from __future__ import annotations

import gc
import sys

import pytest

import accel
from accel._interop import DLPackExportError

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")


def test_default_stream_is_the_device_s_default_as_in_torch(runtime) -> None:
    default = accel.default_stream()
    assert default.native_handle == runtime.backend.default_stream(0)
    assert default == accel.current_stream() == accel.default_stream(0) == accel.default_stream(device=accel.Device(runtime.name, 0))
    with accel.Stream() as created:
        assert accel.current_stream() == created != accel.default_stream()
        assert accel.default_stream() == default
    last = accel.device_count() - 1
    assert accel.default_stream(last).device == accel.Device(runtime.name, last)
    with pytest.raises(accel.DeviceError, match="out of range"):
        accel.default_stream(accel.device_count())


def test_the_capability_says_whether_torch_work_runs_inline(runtime) -> None:
    # What libraries test with `device.type == "cpu"`: on the host torch ops are done
    # when they return; on a GPU they are queued on the device.
    expected = {"cpu": True, "cuda": False, "xpu": False}[runtime.name]
    assert accel.get_device_capability()["torch_runs_inline"] is expected
    assert runtime.backend.torch_runs_inline is expected


def _written_host_buffer(value: int, nbytes: int = 64) -> accel.memory.HostBuffer:
    """Page-locked memory written by a copy from device memory, the copy waited for."""
    hb = accel.memory.allocate_host(nbytes)
    stream = accel.Stream()
    with accel.memory.allocate(nbytes, stream=stream) as device:
        stream.fill(device, value)
        stream.copy(hb, device, nbytes)
        stream.synchronize()
    return hb


def _active_host_requests() -> int:
    return int(accel.memory.host_memory_stats()["active_requests.current"])


def test_a_host_buffer_is_a_host_tensor_without_a_copy(runtime) -> None:
    hb = _written_host_buffer(7)
    tensor = accel.as_tensor(hb)
    assert tensor.device == torch.device("cpu") and tensor.dtype == torch.uint8
    assert tensor.data_ptr() == hb.ptr and tensor.tolist() == [7] * 64
    assert accel.as_tensor(hb, "int32", (4, 4)).tolist() == [[0x07070707] * 4] * 4
    from_dlpack = torch.from_dlpack(hb)
    assert from_dlpack.data_ptr() == hb.ptr and from_dlpack.tolist() == [7] * 64
    array = np.from_dlpack(hb)
    assert array.ctypes.data == hb.ptr and (array == 7).all()
    assert hb.__dlpack_device__() == (1, 0)  # kDLCPU: torch refuses kDLCUDAHost
    tensor[0] = 9  # one memory
    assert array[0] == 9 and from_dlpack[0] == 9


def test_a_host_buffer_speaks_the_buffer_protocol(runtime) -> None:
    hb = _written_host_buffer(5, 16)
    view = hb.__buffer__(0)
    assert (view.format, view.nbytes, view.readonly) == ("B", 16, False)
    assert bytes(view) == b"\x05" * 16
    view[1] = 6
    assert accel.as_tensor(hb)[1] == 6
    if sys.version_info >= (3, 12):  # PEP 688: memoryview() finds __buffer__
        assert bytes(memoryview(hb)) == bytes(view)


def test_views_of_a_host_buffer_keep_its_memory_past_free(runtime) -> None:
    before = _active_host_requests()
    hb = _written_host_buffer(3)
    tensor, view, capsule_view = accel.as_tensor(hb), hb.__buffer__(0), torch.from_dlpack(hb)
    hb.free()
    with pytest.raises(accel.InvalidHandleError, match="was freed"):
        accel.as_tensor(hb)
    # Not reused while viewed: new page-locked memory is not this memory.
    with accel.memory.allocate_host(64) as other:
        accel.current_stream().fill(other, 1)
        accel.current_stream().synchronize()
    assert tensor.tolist() == [3] * 64 and bytes(view) == b"\x03" * 64 and capsule_view.tolist() == [3] * 64
    assert _active_host_requests() == before + 1
    del tensor, view, capsule_view
    gc.collect()
    assert _active_host_requests() == before


def test_host_buffer_exports_refuse_what_they_cannot_give(runtime) -> None:
    hb = _written_host_buffer(2, 8)
    with pytest.raises(DLPackExportError, match="take stream=None"):
        hb.__dlpack__(stream=5)
    with pytest.raises(DLPackExportError, match="not \\(2, 0\\)"):
        hb.__dlpack__(dl_device=(2, 0))
    with pytest.raises(accel.InvalidValueError, match="needs 16 bytes"):
        accel.as_tensor(hb, "uint8", 16)
    copied = torch.from_dlpack(hb.__dlpack__(copy=True, max_version=(1, 0)))
    assert copied.data_ptr() != hb.ptr and copied.tolist() == [2] * 8
    assert torch.from_dlpack(hb.__dlpack__(stream=-1, dl_device=(1, 0))).tolist() == [2] * 8


def _locked_kib(ptr: int) -> int:
    """The ``Locked:`` kB of the mapping that holds ``ptr``, from /proc/self/smaps."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= ptr < end
            elif inside and head == "Locked:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {ptr:#x}")


def test_a_host_buffer_says_whether_it_is_page_locked_where_is_pinned_cannot(runtime) -> None:
    hb = accel.memory.allocate_host(4096)
    assert hb.page_locked is {"cpu": False, "cuda": True, "xpu": True}[runtime.name]
    assert hb.page_locked is runtime.backend.host_memory_page_locked
    if not torch.cuda.is_available() and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        # A CPU-only torch has no pinned-memory registry to ask: is_pinned() cannot tell.
        assert accel.as_tensor(hb).is_pinned() is False
    if runtime.name == "cpu" and sys.platform == "linux":
        assert _locked_kib(hb.ptr) == 0  # the host backend's staging pages are ordinary ones
