/*
 * emu_rt.cpp - the CUDA emulation's run time (emu_cuda.h): a block's threads
 * as fibers on their own stacks, switched by a few lines of x86-64 assembly at
 * barriers and shuffles; the scheduler that releases a barrier once every
 * live thread of the block (or warp) has reached it; and the runtime API the
 * kernels' host code calls (memory, copies, streams, events, graphs).
 *
 * Environment: EMU_ORDER=reverse runs each step's threads from the last to
 * the first (a result that changes with it is a race); EMU_NOGRAPH=1 refuses
 * graph capture, as a device without it; EMU_NODEV=1 reports no device;
 * EMU_FAULT_FILE and EMU_FAULT_LAUNCH inject a device fault (below).
 */
#include <map>

#include <unistd.h>

#include "emu_cuda.h"

dim3 threadIdx, blockIdx, blockDim, gridDim;

extern "C" void emu_switch(void **save, void *to);
asm(R"(
.pushsection .text
.globl emu_switch
.type emu_switch,@function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size emu_switch, .-emu_switch
.popsection
)");

namespace {
struct CpReq { void *dst; const void *src; int bytes; };
struct Fiber {
    void *sp = nullptr;
    char *stack = nullptr;
    bool done = false;
    int wait = 0;               /* 0 ready, 1 warp barrier, 2 block barrier, 3 shuffle */
    unsigned xgen = 0;          /* exchanges this thread has made: picks xslot's half */
    std::vector<CpReq> pending;
};
constexpr size_t STACK = 256 << 10;
std::vector<Fiber> F;
int NT, cur, pos;               /* threads in the block; the one running; its place in the round */
bool reverse;                   /* EMU_ORDER=reverse */
void *main_sp;
const std::function<void()> *g_body;
uint64_t xslot[2][32][32];      /* [exchange parity][warp][lane] */
std::map<uintptr_t, size_t> allocs;
long long barriers;
}

void emu_fail(const char *what)
{
    fprintf(stderr, "EMU FAILURE: %s (block %u,%u,%u thread %u)\n", what, blockIdx.x, blockIdx.y, blockIdx.z,
            threadIdx.x);
    abort();
}

static void check_dev(const void *p, size_t n, const char *what)
{
    auto it = allocs.upper_bound((uintptr_t)p);
    if (it == allocs.begin()) emu_fail(what);
    --it;
    if ((uintptr_t)p + n > it->first + it->second) emu_fail(what);
}

/*
 * The running thread stops (it waits, or it has exited): on to the next
 * ready thread of this round, or back to the scheduler when none is left.
 * Nothing becomes ready during a round, so going from thread to thread is
 * the order the scheduler would run them in, at one switch a thread.
 */
static void yield()
{
    Fiber &me = F[cur];
    while (++pos < NT) {
        const int i = reverse ? NT - 1 - pos : pos;
        if (F[i].done || F[i].wait) continue;
        cur = i;
        threadIdx = dim3((unsigned)i);
        emu_switch(&me.sp, F[i].sp);
        return;
    }
    emu_switch(&me.sp, main_sp);
}

static void trampoline()
{
    (*g_body)();
    if (!F[cur].pending.empty()) emu_fail("thread exited with cp.async pending");
    F[cur].done = true;
    yield();
    abort();
}

void emu_barrier(int kind)
{
    barriers++;
    F[cur].wait = kind;
    yield();
}

/*
 * A warp-wide exchange of one value per lane. The slots alternate between
 * two halves, so one barrier is enough: a lane can write exchange k+1's
 * value only after every lane reached exchange k+1's barrier, that is after
 * every lane has read what exchange k left in the other half.
 */
uint64_t emu_exchange(uint64_t v, int src)
{
    const int w = cur / 32, lane = cur % 32;
    uint64_t *slot = xslot[F[cur].xgen++ & 1][w];
    slot[lane] = v;
    emu_barrier(3);
    return slot[src];
}

/* Every lane's v, for a warp-wide vote (every lane of the warp calls). */
static void warp_values(uint64_t v, uint64_t all[32])
{
    const int w = cur / 32, lane = cur % 32;
    uint64_t *slot = xslot[F[cur].xgen++ & 1][w];
    slot[lane] = v;
    emu_barrier(3);
    memcpy(all, slot, 32 * sizeof(*slot));
}

unsigned emu_match_any(uint64_t v)
{
    uint64_t all[32];
    warp_values(v, all);
    unsigned m = 0;
    for (int l = 0; l < 32; l++)
        m |= (all[l] == v ? 1u : 0u) << l;
    return m;
}

unsigned emu_ballot(bool pred)
{
    uint64_t all[32];
    warp_values(pred, all);
    unsigned m = 0;
    for (int l = 0; l < 32; l++)
        m |= (all[l] != 0 ? 1u : 0u) << l;
    return m;
}

void emu_cp_async(void *dst, const void *src, int bytes)
{
    if ((uintptr_t)dst % 16 || (uintptr_t)src % 16) emu_fail("misaligned cp.async");
    if (bytes < 0 || bytes > 16) emu_fail("cp.async size");
    if (bytes) check_dev(src, (size_t)bytes, "cp.async reads outside an allocation");
    F[cur].pending.push_back({ dst, src, bytes });
}

