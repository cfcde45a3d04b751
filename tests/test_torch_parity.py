"""accel against the installed torch, name by name and signature by signature.

The names come from torch itself: ``torch.accelerator.__all__``,
``torch.accelerator.memory.__all__``, ``torch.cuda.memory.__all__`` (plus its
``_record_memory_history`` / ``_dump_snapshot``, which accel names without the
underscore) and the public members of ``torch.Stream``, ``torch.Event`` and
``torch.accelerator.Graph``. Signatures come from ``inspect.signature``, or,
for torch's C methods that have none, from the signature line that opens
their docstring (``Event.record(stream=None) -> None``).

A call written for torch must work on accel: each positional parameter of
torch's at the same position, each keyword by the same name, each torch
default a default here too, and every extra accel parameter optional. What
differs on purpose is listed, with the reason, in the table "Deliberate
differences from torch" of docs/concepts.md; the test fails on a difference
that is not listed, on a listed one that no longer exists, and when torch
adds a name.
"""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import accel  # noqa: E402
import accel.memory  # noqa: E402
from accel.graph import Graph  # noqa: E402

CONCEPTS = Path(__file__).resolve().parents[1] / "docs" / "concepts.md"
_EMPTY = inspect.Parameter.empty
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)

#: torch's private names that accel offers publicly.
_RENAMED = {"_record_memory_history": "record_memory_history", "_dump_snapshot": "dump_snapshot"}


def _doc_signature(obj: Any, name: str) -> inspect.Signature | None:
    """The signature in the first line of a C method's docstring, e.g. ``Event.record(stream=None) -> None``."""
    first = next((line.strip() for line in (obj.__doc__ or "").splitlines() if line.strip()), "")
    match = re.match(rf"^(?:\w+\.)?{re.escape(name)}\((.*)\)(?:\s*->.*)?$", first)
    if match is None:
        return None
    tree = ast.parse(f"def f(self, {match.group(1)}): pass" if match.group(1) else "def f(self): pass")
    namespace: dict[str, Any] = {}
    exec(compile(tree, "<signature>", "exec"), namespace)  # defaults are literals (None, False)
    return inspect.signature(namespace["f"])


