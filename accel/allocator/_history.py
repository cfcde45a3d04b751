"""Allocation history: the trace ring buffer and the stack frames it records.

Entries use the layout of PyTorch's ``torch.cuda.memory._snapshot()``
``device_traces``, so ``torch.cuda._memory_viz`` and pytorch.org/memory_viz
read the pickles :func:`accel.memory.dump_snapshot` writes.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from types import FrameType
from typing import Any

from accel._errors import InvalidValueError

__all__ = ["History", "capture_frames"]

Frame = dict[str, Any]

# Frames inside accel's own allocator and facade say nothing about the caller.
_SKIP_PREFIXES = tuple(
    f"accel{sep}{part}" for sep in ("/", "\\") for part in ("allocator", "memory.py")
)


def capture_frames(skip: int = 2) -> list[Frame]:
    """The Python stack of the caller, innermost first, without accel's own frames."""
    frames: list[Frame] = []
    f: FrameType | None = sys._getframe(skip)
    while f is not None:
        code = f.f_code
        if not any(p in code.co_filename for p in _SKIP_PREFIXES):
            frames.append({"filename": code.co_filename, "line": f.f_lineno, "name": code.co_name})
        f = f.f_back
    return frames


class History:
    """What ``record_memory_history`` asked for, and the ring of trace entries.

    ``context`` chooses which events carry stacks: "state" (live blocks only),
    "alloc" (also alloc entries), "all" (also frees). ``trace`` is False for
    ``enabled="state"``: then no ring is kept, only block contexts.
    """

    __slots__ = ("trace", "context", "entries")

    def __init__(self, enabled: str, context: str | None, stacks: str, max_entries: int) -> None:
        if enabled not in ("all", "state"):
            raise InvalidValueError(f"expected state to be 'state', 'all', or None, got {enabled!r}")
        if context not in ("all", "alloc", "state", None):
            raise InvalidValueError(f"expected context to be 'state', 'alloc', 'all', or None, got {context!r}")
        if stacks not in ("python", "all"):
            raise InvalidValueError(f"expected stacks to be 'python', or 'all', got {stacks!r}")
        if isinstance(max_entries, bool) or not isinstance(max_entries, int):
            raise InvalidValueError(f"max_entries={max_entries!r} must be an int")
        self.trace = enabled == "all"
        self.context = context
        # "state" keeps one entry, as PyTorch does; the ring overwrites the oldest.
        size = max(1, max_entries) if self.trace else 1
        self.entries: deque[dict[str, Any]] = deque(maxlen=min(size, sys.maxsize))

    def block_frames(self) -> list[Frame]:
        """Frames to keep on a newly allocated block (any context level)."""
        return capture_frames(3) if self.context is not None else []

    def record(self, action: str, addr: int, size: int, stream: int, frames: list[Frame] | None) -> None:
        if not self.trace:
            return
        if frames is None:
            wants = self.context == "all" or (self.context == "alloc" and action == "alloc")
            frames = capture_frames(3) if wants else []
        entry: dict[str, Any] = {
            "action": action,
            "addr": addr,
            "size": size,
            "stream": stream,
            "time_us": time.time_ns() // 1000,
            "frames": frames,
            "compile_context": "",
            "user_metadata": "",
        }
        if action == "oom":
            entry["device_free"] = entry.pop("addr")
        self.entries.append(entry)
