"""``accel memory plot``: images of the expected size, figures that match the snapshot, one-line errors."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import pickle
import re
import runpy
import struct
import subprocess
import sys
import warnings

import pytest

from accel._cli import main
from accel._cli import memory as memory_cli
from tests._cli.snapshots import MiB, sample_snapshot, write


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


@pytest.fixture
def snapshot(tmp_path):
    return write(tmp_path / "snap.pickle", sample_snapshot())


def test_png_of_the_requested_size(snapshot, tmp_path, capsys):
    out = tmp_path / "out.png"
    assert main(["memory", "plot", str(snapshot), "-o", str(out), "--size", "900x600"]) == 0
    data = out.read_bytes()
    assert len(data) > 10_000  # two drawn panels, not an empty canvas
    assert _png_size(data) == (900, 600)
    assert "wrote" in capsys.readouterr().out


def test_default_size(snapshot, tmp_path):
    out = tmp_path / "out.png"
    assert main(["memory", "plot", str(snapshot), "-o", str(out)]) == 0
    assert _png_size(out.read_bytes()) == (1280, 800)


def test_html_embeds_the_image_and_a_table(snapshot, tmp_path):
    out = tmp_path / "out.html"
    assert main(["memory", "plot", str(snapshot), "-o", str(out), "--size", "800x500"]) == 0
    page = out.read_text()
    match = re.search(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", page)
    assert match, "no embedded PNG"
    assert _png_size(base64.b64decode(match.group(1))) == (800, 500)
    assert "<td>pool (1,0) small</td>" in page and "<td>large</td>" in page


def test_figures_end_at_the_snapshot_state(snapshot, tmp_path, capsys):
    assert main(["memory", "plot", str(snapshot), "-o", str(tmp_path / "o.png"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    pools = report["pools"]
    assert pools["small"] == {"allocated": 1536, "reserved": 2 * MiB, "peak_allocated": 1536, "peak_reserved": 2 * MiB}
    # large: 4 MiB live (the pending 2 MiB is no longer allocated), 20 MiB reserved; peak with the freed segment.
    assert pools["large"] == {"allocated": 4 * MiB, "reserved": 20 * MiB, "peak_allocated": 12 * MiB, "peak_reserved": 40 * MiB}
    assert pools["pool (1,0) small"]["allocated"] == 2 * MiB
    assert (report["segments"], report["trace_entries"], report["device"]) == (3, 15, 0)


def test_timeline_is_anchored_when_history_started_late(tmp_path, capsys):
    data = sample_snapshot()
    data["device_traces"] = [data["device_traces"][0][-2:]]  # only the graph pool's entries survived
    path = write(tmp_path / "late.pickle", data)
    assert main(["memory", "plot", str(path), "-o", str(tmp_path / "o.png"), "--json"]) == 0
    pools = json.loads(capsys.readouterr().out)["pools"]
    assert pools["large"]["allocated"] == pools["large"]["peak_allocated"] == 4 * MiB
    assert pools["pool (1,0) small"]["peak_reserved"] == 2 * MiB


def test_snapshot_without_trace_and_segments_only_form(tmp_path, capsys):
    path = write(tmp_path / "segs.pickle", sample_snapshot()["segments"])
    out = tmp_path / "o.png"
    assert main(["memory", "plot", str(path), "-o", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["trace_entries"] == 0
    assert _png_size(out.read_bytes()) == (1280, 800)


def test_empty_snapshot(tmp_path):
    path = write(tmp_path / "empty.pickle", {"segments": [], "device_traces": []})
    out = tmp_path / "o.png"
    assert main(["memory", "plot", str(path), "-o", str(out)]) == 0
    assert _png_size(out.read_bytes()) == (1280, 800)


class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"not a pickle", "is not a memory snapshot pickle"),
        (pickle.dumps({"a": 1}), "is a pickle but not a memory snapshot"),
        (pickle.dumps(_Evil()), "refusing to load builtins.print"),
        (pickle.dumps({"segments": [{"device": 0}]}), "the snapshot is malformed"),
    ],
)
def test_bad_snapshots_are_one_line_errors(tmp_path, capsys, content, message):
    path = tmp_path / "bad.pickle"
    path.write_bytes(content)
    assert main(["memory", "plot", str(path), "-o", str(tmp_path / "o.png")]) == 1
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (["memory"], 2, "the following arguments are required: ACTION"),
        (["memory", "plot", "snap.pickle"], 2, "the following arguments are required: -o/--output"),
        (["memory", "plot", "{snap}", "-o", "x.jpg"], 1, "must end in .png or .html"),
        (["memory", "plot", "missing.pickle", "-o", "x.png"], 1, "does not exist"),
        (["memory", "plot", "{snap}", "-o", "x.png", "--size", "big"], 2, "is not WIDTHxHEIGHT"),
        (["memory", "plot", "{snap}", "-o", "x.png", "--size", "50x50"], 2, "must be 200..10000 pixels"),
        (["memory", "plot", "{snap}", "-o", "x.png", "--device", "3"], 1, "device 3 has no data in this snapshot"),
        (["memory", "draw"], 2, "invalid choice: 'draw'"),
    ],
)
def test_bad_arguments(snapshot, tmp_path, monkeypatch, capsys, argv, code, message):
    monkeypatch.chdir(tmp_path)
    argv = [a.replace("{snap}", str(snapshot)) for a in argv]
    try:
        result = main(argv)
    except SystemExit as exc:  # argparse errors exit from inside main
        result = exc.code
    assert result == code
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_missing_matplotlib_is_one_line(snapshot, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    assert main(["memory", "plot", str(snapshot), "-o", str(tmp_path / "o.png")]) == 1
    err = capsys.readouterr().err
    assert "needs matplotlib" in err and "pip install accel[plot]" in err and err.count("\n") == 1


def test_hand_built_snapshots_have_torchs_layout(snapshot):
    """The fixtures above are read by PyTorch's tool like real snapshots."""
    assert "total_reserved: 24.0MiB" in _viewer("stats", snapshot)
    assert memory_cli.load_snapshot(snapshot)["segments"][0]["total_size"] == 2 * MiB


