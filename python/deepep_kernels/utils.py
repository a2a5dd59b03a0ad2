"""``EventHandle`` / ``EventOverlap``: DeepEP's CUDA-event wrappers."""

from __future__ import annotations

from typing import Any, Optional, Tuple

from . import _native


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
    """DeepEP's ``EventOverlap(event, extra_tensors)``: ``current_stream_wait()`` and a ``with``
    block whose exit makes the current stream wait for the event."""

    def __init__(self, event: Optional[EventHandle] = None, extra_tensors: Optional[Tuple[Any, ...]] = None) -> None:
        self.event = event
        # Keeps tensors alive until the event is waited for (stream recording that works in
        # CUDA graphs, like DeepEP).
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        if self.event is None:
            raise RuntimeError("this EventOverlap has no event (the call ran with async_finish=False, so the current stream already waits)")
        self.event.current_stream_wait()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self.event.current_stream_wait()
