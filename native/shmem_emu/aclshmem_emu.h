/* Declarations of the Ascend SHMEM host API subset that memsem uses, as exported by the
 * memsem shmem host emulator (libshmem_host_emu.so), which is a TEST DOUBLE: it moves bytes
 * with host memcpy over POSIX shared memory and never touches an NPU.
 *
 * Written from the public headers of Ascend SHMEM (github hicann/shmem at 643bfb7,
 * include/host/... and include/host_device/shmem_common_types.h); the types and signatures
 * below have the same C ABI as libshmem.so. It is plain C for cffi: no includes, no guards,
 * only "#define NAME <int>" macros. The includer provides <stdint.h> and <stddef.h>.
 * C++ enums of the real headers are written as int (data_op_engine_type_t, int-sized) and
 * unsigned int (aclshmemx_bootstrap_t, declared ": unsigned int"). aclrtStream is void *.
 *
 * The memsem engine binds the same functions through src/memsem/engines/mte/_aclshmem_cdef.h;
 * tests/test_shmem_emu.py checks that both files declare the same types and layouts.
 */

/* enum aclshmem_error_code_t (include/host/shmem_host_def.h) */
#define ACLSHMEM_SUCCESS 0
#define ACLSHMEM_INVALID_PARAM -1
#define ACLSHMEM_INVALID_VALUE -2
#define ACLSHMEM_SMEM_ERROR -3
#define ACLSHMEM_INNER_ERROR -4
#define ACLSHMEM_NOT_INITED -5
#define ACLSHMEM_BOOTSTRAP_ERROR -6
#define ACLSHMEM_TIMEOUT_ERROR -7
#define ACLSHMEM_MALLOC_FAILED -8
#define ACLSHMEM_DL_FUNC_FAILED -9
#define ACLSHMEM_INNER_TIMEOUT -10
#define ACLSHMEM_UNDER_API_UNLOAD -11
#define ACLSHMEM_NOT_SUPPORTED -100

/* enum aclshmemx_bootstrap_t : unsigned int */
#define ACLSHMEMX_INIT_WITH_DEFAULT 1
#define ACLSHMEMX_INIT_WITH_MPI 2
#define ACLSHMEMX_INIT_WITH_UNIQUEID 8

/* enum aclshmemx_init_status_t */
#define ACLSHMEM_STATUS_NOT_INITIALIZED 0
#define ACLSHMEM_STATUS_SHM_CREATED 1
#define ACLSHMEM_STATUS_IS_INITIALIZED 2

/* enum data_op_engine_type_t (include/host_device/shmem_common_types.h) */
#define ACLSHMEM_DATA_OP_MTE 1
#define ACLSHMEM_DATA_OP_SDMA 2
#define ACLSHMEM_DATA_OP_ROCE 4
#define ACLSHMEM_DATA_OP_UDMA 8

/* enum aclshmem_signal_op_type_t */
#define ACLSHMEM_SIGNAL_SET 0
#define ACLSHMEM_SIGNAL_ADD 1

/* enum aclshmem_cmp_op_type_t */
#define ACLSHMEM_CMP_EQ 0
#define ACLSHMEM_CMP_NE 1
#define ACLSHMEM_CMP_GT 2
#define ACLSHMEM_CMP_GE 3
#define ACLSHMEM_CMP_LT 4
#define ACLSHMEM_CMP_LE 5

/* enum aclshmem_mem_type_t */
#define HOST_SIDE 0
#define DEVICE_SIDE 1

/* Sizes from the real headers. */
#define ACLSHMEM_MAX_IP_PORT_LEN 64
#define ACLSHMEM_UNIQUE_ID_INNER_LEN 124
#define ACLSHMEM_SIGNAL_SIZE 8
#define ACLSHMEM_DEFAULT_TIMEOUT_S 120

typedef void *aclrtStream;

/* 24 bytes. version is (1 << 16) + sizeof(this struct) in the C++ default initializer. */
typedef struct {
    int version;
    int data_op_engine_type;             /* data_op_engine_type_t */
    uint32_t shm_init_timeout;           /* seconds */
    uint32_t shm_create_timeout;         /* seconds */
    uint32_t control_operation_timeout;  /* seconds */
    int32_t sockFd;
} aclshmem_init_optional_attr_t;

