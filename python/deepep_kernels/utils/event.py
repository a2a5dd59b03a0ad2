"""``EventHandle`` / ``EventOverlap``: DeepEP's CUDA-event wrappers (``deep_ep.utils.event``).

``EventOverlap`` serves both APIs: DeepEP v1.2.1's (``current_stream_wait()``, a ``with`` block)
and DeepEP 2.1's additions (``current_stream_wait(release_handle=...)``, ``event_overlap(
release_handle=True)`` as a ``with`` target, and ``register_hook_after_wait(hook)``). No torch
import at module import time.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

from .. import _native

__all__ = ["EventHandle", "EventOverlap"]


def _current_stream_handle() -> int:
    import torch

    return torch.cuda.current_stream().cuda_stream


class EventHandle:
    """A CUDA event; created recorded on the current stream (like DeepEP's ``EventHandle()``)."""

    def __init__(self, event: Optional[_native.Event] = None) -> None:
        self.event = event if event is not None else _native.Event.recorded_on(_current_stream_handle())

    def current_stream_wait(self) -> None:
        """``torch.cuda.current_stream()`` waits for the event (no host wait)."""
        self.event.wait_on(_current_stream_handle())

    def synchronize(self) -> None:
        self.event.synchronize()

    def query(self) -> bool:
        return self.event.query()


class EventOverlap:
    """DeepEP's ``EventOverlap(event, extra_tensors)``.

    ``current_stream_wait()`` makes the current stream wait for the event; so does leaving a
    ``with`` block (when there is an event). A hook registered with ``register_hook_after_wait``
    runs once, right after that wait, on the host (DeepEP 2.1 runs its deterministic dispatch's
    sort there, on the current stream). ``release_handle=True`` (an argument of
    ``current_stream_wait``, or ``with overlap(release_handle=True):``) drops the event after the
    wait, releasing what it keeps alive.
    """

    def __init__(self, event: Optional[EventHandle] = None, extra_tensors: Optional[Tuple[Any, ...]] = None) -> None:
        self.event = event
        # Keeps tensors alive until the event is waited for (stream recording that works in
        # CUDA graphs, like DeepEP).
        self.extra_tensors = extra_tensors
        self.hook_after_wait: Optional[Callable[[], Any]] = None
        # set by __call__ for the next `with` block only
        self._release_on_exit = False

    def current_stream_wait(self, release_handle: bool = False) -> None:
        """The current stream waits for the event; then the registered hook (if any) runs once;
        with ``release_handle`` the event is dropped afterwards."""
        if self.event is None:
            raise RuntimeError("this EventOverlap has no event (the call ran with async_finish=False, so the current stream already waits)")
        self.event.current_stream_wait()
        hook, self.hook_after_wait = self.hook_after_wait, None
        if hook is not None:
            hook()
        if release_handle:
            self.event = None

    def register_hook_after_wait(self, hook_after_wait: Callable[[], Any]) -> None:
        """Run ``hook_after_wait()`` right after the next wait for the event (``current_stream_wait()``
        or leaving a ``with`` block). One hook at a time, as in DeepEP 2.1."""
        if not callable(hook_after_wait):
            raise TypeError(f"register_hook_after_wait takes a callable, got {type(hook_after_wait).__name__}")
        if self.hook_after_wait is not None:
            raise RuntimeError("a hook is already registered on this EventOverlap (one at a time: it runs after the next wait; "
                               "wait for the event first, or combine both actions into one callable)")
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> "EventOverlap":
        """``with overlap(release_handle=True):`` drops the event when the block is left (after the
        wait). Returns ``self``."""
        self._release_on_exit = bool(release_handle)
        return self

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        release, self._release_on_exit = self._release_on_exit, False
        if self.event is not None:
            self.current_stream_wait(release_handle=release)
