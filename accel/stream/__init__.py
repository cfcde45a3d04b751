"""Streams and events: ordered device work, and markers to order and time it."""

from accel.stream._event import Event
from accel.stream._stream import ExternalStream, Stream, as_stream

__all__ = ["Event", "ExternalStream", "Stream", "as_stream"]
