"""Hostile snapshot files and arguments for ``accel memory plot``: one-line errors, never a traceback.

The crafted files are the ones that raised MemoryError, AttributeError,
IndexError, KeyError, OverflowError and RecursionError out of the command
before the snapshot layout was checked on load; the fuzz tests then throw
random pickles and random arguments at it and accept only accel's errors.
"""

from __future__ import annotations

import pickle
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from accel._cli import main
from accel._cli import memory as memory_cli
from accel._errors import AccelError

MiB = 1 << 20


def _segment(**fields: object) -> dict[str, object]:
    segment = {"device": 0, "address": 0x1000, "total_size": 2 * MiB, "allocated_size": 0,
               "segment_type": "large", "blocks": []}
    segment.update(fields)
    return segment


def _deeply_nested_addresses(depth: int) -> bytes:
    """Two segments whose addresses are lists nested ``depth`` deep (sorting them recursed)."""
    placeholder = 0x5EED5EED
    data = pickle.dumps({"segments": [_segment(address=placeholder), _segment(address=placeholder)]}, protocol=2)
    nested = b"]" * depth + b"a" * (depth - 1)  # EMPTY_LIST depth times, APPEND each into the one below
    return data.replace(b"J" + struct.pack("<i", placeholder), nested)


CRAFTED = {
    "MemoryError": (b"\x80\x04\x8e" + struct.pack("<Q", 1 << 60) + b"x.", []),  # BINBYTES8 of 1 EiB
    "AttributeError": (b"\x80\x04]}b.", []),  # BUILD on a list
    "IndexError": (pickle.dumps({"segments": [], "device_traces": [[]]}), ["--device", "-5"]),
    "KeyError": (pickle.dumps({"segments": [_segment(blocks=[{}])]}), []),  # a block without a size
    "OverflowError": (pickle.dumps({"segments": [_segment(total_size=10**400)]}), []),
    "RecursionError": (_deeply_nested_addresses(5000), []),
}


def _plot(tmp_path, content: bytes, extra: list[str]) -> int:
    path = tmp_path / "crafted.pickle"
    path.write_bytes(content)
    try:
        code = main(["memory", "plot", str(path), "-o", str(tmp_path / "out.png"), *extra])
    except SystemExit as exc:  # argparse's errors exit from inside main
        code = exc.code
    return code


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_crafted_snapshots_are_one_line_errors(name, tmp_path, capsys):
    content, extra = CRAFTED[name]
    code = _plot(tmp_path, content, extra)
    err = capsys.readouterr().err
    assert code in (1, 2), err
    assert err.count("\n") == 1 and err.startswith("accel memory") and "Traceback" not in err, err


def test_an_int_bigger_than_a_float_is_named_in_the_error(tmp_path, capsys):
    code = _plot(tmp_path, CRAFTED["OverflowError"][0], [])
    assert code == 1
    assert "segments[0]['total_size'] is a int, not an integer in 0..18446744073709551615" in capsys.readouterr().err


# Plain data as a snapshot may hold it: what the restricted unpickler can produce.
_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=8),
    st.binary(max_size=8), st.sampled_from(["alloc", "free_requested", "segment_alloc", "segment_free", "oom",
                                            "active_allocated", "inactive", "small", "large"]),
)
_keys = st.sampled_from(["device", "address", "total_size", "allocated_size", "segment_type", "segment_pool_id",
                         "blocks", "size", "state", "action", "time_us", "addr", "pool_id", "segments",
                         "device_traces"])
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.tuples(inner, inner), st.dictionaries(_keys, inner, max_size=6)
    ),
    max_leaves=30,
)
_snapshots = st.fixed_dictionaries(
    {"segments": st.lists(st.dictionaries(_keys, _values, max_size=8), max_size=3)},
    optional={"device_traces": st.lists(st.lists(st.dictionaries(_keys, _values, max_size=6), max_size=4), max_size=3)},
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snapshot=_snapshots, device=st.one_of(st.none(), st.integers(0, 3)))
def test_any_plain_data_snapshot_is_drawn_or_refused_with_an_accel_error(tmp_path_factory, snapshot, device):
    path = tmp_path_factory.mktemp("fuzz") / "snap.pickle"
    path.write_bytes(pickle.dumps(snapshot))
    try:
        model = memory_cli.build_model(memory_cli.load_snapshot(path), device)
    except AccelError:
        return
    memory_cli._draw_timeline(_Axes(), model)  # every value drawing reads must be usable
    memory_cli._draw_segments(_Axes(), model)


class _Axes:
    """Records nothing: stands in for matplotlib's axes, so the fuzz loop stays fast
    while running every line of the drawing code on the fuzzed model."""

    def __getattr__(self, name: str):
        def call(*args: object, **kwargs: object) -> None:
            for value in (*args, *kwargs.values()):
                if isinstance(value, list):
                    for item in value:
                        if isinstance(item, tuple):
                            [float(x) for x in item if isinstance(x, (int, float))]
        return call


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_are_a_snapshot_or_an_accel_error(tmp_path_factory, content):
    path = tmp_path_factory.mktemp("bytes") / "snap.pickle"
    path.write_bytes(b"\x80\x04" + content)
    try:
        memory_cli.build_model(memory_cli.load_snapshot(path), None)
    except AccelError:
        pass
