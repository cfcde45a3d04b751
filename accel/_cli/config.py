"""``accel config``: explain the allocator configuration, or check a string.

    python -m accel config                      # effective settings per backend, with sources
    python -m accel config --check "max_split_size_mb:256"   # exit 1 if invalid
    python -m accel config --keys               # every key: type, default, range, use

Nothing here changes the process state: the environment is resolved with the
pure :func:`accel.allocator.read_environment`.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from accel._cli import print_json
from accel.allocator.config import (
    AllocatorConfig,
    ConfigStringError,
    EnvironmentReport,
    keys,
    parse,
    read_environment,
)
from accel.allocator._config_keys import BACKENDS, KEYS_BY_FIELD
from accel.allocator._config_parse import parse_settings

NAME = "config"
HELP = "show the effective allocator configuration and where each value comes from"

_CHECK_ORIGIN = "the --check string"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--check",
        metavar="STRING",
        help="validate a configuration string without applying it; exit status 1 if invalid",
    )
    mode.add_argument("--keys", action="store_true", help="list every known key")
    parser.add_argument("--backend", choices=BACKENDS, help="show only this backend")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def run(args: argparse.Namespace) -> int:
    if args.keys:
        return _show_keys(args.json)
    if args.check is not None:
        return _check(args.check, args.json)
    return _show_environment(read_environment(), args.backend, args.json)


def _json_value(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _settings_rows(config: AllocatorConfig) -> list[dict[str, Any]]:
    rows = []
    for spec in keys():
        source = config.sources[spec.field]
        if spec.field == "max_non_split_rounding" and source == "default":
            source = "default (= large_segment_size_mb)"
        rows.append(
            {
                "key": spec.key,
                "field": spec.field,
                "value": _json_value(getattr(config, spec.field)),
                "display": config.describe(spec.field),
                "source": source,
                "used_by_accel": spec.used_by_accel,
            }
        )
    return rows


def _check(text: str, as_json: bool) -> int:
    try:
        config = parse(text, origin=_CHECK_ORIGIN)
    except ConfigStringError as exc:
        if not as_json:
            raise
        print_json(
            {
                "valid": False,
                "position": exc.position,
                "end": exc.end,
                "reason": exc.reason,
                "suggestion": exc.suggestion,
                "message": str(exc),
            }
        )
        return 1
    named = [KEYS_BY_FIELD[s.spec.field] for s in parse_settings(text, _CHECK_ORIGIN)]
    named = list(dict.fromkeys(named))
    if as_json:
        print_json(
            {
                "valid": True,
                "canonical": str(config),
                "settings": {spec.key: _json_value(getattr(config, spec.field)) for spec in named},
                "warnings": list(config.warnings),
            }
        )
        return 0
    print(f"valid ({len(named)} setting{'s' if len(named) != 1 else ''})")
    width = max((len(spec.key) for spec in named), default=0)
    for spec in named:
        note = "" if spec.used_by_accel else "   (not used by accel)"
        print(f"  {spec.key:<{width}}  {config.describe(spec.field)}{note}")
    print(f"canonical form: '{config}'")
    for message in config.warnings:
        print(f"warning: {message}")
    return 0


def _show_keys(as_json: bool) -> int:
    specs = keys()
    if as_json:
        print_json([dataclasses.asdict(spec) for spec in specs])
        return 0
    for spec in specs:
        use = "used by accel" if spec.used_by_accel else "not used by accel"
        unit = f", unit {spec.unit}" if spec.unit else ""
        aliases = f" (alias: {', '.join(spec.aliases)})" if spec.aliases else ""
        print(f"{spec.key}{aliases}")
        print(f"    {spec.kind}{unit}; default {spec.default_text}; valid: {spec.range_text}")
        print(
            f"    {'accel-only key' if spec.pytorch_set == 'none' else f'PyTorch {spec.pytorch_set} key'}; "
            f"backends: {', '.join(spec.backends)}; {use}"
        )
        print(f"    {spec.summary}")
    return 0


def _show_environment(report: EnvironmentReport, only: str | None, as_json: bool) -> int:
    backends = [only] if only else list(BACKENDS)
    if as_json:
        print_json(
            {
                "variables": dict(report.variables),
                "used": list(report.used),
                "backends": {
                    name: {
                        "canonical": str(report.configs[name]),
                        "settings": _settings_rows(report.configs[name]),
                    }
                    for name in backends
                },
                "warnings": list(report.warnings),
            }
        )
        return 0
    print("Allocator configuration (accel reads the environment once, at first use)")
    print()
    print("Environment:")
    width = max(len(name) for name in report.variables)
    for name, value in report.variables.items():
        if value is None:
            state = "not set"
        else:
            state = f"'{value}'  " + ("used" if name in report.used else "ignored")
        print(f"  {name:<{width}}  {state}")
    for name in backends:
        config = report.configs[name]
        rows = _settings_rows(config)
        print()
        print(f"Backend {name}:  '{config}'")
        key_width = max(len(row["key"]) for row in rows)
        value_width = max(len(row["display"]) for row in rows)
        for row in rows:
            note = "" if row["used_by_accel"] else "  (not used by accel)"
            print(f"  {row['key']:<{key_width}}  {row['display']:<{value_width}}  {row['source']}{note}")
    print()
    if report.warnings:
        print("Warnings:")
        for message in report.warnings:
            print(f"  - {message}")
    else:
        print("No warnings.")
    return 0
