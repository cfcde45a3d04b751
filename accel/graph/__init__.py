"""Capture and replay: record stream work (and torch ops) once, replay it many times.

Public names (re-exported by the ``accel`` facade): :class:`Graph`,
:func:`graph`, :func:`is_capturing`, :func:`graph_pool_handle` and
:func:`make_graphed_callables`. The torch-facing names are loaded on first
use, so that importing accel.graph does not import torch.

``accel.graph`` is this package *and* the capture context manager (as
``torch.cuda.graph``): importing the package binds ``accel.graph`` to it,
so the package itself is callable and ``accel.graph(g)`` is
``accel.graph.graph(g)``.

>>> import accel
>>> g = accel.graph.Graph()
>>> with accel.graph(g):
...     accel.current_stream().launch_host_func(lambda: None)
>>> g.replay()
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from accel.graph._graph import Graph, graph, is_capturing
from accel.graph._pool import graph_pool_handle

__all__ = [
    "BuildWarning",
    "CompiledProgram",
    "Graph",
    "GraphCacheWarning",
    "GraphedCallable",
    "compile_graph",
    "graph",
    "graph_pool_handle",
    "is_capturing",
    "make_graphed_callables",
]

if TYPE_CHECKING:  # loaded by __getattr__ on first use, since they import torch
    from accel.graph._compiled import BuildWarning, CompiledProgram, compile_graph
    from accel.graph._graphed import GraphCacheWarning, GraphedCallable, make_graphed_callables

_LAZY = {
    "GraphCacheWarning": "accel.graph._graphed",
    "GraphedCallable": "accel.graph._graphed",
    "make_graphed_callables": "accel.graph._graphed",
    "BuildWarning": "accel.graph._compiled",
    "CompiledProgram": "accel.graph._compiled",
    "compile_graph": "accel.graph._compiled",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'accel.graph' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


class _CallablePackage(types.ModuleType):
    def __call__(
        self,
        g: Graph,
        *,
        pool: tuple[int, int] | None = None,
        stream: Any = None,
        capture_error_mode: str | None = None,
    ) -> graph:
        return graph(g, pool=pool, stream=stream, capture_error_mode=capture_error_mode)


sys.modules[__name__].__class__ = _CallablePackage