def _signature(obj: Any, name: str, owner: type) -> inspect.Signature | None:
    """inspect's signature, or the docstring's where inspect sees only ``(*args, **kwargs)``
    (torch's C methods; a C class's ``__init__`` is documented on the class)."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        signature = None
    if signature is None or any(p.kind is p.VAR_POSITIONAL for p in signature.parameters.values()):
        if name == "__init__":
            return _doc_signature(owner, owner.__name__) or signature
        found = _doc_signature(obj, name)
        if found is None and owner is torch.Event and hasattr(torch.cuda.Event, name):
            # Undocumented C methods (ipc_handle, from_ipc_handle): torch.cuda.Event wraps
            # the same ones in Python, with their signatures.
            return _signature(getattr(torch.cuda.Event, name), name, torch.cuda.Event)
        return found or signature
    return signature


def _without_self(signature: inspect.Signature) -> list[inspect.Parameter]:
    params = list(signature.parameters.values())
    return params[1:] if params and params[0].name == "self" else params


def signature_problems(theirs: inspect.Signature, ours: inspect.Signature) -> list[str]:
    """How a call written for ``theirs`` could fail on ``ours`` (empty: compatible)."""
    problems = []
    t_params, o_params = _without_self(theirs), _without_self(ours)
    o_positional = [p for p in o_params if p.kind in _POSITIONAL]
    o_by_name = {p.name: p for p in o_params}
    o_var_kw = any(p.kind is p.VAR_KEYWORD for p in o_params)
    o_var_pos = any(p.kind is p.VAR_POSITIONAL for p in o_params)
    matched: set[str] = set()
    for i, p in enumerate(t_params):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.kind in _POSITIONAL:
            if i < len(o_positional):
                matched.add(o_positional[i].name)
                if p.default is not _EMPTY and o_positional[i].default is _EMPTY:
                    problems.append(f"'{p.name}' is optional in torch, required here")
            elif not o_var_pos:
                problems.append(f"'{p.name}' is positional #{i} in torch, not here")
        if p.kind in _KEYWORD:
            mine = o_by_name.get(p.name)
            if mine is not None and mine.kind in _KEYWORD:
                matched.add(mine.name)
                if p.default is not _EMPTY and mine.default is _EMPTY:
                    problems.append(f"'{p.name}' is optional in torch, required here")
            elif not o_var_kw:
                problems.append(f"keyword '{p.name}' is not accepted")
    for p in o_params:
        if p.name not in matched and p.default is _EMPTY and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            problems.append(f"'{p.name}' is required here, unknown to torch")
    return problems


def _members(cls: type) -> Iterator[str]:
    for name in sorted(dir(cls)):
        if not name.startswith("_") or name in ("__init__", "__enter__", "__exit__"):
            yield name


def _pairs() -> Iterator[tuple[str, Any, Any, type | None, type | None]]:
    """(torch's name, torch's object, accel's object or None, torch class, accel class)."""
    for name in torch.accelerator.__all__:
        yield f"torch.accelerator.{name}", getattr(torch.accelerator, name), getattr(accel, name, None), None, None
    for name in torch.accelerator.memory.__all__:
        yield (f"torch.accelerator.memory.{name}", getattr(torch.accelerator.memory, name),
               getattr(accel.memory, name, None), None, None)
    for name in [*torch.cuda.memory.__all__, *_RENAMED]:
        yield (f"torch.cuda.memory.{name}", getattr(torch.cuda.memory, name),
               getattr(accel.memory, _RENAMED.get(name, name), None), None, None)
    for torch_cls, accel_cls in ((torch.Stream, accel.Stream), (torch.Event, accel.Event),
                                 (torch.accelerator.Graph, Graph)):
        for name in _members(torch_cls):
            yield (f"torch.{torch_cls.__qualname__}.{name}".replace("torch.Graph", "torch.accelerator.Graph"),
                   getattr(torch_cls, name), getattr(accel_cls, name, None), torch_cls, accel_cls)


def differences() -> dict[str, str]:
    """Every torch name accel lacks or takes differently: {name: what differs}."""
    found = {}
    for name, theirs, ours, torch_cls, accel_cls in _pairs():
        if ours is None:
            found[name] = "missing"
            continue
        member = name.rsplit(".", 1)[1]
        if torch_cls is not None and not callable(theirs) or isinstance(theirs, property):
            if callable(ours) and not isinstance(ours, property):
                found[name] = "a method here, an attribute in torch"
            continue
        if torch_cls is not None and member in ("__enter__", "__exit__"):
            continue  # protocol methods: `with` works or it does not (tested below)
        t_sig = _signature(theirs, member, torch_cls or type(theirs))
        o_sig = _signature(ours, member, accel_cls or type(ours))
        if t_sig is None or o_sig is None:
            found[name] = "signature unknown"
            continue
        problems = signature_problems(t_sig, o_sig)
        if problems:
            found[name] = "; ".join(problems)
    return found


def listed_differences() -> dict[str, str]:
    """The table "Deliberate differences from torch" of docs/concepts.md: {torch name: reason}."""
    text = CONCEPTS.read_text()
    section = text.split("## Deliberate differences from torch", 1)[1].split("\n## ", 1)[0]
    listed = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`torch."):
            listed[cells[0].strip("`")] = cells[1]
    return listed


def test_every_difference_from_torch_is_deliberate_and_explained() -> None:
    found, listed = differences(), listed_differences()
    unexplained = {name: why for name, why in found.items() if name not in listed}
    assert not unexplained, f"differences from torch {torch.__version__} not listed in docs/concepts.md: {unexplained}"
    stale = sorted(set(listed) - set(found))
    assert not stale, f"docs/concepts.md lists differences that no longer exist: {stale}"
    assert all(len(reason) > 20 for reason in listed.values()), "each listed difference says why"


def test_all_of_torch_accelerator_is_here_with_compatible_signatures() -> None:
    """The issue's bar: 100% of torch.accelerator, its memory module, Stream, Event and Graph."""
    scope = ("torch.accelerator.", "torch.Stream.", "torch.Event.")
    gaps = {name: why for name, why in differences().items() if name.startswith(scope)}
    assert not gaps


def test_graph_has_the_attributes_torch_s_constructor_sets() -> None:
    # torch.accelerator.Graph() needs an accelerator, so its attributes (graph_pool,
    # capture_error_mode: what the next capture uses) are read from its __init__.
    tree = ast.parse(inspect.getsource(torch.accelerator.Graph.__init__).strip())
    names = {target.attr for node in ast.walk(tree) if isinstance(node, ast.Assign) for target in node.targets
             if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"}
    assert names >= {"graph_pool", "capture_error_mode"}
    g = Graph()
    for name in names:
        value = getattr(g, name)
        setattr(g, name, value)  # settable, as torch's, to change the next capture
    assert (g.graph_pool, g.capture_error_mode) == (None, "default")


def test_the_checker_catches_incompatible_signatures() -> None:
    def torch_style(a, b=1, /, c=2, *, d=3): ...  # noqa: ANN001, ANN202

    def keyword_only(*, a, b=1, c=2, d=3): ...  # noqa: ANN001, ANN202

    def extra_required(a, b=1, c=2, *, d=3, e): ...  # noqa: ANN001, ANN202

    def compatible(a, b=1, c=2, *, d=3, e=4): ...  # noqa: ANN001, ANN202

    assert signature_problems(inspect.signature(torch_style), inspect.signature(compatible)) == []
    assert "'a' is positional #0 in torch, not here" in signature_problems(
        inspect.signature(torch_style), inspect.signature(keyword_only))
    assert "'e' is required here, unknown to torch" in signature_problems(
        inspect.signature(torch_style), inspect.signature(extra_required))
    assert _doc_signature(torch.Event.record, "record") == inspect.Signature(
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
         inspect.Parameter("stream", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)])


def test_streams_events_and_graphs_are_context_managers_where_torch_s_are() -> None:
    for torch_cls, accel_cls in ((torch.Stream, accel.Stream), (torch.accelerator.Graph, Graph)):
        for protocol in ("__enter__", "__exit__"):
            assert hasattr(torch_cls, protocol) and hasattr(accel_cls, protocol)


def test_torch_names_are_read_from_torch_itself() -> None:
    names = [name for name, *_ in _pairs()]
    assert len(names) == len(set(names)) > 60
    assert "torch.accelerator.get_memory_info" in names and "torch.Event.event_id" in names
