"""Generate docs/api.md, the API reference, from the docstrings of accel's public names.

Run ``python docs/gen_api.py`` from the repository root after changing a
public name or its docstring; ``--check`` exits 1 (and says so) when
docs/api.md is out of date, which the test suite checks.

The public API is the ``__all__`` of ``accel`` and of its public modules (no
part of the dotted name starts with ``_``), and nothing else: tests/test_docs.py
checks that every name in ``__all__`` of every such module has its heading here
and that every heading is such a name. A name a module re-exports (the same
object) is documented once, where it first appears, and named where else it
can be imported. Class members are the public methods and properties defined in
accel (plus the interop protocols such as ``__dlpack__``); those a documented
base class defines are documented on that class. Nothing here loads a backend.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import inspect
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "api.md"

#: (title, module, introduction). Names come from the module's __all__. Public modules
#: whose names all appear here under another module (accel.allocator.config's are
#: accel.allocator's) need no section of their own.
SECTIONS: tuple[tuple[str, str, str], ...] = (
    ("Devices, streams, events", "accel",
     "The facade: torch.accelerator's names, on every backend. `import accel` loads nothing until a device is needed."),
    ("Memory", "accel.memory", "Buffers from the caching allocator, statistics, snapshots (PyTorch's layout)."),
    ("Allocator", "accel.allocator",
     "`ACCEL_ALLOC_CONF` and friends (parse, check, explain, apply), the memory resources an allocator takes "
     "its memory from, and memory pools."),
    ("Graphs: capture and replay", "accel.graph", "Record stream work (and torch ops) once, replay it many times."),
    ("Streams and events", "accel.stream", "The stream layer; `accel` re-exports its classes."),
    ("Distributed", "accel.distributed",
     "Under torch.distributed: collectives ordered on accel streams, comm pools, buffers exchanged between ranks."),
    ("Backend discovery", "accel.backends", "Which backends exist here and which one this process uses."),
    ("The Backend protocol", "accel.backends.base", "For backend authors: the one seam between accel and a vendor runtime."),
    ("The host backend", "accel.backends.cpu", "Host memory and worker-thread streams: the default without a GPU."),
    ("The CUDA backend", "accel.backends.cuda", "NVIDIA GPUs through the CUDA driver API (docs/backends/cuda.md)."),
    ("The XPU backend", "accel.backends.xpu", "Intel GPUs through Level Zero (docs/backends/xpu.md)."),
)

#: Dunder members worth documenting: the protocols other libraries speak.
PROTOCOLS = frozenset({"__dlpack__", "__dlpack_device__", "__cuda_array_interface__", "__cuda_stream__"})

_ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj):`~?([^`]+)`")


def _rst_to_md(text: str) -> str:
    """Docstring RST to Markdown: roles become code, doctests and ``::`` blocks become fences."""
    text = _ROLE.sub(lambda m: f"`{m.group(1)}`", text).replace("``", "`")
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith(">>>"):
            block = []
            while i < len(lines) and lines[i].strip():
                block.append(lines[i])
                i += 1
            out += ["```python", *block, "```"]
            continue
        if line.rstrip().endswith("::") and i + 1 < len(lines):
            out.append(line.rstrip()[:-1] if not line.rstrip().endswith(" ::") else line.rstrip()[:-3])
            i += 1
            while i < len(lines) and not lines[i].strip():
                i += 1
            block = []
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
                block.append(lines[i])
                i += 1
            while block and not block[-1].strip():
                block.pop()
            indent = min((len(b) - len(b.lstrip()) for b in block if b.strip()), default=0)
            out += ["", "```python", *(b[indent:] for b in block), "```", ""]
            continue
        out.append(line)
        i += 1
    return "\n".join(out).strip()


def _annotation(annotation: Any) -> str:
    if isinstance(annotation, str):
        return annotation
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _signature(obj: Any) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    parts = []
    seen_kw_only = False
    params = list(sig.parameters.values())
    if params and params[0].name in ("self", "cls"):
        params = params[1:]
    for index, param in enumerate(params):
        if param.kind is param.KEYWORD_ONLY and not seen_kw_only:
            parts.append("*")
            seen_kw_only = True
        if param.kind is param.VAR_POSITIONAL:
            seen_kw_only = True
            text = f"*{param.name}"
        elif param.kind is param.VAR_KEYWORD:
            text = f"**{param.name}"
        else:
            text = param.name
        if param.annotation is not param.empty:
            text += f": {_annotation(param.annotation)}"
        if param.default is not param.empty:
            text += f" = {param.default!r}" if param.annotation is not param.empty else f"={param.default!r}"
        parts.append(text)
        if param.kind is param.POSITIONAL_ONLY and (
            index + 1 == len(params) or params[index + 1].kind is not param.POSITIONAL_ONLY
        ):
            parts.append("/")
    result = f"({', '.join(parts)})"
    if sig.return_annotation is not sig.empty:
        result += f" -> {_annotation(sig.return_annotation)}"
    return result


def _doc(obj: Any) -> str:
    doc = inspect.getdoc(obj)
    return _rst_to_md(doc) if doc else "*(no docstring)*"


def _own_doc(obj: Any) -> str | None:
    """The object's own docstring, not one inherited from a builtin base."""
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
    return _rst_to_md(inspect.cleandoc(doc)) if doc else None


