# The C extension accel/_speedups.c, part of every build (see accel/_native.py).
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any, NoReturn

SOURCE_CRC32: str

def install_buffers(names: Mapping[str, object], /) -> None: ...
def install_empty(module: ModuleType, /) -> None: ...

class CoreBlock:
    @property
    def ptr(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def requested(self) -> int: ...
    @property
    def owner(self) -> Any: ...
    @property
    def segment(self) -> None: ...
    stream: int
    stream_uses: set[int] | None
    frames: list[dict[str, Any]] | None
    state: int
    event_count: int

class CoreSteps:
    def __init__(
        self,
        owner: object,
        core: int,
        live: dict[int, CoreBlock],
        known: set[int],
        entry_points: tuple[int, int, int, int],
        error: type[BaseException],
        /,
    ) -> None: ...
    def malloc(self, nbytes: int, stream: int, pool: int, flags: int, /) -> CoreBlock | int: ...
    def free(self, block: CoreBlock, /) -> None: ...
    def hold(self, block: CoreBlock, /) -> None: ...
    def release(self, block: CoreBlock, /) -> None: ...
def install_graphs(names: Mapping[str, object], /) -> None: ...

class SteadyCall:
    __wrapped__: Callable[[Sequence[Any]], Any]
    def __init__(
        self,
        fallback: Callable[[Sequence[Any]], Any],
        inputs: list[Any],
        thread: Any,
        device: int,
        default: Any,
        run: Callable[..., Any],
        finish: Any,
        binding: Any,
        real: bool,
        failed: Callable[[Exception], Any] | None = None,
        /,
    ) -> None: ...
    def __call__(self, args: Sequence[Any], /) -> Any: ...

class _CallHead:
    _hot: Callable[[Sequence[Any]], Any] | None
    hits: int
    _lock: Any
    _owner: int
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Any: ...
    def _refuse(self, args: tuple[Any, ...], exc: BaseException) -> NoReturn: ...

def set_current(streams: dict[int, Any], index: int, stream: Any, /) -> None: ...
