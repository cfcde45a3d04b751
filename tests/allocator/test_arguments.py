"""Wrong arguments to the allocators' public methods (DeviceAllocator, HostCachingAllocator)
are accel errors that name the argument, and leave the allocator as it was, whether the
compiled common case (accel/_speedups.c) or the Python code it hands back to sees them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import accel
from accel.allocator import DeviceAllocator, get_allocator
from accel.allocator._host_cache import HostCachingAllocator
from accel.allocator._registry import registry
from accel.allocator._pool_ids import check_pool_id
from accel.allocator.config import AllocatorConfig
from tests.allocator.test_caching import check_invariants

torch = pytest.importorskip("torch")


class _Things:
    """Live objects of the wrong kind for an argument (a stream where a block goes...),
    made once: hypothesis draws them by name."""

    def __init__(self) -> None:
        self.allocator = get_allocator(0)
        self.host = registry().host_allocator()
        self.stream = accel.current_stream(0)
        self.block = self.allocator.malloc(1000, self.stream)
        self.host_block = self.host.malloc(1000)
        closed = accel.Stream(0)
        closed.close()
        freed = self.allocator.malloc(1000, self.stream)
        self.allocator.free(freed)
        host_freed = self.host.malloc(1000)
        self.host.free(host_freed)
        self.other = DeviceAllocator(self.allocator.backend, 0, AllocatorConfig())
        self.other_block = self.other.malloc(1000, self.stream)
        self.buffer = accel.memory.allocate(1000)
        self.named: dict[str, object] = {
            "a stream": self.stream,
            "a closed stream": closed,
            "a stream of device 1": accel.Stream(1),
            "a torch stream": torch.Stream("cpu"),
            "a block": self.block,
            "a freed block": freed,
            "a block of another allocator": self.other_block,
            "a host block": self.host_block,
            "a freed host block": host_freed,
            "a buffer": self.buffer,
            "an event": accel.Event(),
            "an AllocatorConfig": AllocatorConfig(),
        }

    def free(self) -> None:
        self.allocator.free(self.block)
        self.host.free(self.host_block)
        self.other.free(self.other_block)
        self.buffer.free()


_things: _Things | None = None


def things() -> _Things:
    assert _things is not None, "made by the module's fixture"
    return _things


@pytest.fixture(scope="module", autouse=True)
def _made() -> Iterator[None]:
    global _things
    _things = _Things()
    yield
    _things.free()  # the other tests count what is allocated
    _things = None


# What a caller may pass by mistake: plain values, and live accel objects of the wrong kind.
_PLAIN = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.binary(max_size=4),
    st.lists(st.integers(min_value=-3, max_value=3), max_size=3),
    st.tuples(st.integers(min_value=-3, max_value=3), st.integers(min_value=-3, max_value=3)),
    st.builds(object),
)
_NAMED = st.sampled_from(
    ["a stream", "a closed stream", "a stream of device 1", "a torch stream", "a block", "a freed block",
     "a block of another allocator", "a host block", "a freed host block", "a buffer", "an event",
     "an AllocatorConfig"]
)
ARGUMENT = st.one_of(_PLAIN, _NAMED.map(lambda name: ("named", name)))


def _value(drawn: object) -> object:
    if isinstance(drawn, tuple) and len(drawn) == 2 and drawn[0] == "named":
        return things().named[drawn[1]]
    return drawn


def _pool_id(value: object) -> bool:
    try:
        check_pool_id(value, where="test")
    except accel.AccelError:
        return False
    return True


def _size(value: object) -> bool:
    return type(value) is int and value > 0


def _device(value: object) -> bool:
    return type(value) is int and 0 <= value < 2


def _block(value: object) -> bool:
    return value is things().block


def _host_block(value: object) -> bool:
    return value is things().host_block


# name -> (call, whether the bad value happens to be a valid one there: those are not drawn)
Call = Callable[[_Things, Any], object]
DEVICE_CALLS: dict[str, tuple[Call, Callable[[object], bool]]] = {
    "malloc(bad, stream)": (lambda t, x: t.allocator.malloc(x, t.stream), _size),
    "malloc(1000, bad)": (lambda t, x: t.allocator.malloc(1000, x), lambda x: x is things().stream),
    "free(bad)": (lambda t, x: t.allocator.free(x), _block),
    "free_from_finalizer(bad)": (lambda t, x: t.allocator.free_from_finalizer(x), _block),
    "record_stream(bad, stream)": (lambda t, x: t.allocator.record_stream(x, t.stream), _block),
    "record_stream(block, bad)": (lambda t, x: t.allocator.record_stream(t.block, x), lambda x: False),
    "begin_allocate_to_pool(bad, filter)": (lambda t, x: t.allocator.begin_allocate_to_pool(x, bool), _pool_id),
    "begin_allocate_to_pool(pool, bad)": (lambda t, x: t.allocator.begin_allocate_to_pool((0, 99), x), callable),
    "end_allocate_to_pool(bad)": (lambda t, x: t.allocator.end_allocate_to_pool(x), lambda x: False),
    "release_pool(bad)": (lambda t, x: t.allocator.release_pool(x), lambda x: False),
    "release_pool_from_finalizer(bad)": (lambda t, x: t.allocator.release_pool_from_finalizer(x), _pool_id),
    "update_config(bad)": (lambda t, x: t.allocator.update_config(x), lambda x: isinstance(x, AllocatorConfig)),
    "record_history(bad)": (lambda t, x: t.allocator.record_history(x), lambda x: x is None),
}
HOST_CALLS: dict[str, tuple[Call, Callable[[object], bool]]] = {
    "malloc(bad)": (lambda t, x: t.host.malloc(x), _size),
    "free(bad)": (lambda t, x: t.host.free(x), _host_block),
    "free_from_finalizer(bad)": (lambda t, x: t.host.free_from_finalizer(x), _host_block),
    "record_stream(bad, stream)": (lambda t, x: t.host.record_stream(x, t.stream), _host_block),
    "record_stream(block, bad)": (lambda t, x: t.host.record_stream(t.host_block, x), lambda x: False),
    "begin_capture(bad, pool)": (lambda t, x: t.host.begin_capture(x, (0, 99)), _device),
    "begin_capture(0, bad)": (lambda t, x: t.host.begin_capture(0, x), _pool_id),
    "end_capture(bad)": (lambda t, x: t.host.end_capture(x), _device),
    "release_pool(bad)": (lambda t, x: t.host.release_pool(x), lambda x: False),
    "update_config(bad)": (lambda t, x: t.host.update_config(x), lambda x: isinstance(x, AllocatorConfig)),
}


def _call_refused_or_harmless(call: Call, valid: Callable[[object], bool], drawn: object, lock: Any) -> None:
    t = things()
    value = _value(drawn)
    assume(not valid(value))
    # With the lock taken (a collection inside the allocator), a finalizer's free is
    # deferred: what it queues must be a block, not junk found by the next call.
    if lock is not None:
        lock.acquire()
    try:
        call(t, value)
    except accel.AccelError:
        pass  # the point: never AttributeError, TypeError, KeyError... naming internals
    finally:
        if lock is not None:
            lock.release()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(DEVICE_CALLS)), drawn=ARGUMENT, locked=st.booleans())
def test_bad_arguments_to_the_device_allocator_are_accel_errors(name: str, drawn: object, locked: bool) -> None:
    t = things()
    call, valid = DEVICE_CALLS[name]
    before = t.allocator.stats()
    locked = locked and name.startswith("free_from_finalizer")  # the only call that does not wait for it
    _call_refused_or_harmless(call, valid, drawn, t.allocator._lock if locked else None)
    t.allocator.free(t.allocator.malloc(1000, t.stream))  # still works, and takes what was deferred
    check_invariants(t.allocator)
    after = t.allocator.stats()
    for key in ("allocated_bytes.all.current", "reserved_bytes.all.current", "allocation.all.current"):
        assert after[key] == before[key], (key, name)
    assert not t.allocator._captures and not t.allocator._gc_frees


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(HOST_CALLS)), drawn=ARGUMENT, locked=st.booleans())
def test_bad_arguments_to_the_staging_cache_are_accel_errors(name: str, drawn: object, locked: bool) -> None:
    t = things()
    call, valid = HOST_CALLS[name]
    before = t.host.stats()
    locked = locked and name.startswith("free_from_finalizer")  # the only call that does not wait for it
    _call_refused_or_harmless(call, valid, drawn, t.host._lock if locked else None)
    t.host.free(t.host.malloc(1000))  # still works, and takes what was deferred
    assert t.host.stats()["allocated_bytes"] == before["allocated_bytes"], name
    assert not t.host._capturing and not t.host._gc_frees


@pytest.mark.parametrize(
    "call",
    [
        lambda a, s, b: a.malloc(100, None),
        lambda a, s, b: a.free(5),
        lambda a, s, b: a.record_stream(None, s),
        lambda a, s, b: a.record_stream(b, None),
    ],
    ids=["malloc(100, None)", "free(5)", "record_stream(None, s)", "record_stream(block, None)"],
)
def test_the_reported_calls_say_what_was_wrong_and_what_to_pass(call: Callable[..., object]) -> None:
    # Each raised AttributeError naming internals ('NoneType' object has no attribute '_device').
    allocator, stream = accel.memory.get_allocator(), accel.current_stream()
    block = allocator.malloc(100, stream)
    try:
        with pytest.raises(accel.InvalidValueError, match=r"(stream|block)=\S+ \(\w+\) is not an? (accel\.Stream|Block); .*(stream|Block) .*"):
            call(allocator, stream, block)
    finally:
        allocator.free(block)