def _members(cls: type, documented: dict[int, str]) -> list[tuple[str, Any]]:
    """Public members defined in accel classes along the MRO (first definition wins),
    less those a documented base class has: they are documented there."""
    seen: dict[str, Any] = {}
    documented_bases = [k for k in cls.__mro__[1:] if id(k) in documented]
    for klass in cls.__mro__:
        if not klass.__module__.startswith("accel") or klass in documented_bases:
            continue
        for name, value in vars(klass).items():
            if name in seen or (name.startswith("_") and name not in PROTOCOLS):
                continue
            if any(name in vars(base) for base in documented_bases):
                continue
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if callable(value) or isinstance(value, property):
                seen[name] = value
    return sorted(seen.items(), key=lambda item: (item[0].startswith("_"), item[0]))


def _render_class(qualname: str, cls: type, documented: dict[int, str]) -> list[str]:
    out = []
    if issubclass(cls, enum.Enum):
        out += [f"### `{qualname}`", "", f"*enum* ({', '.join(m.name + ' = ' + repr(m.value) for m in cls)})", ""]
        out += [_own_doc(cls) or "", ""]
        return out
    kind = "exception" if issubclass(cls, BaseException) else "class"
    # A constructor is shown only when accel defines one (not BaseException's).
    own_init = any("__init__" in vars(k) for k in cls.__mro__ if k.__module__.startswith("accel"))
    signature = _signature(cls).removesuffix(" -> None") if own_init else ""
    bases = [b.__name__ for b in cls.__bases__ if b is not object]
    if kind == "class" and hasattr(cls, "__enter__"):
        kind = "class, context manager"
    out += [f"### `{qualname}{signature}`", "", f"*{kind}*" + (f" ({', '.join(bases)})" if bases else ""), ""]
    out += [_own_doc(cls) or "*(no docstring)*", ""]
    if kind == "exception":
        return out
    inherited = [documented[id(k)] for k in cls.__mro__[1:] if id(k) in documented]
    if inherited:
        out += [f"Also has the members of {', '.join(f'`{name}`' for name in inherited)}.", ""]
    for name, value in _members(cls, documented):
        if isinstance(value, property):
            out += [f"#### `{name}`", "", "*property*" + (f" — {_doc(value)}" if value.__doc__ else ""), ""]
        else:
            method_kind = "classmethod " if isinstance(inspect.getattr_static(cls, name), classmethod) else ""
            out += [f"#### `{method_kind}{name}{_signature(value)}`", "", _doc(value), ""]
    return out


