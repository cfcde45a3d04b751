"""Capture and replay: record stream work (and torch ops) once, replay it many times.

Public names (re-exported by the ``accel`` facade): :class:`Graph`,
:func:`graph`, :func:`is_capturing`, :func:`graph_pool_handle` and
:func:`make_graphed_callables`.
"""

from accel.graph._graph import Graph, graph, is_capturing
from accel.graph._pool import graph_pool_handle

__all__ = ["Graph", "graph", "graph_pool_handle", "is_capturing"]
