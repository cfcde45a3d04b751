"""``accel memory plot``: draw a memory snapshot (PyTorch's snapshot layout).

Reads the pickle written by ``accel.memory.dump_snapshot(path)`` (or by
``torch.cuda.memory._dump_snapshot``) and draws, for one device:

- the **timeline** of allocated and reserved bytes per pool (small, large,
  and each private pool) from the recorded trace, anchored so that its end
  matches the snapshot's segments exactly;
- the **segment map**: each segment as a bar, its blocks coloured by state.

``-o out.png`` writes a PNG; ``-o out.html`` a self-contained page with the
same image and a table of the figures. matplotlib is needed
(``pip install accel[plot]``).

Snapshots are pickles, but only plain data is accepted when loading them (a
restricted unpickler), so a hostile file cannot run code.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import pickle
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accel._cli import print_json
from accel._errors import InvalidValueError, NotSupportedError

NAME = "memory"
HELP = "look at memory snapshots (plot the allocated/reserved timeline and the segment map)"

_SMALL_SEGMENT = 2 << 20  # the small pool's segment size (kSmallBuffer)
_SMALL_REQUEST = 1 << 20  # requests up to this size use the small pool
_MAX_SEGMENT_ROWS = 40
_STATE_COLOURS = {
    "active_allocated": "#1f77b4",
    "active_pending_free": "#ff7f0e",
    "inactive": "#d9d9d9",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    plot = actions.add_parser(
        "plot",
        help="draw a snapshot's timeline and segment map to a PNG or HTML file",
        description="Draw the allocated and reserved timeline per pool and the segment map of a "
        "memory snapshot (accel.memory.dump_snapshot or torch.cuda.memory._dump_snapshot).",
    )
    plot.add_argument("snapshot", help="the snapshot pickle file")
    plot.add_argument("-o", "--output", required=True, help="where to write: a .png or .html file")
    plot.add_argument("--device", type=_device_index, default=None, help="device index (default: the first with data)")
    plot.add_argument("--size", type=_size, default=(1280, 800), metavar="WxH", help="image size in pixels (default 1280x800)")
    plot.add_argument("--json", action="store_true", help="print what was drawn as JSON")


def _device_index(text: str) -> int:
    try:
        index = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device index") from None
    if not 0 <= index < _MAX_DEVICE:
        raise argparse.ArgumentTypeError(f"{text!r}: a device index is 0 or more")
    return index


def _size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not WIDTHxHEIGHT, e.g. 1280x800") from None
    if not (200 <= width <= 10000 and 200 <= height <= 10000):
        raise argparse.ArgumentTypeError(f"{text!r}: width and height must be 200..10000 pixels")
    return width, height


def run(args: argparse.Namespace) -> int:
    output = Path(args.output)
    kind = output.suffix.lower()
    if kind not in (".png", ".html"):
        raise InvalidValueError(f"output {args.output!r} must end in .png or .html")
    snapshot = load_snapshot(Path(args.snapshot))
    model = build_model(snapshot, args.device)
    width, height = args.size
    png = render_png(model, width, height)
    if kind == ".png":
        output.write_bytes(png)
    else:
        output.write_text(_html(model, png, width, height), encoding="utf-8")
    summary = {
        "output": str(output),
        "device": model.device,
        "width": width,
        "height": height,
        "segments": len(model.segments),
        "trace_entries": model.trace_entries,
        "pools": {
            pool: {
                "allocated": series.allocated[-1][1] if series.allocated else 0,
                "reserved": series.reserved[-1][1] if series.reserved else 0,
                "peak_allocated": max((v for _, v in series.allocated), default=0),
                "peak_reserved": max((v for _, v in series.reserved), default=0),
            }
            for pool, series in sorted(model.pools.items())
        },
    }
    if args.json:
        print_json(summary)
    else:
        print(f"wrote {output} ({width}x{height}): {len(model.segments)} segments, "
              f"{model.trace_entries} trace entries, pools: {', '.join(sorted(model.pools)) or 'none'}")
    return 0


# -- reading -----------------------------------------------------------------------


class _PlainUnpickler(pickle.Unpickler):
    """Loads dicts, lists, tuples, strings and numbers; refuses any class."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: a snapshot holds plain data only")


