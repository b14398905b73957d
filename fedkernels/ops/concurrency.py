"""What the stateful objects do when two threads use one at the same time (the contract is in
``docs/guide/python_api.md``, "Threads"): either they serialise the calls with a lock
(:class:`CopyableLock`: Accumulator, NVFlare's aggregators), or they refuse the second call with a
``RuntimeError`` naming the object (:func:`one_call_at_a_time`: objects whose calls only make
sense in one order, such as an optimizer's step or a collective)."""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class CopyableLock:
    """A ``threading.Lock`` (``RLock`` when ``reentrant``) that a copy, deep copy or unpickling
    of its owner replaces by a new, unlocked one (a lock cannot be pickled, and a copy is a
    separate object to guard)."""

    __slots__ = ("_lock", "_reentrant")

    def __init__(self, reentrant: bool = False) -> None:
        self._reentrant = reentrant
        self._lock = threading.RLock() if reentrant else threading.Lock()

    def __enter__(self) -> CopyableLock:
        self._lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()

    def try_acquire(self) -> bool:
        return self._lock.acquire(blocking=False)

    def release(self) -> None:
        self._lock.release()

    def __reduce__(self):
        return (CopyableLock, (self._reentrant,))


# One guard per object, kept outside it (its attributes stay those of the class it stands in
# for, and copies or pickles of it carry none), dropped when the object is collected.
_GUARDS: dict[int, _Guard] = {}
_GUARDS_LOCK = threading.Lock()


def _guard_of(owner: Any) -> _Guard:
    key = id(owner)
    guard = _GUARDS.get(key)
    if guard is None:
        with _GUARDS_LOCK:
            guard = _GUARDS.get(key)
            if guard is None:
                guard = _GUARDS[key] = _Guard()
                try:
                    weakref.finalize(owner, _GUARDS.pop, key, None).atexit = False
                except TypeError:  # not weak-referenceable: the guard stays (a few bytes)
                    pass
    return guard


def one_call_at_a_time(api: str | None = None) -> Callable[[F], F]:
    """Decorates a method so that a call made while another thread is inside a method of the
    same object decorated likewise raises ``RuntimeError`` (naming ``api``, or the object's
    class when None, and the method) at once, without touching the object; calls one after
    another, from any threads, are fine. A call from inside such a method on the same thread
    (a method calling another) passes."""

    def decorate(method: F) -> F:
        @functools.wraps(method)
        def guarded(self, *args, **kwargs):
            guard = _guard_of(self)
            me = threading.get_ident()
            if guard.owner == me:  # re-entered from the same thread
                return method(self, *args, **kwargs)
            if not guard.lock.try_acquire():
                who = api if api is not None else type(self).__name__
                raise RuntimeError(
                    f"{who}.{method.__name__}: called while another thread is inside a call on "
                    "the same object; it is not for concurrent use (call it from one thread, or "
                    "give each thread its own object)")
            guard.owner = me
            try:
                return method(self, *args, **kwargs)
            finally:
                guard.owner = None
                guard.lock.release()

        return guarded  # type: ignore[return-value]

    return decorate


class _Guard:
    __slots__ = ("lock", "owner")

    def __init__(self) -> None:
        self.lock = CopyableLock()
        self.owner: int | None = None
