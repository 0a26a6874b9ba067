/*
 * emu_cuda.h - the part of CUDA that kernels/cuda uses, emulated on the CPU,
 * so that the kernels' tests run where no GPU is (CI, this project's usual
 * machines). Force-included (-include) into every kernel source, which is
 * compiled as C++ after tests/gpu/emu/emu_source.py has turned its launches
 * (kernel<<<grid, block, smem, stream>>>(args)) into emu_launch calls.
 *
 * Each block runs alone; its threads are fibers (emu_rt.cpp) that switch only
 * at __syncthreads, __syncwarp and shuffles, so the emulation checks what a
 * kernel computes (indexing, bounds, arithmetic, the barrier pattern: a
 * barrier some threads of a warp or block never reach is reported as
 * divergent or as a deadlock) but not timing: a race between two barriers
 * shows only where the order of threads matters (EMU_ORDER=reverse runs each
 * step's threads in the other order). Device memory is host memory whose
 * allocations are tracked (cp.async checks bounds and alignment, __ldg
 * alignment);
 * streams run synchronously; graph capture records launches and a graph
 * launch replays them. Float intrinsics round as the device does (_rn);
 * libm's exp, sin and cos stand in for CUDA's, which may differ in the
 * last bit. A failure prints "EMU FAILURE: ..." with the block and thread
 * and aborts. The real GPU tests remain the authority (tests/gpu/run.sh).
 */
#pragma once
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <limits.h>
#include <new>
#include <functional>
#include <vector>
extern "C" {
#include "f16.h"
}
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct dim3 { unsigned x, y, z; dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {} };
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
struct float4 { float x, y, z, w; };
struct float2 { float x, y; };
struct __half { uint16_t b; };

extern dim3 threadIdx, blockIdx, blockDim, gridDim;

typedef struct CUstream_st *cudaStream_t;
typedef struct emu_event *cudaEvent_t;
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorMemoryAllocation = 2, cudaErrorInsufficientDriver = 35,
                   cudaErrorIllegalAddress = 700 };
enum cudaMemcpyKind { cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice };
enum cudaDeviceAttr {
    cudaDevAttrMemoryClockRate = 36, cudaDevAttrGlobalMemoryBusWidth = 37,
    cudaDevAttrComputeCapabilityMajor = 75, cudaDevAttrComputeCapabilityMinor = 76,
};
struct cudaDeviceProp { char name[256]; int major, minor, multiProcessorCount; size_t totalGlobalMem; };
cudaError_t cudaGetDeviceCount(int *n);
cudaError_t cudaSetDevice(int);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int);
cudaError_t cudaDeviceGetAttribute(int *v, cudaDeviceAttr, int);
const char *cudaGetErrorString(cudaError_t);
const char *cudaGetErrorName(cudaError_t);
cudaError_t cudaGetLastError();
cudaError_t cudaMalloc(void **p, size_t n);
cudaError_t cudaFree(void *p);
cudaError_t cudaMemcpy(void *d, const void *s, size_t n, cudaMemcpyKind);
cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, cudaMemcpyKind, cudaStream_t);
cudaError_t cudaMemsetAsync(void *d, int v, size_t n, cudaStream_t);
cudaError_t cudaMemcpy2DAsync(void *d, size_t dp, const void *s, size_t sp, size_t w, size_t h, cudaMemcpyKind, cudaStream_t);
cudaError_t cudaDeviceSynchronize();
cudaError_t cudaEventCreate(cudaEvent_t *);
cudaError_t cudaEventDestroy(cudaEvent_t);
cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t);
cudaError_t cudaEventSynchronize(cudaEvent_t);
cudaError_t cudaEventElapsedTime(float *, cudaEvent_t, cudaEvent_t);

/* half */
inline float __half2float(__half h) { return kvd_f16_to_f32(h.b); }
inline __half __float2half_rn(float f) { return __half{ kvd_f32_to_f16(f) }; }
inline __half __ushort_as_half(unsigned short u) { return __half{ u }; }
inline unsigned short __half_as_ushort(__half h) { return h.b; }