void emu_cp_wait()
{
    for (auto &r : F[cur].pending) {
        memcpy(r.dst, r.src, (size_t)r.bytes);     /* the rest of the 16 bytes zero-filled */
        memset((char *)r.dst + r.bytes, 0, (size_t)(16 - r.bytes));
    }
    F[cur].pending.clear();
}

static void run_block()
{
    for (int i = 0; i < NT; i++) {
        Fiber &f = F[i];
        if (!f.stack) f.stack = (char *)malloc(STACK);
        uintptr_t A = ((uintptr_t)(f.stack + STACK) & ~(uintptr_t)15) - 16;
        *(void **)A = (void *)trampoline;
        for (int k = 1; k <= 6; k++) *(uint64_t *)(A - 8 * k) = 0;
        f.sp = (void *)(A - 48);
        f.done = false;
        f.wait = 0;
        f.xgen = 0;
        f.pending.clear();
    }
    for (;;) {
        /* a round: the first ready thread, which hands on to the next (yield) */
        for (pos = 0; pos < NT; pos++) {
            const int i = reverse ? NT - 1 - pos : pos;
            if (F[i].done || F[i].wait) continue;
            cur = i;
            threadIdx = dim3((unsigned)i);
            emu_switch(&main_sp, F[i].sp);
            break;
        }
        int live = 0, at_block = 0;
        for (int i = 0; i < NT; i++)
            if (!F[i].done) { live++; at_block += F[i].wait == 2; }
        if (live == 0) return;
        bool released = false;
        if (at_block == live) {
            for (int i = 0; i < NT; i++) F[i].wait = 0;
            continue;
        }
        for (int w = 0; w * 32 < NT; w++) {
            int n = 0, n1 = 0, n3 = 0, dead = 0;
            for (int l = 0; l < 32 && w * 32 + l < NT; l++) {
                const Fiber &f = F[w * 32 + l];
                if (f.done) { dead++; continue; }
                n++; n1 += f.wait == 1; n3 += f.wait == 3;
            }
            if (n == 0) continue;
            if (n1 == n || n3 == n) {
                if (n3 == n && (dead || n != 32)) emu_fail("shuffle with exited lanes");
                for (int l = 0; l < 32 && w * 32 + l < NT; l++) F[w * 32 + l].wait = 0;
                released = true;
            } else if (n1 + n3 > 0 && (n1 + n3 != n || (n1 && n3))) {
                fprintf(stderr, "warp %d: %d live, %d at syncwarp, %d at shuffle\n", w, n, n1, n3);
                emu_fail("divergent warp barrier");
            }
        }
        if (!released) emu_fail("deadlock");
    }
}

bool emu_capturing;
std::vector<emu_node> emu_captured;

/*
 * An injected device fault, to test what a process does with a CUDA context
 * that a kernel has broken: with EMU_FAULT_FILE naming a file and
 * EMU_FAULT_LAUNCH=N, the process whose N-th kernel is about to run while the
 * file exists removes it (so one process of several faults) and from then on
 * behaves as a context after an illegal address: no kernel or copy runs; as on
 * a GPU, the launch itself reports nothing, the next synchronizing call (or
 * copy) reports the error, and from then on every such call and
 * cudaGetLastError do, for good.
 */
static bool faulted, observed;
static long launches;

static bool fault_now()
{
    static const char *file = getenv("EMU_FAULT_FILE");
    static const long at = getenv("EMU_FAULT_LAUNCH") ? atol(getenv("EMU_FAULT_LAUNCH")) : 0;
    if (faulted)
        return true;
    if (file == nullptr || at <= 0 || ++launches < at)
        return false;
    if (unlink(file) == 0) {
        fprintf(stderr, "emulation: device fault injected at kernel %ld (pid %d)\n", launches, (int)getpid());
        faulted = true;
    }
    return faulted;
}

/* what a synchronizing call returns (and after which the error is known) */
static cudaError_t status()
{
    observed = faulted;
    return faulted ? cudaErrorIllegalAddress : cudaSuccess;
}

void emu_run_grid(dim3 grid, dim3 block, const std::function<void()> &body)
{
    if (emu_capturing) { emu_captured.push_back({ grid, block, body }); return; }
    if (fault_now())
        return;
    if (block.y != 1 || block.z != 1) emu_fail("2-D blocks");
    static const bool rev = getenv("EMU_ORDER") != nullptr && strcmp(getenv("EMU_ORDER"), "reverse") == 0;
    reverse = rev;
    NT = (int)block.x;
    if ((int)F.size() < NT) F.resize(NT);
    g_body = &body;
    gridDim = grid;
    blockDim = block;
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                blockIdx = dim3(x, y, z);
                run_block();
            }
}