@pytest.fixture
def accel_snapshot(tmp_path):
    """A snapshot written by accel itself, and accel's stats at that moment."""
    import accel
    from accel import memory

    memory.record_memory_history()
    try:
        buffers = [memory.allocate(n) for n in (1000, 4096, 3 * MiB, 12 * MiB, 600)]
        buffers[1].free()
        buffers[3].free()
        side = accel.Stream()
        pending = memory.allocate(2048, stream=side)
        pending.record_stream(accel.current_stream())
        path = tmp_path / "accel.pickle"
        memory.dump_snapshot(path)
        stats = dict(memory.memory_stats())
    finally:
        memory.record_memory_history(None)
    yield path, stats
    for buf in (*buffers, pending):
        buf.free()


def _viewer(action: str, path) -> str:
    """PyTorch's viewer command line (``python -m torch.cuda._memory_viz ACTION FILE``), run in this
    process to spare a torch import per call; one test runs it as a real process."""
    out = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(out):
        warnings.simplefilter("ignore")  # runpy: the module is already imported
        old_argv, sys.argv = sys.argv, ["_memory_viz", action, str(path)]
        try:
            runpy.run_module("torch.cuda._memory_viz", run_name="__main__")
        finally:
            sys.argv = old_argv
    return out.getvalue()


def test_torch_viewer_reads_an_accel_snapshot_with_the_same_totals(accel_snapshot):
    from torch.cuda._memory_viz import _format_size, segsum

    path, stats = accel_snapshot
    data = pickle.loads(path.read_bytes())
    # Exact figures first: the segments add up to accel's counters...
    assert sum(s["total_size"] for s in data["segments"]) == stats["reserved_bytes.all.current"]
    assert sum(s["allocated_size"] for s in data["segments"]) == stats["allocated_bytes.all.current"]
    active = sum(b["requested_size"] for s in data["segments"] for b in s["blocks"] if b["state"] == "active_allocated")
    assert active == stats["requested_bytes.all.current"]
    segsum(data)  # raises on any accounting mismatch inside segments
    # ...then what PyTorch's tool prints from the file, run as a user runs it.
    result = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "stats", str(path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"total_reserved: {_format_size(stats['reserved_bytes.all.current'])}\n" in out
    assert f"total_allocated: {_format_size(stats['requested_bytes.all.current'])}\n" in out
    assert f"segments: {len(data['segments'])}\n" in out


def test_torch_viewer_trace_of_an_accel_snapshot(accel_snapshot):
    path, _ = accel_snapshot
    trace = pickle.loads(path.read_bytes())["device_traces"][0]
    out = _viewer("trace", path)
    assert f"{len(trace)} entries" in out
    mallocs = [e for e in trace if e["action"] == "segment_alloc"]
    assert out.count("= cudaMalloc(") == len(mallocs) >= 1
    assert out.count("del ") == sum(e["action"] == "free_requested" for e in trace) == 2
    assert ":1000.0B]" not in out and ":1.0KiB]" in out  # sizes are the rounded block sizes


def test_accel_plot_agrees_with_accel_stats(accel_snapshot, tmp_path, capsys):
    path, stats = accel_snapshot
    assert main(["memory", "plot", str(path), "-o", str(tmp_path / "a.png"), "--json"]) == 0
    pools = json.loads(capsys.readouterr().out)["pools"]
    assert sum(p["reserved"] for p in pools.values()) == stats["reserved_bytes.all.current"]
    assert sum(p["allocated"] for p in pools.values()) == stats["allocated_bytes.all.current"]
    assert _png_size((tmp_path / "a.png").read_bytes()) == (1280, 800)