/* math */
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
inline float __fsqrt_rn(float a) { return sqrtf(a); }
inline float __expf(float x) { return expf(x); }
inline int __dp4a(int a, int b, int c)
{
    for (int i = 0; i < 4; i++)
        c += (int)(int8_t)(a >> (8 * i)) * (int)(int8_t)(b >> (8 * i));
    return c;
}
/* (hi:lo) >> min(shift, 32), the low 32 bits */
inline unsigned __funnelshift_rc(unsigned lo, unsigned hi, unsigned shift)
{
    const unsigned s = shift < 32 ? shift : 32;
    return (unsigned)((((uint64_t)hi << 32) | lo) >> s);
}
void emu_fail(const char *what);
template <class T> inline T __ldg(const T *p)
{
    if ((uintptr_t)p % alignof(T) != 0 || ((sizeof(T) == 16 || sizeof(T) == 8) && (uintptr_t)p % sizeof(T)))
        emu_fail("misaligned __ldg");
    return *p;
}

/* threads, barriers, shuffles */
void emu_barrier(int kind);      /* 1: warp, 2: block */
uint64_t emu_exchange(uint64_t v, int src_lane);
inline void __syncwarp(unsigned = 0xffffffffu) { emu_barrier(1); }
inline void __syncthreads() { emu_barrier(2); }
template <class T> inline T emu_shfl(T v, int src)
{
    uint64_t b = 0;
    memcpy(&b, &v, sizeof(T));
    b = emu_exchange(b, src);
    T r;
    memcpy(&r, &b, sizeof(T));
    return r;
}
template <class T> inline T __shfl_sync(unsigned mask, T v, int src)
{
    if (mask != 0xffffffffu) emu_fail("partial mask");
    return emu_shfl(v, src & 31);
}
template <class T> inline T __shfl_xor_sync(unsigned mask, T v, int o)
{
    if (mask != 0xffffffffu) emu_fail("partial mask");
    return emu_shfl(v, (int)((threadIdx.x % 32) ^ o));
}
/* the lanes holding the same value as this one (every lane asks) */
unsigned emu_match_any(uint64_t v);
inline unsigned __match_any_sync(unsigned mask, unsigned v)
{
    if (mask != 0xffffffffu) emu_fail("partial mask");
    return emu_match_any(v);
}
unsigned emu_ballot(bool pred);
inline unsigned __ballot_sync(unsigned mask, int pred)
{
    if (mask != 0xffffffffu) emu_fail("partial mask");
    return emu_ballot(pred != 0);
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
/* cp.async: queued per thread, done at the wait */
void emu_cp_async(void *dst, const void *src, int bytes);
void emu_cp_wait();

/* launch: every block in turn, its threads as fibers */
void emu_run_grid(dim3 grid, dim3 block, const std::function<void()> &body);
/* graph capture: launches are recorded (arguments by value) while capturing */
struct emu_node { dim3 grid, block; std::function<void()> body; };
extern bool emu_capturing;
extern std::vector<emu_node> emu_captured;
template <class... P, class... A>
void emu_launch(void (*k)(P...), dim3 grid, dim3 block, size_t, cudaStream_t, A... args)
{
    emu_run_grid(grid, block, [=]() { k(args...); });
}

/* streams, page-locked memory and graphs (kcuda_stream.cu): streams run
 * synchronously; capture records launches and a graph launch replays them
 * (EMU_NOGRAPH=1 refuses capture, as a device without it) */
enum { cudaStreamNonBlocking = 1 };
enum cudaStreamCaptureMode { cudaStreamCaptureModeGlobal = 0, cudaStreamCaptureModeThreadLocal = 1 };
typedef struct emu_graph *cudaGraph_t;
typedef struct emu_graph_exec *cudaGraphExec_t;
#define cudaErrorNotSupported ((cudaError_t)801)
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaMallocHost(void **p, size_t n);
cudaError_t cudaFreeHost(void *p);
cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode m);
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *g);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *e, cudaGraph_t g, unsigned long long flags);
cudaError_t cudaGraphLaunch(cudaGraphExec_t e, cudaStream_t s);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t e);
cudaError_t cudaGraphDestroy(cudaGraph_t g);
/* a kernel that finds its contract broken stops the whole program */
inline void __trap() { emu_fail("__trap (a kernel found its contract broken)"); }
/* fibers switch only at barriers, so a plain add is atomic */
inline unsigned atomicAdd(unsigned *p, unsigned v) { unsigned o = *p; *p = o + v; return o; }
inline int atomicAdd(int *p, int v) { int o = *p; *p = o + v; return o; }
inline uint32_t __float_as_uint(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
