"""``accel info``: the device report (the default command)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

NAME = "info"
HELP = "show the backend, its devices, their properties and memory"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def collect() -> dict[str, Any]:
    """The report as plain data; raises BackendUnavailableError when the
    selected backend cannot be used."""
    import accel
    from accel._native import describe
    from accel._runtime import get_runtime, requested_backend_name
    from accel.backends import BACKEND_NAMES, probe_backend

    runtime = get_runtime()
    requested = requested_backend_name()
    backends = []
    for name in BACKEND_NAMES:
        info = probe_backend(name) if name != runtime.name else None
        backends.append(
            {"name": name, "available": True, "reason": ""}
            if info is None
            else {"name": name, "available": info.available, "reason": info.reason}
        )
    devices = []
    for index in range(runtime.device_count()):
        props = runtime.backend.device_properties(index)
        free, total = runtime.backend.memory_info(index)
        entry = dataclasses.asdict(props)
        entry["extra"] = dict(props.extra)
        entry["device"] = f"{runtime.name}:{index}"
        entry["memory_free"] = free
        entry["memory_total"] = total
        devices.append(entry)
    from accel.allocator import config_for_backend

    config = config_for_backend(runtime.name)
    settings = {
        "string": str(config),
        "non_default": {
            field: config.sources[field] for field in sorted(config.sources) if config.sources[field] != "default"
        },
    }
    return {
        "accel_version": accel.__version__,
        "speedups": describe(),
        "allocator_settings": settings,
        "backend": runtime.name,
        "selected_by": f"ACCEL_BACKEND={requested}" if requested else "first available of cuda, xpu, cpu",
        "backends": backends,
        "devices": devices,
    }


def run(args: argparse.Namespace) -> int:
    from accel._cli import print_json
    from accel._units import format_size

    report = collect()
    if args.json:
        print_json(report)
        return 0
    print(f"accel {report['accel_version']}: backend {report['backend']} ({report['selected_by']})")
    for b in report["backends"]:
        state = "available" if b["available"] else f"unavailable: {b['reason']}"
        print(f"  {b['name']:<5} {state}")
    speedups = report["speedups"]
    print(f"  compiled paths: {speedups['file']} (CRC-32 {speedups['built_crc32']})")
    settings = report["allocator_settings"]
    print(f"  allocator settings: {settings['string'] or '(all defaults)'}")
    for field, source in settings["non_default"].items():
        print(f"    {field} from {source}")
    for d in report["devices"]:
        print(f"\n{d['device']}  {d['name']}")
        used = d["memory_total"] - d["memory_free"]
        print(
            f"  memory         {format_size(d['memory_free'])} free of {format_size(d['memory_total'])}"
            f" ({format_size(used)} in use)"
        )
        rows = [
            ("uuid", d["uuid"]),
            ("driver", d["driver_version"]),
            ("processors", d["multi_processor_count"]),
            ("capability", ".".join(map(str, d["compute_capability"])) if d["compute_capability"] else None),
            ("pci bus id", d["pci_bus_id"]),
            ("integrated", d["is_integrated"]),
        ]
        rows += sorted(d["extra"].items())
        for key, value in rows:
            if value is not None:
                print(f"  {key:<18} {value}")
    return 0
