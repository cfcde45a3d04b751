"""The torch.accelerator-style facade on the host backend, bad inputs included."""

from __future__ import annotations

import doctest
import importlib
import os
import subprocess
import sys
import threading

import pytest

import accel


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (backends load once per process)."""
    full_env = {**os.environ, **env}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=120
    )


def test_is_available_and_current_accelerator() -> None:
    assert accel.is_available()
    device = accel.current_accelerator()
    assert device == accel.Device("cpu") and device.index is None
    assert accel.current_accelerator(check_available=True) == device


def test_unavailable_backend_is_reported_not_raised() -> None:
    result = run_python(
        "import accel\n"
        "print(accel.is_available(), accel.device_count(), accel.current_accelerator(),"
        " accel.current_accelerator(check_available=True))\n"
        "try:\n    accel.current_device_index()\n"
        "except accel.BackendUnavailableError as e:\n    print('error:', e)",
        ACCEL_BACKEND="nonsense",
    )
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.splitlines()
    assert first == "False 0 None None"  # "nonsense" is no device type: no Device names it
    assert "backend 'nonsense' is unavailable: no such backend" in second
    assert "cpu, cuda, xpu" in second or "cuda, xpu, cpu" in second


@pytest.mark.parametrize("requested", ["cuda:1", "cpu:0"])
def test_a_backend_named_with_an_index_is_no_accelerator(requested: str) -> None:
    """ACCEL_BACKEND=cuda:1 loads no backend, yet current_accelerator() said the
    accelerator was the device cuda:1 (documented: a type, with no index)."""
    result = run_python(
        "import accel\nprint(accel.is_available(), accel.current_accelerator())", ACCEL_BACKEND=requested
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "None"]


def test_device_count_follows_accel_cpu_devices() -> None:
    assert accel.device_count() == int(os.environ["ACCEL_CPU_DEVICES"])
    result = run_python("import accel; print(accel.device_count())", ACCEL_CPU_DEVICES="3")
    assert result.stdout.strip() == "3"


# "²" passed str.isdigit() and int() raised a raw ValueError; 10**20 devices never finished loading.
@pytest.mark.parametrize("value", ["0", "-1", "two", "\u00b2", "99999999999999999999"])
def test_bad_accel_cpu_devices_makes_the_backend_unavailable(value: str) -> None:
    result = run_python(
        "import accel\ntry:\n    accel.device_count() or accel.current_device_index()\n"
        "except accel.BackendUnavailableError as e:\n    print(e)",
        ACCEL_CPU_DEVICES=value,
    )
    assert f"ACCEL_CPU_DEVICES={value!r} is not an integer from 1 to 1024" in result.stdout


def test_set_device_index_and_context_manager() -> None:
    assert accel.current_device_index() == 0
    with accel.device_index(1):
        assert accel.current_device_index() == 1
        with accel.device_index("cpu:0"):
            assert accel.current_device_index() == 0
        assert accel.current_device_index() == 1
    assert accel.current_device_index() == 0
    with accel.device_index(None):
        assert accel.current_device_index() == 0
    accel.set_device_index(1)
    try:
        assert accel.current_device_index() == 1
    finally:
        accel.set_device_index(0)


def test_current_device_is_thread_local() -> None:
    seen = []
    accel.set_device_index(1)
    try:
        thread = threading.Thread(target=lambda: seen.append(accel.current_device_index()))
        thread.start()
        thread.join()
    finally:
        accel.set_device_index(0)
    assert seen == [0]


@pytest.mark.parametrize(
    "bad, message",
    [
        (5, "device index 5 is out of range: the cpu backend has 2 devices"),
        (-1, "device index -1 is out of range"),
        ("cuda:0", "does not match the current accelerator 'cpu'"),
        ("gpu", "'gpu' is not a device type torch knows: device types are lowercase"),
        ("meta:0", "does not match the current accelerator 'cpu'; device types are"),
        ("xpu", "does not match the current accelerator 'cpu'; start the process with ACCEL_BACKEND=xpu"),
        ("cpu:x", "is not a device string"),
        (True, "is not a device"),
        (1.0, "is not a device"),
    ],
)
def test_bad_devices_are_refused_everywhere(bad: object, message: str) -> None:
    for call in (
        accel.set_device_index,
        accel.current_stream,
        accel.synchronize,
        accel.get_memory_info,
        accel.get_device_properties,
        accel.get_device_capability,
        lambda d: accel.can_device_access_peer(0, d),
        lambda d: accel.device_index(d).__enter__(),
        lambda d: accel.Stream(d),
        lambda d: accel.Event(device=d),
    ):
        with pytest.raises(accel.DeviceError, match=message.replace("(", r"\(")):
            call(bad)
    assert accel.current_device_index() == 0


def test_torch_devices_are_accepted() -> None:
    torch = pytest.importorskip("torch")
    assert accel.get_device_properties(torch.device("cpu", 1)).index == 1
    with pytest.raises(accel.DeviceError, match="does not match"):
        accel.get_memory_info(torch.device("meta"))


def in_thread(fn):
    """Run ``fn`` in a fresh thread (fresh current device and streams) and return its result."""
    result = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join()
    return result[0]


def test_current_stream_and_set_stream() -> None:
    default = accel.current_stream()
    assert default == accel.current_stream(0) and default.native_handle
    assert accel.current_stream(1) != default
    s = accel.Stream(1)

    def switch():
        accel.set_stream(s)
        return accel.current_device_index(), accel.current_stream(), accel.current_stream(0)

    assert in_thread(switch) == (1, s, default)
    assert accel.current_stream(1) != s  # the other thread's choice stays there
    with pytest.raises(accel.InvalidValueError, match="stream='stream' .* is not a stream"):
        accel.set_stream("stream")  # type: ignore[arg-type]


def test_stream_context_restores_device_and_stream() -> None:
    s = accel.Stream(1)
    with s:
        assert accel.current_device_index() == 1 and accel.current_stream() == s
        inner = accel.Stream(0)
        with inner:
            assert accel.current_device_index() == 0 and accel.current_stream() == inner
        assert accel.current_stream() == s
    assert accel.current_device_index() == 0
    assert accel.current_stream(1) != s


def test_synchronize_waits_for_all_streams_of_the_device() -> None:
    done = []
    streams = [accel.Stream(), accel.Stream()]
    for i, s in enumerate(streams):
        s.launch_host_func(lambda i=i: (threading.Event().wait(0.05), done.append(i)))
    accel.synchronize()
    assert sorted(done) == [0, 1]
    accel.synchronize("cpu:1")


def test_memory_info_is_real() -> None:
    free, total = accel.get_memory_info()
    with open("/proc/meminfo") as f:
        mem_total = int(f.readline().split()[1]) * 1024
    assert 0 < free <= total <= mem_total
    result = run_python("import accel; print(*accel.get_memory_info())", ACCEL_CPU_MEMORY_LIMIT="64MiB")
    assert result.stdout.split() == [str(64 << 20)] * 2


def test_bad_memory_limit_says_how_to_write_it() -> None:
    result = run_python(
        "import accel\ntry:\n    accel.get_memory_info()\nexcept accel.BackendUnavailableError as e:\n    print(e)",
        ACCEL_CPU_MEMORY_LIMIT="lots",
    )
    assert "ACCEL_CPU_MEMORY_LIMIT='lots' is not a size" in result.stdout
    assert "8GiB" in result.stdout


def test_device_properties() -> None:
    props = accel.get_device_properties()
    assert props.type == "cpu" and props.index == 0
    assert props.total_memory == accel.get_memory_info()[1]
    assert props.uuid != accel.get_device_properties(1).uuid
    assert props.multi_processor_count == os.cpu_count()


def test_device_capability_names_dtypes() -> None:
    capability = accel.get_device_capability()
    assert {"float32", "bfloat16", "int64", "bool"} <= capability["supported_dtypes"]
    torch = pytest.importorskip("torch")
    assert all(isinstance(getattr(torch, name), torch.dtype) for name in capability["supported_dtypes"])


def test_peer_access() -> None:
    assert accel.can_device_access_peer(0, 1)
    assert accel.can_device_access_peer("cpu:1", 1)
    with pytest.raises(accel.DeviceError, match="a device is required"):
        accel.can_device_access_peer(None, 0)


# What `import accel` must not load (DESIGN.md: no torch, no driver, no device probe):
# the layers that load on first use, the drivers' bindings, and the standard modules
# that only those layers need. Each of these cost milliseconds at import when it crept in.
_NOT_AT_IMPORT = (
    "torch", "numpy", "cffi", "pycparser", "onnxruntime", "typing_extensions",
    "accel.allocator", "accel.memory", "accel.graph", "accel._interop",
    "accel.backends.cpu", "accel.backends.cuda", "accel.backends.xpu", "accel.backends._sharing",
    "socket", "secrets", "hmac", "json", "logging", "pickle", "difflib", "fractions", "decimal",
)


def test_import_loads_no_layer_driver_or_module_it_does_not_need() -> None:
    result = run_python(
        "import sys\nbefore = set(sys.modules)\nimport accel\n"
        "print(' '.join(sorted(set(sys.modules) - before)))"
    )
    assert result.returncode == 0, result.stderr
    loaded = set(result.stdout.split())
    assert "accel" in loaded
    assert sorted(loaded & set(_NOT_AT_IMPORT)) == []


def test_what_import_does_not_load_arrives_on_first_use() -> None:
    # The buffer exports live in the interop layer, loaded by the first export.
    result = run_python(
        "import sys, accel\n"
        "buf = accel.memory.allocate(64)\n"
        "print('accel._interop' in sys.modules, buf.__dlpack_device__(), 'accel._interop' in sys.modules,"
        " accel.from_dlpack(buf).nbytes)"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "(<DLDeviceType.kDLCPU:", "1>,", "0)", "True", "64"]


def test_memory_functions_are_on_the_facade_without_loading_them_at_import() -> None:
    result = run_python(
        "import sys, accel\n"
        "print('accel.memory' in sys.modules)\n"
        "b = accel.memory.allocate(4096)\n"
        "print(accel.memory_allocated() >= 4096, accel.memory_reserved() > 0)\n"
        "b.free(); accel.empty_cache(); accel.empty_host_cache()\n"
        "print(accel.memory_reserved(), accel.max_memory_allocated() >= 4096)\n"
        "accel.reset_peak_memory_stats(); accel.reset_accumulated_memory_stats()\n"
        "print(accel.max_memory_allocated(), accel.memory_stats()['num_device_alloc'])"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "True", "True", "0", "True", "0", "0"]


def test_graph_names_are_on_the_facade_without_importing_torch() -> None:
    result = run_python(
        "import sys, accel\n"
        "g = accel.Graph()\n"
        "with accel.graph(g):\n"
        "    assert accel.is_capturing()\n"
        "    accel.current_stream().launch_host_func(lambda: None)\n"
        "g.replay(); accel.synchronize()\n"
        "print(accel.is_capturing(), accel.graph_pool_handle()[0], 'torch' in sys.modules,"
        " callable(accel.make_graphed_callables), sorted(set(accel.__all__) - set(dir(accel))))"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "0", "False", "True", "[]"]


def test_dir_offers_the_public_names_only() -> None:
    names = dir(accel)
    public = [name for name in names if not (name.startswith("__") and name.endswith("__"))]
    assert set(accel.__all__) <= set(public)
    # The facade's own imports and helpers stay out of tab completion and help().
    assert not [name for name in public if name.startswith("_")]
    assert not {"TYPE_CHECKING", "annotations", "importlib", "Any"} & set(names)
    assert "__version__" in names
    for name in public:  # every name offered resolves (the torch-facing ones load torch)
        getattr(accel, name)


def test_star_import_needs_no_torch() -> None:
    result = run_python(
        "import sys\nsys.modules['torch'] = None  # as if torch were not installed\n"
        "from accel import *\nprint(is_available(), Graph is not None)"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True"]


def test_torch_takes_accel_devices() -> None:
    torch = pytest.importorskip("torch")
    device = accel.current_accelerator()
    assert torch.ones(2).to(device).device.type == "cpu"
    assert torch.empty(2, device=device).device.type == "cpu"
    assert torch.device(accel.Device("cpu", 0)) == torch.device("cpu", 0)
    assert torch.zeros(1, device=accel.Device("cpu", 0)).device == torch.device("cpu")
    assert accel.Device("cuda", 1) == "cuda:1" and accel.Device.parse(str(device)) == device


def test_device_is_immutable_and_checks_its_parts() -> None:
    import pickle

    device = accel.Device("cuda", 1)
    assert (device.type, device.index, repr(device)) == ("cuda", 1, "Device(type='cuda', index=1)")
    assert repr(pickle.loads(pickle.dumps(device))) == repr(device)
    with pytest.raises(AttributeError, match="immutable"):
        device.index = 2  # type: ignore[misc]
    for bad in (("cuda", -1), ("cuda", True), ("cu:da", None), (3, None)):
        with pytest.raises(accel.DeviceError):
            accel.Device(*bad)  # type: ignore[arg-type]


def test_supported_dtypes_are_a_set_with_unsigned_ints() -> None:
    dtypes = accel.get_device_capability()["supported_dtypes"]
    assert type(dtypes) is set
    assert {"uint16", "uint32", "uint64"} <= dtypes


def test_deprecated_idx_aliases_warn_as_torch() -> None:
    with pytest.warns(DeprecationWarning, match="current_device_index"):
        assert accel.current_device_idx() == accel.current_device_index()
    with pytest.warns(DeprecationWarning, match="set_device_index"):
        accel.set_device_idx(0)


@pytest.mark.parametrize("name", ["accel._facade", "accel._device", "accel.stream._event", "accel.allocator._buffer"])
def test_docstring_examples_run(name: str) -> None:
    pytest.importorskip("torch")  # some examples show torch objects
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
