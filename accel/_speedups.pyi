# The optional C extension accel/_speedups.c (see accel/_native.py).
from collections.abc import Mapping

def install_allocator(names: Mapping[str, object], /) -> None: ...
