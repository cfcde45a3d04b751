"""cffi (ABI mode) bindings to the part of the CUDA driver API accel uses.

The declarations follow ``cuda.h`` (CUDA 12.x and 13.x; both give the same
layouts for what is declared here, and every enum is 4 bytes, so enums are
declared as ``int``). ABI mode means no compiler and no CUDA toolkit: the
driver library is opened with ``dlopen`` and each entry point is looked up
by its exported name.

``cuda.h`` maps API names to versioned symbols (``cuMemAlloc`` is
``cuMemAlloc_v2``), and the versions differ between CUDA 12 and 13 drivers
(``cuStreamGetCaptureInfo_v2`` vs ``_v3``, ``cuEventElapsedTime`` vs ``_v2``).
Rather than trusting one header, :func:`open_driver` probes what the loaded
library exports and takes the newest version it knows. A missing required
entry point makes the backend unavailable with its name; a missing optional
group (virtual memory, graphs, sharing with other processes) only turns that
feature off.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import cffi

from accel._errors import BackendUnavailableError
from accel.backends.cuda._library import DEFAULT_LIBRARY, cannot_load, driver_path

__all__ = [
    "DEFAULT_LIBRARY",
    "Driver",
    "GRAPH_FUNCTIONS",
    "IPC_FUNCTIONS",
    "REQUIRED_FUNCTIONS",
    "VMM_FUNCTIONS",
    "VMM_IPC_FUNCTIONS",
    "open_driver",
]

#: Loaded when ``ACCEL_CUDA_DRIVER`` is not set: the driver's soname, found by the dynamic loader.

CDEF = """
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long cuuint64_t;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUgraphNode_st *CUgraphNode;
typedef void (*CUhostFn)(void *userData);

typedef struct CUuuid_st { char bytes[16]; } CUuuid;
typedef struct CUmemLocation_st { int type; int id; } CUmemLocation;
typedef struct CUmemAllocationProp_st {
    int type;
    int requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;
typedef struct CUmemAccessDesc_st { CUmemLocation location; int flags; } CUmemAccessDesc;
typedef struct CUipcEventHandle_st { char reserved[64]; } CUipcEventHandle;
typedef struct CUipcMemHandle_st { char reserved[64]; } CUipcMemHandle;
typedef struct CUgraphEdgeData_st {
    unsigned char from_port; unsigned char to_port; unsigned char type; unsigned char reserved[5];
} CUgraphEdgeData;

CUresult cuInit(unsigned int Flags);
CUresult cuDriverGetVersion(int *driverVersion);
CUresult cuGetErrorName(CUresult error, const char **pStr);
CUresult cuGetErrorString(CUresult error, const char **pStr);

CUresult cuDeviceGetCount(int *count);
CUresult cuDeviceGetName(char *name, int len, CUdevice dev);
CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev);
CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev);
CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev);
CUresult cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev);
CUresult cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev);
CUresult cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev);

CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuCtxGetCurrent(CUcontext *pctx);
CUresult cuCtxPushCurrent_v2(CUcontext ctx);
CUresult cuCtxPopCurrent_v2(CUcontext *pctx);
CUresult cuCtxSynchronize(void);
CUresult cuCtxGetStreamPriorityRange(int *leastPriority, int *greatestPriority);

CUresult cuMemGetInfo_v2(size_t *free, size_t *total);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
CUresult cuMemFree_v2(CUdeviceptr dptr);
CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags);
CUresult cuMemFreeHost(void *p);
CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream);
CUresult cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream);
CUresult cuLaunchHostFunc(CUstream hStream, CUhostFn fn, void *userData);

CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop, int option);
CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags);
CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size);
CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                     unsigned long long flags);
CUresult cuMemRelease(CUmemGenericAllocationHandle handle);
CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags);
CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count);
CUresult cuMemUnmap(CUdeviceptr ptr, size_t size);
CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle, int handleType,
                                      unsigned long long flags);
CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle, int shHandleType);
CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr);

CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr);
CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr);
CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags);
CUresult cuIpcCloseMemHandle(CUdeviceptr dptr);
CUresult cuIpcGetEventHandle(CUipcEventHandle *pHandle, CUevent event);
CUresult cuIpcOpenEventHandle(CUevent *phEvent, CUipcEventHandle handle);

CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority);
CUresult cuStreamDestroy_v2(CUstream hStream);
CUresult cuStreamQuery(CUstream hStream);
CUresult cuStreamSynchronize(CUstream hStream);
CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags);

CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags);
CUresult cuEventDestroy_v2(CUevent hEvent);
CUresult cuEventRecord(CUevent hEvent, CUstream hStream);
CUresult cuEventRecordWithFlags(CUevent hEvent, CUstream hStream, unsigned int flags);
CUresult cuEventQuery(CUevent hEvent);
CUresult cuEventSynchronize(CUevent hEvent);
CUresult cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd);
CUresult cuEventElapsedTime_v2(float *pMilliseconds, CUevent hStart, CUevent hEnd);

CUresult cuThreadExchangeStreamCaptureMode(int *mode);
CUresult cuStreamBeginCapture_v2(CUstream hStream, int mode);
CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph);
CUresult cuStreamIsCapturing(CUstream hStream, int *captureStatus);
CUresult cuStreamGetCaptureInfo_v2(CUstream hStream, int *captureStatus_out, cuuint64_t *id_out,
                                   CUgraph *graph_out, const CUgraphNode **dependencies_out,
                                   size_t *numDependencies_out);
CUresult cuStreamGetCaptureInfo_v3(CUstream hStream, int *captureStatus_out, cuuint64_t *id_out,
                                   CUgraph *graph_out, const CUgraphNode **dependencies_out,
                                   const CUgraphEdgeData **edgeData_out, size_t *numDependencies_out);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags);
CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream);
CUresult cuGraphExecDestroy(CUgraphExec hGraphExec);
CUresult cuGraphDestroy(CUgraph hGraph);
CUresult cuGraphGetNodes(CUgraph hGraph, CUgraphNode *nodes, size_t *numNodes);
CUresult cuGraphDebugDotPrint(CUgraph hGraph, const char *path, unsigned int flags);
"""

#: Entry points accel cannot work without (API name -> exported names, newest first).
REQUIRED_FUNCTIONS: dict[str, tuple[str, ...]] = {
    name: (name,)
    for name in (
        "cuInit",
        "cuDriverGetVersion",
        "cuGetErrorName",
        "cuGetErrorString",
        "cuDeviceGetCount",
        "cuDeviceGetName",
        "cuDeviceGetAttribute",
        "cuDeviceGetPCIBusId",
        "cuDeviceCanAccessPeer",
        "cuDevicePrimaryCtxRetain",
        "cuCtxSetCurrent",
        "cuCtxGetCurrent",
        "cuCtxSynchronize",
        "cuCtxGetStreamPriorityRange",
        "cuMemHostAlloc",
        "cuMemFreeHost",
        "cuMemcpyAsync",
        "cuMemsetD8Async",
        "cuLaunchHostFunc",
        "cuStreamCreateWithPriority",
        "cuStreamQuery",
        "cuStreamSynchronize",
        "cuStreamWaitEvent",
        "cuEventCreate",
        "cuEventRecord",
        "cuEventQuery",
        "cuEventSynchronize",
        "cuThreadExchangeStreamCaptureMode",
    )
} | {
    "cuDeviceTotalMem": ("cuDeviceTotalMem_v2",),
    "cuDeviceGetUuid": ("cuDeviceGetUuid_v2", "cuDeviceGetUuid"),
    "cuCtxPushCurrent": ("cuCtxPushCurrent_v2",),
    "cuCtxPopCurrent": ("cuCtxPopCurrent_v2",),
    "cuMemGetInfo": ("cuMemGetInfo_v2",),
    "cuMemAlloc": ("cuMemAlloc_v2",),
    "cuMemFree": ("cuMemFree_v2",),
    "cuStreamDestroy": ("cuStreamDestroy_v2",),
    "cuEventDestroy": ("cuEventDestroy_v2",),
    "cuEventElapsedTime": ("cuEventElapsedTime_v2", "cuEventElapsedTime"),
}

#: Virtual memory management (expandable segments): all or nothing.
VMM_FUNCTIONS: dict[str, tuple[str, ...]] = {
    name: (name,)
    for name in (
        "cuMemGetAllocationGranularity",
        "cuMemAddressReserve",
        "cuMemAddressFree",
        "cuMemCreate",
        "cuMemRelease",
        "cuMemMap",
        "cuMemSetAccess",
        "cuMemUnmap",
    )
}

#: Sharing memory and events with other processes (legacy IPC handles): all or nothing.
IPC_FUNCTIONS: dict[str, tuple[str, ...]] = {
    "cuMemGetAddressRange": ("cuMemGetAddressRange_v2",),
    "cuIpcGetMemHandle": ("cuIpcGetMemHandle",),
    "cuIpcOpenMemHandle": ("cuIpcOpenMemHandle_v2",),
    "cuIpcCloseMemHandle": ("cuIpcCloseMemHandle",),
    "cuIpcGetEventHandle": ("cuIpcGetEventHandle",),
    "cuIpcOpenEventHandle": ("cuIpcOpenEventHandle",),
}

#: Sharing virtual-memory chunks as POSIX file descriptors: all or nothing.
VMM_IPC_FUNCTIONS: dict[str, tuple[str, ...]] = {
    name: (name,)
    for name in ("cuMemExportToShareableHandle", "cuMemImportFromShareableHandle", "cuMemRetainAllocationHandle")
}

#: Stream capture and graph replay: all or nothing.
GRAPH_FUNCTIONS: dict[str, tuple[str, ...]] = {
    "cuStreamBeginCapture": ("cuStreamBeginCapture_v2",),
    "cuStreamEndCapture": ("cuStreamEndCapture",),
    "cuStreamIsCapturing": ("cuStreamIsCapturing",),
    "cuStreamGetCaptureInfo": ("cuStreamGetCaptureInfo_v3", "cuStreamGetCaptureInfo_v2"),
    "cuGraphInstantiateWithFlags": ("cuGraphInstantiateWithFlags",),
    "cuGraphLaunch": ("cuGraphLaunch",),
    "cuGraphExecDestroy": ("cuGraphExecDestroy",),
    "cuGraphDestroy": ("cuGraphDestroy",),
    "cuGraphGetNodes": ("cuGraphGetNodes",),
}

_OPTIONAL_FUNCTIONS: dict[str, tuple[str, ...]] = {
    "cuGraphDebugDotPrint": ("cuGraphDebugDotPrint",),
    "cuEventRecordWithFlags": ("cuEventRecordWithFlags",),  # CUDA 11.1
}

_ffi: cffi.FFI | None = None


def _get_ffi() -> cffi.FFI:
    global _ffi
    if _ffi is None:
        ffi = cffi.FFI()
        ffi.cdef(CDEF)
        _ffi = ffi
    return _ffi


@dataclass
class Driver:
    """An opened CUDA driver: its entry points by API name, and what was chosen.

    ``fn["cuMemAlloc"]`` is the callable bound to the exported symbol
    ``symbols["cuMemAlloc"]`` (``"cuMemAlloc_v2"``). Optional entry points
    that the library lacks are absent from ``fn``.
    """

    ffi: cffi.FFI
    lib: Any
    path: str
    fn: dict[str, Any] = field(default_factory=dict)
    symbols: dict[str, str] = field(default_factory=dict)
    has_vmm: bool = False
    has_graphs: bool = False
    has_ipc: bool = False
    has_vmm_ipc: bool = False

    def probed_symbols(self) -> list[str]:
        """The exported names chosen where several versions were candidates."""
        tables = (REQUIRED_FUNCTIONS, VMM_FUNCTIONS, GRAPH_FUNCTIONS, IPC_FUNCTIONS, VMM_IPC_FUNCTIONS)
        return [self.symbols[api] for table in tables for api, names in table.items()
                if len(names) > 1 and api in self.symbols]

    def error_name(self, code: int) -> str:
        """``CUDA_ERROR_...`` for ``code`` as the driver names it."""
        return self._error_text("cuGetErrorName", code) or f"CUDA_ERROR_UNRECOGNIZED_{code}"

    def error_string(self, code: int) -> str:
        """The driver's description of ``code`` ('' when it has none)."""
        return self._error_text("cuGetErrorString", code)

    def _error_text(self, call: str, code: int) -> str:
        out = self.ffi.new("const char **")
        if self.fn[call](code, out) != 0 or out[0] == self.ffi.NULL:
            return ""
        text: bytes = self.ffi.string(out[0])
        return text.decode(errors="replace")

    def describe(self, code: int) -> str:
        """``"NAME (code): description"``, the form every accel message uses."""
        text = f"{self.error_name(code)} ({code})"
        string = self.error_string(code)
        return f"{text}: {string}" if string else text


