"""Capture and replay: record stream work (and torch ops) once, replay it many times.

Public names (re-exported by the ``accel`` facade): :class:`Graph`,
:func:`graph`, :func:`is_capturing`, :func:`graph_pool_handle` and
:func:`make_graphed_callables`. The torch-facing names are loaded on first
use, so that importing accel.graph does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from accel.graph._graph import Graph, graph, is_capturing
from accel.graph._pool import graph_pool_handle

__all__ = [
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

_LAZY = {
    "GraphCacheWarning": "accel.graph._graphed",
    "GraphedCallable": "accel.graph._graphed",
    "make_graphed_callables": "accel.graph._graphed",
    "CompiledProgram": "accel.graph._compiled",
    "compile_graph": "accel.graph._compiled",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'accel.graph' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