cudaError_t cudaGetDeviceCount(int *n) { *n = getenv("EMU_NODEV") ? 0 : 1; return *n ? cudaSuccess : cudaErrorInvalidValue; }
cudaError_t cudaSetDevice(int) { return cudaSuccess; }
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int)
{
    memset(p, 0, sizeof(*p));
    strcpy(p->name, "CPU emulation");
    p->major = 9; p->minor = 0; p->multiProcessorCount = 132; p->totalGlobalMem = 1ull << 34;
    return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int *v, cudaDeviceAttr a, int)
{
    *v = a == cudaDevAttrComputeCapabilityMajor ? 9 : 0;   /* an sm_90 device */
    return cudaSuccess;
}
const char *cudaGetErrorString(cudaError_t e)
{
    return e == cudaErrorIllegalAddress ? "an illegal memory access was encountered (emulated)" : "emulated error";
}
const char *cudaGetErrorName(cudaError_t) { return "cudaErrorEmulated"; }
cudaError_t cudaGetLastError() { return observed ? cudaErrorIllegalAddress : cudaSuccess; }
cudaError_t cudaMalloc(void **p, size_t n)
{
    n = (n + 255) / 256 * 256;
    *p = aligned_alloc(256, n);
    if (!*p) return cudaErrorMemoryAllocation;
    memset(*p, 0xa5, n);
    allocs[(uintptr_t)*p] = n;
    return cudaSuccess;
}
cudaError_t cudaFree(void *p) { allocs.erase((uintptr_t)p); free(p); return cudaSuccess; }

/* Memory that is device memory to the kernels without coming from cudaMalloc
 * (the shared allocations of emu_vmm.cpp): known to the bounds checks. */
void emu_register(void *p, size_t n, bool add)
{
    if (add)
        allocs[(uintptr_t)p] = n;
    else
        allocs.erase((uintptr_t)p);
}
cudaError_t cudaMemcpy(void *d, const void *s, size_t n, cudaMemcpyKind)
{
    if (faulted) return status();
    memmove(d, s, n);
    return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, cudaMemcpyKind k, cudaStream_t) { if (emu_capturing) emu_fail("copy during capture"); return cudaMemcpy(d, s, n, k); }
cudaError_t cudaMemsetAsync(void *d, int v, size_t n, cudaStream_t)
{
    if (emu_capturing) emu_fail("copy during capture");
    if (faulted) return status();
    memset(d, v, n);
    return cudaSuccess;
}
cudaError_t cudaMemcpy2DAsync(void *d, size_t dp, const void *s, size_t sp, size_t w, size_t h, cudaMemcpyKind, cudaStream_t)
{
    if (emu_capturing) emu_fail("copy during capture");
    if (faulted) return status();
    for (size_t i = 0; i < h; i++) memcpy((char *)d + i * dp, (const char *)s + i * sp, w);
    return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() { return status(); }
struct emu_event { int x; };
cudaError_t cudaEventCreate(cudaEvent_t *e) { *e = new emu_event; return cudaSuccess; }
cudaError_t cudaEventDestroy(cudaEvent_t e) { delete e; return cudaSuccess; }
cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t) { return cudaSuccess; }
cudaError_t cudaEventSynchronize(cudaEvent_t) { return status(); }
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t, cudaEvent_t) { *ms = 1.0f; return cudaSuccess; }
/* ---- streams, page-locked memory, graphs ---- */

struct CUstream_st { int x; };
struct emu_graph { std::vector<emu_node> nodes; };
struct emu_graph_exec { std::vector<emu_node> nodes; };
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned) { *s = new CUstream_st; return cudaSuccess; }
cudaError_t cudaStreamDestroy(cudaStream_t s) { delete s; return cudaSuccess; }
cudaError_t cudaStreamSynchronize(cudaStream_t) { return status(); }
cudaError_t cudaMallocHost(void **p, size_t n)
{
    *p = malloc(n);
    if (*p == nullptr)
        return cudaErrorMemoryAllocation;
    memset(*p, 0x5a, n);
    return cudaSuccess;
}
cudaError_t cudaFreeHost(void *p) { free(p); return cudaSuccess; }
/* capture records kernel launches (the only work the engine captures); a
 * launch replays them in order with the arguments they had when recorded */
cudaError_t cudaStreamBeginCapture(cudaStream_t, cudaStreamCaptureMode)
{
    if (getenv("EMU_NOGRAPH")) return cudaErrorNotSupported;
    if (emu_capturing) return cudaErrorInvalidValue;
    emu_capturing = true; emu_captured.clear(); return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t, cudaGraph_t *g)
{
    if (!emu_capturing) { *g = nullptr; return cudaErrorInvalidValue; }
    emu_capturing = false;
    *g = new emu_graph{ std::move(emu_captured) };
    emu_captured.clear();
    return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *e, cudaGraph_t g, unsigned long long) { *e = new emu_graph_exec{ g->nodes }; return cudaSuccess; }
cudaError_t cudaGraphLaunch(cudaGraphExec_t e, cudaStream_t)
{
    for (auto &n : e->nodes) emu_run_grid(n.grid, n.block, n.body);
    return observed ? cudaErrorIllegalAddress : cudaSuccess;   /* as a launch: the fault shows later */
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t e) { delete e; return cudaSuccess; }
cudaError_t cudaGraphDestroy(cudaGraph_t g) { delete g; return cudaSuccess; }
