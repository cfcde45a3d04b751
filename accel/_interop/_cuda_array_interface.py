"""``__cuda_array_interface__`` (version 3) for accel's CUDA buffers.

Numba, CuPy, PyTorch and others read this dict to wrap device memory without
a copy. Version 3 adds ``"stream"``: the stream on which the data was last
written, which the consumer must wait on before reading (the consumer does
the synchronization in this protocol, unlike DLPack's).

The attribute only exists on CUDA buffers: for any other device
:func:`cuda_array_interface` raises :class:`AttributeError`, so that
``hasattr(buffer, "__cuda_array_interface__")`` is False there, which is
how consumers probe for it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CAI_VERSION", "cuda_array_interface"]

CAI_VERSION = 3

# CAI v3 stream values: 1 is the legacy default stream (a CUstream of 0 is
# ambiguous, so the protocol forbids it); None means "no synchronization".
_LEGACY_DEFAULT_STREAM = 1


def cuda_array_interface(obj: Any) -> dict[str, Any]:
    """The CAI v3 dict of a CUDA buffer: 1-D bytes (``"|u1"``), C-contiguous, writable.

    >>> from accel._interop import cuda_array_interface
    >>> import accel
    >>> class B:  # a CUDA buffer's attributes
    ...     ptr, nbytes, device = 0x7f0000000000, 256, accel.Device("cuda", 0)
    ...     class stream: native_handle = 0
    >>> cuda_array_interface(B())["stream"]
    1
    """
    device = getattr(obj, "device", None)
    if getattr(device, "type", None) != "cuda":
        raise AttributeError(
            f"__cuda_array_interface__ is only defined for CUDA buffers; this one is on {device}. "
            "Use __dlpack__ (np.from_dlpack, torch.from_dlpack) instead"
        )
    handle = getattr(getattr(obj, "stream", None), "native_handle", None)
    if not isinstance(handle, int):
        raise AttributeError(f"{type(obj).__name__}.stream has no native_handle; cannot describe its stream")
    nbytes = int(obj.nbytes)
    return {
        "version": CAI_VERSION,
        "shape": (nbytes,),
        "typestr": "|u1",
        "descr": [("", "|u1")],
        # A zero-size buffer must report address 0 (the protocol's rule).
        "data": (int(obj.ptr) if nbytes else 0, False),
        "strides": None,
        "stream": handle if handle else _LEGACY_DEFAULT_STREAM,
    }