def _render_value(qualname: str, value: Any) -> list[str]:
    if isinstance(value, (frozenset, set)):
        return [f"### `{qualname}`", "", f"`= {sorted(value)!r}` (a set)", ""]  # sorted: stable output
    if isinstance(value, (str, int, float, tuple)) or type(value).__name__ == "mappingproxy":
        shown = dict(value) if type(value).__name__ == "mappingproxy" else value
        return [f"### `{qualname}`", "", f"`= {shown!r}`", ""]
    return [f"### `{qualname}`", "", _doc(value), ""]


def _documented_value(module: Any, name: str) -> Any:
    value = getattr(module, name)
    if type(value).__module__ == "accel._speedups":
        value = value.__wrapped__  # a compiled stand-in (accel/_native.py) documents its Python function
    return value


def _is_shared(value: Any) -> bool:
    """Whether ``value`` is one object wherever it is imported from (not an int or a string)."""
    return inspect.isclass(value) or inspect.isroutine(value) or isinstance(value, enum.Enum)


def where_documented() -> dict[int, str]:
    """The id of each public class, function and enum member, to the name it is documented
    under: its first appearance in SECTIONS' order."""
    documented: dict[int, str] = {}
    for _, module_name, _ in SECTIONS:
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", ()):
            value = _documented_value(module, name)
            if _is_shared(value):
                documented.setdefault(id(value), f"{module_name}.{name}")
    return documented


def render_module(title: str, module_name: str, intro: str, documented: dict[int, str] | None = None) -> list[str]:
    """One section; ``documented`` is :func:`where_documented`'s answer."""
    documented = where_documented() if documented is None else documented
    module = importlib.import_module(module_name)
    names = list(getattr(module, "__all__", ()))
    out = [f"## {title}: `{module_name}`", "", intro, ""]
    for name in names:
        value = _documented_value(module, name)
        qualname = f"{module_name}.{name}"
        if inspect.ismodule(value):
            continue
        if _is_shared(value) and documented[id(value)] != qualname:
            out += [f"### `{qualname}`", "", f"The same object as `{documented[id(value)]}`.", ""]
            continue
        if inspect.isclass(value):
            out += _render_class(qualname, value, documented)
        elif inspect.isfunction(value) or inspect.isbuiltin(value):
            out += [f"### `{qualname}{_signature(value)}`", "", _doc(value), ""]
        else:
            out += _render_value(qualname, value)
    return out


def render_cli() -> list[str]:
    from accel._cli import _subcommands, build_parser

    parser = build_parser()
    out = ["## Command line: `python -m accel` (also the `accel` script)", "",
           "`info` runs when no command is given. A bad argument ends in one line on stderr and a non-zero exit.", ""]
    out += ["```text", parser.format_help().rstrip(), "```", ""]
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for module in _subcommands():
        sub = subparsers.choices[module.NAME]
        out += [f"### `accel {module.NAME}`", "", "```text", sub.format_help().rstrip(), "```", ""]
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, nested in action.choices.items():
                    out += [f"#### `accel {module.NAME} {name}`", "", "```text", nested.format_help().rstrip(), "```", ""]
    return out


def render() -> str:
    """The whole of docs/api.md."""
    import os

    # Help text wraps at the terminal width: fix it so the output is the same everywhere.
    os.environ["COLUMNS"] = "100"
    out = [
        "# API reference",
        "",
        "Generated from the docstrings by `python docs/gen_api.py`; do not edit by hand.",
        "",
        *(f"- [{title}](#{_anchor(title, module)})" for title, module, _ in SECTIONS),
        "- [Command line](#command-line-python--m-accel-also-the-accel-script)",
        "",
    ]
    documented = where_documented()
    for title, module, intro in SECTIONS:
        out += render_module(title, module, intro, documented)
    out += render_cli()
    text = "\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", text).rstrip() + "\n"


def _anchor(title: str, module: str) -> str:
    heading = f"{title}: {module}".lower()
    return re.sub(r"[^a-z0-9 _-]", "", heading).replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Generate docs/api.md from accel's docstrings.")
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUTPUT.read_text(encoding="utf-8") if OUTPUT.exists() else ""
        if current != text:
            print("docs/api.md is out of date: run `python docs/gen_api.py`", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUTPUT.relative_to(ROOT)} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