def load_snapshot(path: Path) -> dict[str, Any]:
    """Read a snapshot pickle and check its layout; an accel error says what is
    wrong with a bad one, whatever the file holds."""
    try:
        with path.open("rb") as handle:
            data = _PlainUnpickler(handle).load()
    except FileNotFoundError:
        raise InvalidValueError(f"snapshot {str(path)!r} does not exist; write one with accel.memory.dump_snapshot(path)") from None
    except IsADirectoryError:
        raise InvalidValueError(f"snapshot {str(path)!r} is a directory, not a snapshot file") from None
    except (OSError, KeyboardInterrupt):
        raise
    # Unpickling is parsing an untrusted file: any failure, a MemoryError from a
    # claimed multi-gigabyte string or a KeyError from a bad memo reference
    # included, means the file is not a snapshot.
    except Exception as exc:  # noqa: BLE001
        raise InvalidValueError(
            f"{str(path)!r} is not a memory snapshot pickle ({type(exc).__name__}: {_first_line(exc)})"
        ) from None
    if isinstance(data, list):  # the segments-only form (memory_snapshot())
        data = {"segments": data, "device_traces": []}
    if not isinstance(data, dict) or not isinstance(data.get("segments"), list):
        raise InvalidValueError(
            f"{str(path)!r} is a pickle but not a memory snapshot: expected a dict with 'segments' "
            "(as written by accel.memory.dump_snapshot)"
        )
    return _checked(data)


def _first_line(exc: BaseException) -> str:
    text = str(exc).splitlines()
    return text[0][:200] if text else ""


_MAX_VALUE = 1 << 64  # sizes and addresses are 64-bit
_MAX_DEVICE = 1 << 16


class _Malformed(Exception):
    """Where a snapshot departs from PyTorch's layout (becomes an InvalidValueError)."""


def _int(container: dict[Any, Any], key: str, where: str, *, default: int | None = None, limit: int = _MAX_VALUE) -> int:
    value = container.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < limit:
        # Only the type is shown: the repr of a hostile value can be huge or recurse forever.
        shown = "missing" if key not in container else f"a {type(value).__name__}"
        raise _Malformed(f"{where}[{key!r}] is {shown}, not an integer in 0..{limit - 1}")
    return value