def _resolve(lib: Any, table: dict[str, tuple[str, ...]]) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """Bind each API name to the first exported candidate; also return what is missing."""
    bound: dict[str, Any] = {}
    symbols: dict[str, str] = {}
    missing: list[str] = []
    for api, candidates in table.items():
        for symbol in candidates:
            try:
                bound[api] = getattr(lib, symbol)
            except AttributeError:
                continue
            symbols[api] = symbol
            break
        else:
            missing.append(" or ".join(candidates))
    return bound, symbols, missing


def open_driver(path: str | None = None) -> Driver:
    """Open the driver library and bind its entry points; does not call cuInit.

    ``path`` defaults to ``ACCEL_CUDA_DRIVER``, then ``libcuda.so.1``.
    Raises :class:`~accel.BackendUnavailableError` with a one-line reason.

    >>> open_driver("/nonexistent/libcuda.so.1")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    accel._errors.BackendUnavailableError: accel backend 'cuda' is unavailable: cannot load ...
    """
    target, explicit = driver_path(path)
    ffi = _get_ffi()
    try:
        lib = ffi.dlopen(target)
    except OSError as exc:
        raise cannot_load(target, explicit, str(exc)) from None

    fn, symbols, missing = _resolve(lib, REQUIRED_FUNCTIONS)
    if missing:
        raise BackendUnavailableError(
            "cuda",
            f"the CUDA driver {target} does not export {missing[0]}"
            + (f" (and {len(missing) - 1} more required entry points)" if len(missing) > 1 else ""),
            remedy="Update the NVIDIA driver (accel needs CUDA 12.0 or newer)",
        )
    driver = Driver(ffi=ffi, lib=lib, path=target, fn=fn, symbols=symbols)
    groups = (
        (VMM_FUNCTIONS, "has_vmm"),
        (GRAPH_FUNCTIONS, "has_graphs"),
        (IPC_FUNCTIONS, "has_ipc"),
        (VMM_IPC_FUNCTIONS, "has_vmm_ipc"),
    )
    for table, attr in groups:
        extra, extra_symbols, missing = _resolve(lib, table)
        if not missing:
            driver.fn.update(extra)
            driver.symbols.update(extra_symbols)
            setattr(driver, attr, True)
    extra, extra_symbols, _ = _resolve(lib, _OPTIONAL_FUNCTIONS)
    driver.fn.update(extra)
    driver.symbols.update(extra_symbols)
    return driver
