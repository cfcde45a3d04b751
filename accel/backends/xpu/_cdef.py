"""cffi declarations for the Level Zero subset accel uses (ABI mode: no compiler, no headers at run time).

Derived from Debian's ``libze-dev`` 1.8 headers (API version 1.4): the
declarations below were extracted from ``gcc -E -P`` output of
``level_zero/ze_api.h``, ``zes_api.h`` and ``loader/ze_loader.h`` for the
functions accel calls and the types they need, then checked against gcc's
``sizeof`` for every structure. Later functions are declared by hand at the
end (``zeCommandListHostSynchronize`` of API 1.6, ``zePhysicalMemGetProperties``
and its structure of API 1.15); the 1.8 loader lacks them, so they are probed,
never assumed.
"""

CDEF = r"""
typedef uint8_t ze_bool_t;
typedef struct _ze_driver_handle_t *ze_driver_handle_t;
typedef struct _ze_device_handle_t *ze_device_handle_t;
typedef struct _ze_context_handle_t *ze_context_handle_t;
typedef struct _ze_command_queue_handle_t *ze_command_queue_handle_t;
typedef struct _ze_command_list_handle_t *ze_command_list_handle_t;
typedef struct _ze_fence_handle_t *ze_fence_handle_t;
typedef struct _ze_event_pool_handle_t *ze_event_pool_handle_t;
typedef struct _ze_event_handle_t *ze_event_handle_t;
typedef struct _ze_physical_mem_handle_t *ze_physical_mem_handle_t;
typedef enum _ze_result_t
{
 ZE_RESULT_SUCCESS = 0,
 ZE_RESULT_NOT_READY = 1,
 ZE_RESULT_ERROR_DEVICE_LOST = 0x70000001,
 ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY = 0x70000002,
 ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY = 0x70000003,
 ZE_RESULT_ERROR_MODULE_BUILD_FAILURE = 0x70000004,
 ZE_RESULT_ERROR_MODULE_LINK_FAILURE = 0x70000005,
 ZE_RESULT_ERROR_DEVICE_REQUIRES_RESET = 0x70000006,
 ZE_RESULT_ERROR_DEVICE_IN_LOW_POWER_STATE = 0x70000007,
 ZE_RESULT_EXP_ERROR_DEVICE_IS_NOT_VERTEX = 0x7ff00001,
 ZE_RESULT_EXP_ERROR_VERTEX_IS_NOT_DEVICE = 0x7ff00002,
 ZE_RESULT_EXP_ERROR_REMOTE_DEVICE = 0x7ff00003,
 ZE_RESULT_ERROR_INSUFFICIENT_PERMISSIONS = 0x70010000,
 ZE_RESULT_ERROR_NOT_AVAILABLE = 0x70010001,
 ZE_RESULT_ERROR_DEPENDENCY_UNAVAILABLE = 0x70020000,
 ZE_RESULT_WARNING_DROPPED_DATA = 0x70020001,
 ZE_RESULT_ERROR_UNINITIALIZED = 0x78000001,
 ZE_RESULT_ERROR_UNSUPPORTED_VERSION = 0x78000002,
 ZE_RESULT_ERROR_UNSUPPORTED_FEATURE = 0x78000003,
 ZE_RESULT_ERROR_INVALID_ARGUMENT = 0x78000004,
 ZE_RESULT_ERROR_INVALID_NULL_HANDLE = 0x78000005,
 ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE = 0x78000006,
 ZE_RESULT_ERROR_INVALID_NULL_POINTER = 0x78000007,
 ZE_RESULT_ERROR_INVALID_SIZE = 0x78000008,
 ZE_RESULT_ERROR_UNSUPPORTED_SIZE = 0x78000009,
 ZE_RESULT_ERROR_UNSUPPORTED_ALIGNMENT = 0x7800000a,
 ZE_RESULT_ERROR_INVALID_SYNCHRONIZATION_OBJECT = 0x7800000b,
 ZE_RESULT_ERROR_INVALID_ENUMERATION = 0x7800000c,
 ZE_RESULT_ERROR_UNSUPPORTED_ENUMERATION = 0x7800000d,
 ZE_RESULT_ERROR_UNSUPPORTED_IMAGE_FORMAT = 0x7800000e,
 ZE_RESULT_ERROR_INVALID_NATIVE_BINARY = 0x7800000f,
 ZE_RESULT_ERROR_INVALID_GLOBAL_NAME = 0x78000010,
 ZE_RESULT_ERROR_INVALID_KERNEL_NAME = 0x78000011,
 ZE_RESULT_ERROR_INVALID_FUNCTION_NAME = 0x78000012,
 ZE_RESULT_ERROR_INVALID_GROUP_SIZE_DIMENSION = 0x78000013,
 ZE_RESULT_ERROR_INVALID_GLOBAL_WIDTH_DIMENSION = 0x78000014,
 ZE_RESULT_ERROR_INVALID_KERNEL_ARGUMENT_INDEX = 0x78000015,
 ZE_RESULT_ERROR_INVALID_KERNEL_ARGUMENT_SIZE = 0x78000016,
 ZE_RESULT_ERROR_INVALID_KERNEL_ATTRIBUTE_VALUE = 0x78000017,
 ZE_RESULT_ERROR_INVALID_MODULE_UNLINKED = 0x78000018,
 ZE_RESULT_ERROR_INVALID_COMMAND_LIST_TYPE = 0x78000019,
 ZE_RESULT_ERROR_OVERLAPPING_REGIONS = 0x7800001a,
 ZE_RESULT_WARNING_ACTION_REQUIRED = 0x7800001b,
 ZE_RESULT_ERROR_UNKNOWN = 0x7ffffffe,
 ZE_RESULT_FORCE_UINT32 = 0x7fffffff
} ze_result_t;
typedef enum _ze_structure_type_t
{
 ZE_STRUCTURE_TYPE_DRIVER_PROPERTIES = 0x1,
 ZE_STRUCTURE_TYPE_DRIVER_IPC_PROPERTIES = 0x2,
 ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES = 0x3,
 ZE_STRUCTURE_TYPE_DEVICE_COMPUTE_PROPERTIES = 0x4,
 ZE_STRUCTURE_TYPE_DEVICE_MODULE_PROPERTIES = 0x5,
 ZE_STRUCTURE_TYPE_COMMAND_QUEUE_GROUP_PROPERTIES = 0x6,
 ZE_STRUCTURE_TYPE_DEVICE_MEMORY_PROPERTIES = 0x7,
 ZE_STRUCTURE_TYPE_DEVICE_MEMORY_ACCESS_PROPERTIES = 0x8,
 ZE_STRUCTURE_TYPE_DEVICE_CACHE_PROPERTIES = 0x9,
 ZE_STRUCTURE_TYPE_DEVICE_IMAGE_PROPERTIES = 0xa,
 ZE_STRUCTURE_TYPE_DEVICE_P2P_PROPERTIES = 0xb,
 ZE_STRUCTURE_TYPE_DEVICE_EXTERNAL_MEMORY_PROPERTIES = 0xc,
 ZE_STRUCTURE_TYPE_CONTEXT_DESC = 0xd,
 ZE_STRUCTURE_TYPE_COMMAND_QUEUE_DESC = 0xe,
 ZE_STRUCTURE_TYPE_COMMAND_LIST_DESC = 0xf,
 ZE_STRUCTURE_TYPE_EVENT_POOL_DESC = 0x10,
 ZE_STRUCTURE_TYPE_EVENT_DESC = 0x11,
 ZE_STRUCTURE_TYPE_FENCE_DESC = 0x12,
 ZE_STRUCTURE_TYPE_IMAGE_DESC = 0x13,
 ZE_STRUCTURE_TYPE_IMAGE_PROPERTIES = 0x14,
 ZE_STRUCTURE_TYPE_DEVICE_MEM_ALLOC_DESC = 0x15,
 ZE_STRUCTURE_TYPE_HOST_MEM_ALLOC_DESC = 0x16,
 ZE_STRUCTURE_TYPE_MEMORY_ALLOCATION_PROPERTIES = 0x17,
 ZE_STRUCTURE_TYPE_EXTERNAL_MEMORY_EXPORT_DESC = 0x18,
 ZE_STRUCTURE_TYPE_EXTERNAL_MEMORY_IMPORT_FD = 0x19,
 ZE_STRUCTURE_TYPE_EXTERNAL_MEMORY_EXPORT_FD = 0x1a,
 ZE_STRUCTURE_TYPE_MODULE_DESC = 0x1b,
 ZE_STRUCTURE_TYPE_MODULE_PROPERTIES = 0x1c,
 ZE_STRUCTURE_TYPE_KERNEL_DESC = 0x1d,
 ZE_STRUCTURE_TYPE_KERNEL_PROPERTIES = 0x1e,
 ZE_STRUCTURE_TYPE_SAMPLER_DESC = 0x1f,
 ZE_STRUCTURE_TYPE_PHYSICAL_MEM_DESC = 0x20,
 ZE_STRUCTURE_TYPE_KERNEL_PREFERRED_GROUP_SIZE_PROPERTIES = 0x21,
 ZE_STRUCTURE_TYPE_EXTERNAL_MEMORY_IMPORT_WIN32 = 0x22,
 ZE_STRUCTURE_TYPE_EXTERNAL_MEMORY_EXPORT_WIN32 = 0x23,
 ZE_STRUCTURE_TYPE_DEVICE_RAYTRACING_EXT_PROPERTIES = 0x00010001,
 ZE_STRUCTURE_TYPE_RAYTRACING_MEM_ALLOC_EXT_DESC = 0x10002,
 ZE_STRUCTURE_TYPE_FLOAT_ATOMIC_EXT_PROPERTIES = 0x10003,
 ZE_STRUCTURE_TYPE_CACHE_RESERVATION_EXT_DESC = 0x10004,
 ZE_STRUCTURE_TYPE_EU_COUNT_EXT = 0x10005,
 ZE_STRUCTURE_TYPE_SRGB_EXT_DESC = 0x10006,
 ZE_STRUCTURE_TYPE_LINKAGE_INSPECTION_EXT_DESC = 0x10007,
 ZE_STRUCTURE_TYPE_PCI_EXT_PROPERTIES = 0x10008,
 ZE_STRUCTURE_TYPE_DRIVER_MEMORY_FREE_EXT_PROPERTIES = 0x10009,
 ZE_STRUCTURE_TYPE_MEMORY_FREE_EXT_DESC = 0x1000a,
 ZE_STRUCTURE_TYPE_MEMORY_COMPRESSION_HINTS_EXT_DESC = 0x1000b,
 ZE_STRUCTURE_TYPE_IMAGE_ALLOCATION_EXT_PROPERTIES = 0x1000c,
 ZE_STRUCTURE_TYPE_DEVICE_LUID_EXT_PROPERTIES = 0x1000d,
 ZE_STRUCTURE_TYPE_DEVICE_MEMORY_EXT_PROPERTIES = 0x1000e,
 ZE_STRUCTURE_TYPE_RELAXED_ALLOCATION_LIMITS_EXP_DESC = 0x00020001,
 ZE_STRUCTURE_TYPE_MODULE_PROGRAM_EXP_DESC = 0x00020002,
 ZE_STRUCTURE_TYPE_SCHEDULING_HINT_EXP_PROPERTIES = 0x00020003,
 ZE_STRUCTURE_TYPE_SCHEDULING_HINT_EXP_DESC = 0x00020004,
 ZE_STRUCTURE_TYPE_IMAGE_VIEW_PLANAR_EXP_DESC = 0x00020005,
 ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES_1_2 = 0x00020006,
 ZE_STRUCTURE_TYPE_IMAGE_MEMORY_EXP_PROPERTIES = 0x00020007,
 ZE_STRUCTURE_TYPE_POWER_SAVING_HINT_EXP_DESC = 0x00020008,
 ZE_STRUCTURE_TYPE_COPY_BANDWIDTH_EXP_PROPERTIES = 0x00020009,
 ZE_STRUCTURE_TYPE_DEVICE_P2P_BANDWIDTH_EXP_PROPERTIES = 0x0002000A,
 ZE_STRUCTURE_TYPE_FABRIC_VERTEX_EXP_PROPERTIES = 0x0002000B,
 ZE_STRUCTURE_TYPE_FABRIC_EDGE_EXP_PROPERTIES = 0x0002000C,
 ZE_STRUCTURE_TYPE_FORCE_UINT32 = 0x7fffffff
} ze_structure_type_t;
typedef struct _ze_driver_uuid_t ze_driver_uuid_t;
typedef struct _ze_driver_properties_t ze_driver_properties_t;
typedef struct _ze_device_uuid_t ze_device_uuid_t;
typedef struct _ze_device_properties_t ze_device_properties_t;
typedef struct _ze_device_compute_properties_t ze_device_compute_properties_t;
typedef struct _ze_command_queue_group_properties_t ze_command_queue_group_properties_t;
typedef struct _ze_device_memory_properties_t ze_device_memory_properties_t;
typedef struct _ze_context_desc_t ze_context_desc_t;
typedef struct _ze_command_queue_desc_t ze_command_queue_desc_t;
typedef struct _ze_command_list_desc_t ze_command_list_desc_t;
typedef struct _ze_event_pool_desc_t ze_event_pool_desc_t;
typedef struct _ze_event_desc_t ze_event_desc_t;
typedef struct _ze_kernel_timestamp_data_t ze_kernel_timestamp_data_t;
typedef struct _ze_kernel_timestamp_result_t ze_kernel_timestamp_result_t;
typedef struct _ze_device_mem_alloc_desc_t ze_device_mem_alloc_desc_t;
typedef struct _ze_host_mem_alloc_desc_t ze_host_mem_alloc_desc_t;
typedef struct _ze_memory_allocation_properties_t ze_memory_allocation_properties_t;
typedef struct _ze_physical_mem_desc_t ze_physical_mem_desc_t;
typedef uint32_t ze_init_flags_t;
typedef enum _ze_init_flag_t
{
 ZE_INIT_FLAG_GPU_ONLY = ( 1 << 0 ),
 ZE_INIT_FLAG_VPU_ONLY = ( 1 << 1 ),
 ZE_INIT_FLAG_FORCE_UINT32 = 0x7fffffff
} ze_init_flag_t;
ze_result_t
zeInit(
 ze_init_flags_t flags
 );
ze_result_t
zeDriverGet(
 uint32_t* pCount,
 ze_driver_handle_t* phDrivers
 );
typedef enum _ze_api_version_t
{
 ZE_API_VERSION_1_0 = (( 1 << 16 )|( 0 & 0x0000ffff)),
 ZE_API_VERSION_1_1 = (( 1 << 16 )|( 1 & 0x0000ffff)),
 ZE_API_VERSION_1_2 = (( 1 << 16 )|( 2 & 0x0000ffff)),
 ZE_API_VERSION_1_3 = (( 1 << 16 )|( 3 & 0x0000ffff)),
 ZE_API_VERSION_1_4 = (( 1 << 16 )|( 4 & 0x0000ffff)),
 ZE_API_VERSION_CURRENT = (( 1 << 16 )|( 4 & 0x0000ffff)),
 ZE_API_VERSION_FORCE_UINT32 = 0x7fffffff
} ze_api_version_t;
ze_result_t
zeDriverGetApiVersion(
 ze_driver_handle_t hDriver,
 ze_api_version_t* version
 );
typedef struct _ze_driver_uuid_t
{
 uint8_t id[16];
} ze_driver_uuid_t;
typedef struct _ze_driver_properties_t
{
 ze_structure_type_t stype;
 void* pNext;
 ze_driver_uuid_t uuid;
 uint32_t driverVersion;
} ze_driver_properties_t;
ze_result_t
zeDriverGetProperties(
 ze_driver_handle_t hDriver,
 ze_driver_properties_t* pDriverProperties
 );
ze_result_t
zeDeviceGet(
 ze_driver_handle_t hDriver,
 uint32_t* pCount,
 ze_device_handle_t* phDevices
 );
typedef enum _ze_device_type_t
{
 ZE_DEVICE_TYPE_GPU = 1,
 ZE_DEVICE_TYPE_CPU = 2,
 ZE_DEVICE_TYPE_FPGA = 3,
 ZE_DEVICE_TYPE_MCA = 4,
 ZE_DEVICE_TYPE_VPU = 5,
 ZE_DEVICE_TYPE_FORCE_UINT32 = 0x7fffffff
} ze_device_type_t;
typedef struct _ze_device_uuid_t
{
 uint8_t id[16];
} ze_device_uuid_t;
typedef uint32_t ze_device_property_flags_t;
typedef enum _ze_device_property_flag_t
{
 ZE_DEVICE_PROPERTY_FLAG_INTEGRATED = ( 1 << 0 ),
 ZE_DEVICE_PROPERTY_FLAG_SUBDEVICE = ( 1 << 1 ),
 ZE_DEVICE_PROPERTY_FLAG_ECC = ( 1 << 2 ),
 ZE_DEVICE_PROPERTY_FLAG_ONDEMANDPAGING = ( 1 << 3 ),
 ZE_DEVICE_PROPERTY_FLAG_FORCE_UINT32 = 0x7fffffff
} ze_device_property_flag_t;
typedef struct _ze_device_properties_t
{
 ze_structure_type_t stype;
 void* pNext;
 ze_device_type_t type;
 uint32_t vendorId;
 uint32_t deviceId;
 ze_device_property_flags_t flags;
 uint32_t subdeviceId;
 uint32_t coreClockRate;
 uint64_t maxMemAllocSize;
 uint32_t maxHardwareContexts;
 uint32_t maxCommandQueuePriority;
 uint32_t numThreadsPerEU;
 uint32_t physicalEUSimdWidth;
 uint32_t numEUsPerSubslice;
 uint32_t numSubslicesPerSlice;
 uint32_t numSlices;
 uint64_t timerResolution;
 uint32_t timestampValidBits;
 uint32_t kernelTimestampValidBits;
 ze_device_uuid_t uuid;
 char name[256];
} ze_device_properties_t;
ze_result_t
zeDeviceGetProperties(
 ze_device_handle_t hDevice,
 ze_device_properties_t* pDeviceProperties
 );
typedef struct _ze_device_compute_properties_t
{
 ze_structure_type_t stype;
 void* pNext;
 uint32_t maxTotalGroupSize;
 uint32_t maxGroupSizeX;
 uint32_t maxGroupSizeY;
 uint32_t maxGroupSizeZ;
 uint32_t maxGroupCountX;
 uint32_t maxGroupCountY;
 uint32_t maxGroupCountZ;
 uint32_t maxSharedLocalMemory;
 uint32_t numSubGroupSizes;
 uint32_t subGroupSizes[8];
} ze_device_compute_properties_t;
ze_result_t
zeDeviceGetComputeProperties(
 ze_device_handle_t hDevice,
 ze_device_compute_properties_t* pComputeProperties
 );
typedef uint32_t ze_command_queue_group_property_flags_t;
typedef enum _ze_command_queue_group_property_flag_t
{
 ZE_COMMAND_QUEUE_GROUP_PROPERTY_FLAG_COMPUTE = ( 1 << 0 ),
 ZE_COMMAND_QUEUE_GROUP_PROPERTY_FLAG_COPY = ( 1 << 1 ),
 ZE_COMMAND_QUEUE_GROUP_PROPERTY_FLAG_COOPERATIVE_KERNELS = ( 1 << 2 ),
 ZE_COMMAND_QUEUE_GROUP_PROPERTY_FLAG_METRICS = ( 1 << 3 ),
 ZE_COMMAND_QUEUE_GROUP_PROPERTY_FLAG_FORCE_UINT32 = 0x7fffffff
} ze_command_queue_group_property_flag_t;
typedef struct _ze_command_queue_group_properties_t
{
 ze_structure_type_t stype;
 void* pNext;
 ze_command_queue_group_property_flags_t flags;
 size_t maxMemoryFillPatternSize;
 uint32_t numQueues;
} ze_command_queue_group_properties_t;
ze_result_t
zeDeviceGetCommandQueueGroupProperties(
 ze_device_handle_t hDevice,
 uint32_t* pCount,
 ze_command_queue_group_properties_t* pCommandQueueGroupProperties
 );
typedef uint32_t ze_device_memory_property_flags_t;
typedef enum _ze_device_memory_property_flag_t
{
 ZE_DEVICE_MEMORY_PROPERTY_FLAG_TBD = ( 1 << 0 ),
 ZE_DEVICE_MEMORY_PROPERTY_FLAG_FORCE_UINT32 = 0x7fffffff
} ze_device_memory_property_flag_t;
typedef struct _ze_device_memory_properties_t
{
 ze_structure_type_t stype;
 void* pNext;
 ze_device_memory_property_flags_t flags;
 uint32_t maxClockRate;
 uint32_t maxBusWidth;
 uint64_t totalSize;
 char name[256];
} ze_device_memory_properties_t;
ze_result_t
zeDeviceGetMemoryProperties(
 ze_device_handle_t hDevice,
 uint32_t* pCount,
 ze_device_memory_properties_t* pMemProperties
 );
ze_result_t
zeDeviceCanAccessPeer(
 ze_device_handle_t hDevice,
 ze_device_handle_t hPeerDevice,
 ze_bool_t* value
 );
ze_result_t
zeDeviceGetGlobalTimestamps(
 ze_device_handle_t hDevice,
 uint64_t* hostTimestamp,
 uint64_t* deviceTimestamp
 );
typedef uint32_t ze_context_flags_t;
typedef struct _ze_context_desc_t
{
 ze_structure_type_t stype;
 const void* pNext;
 ze_context_flags_t flags;
} ze_context_desc_t;
ze_result_t
zeContextCreate(
 ze_driver_handle_t hDriver,
 const ze_context_desc_t* desc,
 ze_context_handle_t* phContext
 );
ze_result_t
zeContextDestroy(
 ze_context_handle_t hContext
 );
typedef uint32_t ze_command_queue_flags_t;
typedef enum _ze_command_queue_flag_t
{
 ZE_COMMAND_QUEUE_FLAG_EXPLICIT_ONLY = ( 1 << 0 ),
 ZE_COMMAND_QUEUE_FLAG_FORCE_UINT32 = 0x7fffffff
} ze_command_queue_flag_t;
typedef enum _ze_command_queue_mode_t
{
 ZE_COMMAND_QUEUE_MODE_DEFAULT = 0,
 ZE_COMMAND_QUEUE_MODE_SYNCHRONOUS = 1,
 ZE_COMMAND_QUEUE_MODE_ASYNCHRONOUS = 2,
 ZE_COMMAND_QUEUE_MODE_FORCE_UINT32 = 0x7fffffff
} ze_command_queue_mode_t;
typedef enum _ze_command_queue_priority_t
{
 ZE_COMMAND_QUEUE_PRIORITY_NORMAL = 0,
 ZE_COMMAND_QUEUE_PRIORITY_PRIORITY_LOW = 1,
 ZE_COMMAND_QUEUE_PRIORITY_PRIORITY_HIGH = 2,
 ZE_COMMAND_QUEUE_PRIORITY_FORCE_UINT32 = 0x7fffffff
} ze_command_queue_priority_t;
typedef struct _ze_command_queue_desc_t
{
 ze_structure_type_t stype;
 const void* pNext;
 uint32_t ordinal;
 uint32_t index;
 ze_command_queue_flags_t flags;
 ze_command_queue_mode_t mode;
 ze_command_queue_priority_t priority;
} ze_command_queue_desc_t;
ze_result_t
zeCommandQueueCreate(
 ze_context_handle_t hContext,
 ze_device_handle_t hDevice,
 const ze_command_queue_desc_t* desc,
 ze_command_queue_handle_t* phCommandQueue
 );
ze_result_t
zeCommandQueueDestroy(
 ze_command_queue_handle_t hCommandQueue
 );
ze_result_t
zeCommandQueueExecuteCommandLists(
 ze_command_queue_handle_t hCommandQueue,
 uint32_t numCommandLists,
 ze_command_list_handle_t* phCommandLists,
 ze_fence_handle_t hFence
 );
ze_result_t
zeCommandQueueSynchronize(
 ze_command_queue_handle_t hCommandQueue,
 uint64_t timeout
 );
typedef uint32_t ze_command_list_flags_t;
typedef enum _ze_command_list_flag_t
{
 ZE_COMMAND_LIST_FLAG_RELAXED_ORDERING = ( 1 << 0 ),
 ZE_COMMAND_LIST_FLAG_MAXIMIZE_THROUGHPUT = ( 1 << 1 ),
 ZE_COMMAND_LIST_FLAG_EXPLICIT_ONLY = ( 1 << 2 ),
 ZE_COMMAND_LIST_FLAG_FORCE_UINT32 = 0x7fffffff
} ze_command_list_flag_t;
typedef struct _ze_command_list_desc_t
{
 ze_structure_type_t stype;
 const void* pNext;
 uint32_t commandQueueGroupOrdinal;
 ze_command_list_flags_t flags;
} ze_command_list_desc_t;
ze_result_t
zeCommandListCreate(
 ze_context_handle_t hContext,
 ze_device_handle_t hDevice,
 const ze_command_list_desc_t* desc,
 ze_command_list_handle_t* phCommandList
 );
ze_result_t
zeCommandListCreateImmediate(
 ze_context_handle_t hContext,
 ze_device_handle_t hDevice,
 const ze_command_queue_desc_t* altdesc,
 ze_command_list_handle_t* phCommandList
 );
ze_result_t
zeCommandListDestroy(
 ze_command_list_handle_t hCommandList
 );
ze_result_t
zeCommandListClose(
 ze_command_list_handle_t hCommandList
 );
ze_result_t
zeCommandListReset(
 ze_command_list_handle_t hCommandList
 );
ze_result_t
zeCommandListAppendWriteGlobalTimestamp(
 ze_command_list_handle_t hCommandList,
 uint64_t* dstptr,
 ze_event_handle_t hSignalEvent,
 uint32_t numWaitEvents,
 ze_event_handle_t* phWaitEvents
 );
ze_result_t
zeCommandListAppendBarrier(
 ze_command_list_handle_t hCommandList,
 ze_event_handle_t hSignalEvent,
 uint32_t numWaitEvents,
 ze_event_handle_t* phWaitEvents
 );
ze_result_t
zeCommandListAppendMemoryCopy(
 ze_command_list_handle_t hCommandList,
 void* dstptr,
 const void* srcptr,
 size_t size,
 ze_event_handle_t hSignalEvent,
 uint32_t numWaitEvents,
 ze_event_handle_t* phWaitEvents
 );
ze_result_t
zeCommandListAppendMemoryFill(
 ze_command_list_handle_t hCommandList,
 void* ptr,
 const void* pattern,
 size_t pattern_size,
 size_t size,
 ze_event_handle_t hSignalEvent,
 uint32_t numWaitEvents,
 ze_event_handle_t* phWaitEvents
 );
typedef uint32_t ze_event_pool_flags_t;
typedef enum _ze_event_pool_flag_t
{
 ZE_EVENT_POOL_FLAG_HOST_VISIBLE = ( 1 << 0 ),
 ZE_EVENT_POOL_FLAG_IPC = ( 1 << 1 ),
 ZE_EVENT_POOL_FLAG_KERNEL_TIMESTAMP = ( 1 << 2 ),
 ZE_EVENT_POOL_FLAG_FORCE_UINT32 = 0x7fffffff
} ze_event_pool_flag_t;
typedef struct _ze_event_pool_desc_t
{
 ze_structure_type_t stype;
 const void* pNext;
 ze_event_pool_flags_t flags;
 uint32_t count;
} ze_event_pool_desc_t;
ze_result_t
zeEventPoolCreate(
 ze_context_handle_t hContext,
 const ze_event_pool_desc_t* desc,
 uint32_t numDevices,
 ze_device_handle_t* phDevices,
 ze_event_pool_handle_t* phEventPool
 );
ze_result_t
zeEventPoolDestroy(
 ze_event_pool_handle_t hEventPool
 );
typedef uint32_t ze_event_scope_flags_t;
typedef enum _ze_event_scope_flag_t
{
 ZE_EVENT_SCOPE_FLAG_SUBDEVICE = ( 1 << 0 ),
 ZE_EVENT_SCOPE_FLAG_DEVICE = ( 1 << 1 ),
 ZE_EVENT_SCOPE_FLAG_HOST = ( 1 << 2 ),
 ZE_EVENT_SCOPE_FLAG_FORCE_UINT32 = 0x7fffffff
} ze_event_scope_flag_t;
typedef struct _ze_event_desc_t
{
 ze_structure_type_t stype;
 const void* pNext;
 uint32_t index;
 ze_event_scope_flags_t signal;
 ze_event_scope_flags_t wait;
} ze_event_desc_t;
ze_result_t
zeEventCreate(
 ze_event_pool_handle_t hEventPool,
 const ze_event_desc_t* desc,
 ze_event_handle_t* phEvent
 );
ze_result_t
zeEventDestroy(
 ze_event_handle_t hEvent
 );
ze_result_t
zeCommandListAppendSignalEvent(
 ze_command_list_handle_t hCommandList,
 ze_event_handle_t hEvent
 );
ze_result_t
zeCommandListAppendWaitOnEvents(
 ze_command_list_handle_t hCommandList,
 uint32_t numEvents,
 ze_event_handle_t* phEvents
 );
ze_result_t
zeEventHostSignal(
 ze_event_handle_t hEvent
 );
ze_result_t
zeEventHostSynchronize(
 ze_event_handle_t hEvent,
 uint64_t timeout
 );
ze_result_t
zeEventQueryStatus(
 ze_event_handle_t hEvent
 );
ze_result_t
zeCommandListAppendEventReset(
 ze_command_list_handle_t hCommandList,
 ze_event_handle_t hEvent
 );
ze_result_t
zeEventHostReset(
 ze_event_handle_t hEvent
 );
typedef struct _ze_kernel_timestamp_data_t
{
 uint64_t kernelStart;
 uint64_t kernelEnd;
} ze_kernel_timestamp_data_t;
typedef struct _ze_kernel_timestamp_result_t
{
 ze_kernel_timestamp_data_t global;
 ze_kernel_timestamp_data_t context;
} ze_kernel_timestamp_result_t;
ze_result_t
zeEventQueryKernelTimestamp(
 ze_event_handle_t hEvent,
 ze_kernel_timestamp_result_t* dstptr
 );
typedef uint32_t ze_device_mem_alloc_flags_t;
typedef struct _ze_device_mem_alloc_desc_t
{
 ze_structure_type_t stype;
 const void* pNext;
 ze_device_mem_alloc_flags_t flags;
 uint32_t ordinal;
} ze_device_mem_alloc_desc_t;
typedef uint32_t ze_host_mem_alloc_flags_t;
typedef struct _ze_host_mem_alloc_desc_t
{
 ze_structure_type_t stype;
 const void* pNext;
 ze_host_mem_alloc_flags_t flags;
} ze_host_mem_alloc_desc_t;
ze_result_t
zeMemAllocDevice(
 ze_context_handle_t hContext,
 const ze_device_mem_alloc_desc_t* device_desc,
 size_t size,
 size_t alignment,
 ze_device_handle_t hDevice,
 void** pptr
 );
ze_result_t
zeMemAllocHost(
 ze_context_handle_t hContext,
 const ze_host_mem_alloc_desc_t* host_desc,
 size_t size,
 size_t alignment,
 void** pptr
 );
ze_result_t
zeMemFree(
 ze_context_handle_t hContext,
 void* ptr
 );
typedef enum _ze_memory_type_t
{
 ZE_MEMORY_TYPE_UNKNOWN = 0,
 ZE_MEMORY_TYPE_HOST = 1,
 ZE_MEMORY_TYPE_DEVICE = 2,
 ZE_MEMORY_TYPE_SHARED = 3,
 ZE_MEMORY_TYPE_FORCE_UINT32 = 0x7fffffff
} ze_memory_type_t;
typedef struct _ze_memory_allocation_properties_t
{
 ze_structure_type_t stype;
 void* pNext;
 ze_memory_type_t type;
 uint64_t id;
 uint64_t pageSize;
} ze_memory_allocation_properties_t;
ze_result_t
zeMemGetAllocProperties(
 ze_context_handle_t hContext,
 const void* ptr,
 ze_memory_allocation_properties_t* pMemAllocProperties,
 ze_device_handle_t* phDevice
 );
ze_result_t
zeMemGetAddressRange(
 ze_context_handle_t hContext,
 const void* ptr,
 void** pBase,
 size_t* pSize
 );
typedef enum _ze_memory_access_attribute_t
{
 ZE_MEMORY_ACCESS_ATTRIBUTE_NONE = 0,
 ZE_MEMORY_ACCESS_ATTRIBUTE_READWRITE = 1,
 ZE_MEMORY_ACCESS_ATTRIBUTE_READONLY = 2,
 ZE_MEMORY_ACCESS_ATTRIBUTE_FORCE_UINT32 = 0x7fffffff
} ze_memory_access_attribute_t;
ze_result_t
zeVirtualMemReserve(
 ze_context_handle_t hContext,
 const void* pStart,
 size_t size,
 void** pptr
 );
ze_result_t
zeVirtualMemFree(
 ze_context_handle_t hContext,
 const void* ptr,
 size_t size
 );
ze_result_t
zeVirtualMemQueryPageSize(
 ze_context_handle_t hContext,
 ze_device_handle_t hDevice,
 size_t size,
 size_t* pagesize
 );
typedef uint32_t ze_external_memory_type_flags_t;
typedef enum _ze_external_memory_type_flag_t
{
 ZE_EXTERNAL_MEMORY_TYPE_FLAG_OPAQUE_FD = (1 << 0),
 ZE_EXTERNAL_MEMORY_TYPE_FLAG_DMA_BUF = (1 << 1),
 ZE_EXTERNAL_MEMORY_TYPE_FLAG_OPAQUE_WIN32 = (1 << 2),
 ZE_EXTERNAL_MEMORY_TYPE_FLAG_OPAQUE_WIN32_KMT = (1 << 3),
 ZE_EXTERNAL_MEMORY_TYPE_FLAG_D3D11_TEXTURE = (1 << 4),
 ZE_EXTERNAL_MEMORY_TYPE_FLAG_D3D11_TEXTURE_KMT = (1 << 5),
 ZE_EXTERNAL_MEMORY_TYPE_FLAG_D3D12_HEAP = (1 << 6),
 ZE_EXTERNAL_MEMORY_TYPE_FLAG_D3D12_RESOURCE = (1 << 7),
 ZE_EXTERNAL_MEMORY_TYPE_FLAG_FORCE_UINT32 = 0x7fffffff
} ze_external_memory_type_flag_t;
typedef struct _ze_external_memory_export_desc_t
{
 ze_structure_type_t stype;
 const void* pNext;
 ze_external_memory_type_flags_t flags;
} ze_external_memory_export_desc_t;
typedef struct _ze_external_memory_import_fd_t
{
 ze_structure_type_t stype;
 const void* pNext;
 ze_external_memory_type_flags_t flags;
 int fd;
} ze_external_memory_import_fd_t;
typedef struct _ze_external_memory_export_fd_t
{
 ze_structure_type_t stype;
 const void* pNext;
 ze_external_memory_type_flags_t flags;
 int fd;
} ze_external_memory_export_fd_t;
typedef uint32_t ze_physical_mem_flags_t;
typedef struct _ze_physical_mem_desc_t
{
 ze_structure_type_t stype;
 const void* pNext;
 ze_physical_mem_flags_t flags;
 size_t size;
} ze_physical_mem_desc_t;
ze_result_t
zePhysicalMemCreate(
 ze_context_handle_t hContext,
 ze_device_handle_t hDevice,
 ze_physical_mem_desc_t* desc,
 ze_physical_mem_handle_t* phPhysicalMemory
 );
ze_result_t
zePhysicalMemDestroy(
 ze_context_handle_t hContext,
 ze_physical_mem_handle_t hPhysicalMemory
 );
ze_result_t
zeVirtualMemMap(
 ze_context_handle_t hContext,
 const void* ptr,
 size_t size,
 ze_physical_mem_handle_t hPhysicalMemory,
 size_t offset,
 ze_memory_access_attribute_t access
 );
ze_result_t
zeVirtualMemUnmap(
 ze_context_handle_t hContext,
 const void* ptr,
 size_t size
 );
ze_result_t
zeVirtualMemSetAccessAttribute(
 ze_context_handle_t hContext,
 const void* ptr,
 size_t size,
 ze_memory_access_attribute_t access
 );
typedef ze_device_handle_t zes_device_handle_t;
typedef struct _zes_mem_handle_t *zes_mem_handle_t;
typedef enum _zes_structure_type_t
{
 ZES_STRUCTURE_TYPE_DEVICE_PROPERTIES = 0x1,
 ZES_STRUCTURE_TYPE_PCI_PROPERTIES = 0x2,
 ZES_STRUCTURE_TYPE_PCI_BAR_PROPERTIES = 0x3,
 ZES_STRUCTURE_TYPE_DIAG_PROPERTIES = 0x4,
 ZES_STRUCTURE_TYPE_ENGINE_PROPERTIES = 0x5,
 ZES_STRUCTURE_TYPE_FABRIC_PORT_PROPERTIES = 0x6,
 ZES_STRUCTURE_TYPE_FAN_PROPERTIES = 0x7,
 ZES_STRUCTURE_TYPE_FIRMWARE_PROPERTIES = 0x8,
 ZES_STRUCTURE_TYPE_FREQ_PROPERTIES = 0x9,
 ZES_STRUCTURE_TYPE_LED_PROPERTIES = 0xa,
 ZES_STRUCTURE_TYPE_MEM_PROPERTIES = 0xb,
 ZES_STRUCTURE_TYPE_PERF_PROPERTIES = 0xc,
 ZES_STRUCTURE_TYPE_POWER_PROPERTIES = 0xd,
 ZES_STRUCTURE_TYPE_PSU_PROPERTIES = 0xe,
 ZES_STRUCTURE_TYPE_RAS_PROPERTIES = 0xf,
 ZES_STRUCTURE_TYPE_SCHED_PROPERTIES = 0x10,
 ZES_STRUCTURE_TYPE_SCHED_TIMEOUT_PROPERTIES = 0x11,
 ZES_STRUCTURE_TYPE_SCHED_TIMESLICE_PROPERTIES = 0x12,
 ZES_STRUCTURE_TYPE_STANDBY_PROPERTIES = 0x13,
 ZES_STRUCTURE_TYPE_TEMP_PROPERTIES = 0x14,
 ZES_STRUCTURE_TYPE_DEVICE_STATE = 0x15,
 ZES_STRUCTURE_TYPE_PROCESS_STATE = 0x16,
 ZES_STRUCTURE_TYPE_PCI_STATE = 0x17,
 ZES_STRUCTURE_TYPE_FABRIC_PORT_CONFIG = 0x18,
 ZES_STRUCTURE_TYPE_FABRIC_PORT_STATE = 0x19,
 ZES_STRUCTURE_TYPE_FAN_CONFIG = 0x1a,
 ZES_STRUCTURE_TYPE_FREQ_STATE = 0x1b,
 ZES_STRUCTURE_TYPE_OC_CAPABILITIES = 0x1c,
 ZES_STRUCTURE_TYPE_LED_STATE = 0x1d,
 ZES_STRUCTURE_TYPE_MEM_STATE = 0x1e,
 ZES_STRUCTURE_TYPE_PSU_STATE = 0x1f,
 ZES_STRUCTURE_TYPE_BASE_STATE = 0x20,
 ZES_STRUCTURE_TYPE_RAS_CONFIG = 0x21,
 ZES_STRUCTURE_TYPE_RAS_STATE = 0x22,
 ZES_STRUCTURE_TYPE_TEMP_CONFIG = 0x23,
 ZES_STRUCTURE_TYPE_PCI_BAR_PROPERTIES_1_2 = 0x24,
 ZES_STRUCTURE_TYPE_DEVICE_ECC_DESC = 0x25,
 ZES_STRUCTURE_TYPE_DEVICE_ECC_PROPERTIES = 0x26,
 ZES_STRUCTURE_TYPE_POWER_LIMIT_EXT_DESC = 0x27,
 ZES_STRUCTURE_TYPE_POWER_EXT_PROPERTIES = 0x28,
 ZES_STRUCTURE_TYPE_FORCE_UINT32 = 0x7fffffff
} zes_structure_type_t;
typedef struct _zes_mem_properties_t zes_mem_properties_t;
typedef struct _zes_mem_state_t zes_mem_state_t;
typedef enum _zes_mem_type_t
{
 ZES_MEM_TYPE_HBM = 0,
 ZES_MEM_TYPE_DDR = 1,
 ZES_MEM_TYPE_DDR3 = 2,
 ZES_MEM_TYPE_DDR4 = 3,
 ZES_MEM_TYPE_DDR5 = 4,
 ZES_MEM_TYPE_LPDDR = 5,
 ZES_MEM_TYPE_LPDDR3 = 6,
 ZES_MEM_TYPE_LPDDR4 = 7,
 ZES_MEM_TYPE_LPDDR5 = 8,
 ZES_MEM_TYPE_SRAM = 9,
 ZES_MEM_TYPE_L1 = 10,
 ZES_MEM_TYPE_L3 = 11,
 ZES_MEM_TYPE_GRF = 12,
 ZES_MEM_TYPE_SLM = 13,
 ZES_MEM_TYPE_GDDR4 = 14,
 ZES_MEM_TYPE_GDDR5 = 15,
 ZES_MEM_TYPE_GDDR5X = 16,
 ZES_MEM_TYPE_GDDR6 = 17,
 ZES_MEM_TYPE_GDDR6X = 18,
 ZES_MEM_TYPE_GDDR7 = 19,
 ZES_MEM_TYPE_FORCE_UINT32 = 0x7fffffff
} zes_mem_type_t;
typedef enum _zes_mem_loc_t
{
 ZES_MEM_LOC_SYSTEM = 0,
 ZES_MEM_LOC_DEVICE = 1,
 ZES_MEM_LOC_FORCE_UINT32 = 0x7fffffff
} zes_mem_loc_t;
typedef enum _zes_mem_health_t
{
 ZES_MEM_HEALTH_UNKNOWN = 0,
 ZES_MEM_HEALTH_OK = 1,
 ZES_MEM_HEALTH_DEGRADED = 2,
 ZES_MEM_HEALTH_CRITICAL = 3,
 ZES_MEM_HEALTH_REPLACE = 4,
 ZES_MEM_HEALTH_FORCE_UINT32 = 0x7fffffff
} zes_mem_health_t;
typedef struct _zes_mem_properties_t
{
 zes_structure_type_t stype;
 void* pNext;
 zes_mem_type_t type;
 ze_bool_t onSubdevice;
 uint32_t subdeviceId;
 zes_mem_loc_t location;
 uint64_t physicalSize;
 int32_t busWidth;
 int32_t numChannels;
} zes_mem_properties_t;
typedef struct _zes_mem_state_t
{
 zes_structure_type_t stype;
 const void* pNext;
 zes_mem_health_t health;
 uint64_t free;
 uint64_t size;
} zes_mem_state_t;
ze_result_t
zesDeviceEnumMemoryModules(
 zes_device_handle_t hDevice,
 uint32_t* pCount,
 zes_mem_handle_t* phMemory
 );
ze_result_t
zesMemoryGetProperties(
 zes_mem_handle_t hMemory,
 zes_mem_properties_t* pProperties
 );
ze_result_t
zesMemoryGetState(
 zes_mem_handle_t hMemory,
 zes_mem_state_t* pState
 );
typedef struct _ze_ipc_mem_handle_t
{
 char data[64];
} ze_ipc_mem_handle_t;
typedef struct _ze_ipc_event_pool_handle_t
{
 char data[64];
} ze_ipc_event_pool_handle_t;
typedef uint32_t ze_ipc_memory_flags_t;
ze_result_t
zeMemGetIpcHandle(
 ze_context_handle_t hContext,
 const void* ptr,
 ze_ipc_mem_handle_t* pIpcHandle
 );
ze_result_t
zeMemOpenIpcHandle(
 ze_context_handle_t hContext,
 ze_device_handle_t hDevice,
 ze_ipc_mem_handle_t handle,
 ze_ipc_memory_flags_t flags,
 void** pptr
 );
ze_result_t
zeMemCloseIpcHandle(
 ze_context_handle_t hContext,
 const void* ptr
 );
ze_result_t
zeEventPoolGetIpcHandle(
 ze_event_pool_handle_t hEventPool,
 ze_ipc_event_pool_handle_t* phIpc
 );
ze_result_t
zeEventPoolOpenIpcHandle(
 ze_context_handle_t hContext,
 ze_ipc_event_pool_handle_t hIpc,
 ze_event_pool_handle_t* phEventPool
 );
ze_result_t
zeEventPoolCloseIpcHandle(
 ze_event_pool_handle_t hEventPool
 );
typedef struct _zel_version {
 int major;
 int minor;
 int patch;
 } zel_version_t;
typedef struct zel_component_version {
 char component_name[64];
 ze_api_version_t spec_version;
 zel_version_t component_lib_version;
} zel_component_version_t;
ze_result_t
zelLoaderGetVersions(
 size_t *num_elems,
 zel_component_version_t *versions);

/* Newer than the 1.4 headers (API 1.6); declared here so it can be probed at run time. */
ze_result_t zeCommandListHostSynchronize(ze_command_list_handle_t hCommandList, uint64_t timeout);

/* Newer than the 1.8 loader (API 1.15): exporting physical memory as a file descriptor,
   written from the Level Zero specification's description of zePhysicalMemGetProperties
   (an ze_external_memory_export_fd_t chained to the properties' pNext). Probed at run time:
   Debian's 1.8.12 loader does not export it. */
#define ZE_STRUCTURE_TYPE_PHYSICAL_MEM_PROPERTIES 0x00020040
typedef struct _ze_physical_mem_properties_t
{
 ze_structure_type_t stype;
 void* pNext;
 uint64_t id;
 uint64_t size;
} ze_physical_mem_properties_t;
ze_result_t zePhysicalMemGetProperties(ze_context_handle_t hContext, ze_physical_mem_handle_t hPhysicalMem,
                                       ze_physical_mem_properties_t* pMemProperties);
"""