def _list(value: object, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise _Malformed(f"{where} is a {type(value).__name__}, not a list")
    return value


def _dict(value: object, where: str) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise _Malformed(f"{where} is a {type(value).__name__}, not a dict")
    return value


def _pool_id(value: object) -> tuple[int, int] | None:
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(
        isinstance(v, int) and not isinstance(v, bool) and abs(v) < _MAX_VALUE for v in value
    ):
        return (value[0], value[1])
    return None


def _pool_fields(raw: dict[Any, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for key in ("segment_pool_id", "pool_id"):
        if key in raw:
            fields[key] = _pool_id(raw[key])
    if "segment_type" in raw:
        kind = raw["segment_type"]
        fields["segment_type"] = kind if isinstance(kind, str) else None
    return fields


def _checked(data: dict[Any, Any]) -> dict[str, Any]:
    """The fields the plot reads, each checked, in plain types: drawing cannot fail on them."""
    try:
        segments = []
        for i, raw in enumerate(data["segments"]):
            where = f"segments[{i}]"
            seg = _dict(raw, where)
            blocks = []
            for j, raw_block in enumerate(_list(seg.get("blocks", []), f"{where}['blocks']")):
                block = _dict(raw_block, f"{where}['blocks'][{j}]")
                state = block.get("state", "inactive")
                blocks.append({
                    "size": _int(block, "size", f"{where}['blocks'][{j}]"),
                    "state": state if isinstance(state, str) else "inactive",
                })
            segments.append({
                "device": _int(seg, "device", where, limit=_MAX_DEVICE),
                "address": _int(seg, "address", where),
                "total_size": _int(seg, "total_size", where),
                "allocated_size": _int(seg, "allocated_size", where, default=0),
                "blocks": blocks,
                **_pool_fields(seg),
            })
        traces = []
        raw_traces = data.get("device_traces") or []
        for d, raw_trace in enumerate(_list(raw_traces, "device_traces")[:_MAX_DEVICE]):
            entries = []
            for k, raw_entry in enumerate(_list(raw_trace or [], f"device_traces[{d}]")):
                where = f"device_traces[{d}][{k}]"
                entry = _dict(raw_entry, where)
                action, time_us = entry.get("action"), entry.get("time_us", 0)
                if isinstance(time_us, bool) or not isinstance(time_us, (int, float)) or not abs(time_us) < 2.0**63:
                    raise _Malformed(f"{where}['time_us'] is a {type(time_us).__name__}, not a time in microseconds")
                entries.append({
                    "action": action if isinstance(action, str) else None,
                    "time_us": float(time_us),
                    "size": _int(entry, "size", where, default=0),
                    "addr": _int(entry, "addr", where, default=0),
                    **_pool_fields(entry),
                })
            traces.append(entries)
    except _Malformed as exc:
        raise InvalidValueError(f"the snapshot is malformed: {exc}") from None
    return {"segments": segments, "device_traces": traces}


# -- the model ---------------------------------------------------------------------


@dataclass
class _Series:
    allocated: list[tuple[float, int]] = field(default_factory=list)
    reserved: list[tuple[float, int]] = field(default_factory=list)


@dataclass
class _Model:
    device: int
    segments: list[dict[str, Any]]
    pools: dict[str, _Series]
    ooms: list[float]
    trace_entries: int


def _pool_label(pool_id: object, segment_type: object) -> str:
    kind = segment_type if segment_type in ("small", "large") else "large"
    if isinstance(pool_id, (tuple, list)) and len(pool_id) == 2 and tuple(pool_id) != (0, 0):
        return f"pool ({pool_id[0]},{pool_id[1]}) {kind}"
    return str(kind)


def _segment_pool(seg: dict[str, Any]) -> str:
    return _pool_label(seg.get("segment_pool_id"), seg.get("segment_type"))


def build_model(snapshot: dict[str, Any], device: int | None) -> _Model:
    """The series to draw: per-pool allocated/reserved steps over time, from a
    snapshot as :func:`load_snapshot` returns it (checked)."""
    traces = snapshot.get("device_traces") or []
    segments_all = snapshot["segments"]
    devices = sorted({int(seg["device"]) for seg in segments_all} | {i for i, t in enumerate(traces) if t})
    if device is None:
        device = devices[0] if devices else 0
    elif devices and device not in devices:
        raise InvalidValueError(
            f"device {device} has no data in this snapshot; it has data for device(s) {', '.join(map(str, devices))}"
        )
    segments = sorted((s for s in segments_all if int(s["device"]) == device), key=lambda s: s["address"])
    entries = list(traces[device]) if device < len(traces) else []

    # Where each segment range belongs, from the live segments and the trace.
    ranges: list[tuple[int, int, str]] = [(s["address"], s["total_size"], _segment_pool(s)) for s in segments]

    def pool_of(addr: int, size: int, is_segment: bool, entry: dict[str, Any]) -> str:
        if "segment_pool_id" in entry or "pool_id" in entry or "segment_type" in entry:
            return _pool_label(entry.get("segment_pool_id", entry.get("pool_id")), entry.get("segment_type"))
        for start, length, label in reversed(ranges):
            if start <= addr < start + length:
                return label
        # Freed segments are gone from the snapshot: fall back on the size rules.
        if is_segment:
            return "small" if size <= _SMALL_SEGMENT else "large"
        return "small" if size <= _SMALL_REQUEST else "large"

    deltas: list[tuple[float, str, str, int]] = []  # (time, pool, "allocated"|"reserved", delta)
    ooms: list[float] = []
    t0 = entries[0].get("time_us", 0) if entries else 0
    for entry in entries:
        action = entry.get("action")
        t = (entry.get("time_us", t0) - t0) / 1e6
        size = int(entry.get("size", 0))
        addr = int(entry.get("addr", 0))
        if action in ("segment_alloc", "segment_map"):
            label = pool_of(addr, size, True, entry)
            ranges.append((addr, size, label))
            deltas.append((t, label, "reserved", size))
        elif action in ("segment_free", "segment_unmap"):
            deltas.append((t, pool_of(addr, size, True, entry), "reserved", -size))
        elif action == "alloc":
            deltas.append((t, pool_of(addr, size, False, entry), "allocated", size))
        elif action == "free_requested":
            deltas.append((t, pool_of(addr, size, False, entry), "allocated", -size))
        elif action == "oom":
            ooms.append(t)

    # Anchor each series so that it ends at what the segments hold now.
    final: dict[tuple[str, str], int] = defaultdict(int)
    for seg in segments:
        label = _segment_pool(seg)
        final[(label, "reserved")] += int(seg["total_size"])
        final[(label, "allocated")] += int(seg.get("allocated_size", 0))
    net: dict[tuple[str, str], int] = defaultdict(int)
    for _, label, kind, delta in deltas:
        net[(label, kind)] += delta
    pools: dict[str, _Series] = {}
    for label, kind in set(final) | set(net):
        series = pools.setdefault(label, _Series())
        level = final[(label, kind)] - net[(label, kind)]
        points = [(0.0, level)]
        for t, pool, what, delta in deltas:
            if (pool, what) == (label, kind):
                level += delta
                points.append((t, level))
        setattr(series, kind, points)
    return _Model(device, segments, pools, ooms, len(entries))


# -- drawing -----------------------------------------------------------------------


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise NotSupportedError("plotting needs matplotlib, which is not installed; run `pip install accel[plot]`") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _mib(n: float) -> float:
    return n / (1 << 20)


def render_png(model: _Model, width: int, height: int) -> bytes:
    """The two panels as PNG bytes of exactly ``width`` x ``height`` pixels."""
    plt = _pyplot()
    dpi = 100
    fig, (timeline, segmap) = plt.subplots(2, 1, figsize=(width / dpi, height / dpi), dpi=dpi, height_ratios=(3, 2))
    try:
        _draw_timeline(timeline, model)
        _draw_segments(segmap, model)
        fig.tight_layout()
        out = io.BytesIO()
        # No bbox_inches="tight": it would change the pixel size asked for.
        fig.savefig(out, format="png", dpi=dpi)
        return out.getvalue()
    finally:
        plt.close(fig)


def _draw_timeline(ax: Any, model: _Model) -> None:
    ax.set_title(f"device {model.device}: allocated (solid) and reserved (dashed) memory per pool")
    ax.set_xlabel("seconds since the first trace entry")
    ax.set_ylabel("MiB")
    end = max((pt[0] for s in model.pools.values() for pt in s.allocated + s.reserved), default=0.0) or 1.0
    colours = iter(["#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"])
    for pool, series in sorted(model.pools.items()):
        colour = next(colours, "#333333")
        for points, style, what in ((series.allocated, "-", "allocated"), (series.reserved, "--", "reserved")):
            if points:
                xs = [p[0] for p in points] + [end]
                ys = [_mib(p[1]) for p in points] + [_mib(points[-1][1])]
                ax.step(xs, ys, where="post", linestyle=style, color=colour, label=f"{pool} {what}")
    for t in model.ooms:
        ax.axvline(t, color="#d62728", linewidth=1)
    if model.trace_entries == 0:
        ax.text(0.5, 0.5, "no trace recorded: call accel.memory.record_memory_history() before allocating",
                transform=ax.transAxes, ha="center", va="center", color="#555555")
    if model.pools:
        ax.legend(loc="upper left", fontsize="small", ncol=2)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)


def _draw_segments(ax: Any, model: _Model) -> None:
    shown = sorted(model.segments, key=lambda s: s["total_size"], reverse=True)[:_MAX_SEGMENT_ROWS]
    shown.sort(key=lambda s: s["address"])
    hidden = len(model.segments) - len(shown)
    ax.set_title(f"segment map: {len(model.segments)} segments" + (f" ({hidden} smallest not shown)" if hidden else ""))
    ax.set_xlabel("MiB from the segment start")
    for row, seg in enumerate(shown):
        offset = 0
        for block in seg.get("blocks", []):
            size = int(block["size"])
            colour = _STATE_COLOURS.get(block.get("state", "inactive"), "#d9d9d9")
            ax.broken_barh([(_mib(offset), _mib(size))], (row - 0.4, 0.8), facecolors=colour, edgecolor="white", linewidth=0.3)
            offset += size
        if not seg.get("blocks"):
            ax.broken_barh([(0, _mib(seg["total_size"]))], (row - 0.4, 0.8), facecolors="#d9d9d9")
    ax.set_yticks(range(len(shown)))
    ax.set_yticklabels([f"{s['address']:#x} {_segment_pool(s)}" for s in shown], fontsize="x-small")
    ax.set_ylim(-0.6, max(len(shown), 1) - 0.4)
    ax.invert_yaxis()
    handles = [_patch(colour, state) for state, colour in _STATE_COLOURS.items()]
    ax.legend(handles=handles, loc="lower right", fontsize="small")
    if not shown:
        ax.text(0.5, 0.5, "no segments", transform=ax.transAxes, ha="center", va="center", color="#555555")


def _patch(colour: str, label: str) -> Any:
    from matplotlib.patches import Patch

    return Patch(facecolor=colour, label=label)


def _html(model: _Model, png: bytes, width: int, height: int) -> str:
    rows = []
    for pool, series in sorted(model.pools.items()):
        allocated = series.allocated[-1][1] if series.allocated else 0
        reserved = series.reserved[-1][1] if series.reserved else 0
        peak = max((v for _, v in series.reserved), default=0)
        rows.append(
            f"<tr><td>{html.escape(pool)}</td><td>{_mib(allocated):.2f}</td>"
            f"<td>{_mib(reserved):.2f}</td><td>{_mib(peak):.2f}</td></tr>"
        )
    image = base64.b64encode(png).decode("ascii")
    return (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>accel memory snapshot</title>"
        "<style>body{font-family:sans-serif}td,th{padding:2px 10px;text-align:right}</style></head><body>\n"
        f"<h1>accel memory snapshot, device {model.device}</h1>\n"
        f"<img alt='timeline and segment map' width='{width}' height='{height}' src='data:image/png;base64,{image}'>\n"
        "<table><tr><th>pool</th><th>allocated MiB</th><th>reserved MiB</th><th>peak reserved MiB</th></tr>\n"
        + "\n".join(rows)
        + f"\n</table><p>{len(model.segments)} segments, {model.trace_entries} trace entries.</p></body></html>\n"
    )
