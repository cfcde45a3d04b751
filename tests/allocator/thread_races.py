"""Thread races on one allocator, for tests/allocator/test_caching.py and test_memory.py:
workers on threads of their own while another thread turns something on and off (the
locked paths), and racers that free each of a set of handles at once."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from accel._errors import InvalidHandleError

T = TypeVar("T")


def run_threads(workers: Sequence[Callable[[], object]]) -> list[BaseException]:
    """Run each of ``workers`` on a thread of its own until they have all ended; what
    any of them raised."""
    errors: list[BaseException] = []

    def guarded(work: Callable[[], object]) -> None:
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(work,)) for work in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def run_while_toggling(workers: Sequence[Callable[[], object]], toggle: Callable[[], object]) -> list[BaseException]:
    """:func:`run_threads`, while one more thread calls ``toggle`` over and over until
    the workers have all ended; what any of them raised."""
    stop = threading.Event()
    toggled: list[BaseException] = []

    def toggling() -> None:
        try:
            while not stop.is_set():
                toggle()
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            toggled.append(exc)

    toggler = threading.Thread(target=toggling)
    toggler.start()
    try:
        errors = run_threads(workers)
    finally:
        stop.set()
        toggler.join()
    return errors + toggled


def free_each(free: Callable[[T], object], items: Sequence[T], freed: list[int] | None = None) -> Callable[[], None]:
    """A worker that frees each of ``items`` by ``free`` while another races it: a free
    the other made first is refused (InvalidHandleError); ``freed[k]`` counts the frees
    of ``items[k]`` that were not."""

    def work() -> None:
        for k, item in enumerate(items):
            try:
                free(item)
            except InvalidHandleError:
                continue
            if freed is not None:
                freed[k] += 1

    return work
