from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
from hypothesis import example, given, settings, strategies as st

import accel
from accel._device import MAX_DEVICE_INDEX, TORCH_DEVICE_TYPES, as_device


@given(st.sampled_from(["cpu", "cuda", "xpu"]), st.one_of(st.none(), st.integers(0, MAX_DEVICE_INDEX)))
def test_device_strings_round_trip(kind: str, index: int | None) -> None:
    device = accel.Device(kind, index)
    assert accel.Device.parse(str(device)) == device == accel.Device(str(device))


@pytest.mark.parametrize(
    "text",
    ["", "cuda:", ":0", "cuda:-1", "cuda 0", "CUDA:0x1", " cpu", "cpu ", "cpu\n", "cpu: 0", "cpu:01", "cpu:+1", "cpu:\u0663"],
)
def test_malformed_device_strings(text: str) -> None:
    with pytest.raises(accel.DeviceError, match="is not a device string"):
        accel.Device.parse(text)


@pytest.mark.parametrize(
    "args, message",
    [
        (("CPU", 0), "'CPU' is not a device type torch knows; write 'cpu'"),
        (("gpu",), "'gpu' is not a device type torch knows: device types are lowercase"),
        (("cpu", 10**30), "device index 1000000000000000000000000000000 is out of range: device indexes are 0..127"),
        (("cpu", 128), "device index 128 is out of range"),
        (("cpu", -1), "device index -1 is out of range"),
        (("cpu:128",), "device index 128 is out of range"),
        (("cpu:" + "9" * 5000,), r"device index 99999999\.\.\.\(5000 digits\) is out of range"),
        (("cpu", True), r"device index True \(bool\) must be None or an int in 0..127"),
        (("cpu", 1.0), r"device index 1.0 \(float\) must be None or an int"),
        (("cpu", "0"), r"device index '0' \(str\) must be None or an int"),
        (("cpu:0", 1), "device 'cpu:0' already names index 0; pass either 'cpu:0' or \\('cpu', 1\\), not both"),
        ((b"cpu",), r"device type b'cpu' \(bytes\) must be a str"),
        ((0,), r"device type 0 \(int\) must be a str"),
    ],
)
def test_bad_devices_are_refused_with_the_valid_range_or_form(args: tuple[object, ...], message: str) -> None:
    with pytest.raises(accel.DeviceError, match=message):
        accel.Device(*args)  # type: ignore[arg-type]


_INDEXES = st.one_of(
    st.none(),
    st.integers(-3, MAX_DEVICE_INDEX + 3),
    st.integers(-(2**70), 2**70),
    st.booleans(),
    st.floats(allow_nan=False),
)
_TYPES = st.one_of(
    st.sampled_from(TORCH_DEVICE_TYPES + ("CPU", "Cuda", "gpu", "cpu_", "_cpu", "cpu1", "")),
    st.builds(
        "{}{}{}".format,
        st.sampled_from(["cpu", "cuda", "xpu", "meta", "CPU", " cpu", "cpu "]),
        st.sampled_from(["", ":", ": "]),
        st.one_of(st.integers(-2, 300).map(str), st.sampled_from(["", "00", "01", "+1", "x", "1_0", "\u0663", "0\n"])),
    ),
    st.text(alphabet="cpuxdaCP:0123456789 -_\n", max_size=8),
)


@settings(max_examples=400, deadline=None)  # the first example imports torch
@given(_TYPES, _INDEXES)
@example("CPU", 0)
@example("cpu", 10**30)
@example("cpu:-1", None)
@example("cuda:x", None)
@example(" cpu", None)
@example("cpu:128", None)
@example("cpu", 2**32)  # torch wraps it to index 0
def test_devices_are_accepted_as_torch_device_accepts_them_and_equal_its_result(
    kind: str, index: int | None
) -> None:
    """accel.Device(type, index) is accepted exactly when torch.device takes it
    *and keeps the index asked for* (torch wraps an index past its 8-bit range
    silently: accel refuses it), and then equals torch's device both ways."""
    torch = pytest.importorskip("torch")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns of "mkldnn"
            # torch refuses ("cuda:0", None) although None is the default; accel
            # cannot tell an explicit None from none, and reads it as no index.
            theirs = torch.device(kind) if index is None else torch.device(kind, index)
    except (RuntimeError, TypeError, ValueError):
        theirs = None
    asked = index if index is None or ":" not in kind else None
    if theirs is not None and ":" in kind:
        asked = int(kind.split(":")[1])
    faithful = theirs is not None and theirs.index == asked
    try:
        ours = accel.Device(kind, index)
    except accel.DeviceError:
        assert not faithful, f"accel refused {kind!r}, {index!r}; torch made {theirs!r}"
        return
    assert faithful, f"accel accepted {kind!r}, {index!r} as {ours!r}; torch: {theirs!r}"
    assert ours == theirs and theirs == ours and not ours != theirs
    assert torch.device(ours) == theirs and str(ours) == str(theirs)


def test_as_device_forms() -> None:
    assert as_device(None) is None
    assert as_device(3) == 3
    assert as_device("cuda:2") == accel.Device("cuda", 2)
    with pytest.raises(accel.DeviceError, match="is not a device string"):
        as_device(" cuda : 2 ")  # torch.device refuses it too

    class TorchLike:
        type, index = "xpu", None

    assert as_device(TorchLike()) == accel.Device("xpu")
    with pytest.raises(accel.DeviceError):
        as_device(object())


def test_as_device_takes_numpy_integers_as_device_does() -> None:
    """Device("cpu", np.int64(1)) worked, as torch.device(np.int64(1)) does, but a
    numpy index was refused as a device argument (device=np.int64(0)) and in a
    torch.device look-alike; a look-alike without an index was read as index -1."""
    np = pytest.importorskip("numpy")
    assert as_device(np.int64(3)) == 3 and type(as_device(np.int64(3))) is int

    class NumpyIndexed:
        type, index = "xpu", np.int32(2)

    class Unindexed:
        type = "xpu"

    assert as_device(NumpyIndexed()) == accel.Device("xpu", 2)
    with pytest.raises(accel.DeviceError, match="is not a device; pass an index"):
        as_device(Unindexed())
    assert accel.Stream(device=np.int64(0)).device == accel.Device("cpu", 0)


def test_a_device_equals_the_torch_device_of_the_same_type_and_index_both_ways() -> None:
    torch = pytest.importorskip("torch")
    for kind, index in (("cpu", 0), ("cpu", None), ("cuda", 1), ("xpu", 0)):
        ours, theirs = accel.Device(kind, index), torch.device(kind, index)
        assert ours == theirs and theirs == ours
        assert not (ours != theirs) and not (theirs != ours)
    # torch's own rules: no index is not index 0, and the type must match.
    assert accel.Device("cpu") != torch.device("cpu:0") and torch.device("cpu:0") != accel.Device("cpu")
    assert accel.Device("cpu", 0) != torch.device("cpu") and accel.Device("cuda", 0) != torch.device("xpu:0")
    # Still its string, and hashed as one (a set of strings finds it).
    assert accel.Device("cpu", 0) == "cpu:0" and accel.Device("cpu", 0) in {"cpu:0"}
    assert accel.Device("cpu", 0) != "cpu" and accel.Device("cpu", 0) != 0


def test_comparing_devices_imports_no_torch() -> None:
    code = (
        "import sys, accel\n"
        "d = accel.Device('cpu', 0)\n"
        "print(d == object(), d != object(), d == 'cpu:0', 'torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "True", "True", "False"]
