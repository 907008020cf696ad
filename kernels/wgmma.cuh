// Hopper warpgroup MMA (wgmma, sm_90a only) for the attention instances of
// kernels/unified_attention.cu that run on it.
//
// * Tiles in shared memory use the 128-byte swizzle: a tile of `rows` rows
//   of 16-bit elements is stored as 64-column atoms, [atom][rows][128 bytes],
//   and 16-byte chunk c of row r of an atom sits at chunk position
//   c ^ (r % 8) of its row. The swizzle is applied on address bits, so every
//   atom starts 1024-byte aligned. `sw128_offset` gives a chunk's byte
//   offset; `sw128_desc` the matrix descriptor of a part of such a tile.
// * An operand stored with its K dimension along the rows' 64 columns (Q and
//   K for S = Q K^T: "K-major") is read 16 columns at a time by adding the
//   column offset (32 bytes per 16 columns) to the descriptor's start; its
//   8-row groups are 1024 bytes apart (the stride byte offset).
// * V for O += P V is stored the same way, keys as rows and value columns
//   along the atoms, which is the MN-major (transposed) layout of the B
//   operand: the 8-key groups are 1024 bytes apart (stride byte offset) and
//   the 64-column atoms `rows` x 128 bytes apart (leading byte offset).
// * The accumulator of m64nNk16 gives warp w of the warpgroup rows
//   16w .. 16w + 15 in the layout of mma.sync m16n8k16 (register 4i + e:
//   row g + 8 (e / 2), column 8i + 2 (lane % 4) + e % 2, g = lane / 4), and
//   the A operand from registers takes that layout too, so probabilities go
//   from the scores' registers to P V as they do for mma.sync.
// * The instructions assemble for sm_90a only: kernels that use them are
//   instantiated only in that compilation (see `CPA_SM90A` in
//   kernels/unified_attention.cu).
// * Every thread of the warpgroup executes each call (`.sync.aligned`);
//   `wg_fence` before the first MMA that reads registers written since the
//   last one, `wg_commit` after a batch, `wg_wait<N>` until at most N
//   batches are pending; `wg_fence_operands` keeps the compiler from moving
//   register accesses across them.
#pragma once

#include "common.cuh"

namespace cpa {

// Byte offset of 16-byte chunk `chunk` (columns 8 chunk .. + 8) of row `row`
// in a 128-byte-swizzled tile of `rows` rows.
__device__ __forceinline__ uint32_t sw128_offset(int rows, int row, int chunk) {
  return (uint32_t)((chunk >> 3) * rows * 128 + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
}

// Matrix descriptor of a 128-byte-swizzled operand at shared address `saddr`
// (lbo / sbo: leading / stride byte offsets).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
  return (uint64_t)((saddr & 0x3FFFF) >> 4) | ((uint64_t)((lbo & 0x3FFFF) >> 4) << 16) |
         ((uint64_t)((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

// Shared-memory writes of the generic proxy (stores, cp.async) made visible
// to the MMAs, which read through the async proxy; before the barrier that
// publishes them.
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
template <int R>
__device__ __forceinline__ void wg_fence_operands(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// ---- mbarriers (shared memory, CTA scope) ----
// `init`: `count` arrivals complete a phase. `arrive`: one arrival (release).
// `cp_async_arrive`: one arrival once every cp.async this thread issued so
// far has landed (.noinc: the arrival is one of the `count`). `wait`: until
// the phase of parity `parity` has completed (acquire).
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_cp_async_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  } while (!done);
}

// Registers per thread of this warpgroup from here on (a multiple of 8,
// 24-256; every thread of the warpgroup executes it).
template <int N>
__device__ __forceinline__ void set_max_regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void set_max_regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

#define CPA_WG_REGS32                                                                                            \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31"
#define CPA_WG_REGS64                                                                                            \
  CPA_WG_REGS32                                                                                                  \
  ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "  \
  "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define CPA_WG_REGS128                                                                                           \
  CPA_WG_REGS64                                                                                                  \
  ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, "  \
  "%85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, "   \
  "%105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, " \
  "%123, %124, %125, %126, %127"

#define CPA_WG_D8(b) \
  "+f"(d[b]), "+f"(d[b + 1]), "+f"(d[b + 2]), "+f"(d[b + 3]), "+f"(d[b + 4]), "+f"(d[b + 5]), "+f"(d[b + 6]), "+f"(d[b + 7])
#define CPA_WG_D32 CPA_WG_D8(0), CPA_WG_D8(8), CPA_WG_D8(16), CPA_WG_D8(24)
#define CPA_WG_D64 CPA_WG_D32, CPA_WG_D8(32), CPA_WG_D8(40), CPA_WG_D8(48), CPA_WG_D8(56)
#define CPA_WG_D128 \
  CPA_WG_D64, CPA_WG_D8(64), CPA_WG_D8(72), CPA_WG_D8(80), CPA_WG_D8(88), CPA_WG_D8(96), CPA_WG_D8(104), CPA_WG_D8(112), CPA_WG_D8(120)

// m64nNk16 with f32 accumulators d (N / 2 per thread) for element type T:
// `ss`: d (+)= A B^T, A (64 x 16) and B (N x 16) K-major in shared memory
// (scale_d = 0: d = A B^T); `rs_t`: d += A B, A (64 x 16) from registers,
// B (16 x N) MN-major in shared memory.
template <typename T, int N>
struct WgMma;

#define CPA_WG_MMA(T, PTX, N, R, REGS, DOPS, I0, I1, I2, I3, I4)                                             \
  template <>                                                                                                   \
  struct WgMma<T, N> {                                                                                          \
    static __device__ __forceinline__ void ss(float (&d)[R], uint64_t a, uint64_t b, int scale_d) {            \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" I2 ", 0;\n"                                           \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX "." PTX " {" REGS "}, %" I0 ", %" I1  \
                   ", p, 1, 1, 0, 0;\n}\n"                                                                     \
                   : DOPS                                                                                       \
                   : "l"(a), "l"(b), "r"(scale_d));                                                             \
    }                                                                                                           \
    static __device__ __forceinline__ void rs_t(float (&d)[R], const uint32_t (&a)[4], uint64_t b) {            \
      asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX "." PTX " {" REGS "}, {%" I0 ", %" I1 \
                   ", %" I2 ", %" I3 "}, %" I4 ", 1, 1, 1, 1;\n"                                               \
                   : DOPS                                                                                       \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));                                       \
    }                                                                                                           \
  };

CPA_WG_MMA(__nv_bfloat16, "bf16", 64, 32, CPA_WG_REGS32, CPA_WG_D32, "32", "33", "34", "35", "36")
CPA_WG_MMA(__half, "f16", 64, 32, CPA_WG_REGS32, CPA_WG_D32, "32", "33", "34", "35", "36")
CPA_WG_MMA(__nv_bfloat16, "bf16", 128, 64, CPA_WG_REGS64, CPA_WG_D64, "64", "65", "66", "67", "68")
CPA_WG_MMA(__half, "f16", 128, 64, CPA_WG_REGS64, CPA_WG_D64, "64", "65", "66", "67", "68")
CPA_WG_MMA(__nv_bfloat16, "bf16", 256, 128, CPA_WG_REGS128, CPA_WG_D128, "128", "129", "130", "131", "132")
CPA_WG_MMA(__half, "f16", 256, 128, CPA_WG_REGS128, CPA_WG_D128, "128", "129", "130", "131", "132")

}  // namespace cpa