/* 120 bytes on LP64: my_pe@0 n_pes@4 ip_port@8 local_mem_size@72 option_attr@80
 * comm_args@104 instance_id@112. The C++ header gives option_attr a default initializer
 * (version, MTE, 120 s timeouts); from C the caller must fill it. */
typedef struct aclshmemx_init_attr_t {
    int my_pe;
    int n_pes;
    char ip_port[64];
    uint64_t local_mem_size;
    aclshmem_init_optional_attr_t option_attr;
    void *comm_args;
    uint64_t instance_id;
} aclshmemx_init_attr_t;

/* 136 bytes; version is (1 << 16) + sizeof(aclshmemx_uniqueid_t). */
typedef struct {
    int32_t version;
    int my_pe;
    int n_pes;
    char internal[124];
} aclshmemx_uniqueid_t;

/* init (include/host/init/shmem_host_init.h, include/host/team/shmem_host_team.h) */
int aclshmemx_init_status(void);
int aclshmemx_get_uniqueid(aclshmemx_uniqueid_t *uid);
int aclshmemx_set_attr_uniqueid_args(int my_pe, int n_pes, int64_t local_mem_size,
                                     aclshmemx_uniqueid_t *uid, aclshmemx_init_attr_t *aclshmem_attr);
int aclshmemx_init_attr(unsigned int bootstrap_flags, aclshmemx_init_attr_t *attributes);
int aclshmem_finalize(void);
int aclshmem_my_pe(void);
int aclshmem_n_pes(void);
void aclshmem_info_get_version(int *major, int *minor);
void aclshmem_info_get_name(char *name);

/* symmetric heap (include/host/mem/shmem_host_heap.h) */
void *aclshmem_malloc(size_t size);
void *aclshmem_calloc(size_t nmemb, size_t size);
void *aclshmem_align(size_t alignment, size_t size);
void aclshmem_free(void *ptr);
void *aclshmemx_get_heap_base(int mem_type);

/* RMA (include/host/data_plane/shmem_host_rma.h) */
void *aclshmem_ptr(void *ptr, int pe);
void aclshmem_putmem(void *dst, void *src, size_t elem_size, int32_t pe);
void aclshmem_getmem(void *dst, void *src, size_t elem_size, int32_t pe);
void aclshmem_putmem_nbi(void *dst, void *src, size_t elem_size, int32_t pe);
void aclshmem_getmem_nbi(void *dst, void *src, size_t elem_size, int32_t pe);
void aclshmemx_putmem_on_stream(void *dst, void *src, size_t elem_size, int32_t pe, aclrtStream stream);
void aclshmemx_getmem_on_stream(void *dst, void *src, size_t elem_size, int32_t pe, aclrtStream stream);
void aclshmemx_quiet_on_stream(aclrtStream stream);

/* signals (include/host/data_plane/shmem_host_so.h, shmem_host_p2p_sync.h) */
void aclshmemx_putmem_signal(void *dst, void *src, size_t elem_size, void *sig_addr,
                             int32_t signal, int sig_op, int pe);
void aclshmemx_putmem_signal_nbi(void *dst, void *src, size_t elem_size, void *sig_addr,
                                 int32_t signal, int sig_op, int pe);
void aclshmem_signal_wait_until(int32_t *sig_addr, int cmp, int32_t cmp_val);

/* collectives (include/host/data_plane/shmem_host_cc.h) */
void aclshmem_barrier_all(void);

/* ---- Emulator-only extensions (NOT in libshmem.so; test double only) ----
 * aclshmemx_emu_last_error: the error code of the last failed call on this thread (0 if
 *   none), its message copied into msg (NUL-terminated, msg_len bytes at most; msg may be
 *   NULL); clears it. The real library returns void from data-plane calls and only logs.
 * aclshmemx_emu_set_wait_timeout_ms: bound aclshmem_signal_wait_until (the real call waits
 *   forever). 0 means no bound. Default: $MEMSEM_SHMEM_EMU_WAIT_TIMEOUT_MS or 120000.
 *   On expiry the wait returns and the last error is ACLSHMEM_TIMEOUT_ERROR.
 * aclshmemx_emu_pending_ops: operations queued and not yet completed (only non-zero with
 *   MEMSEM_SHMEM_EMU_DEFER_NBI=1, where nbi and on-stream operations complete at quiet). */
int aclshmemx_emu_last_error(char *msg, size_t msg_len);
int aclshmemx_emu_set_wait_timeout_ms(int64_t timeout_ms);
int aclshmemx_emu_pending_ops(void);
