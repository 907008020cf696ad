// Stream decode: decode-shaped paged attention in which every warp streams
// its own 16-key steps of the paged cache through a ring of shared-memory
// stages (cp.async, several steps in flight, no block barrier in the key
// loop), with the split-KV partials merged in the same launch.
//
// * `unified_attention_h{64|128|256}_stream_r{8|16}_{f16|bf16}[_fp8]` (16
//   rows: head sizes 64 and 128): one program of 4 warps per (sequence, KV
//   head[, head chunk], segment). Its ROWS = 8 x NR packed rows are the
//   query heads of one KV group times the sequence's new tokens (row r:
//   query row r / GE, head r % GE, as in kernels/unified_attention.cu); the
//   launch plan sends here only spans that fit. Block sizes are multiples of
//   16, 16-byte loads are aligned (`vec_loads`), padded head sizes 64, 128
//   and 256 (src/cuda/plan.rs checks all three; other calls take the
//   unified kernel's decode instances).
// * `unified_attention_h128_stream_r8w_{f16|bf16}[_fp8]`: the wide
//   instance, the same program with one ring stage per warp (two over
//   fp8) and registers
//   for 4 programs per SM (3 for `_r8`), which the plan takes when a
//   batch's groups fill one wave of it and not of `_r8`.
//
// The matrix products run transposed, so that the few query rows sit in the
// MMA's N dimension (8 per tile) and keys and value columns in M:
//   S^T [16 keys x 8 rows]  = K [16 keys x HEAD] . Q^T          (m16n8k16)
//   O^T [16 cols x 8 rows] += V^T [16 cols x 16 keys] . P^T
// with lane = 4 g + c (g = lane / 4, c = lane % 4):
// * K (the A operand of S^T): lane (g, c) reads keys g and g + 8 of the
//   step, the 16-byte units c, c + 4, c + 8, ... of each key row (EUK
//   dimensions per unit): the MMA's k index is permuted so that a lane's
//   k-step kk takes positions 4kk .. 4kk + 3 of its dimensions (a0: 4kk,
//   4kk+1; a2: 4kk+2, 4kk+3). Q (the B operand) is stored in shared memory
//   in that order ([row][kk][c][4]), one 8-byte load per k-step. fp8 keys
//   convert in registers, two per cvt.
// * P: the S^T accumulator holds (key g or g + 8, rows 2c, 2c+1); packed to
//   16 bits, each 8 x 8 half is transposed by `movmatrix` into the B
//   fragment of P^T (keys 2c, 2c+1 [+8], row g).
// * V (the A operand of O^T): lane (g, c) reads keys 2c, 2c+1, 2c+8, 2c+9
//   of the step, the units g, g + 8, ... of each value row; m-tile mt's
//   slots g and g + 8 are positions 2mt and 2mt + 1 of the lane's columns
//   (`out_col`). Pairs of keys are joined with byte permutes (fp8: permute,
//   then convert).
//
// Program phases (`StreamProgram`):
// * start: with `decode_only` (every sequence has one new token, so its
//   query row is its index) the query rows are loaded before the sequence's
//   lengths arrive; with `seq_len_hint` the block-table entries of the
//   program's first warp steps are loaded as if the sequence had that many
//   keys (kept when the real segment starts at the same key and ends no
//   later, else read again once the lengths are in).
// * locate: the sequence's span and key count (one round trip), the keys
//   [k_lo, k_hi) its rows see, its segment's 16-key steps [st_begin,
//   st_end) from k_lo rounded down to 16; warp w takes steps
//   st_begin + w + 4j.
// * issue: each warp's first DEPTH steps into its ring (one cp.async group
//   per step: 16 key rows and 16 value rows; keys no row sees and columns
//   past head_size are zero-filled, never read), then Q to shared memory
//   (fp8 caches: scaled per row by a power of two into f16's range; a row
//   holding NaN or +-inf gets a NaN score scale), one block barrier.
// * key loop, per warp, step j in stage j % DEPTH: wait for its group, a
//   warp barrier; QK^T; scores (scale, softcap, mask, ALiBi, qq_bias, as in
//   kernels/unified_attention.cu); the online softmax; P V; a warp barrier
//   (every lane has read the stage), then step j + DEPTH into it. Block ids
//   come from the warp's lanes (lane l holds the entry of step j0 + l; the
//   next 32 are loaded 32 steps ahead).
// * merge warps: row maxima and sums to shared memory, one barrier, each
//   warp's accumulator rescaled to the common maximum (over the rings), one
//   barrier; then the output (one segment: normalised, with the sink) or
//   the split-KV partials, in the layout `reduce_segments_*` reads.
// * split KV with arrival counters (ws_counters non-null): each program
//   fences its partial stores, one barrier, thread 0 counts the program in;
//   the last program of the (sequence, KV head, head chunk) group merges
//   every segment (an online merge over batches of MERGE_BATCH segments,
//   loads through L2) and sets the counter back to 0. Without counters
//   `reduce_segments_*` merges. Empty segments store (-inf, 0) pairs only;
//   the merge skips segments whose sum is 0 (their columns are loaded in
//   bounds and selected away, never multiplied).
// * short sequences of a split launch (`single_segment_steps`, with
//   counters only): a sequence whose keys span at most that many steps
//   runs unsplit. Every program of its group sees the same length and
//   decides alike: segment 0 takes every step and writes the output as a
//   one-segment launch does; the others return after `locate`, storing no
//   partials and never arriving, so the group's counter stays 0. A
//   CUDA-graph step splits for the longest sequence it may replay with;
//   this keeps its short sequences off the partials and the merge.
//
// Semantics and NaN handling are those of kernels/unified_attention.cu: masked
// scores are selected to -inf; NaN in a visible key, value, query or bias
// reaches the row; a row with no visible key is 0.

#pragma once

#include <type_traits>

#include "attention_params.cuh"
#include "kernel_contract.cuh"  // generated by build.rs from src/cuda/tiles.rs
#include "common.cuh"
#include "attention_rows.cuh"
#include "score_mods.cuh"

using namespace cpa;

namespace {

// ---- loads, permutes and conversions ----------------------------------------

// W 32-bit words (4: 16 bytes) from global memory through the non-coherent
// path, not kept in L1 (the query rows, read once); zeros, and no access,
// when !ok.
template <int W>
__device__ __forceinline__ void ld_stream(uint32_t* r, const void* p, bool ok);
template <>
__device__ __forceinline__ void ld_stream<4>(uint32_t* r, const void* p, bool ok) {
  asm volatile(
      "{\n .reg .pred q;\n setp.ne.b32 q, %5, 0;\n"
      " mov.b32 %0, 0;\n mov.b32 %1, 0;\n mov.b32 %2, 0;\n mov.b32 %3, 0;\n"
      " @q ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n}\n"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
      : "l"(p), "r"((int)ok));
}
// A 16-bit float's bits as f32.
template <typename T>
__device__ __forceinline__ float bits_to_f32(uint32_t b);
template <>
__device__ __forceinline__ float bits_to_f32<__half>(uint32_t b) {
  return __half2float(__ushort_as_half((unsigned short)b));
}
template <>
__device__ __forceinline__ float bits_to_f32<__nv_bfloat16>(uint32_t b) {
  return __bfloat162float(__ushort_as_bfloat16((unsigned short)b));
}

// The transpose of an 8 x 8 matrix of 16-bit elements held one row pair per
// lane (lane 4g + c: row g, columns 2c, 2c + 1).
__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
  uint32_t r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
  return r;
}

// Two e4m3 bytes (the low 16 bits of w; the lower byte is the first
// element) to two f16 values, the first in the low half. Exact.
__device__ __forceinline__ uint32_t fp8x2_to_h2(uint32_t w) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w & 0xffffu), __NV_E4M3);
  return (uint32_t)h.x | ((uint32_t)h.y << 16);
}

// The same for the high 16 bits of w. From sm_89 the conversion reads the
// register's upper half itself (no shift instruction).
__device__ __forceinline__ uint32_t fp8x2_hi_to_h2(uint32_t w) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint32_t r;
  asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, hi;\n}" : "=r"(r) : "r"(w));
  return r;
#else
  return fp8x2_to_h2(w >> 16);
#endif
}

}  // namespace

// One program (see the top of the file). HEAD: padded head size; NR: 8-row
// tiles of packed rows; WIDE: the wide instance's shorter ring and 4
// programs per SM.
template <typename T, typename C, int HEAD, int NR, bool WIDE, class G = LaunchGrid>
struct StreamProgram {
  static constexpr bool FP8 = std::is_same<C, fp8_t>::value;
  // fp8 caches run f16 MMAs (e4m3 converts to f16 exactly; the queries are
  // scaled into f16's range per row).
  using MM = typename std::conditional<FP8, __half, T>::type;
  static constexpr int WARPS = 4;
  static constexpr int NT = 32 * WARPS;
  static constexpr int ROWS = 8 * NR;
  static constexpr int DV = HEAD;
  static constexpr int KD = HEAD / 4;              // head dimensions of a key row per lane
  static constexpr int VC = DV / 8;                // value columns of a key row per lane
  static constexpr int KB = KD * (int)sizeof(C);   // bytes of a key row per lane
  static constexpr int VB = VC * (int)sizeof(C);   // bytes of a value row per lane
  static constexpr int KW = KB / 4, VW = VB / 4;   // the same in 32-bit words
  static constexpr int LK = 16;                    // bytes of a K unit
  static constexpr int LV = VB >= 16 ? 16 : VB;    // bytes of a V unit
  static constexpr int KSTEPS = HEAD / 16;         // k-steps of S^T
  static constexpr int MTILES = DV / 16;           // m-tiles of O^T
  // Elements of a 16-byte (K) / LV-byte (V) unit of a cache row: lane c
  // owns the K units c + 4i of a key row, lane g the V units g + 8i of a
  // value row (so that the lanes reading one row in one instruction read
  // consecutive units of it).
  static constexpr int EUK = 16 / (int)sizeof(C);
  static constexpr int EUV = LV / (int)sizeof(C);
  // Per-warp ring of DEPTH stages in shared memory, one 16-key step each:
  // K rows of KROW bytes, V rows of VROW bytes (16 bytes of padding: the
  // value rows a wavefront reads fall on distinct banks, the key rows on at
  // most two), filled by cp.async.
  static constexpr int KBYTES = HEAD * (int)sizeof(C);
  static constexpr int VBYTES = DV * (int)sizeof(C);
  static constexpr int KROW = KBYTES + 16;
  static constexpr int VROW = VBYTES + 16;
  static constexpr int STAGE = 16 * (KROW + VROW);
  // Stages per warp: 2 (3 programs of 4 warps per SM hold 12 warps' rings
  // and keep up to 2 steps of each in flight); head size 256: 3 over fp8,
  // 1 over a 16-bit cache, whose 16.9 KB steps would let a ring of 2 or
  // more hold one program per SM, with nothing to overlap its start and its
  // merge (two programs of 4 warps, one step in flight each, keep 135 KB of
  // an SM in flight), and not fit an A100's 163 KiB per program.
  // The wide instance (WIDE, head size 128, 8 rows): 1 stage over a 16-bit
  // cache (2 over fp8, whose steps are half the bytes), so that 4 programs
  // fit an SM, for batches whose (sequence, KV head) groups fill one wave
  // of it (see `prefer_wide` in src/cuda/plan.rs).
  static constexpr int DEPTH = WIDE ? (FP8 ? 2 : 1) : HEAD <= 128 ? 2 : FP8 ? 3 : 1;
  // Shared memory (bytes): Q [ROWS][QS] in the k-step order, the per-row
  // score scales, the warps' row maxima and sums, then the warps' rings,
  // over which the merge reuses the space for their rescaled accumulators
  // [WARPS][ROWS][OS] floats.
  static constexpr int QS = HEAD + 16;  // 2 HEAD + 32 bytes: rows 32 bytes apart modulo 128
  static constexpr int OS = DV + 4;
  static constexpr int Q_BYTES = ROWS * QS * 2;
  static constexpr int SCALE_BYTES = ROWS * 4;
  static constexpr int RED_BYTES = 2 * WARPS * ROWS * 4;
  static constexpr int O_BYTES = WARPS * ROWS * OS * 4;
  static constexpr int RING_BYTES = WARPS * DEPTH * STAGE;
  static constexpr int SMEM = Q_BYTES + SCALE_BYTES + RED_BYTES + (O_BYTES > RING_BYTES ? O_BYTES : RING_BYTES);
  static constexpr int MERGE_BATCH = 16;
  static_assert(HEAD == 64 || HEAD == 128 || HEAD == 256, "padded head sizes 64, 128, 256");
  static_assert(!WIDE || (HEAD == 128 && NR == 1), "a wide instance at head size 128, 8 rows only");
  static_assert(KB % LK == 0 && VB % LV == 0 && LV >= 8, "whole 16-byte K units, 8- or 16-byte V units");
  static_assert(KBYTES % 16 == 0 && VBYTES % 16 == 0 && STAGE % 16 == 0, "16-byte cp.async rows");
  static_assert(FP8 ? (KW == KSTEPS && 2 * VW == MTILES) : (KW == 2 * KSTEPS && VW == MTILES),
                "one K word per k-step half, one V word per m-tile (16-bit) or two (fp8)");

  const AttnParams& p;

  // ---- shared memory ----
  MM* sQ;
  float* row_qscale;  // [ROWS] the score-scale factor of each row (fp8 query scaling; NaN: bad row)
  float* red_m;       // [WARPS][ROWS]
  float* red_l;       // [WARPS][ROWS]
  float* sO;          // [WARPS][ROWS][OS], over the rings after the key loop
  unsigned char* ring;  // this warp's [DEPTH][STAGE] bytes

  int tid, lane, warp, g, c4;
  int GE, BLOCK_Q, group, kv_head, hc, seg, S;

  // ---- set by `locate` ----
  int seq, q_start, q_len, seq_len, context_len, q_first, q_last, window;
  int c_lo, c_hi, k_lo, k_hi, nr;
  const uint32_t* ranges;
  const uint32_t* table;
  int k_base;           // k_lo rounded down to 16: step t holds keys k_base + 16 t ..
  int st_begin, st_end; // this segment's steps
  int nw;               // this warp's steps
  int hs, bs;
  bool bs_pow2;
  int64_t kv_row, row_bytes;
  ScoreMods mods;  // the score pipeline (kernels/score_mods.cuh)
  bool plain;

  // This lane's rows 2c + j + 8n (j < 2, n < NR): validity and positions.
  bool rvalid[NR][2];
  int rq_rel[NR][2];
  int rhead[NR][2];

  // Block ids of this warp's steps: lane l holds step j0 + l (ent) and
  // j0 + 32 + l (ent_next).
  uint32_t ent, ent_next;
  int j0;

  // The program's place in its part's grid (kernels/attention_rows.cuh).
  G grid;

  __device__ __forceinline__ explicit StreamProgram(const AttnParams& params, const G& grid_ = G())
      : p(params), mods(params), grid(grid_) {
    extern __shared__ __align__(16) unsigned char smem[];
    sQ = reinterpret_cast<MM*>(smem);
    row_qscale = reinterpret_cast<float*>(smem + Q_BYTES);
    red_m = row_qscale + ROWS;
    red_l = red_m + WARPS * ROWS;
    sO = red_l + WARPS * ROWS;
    tid = threadIdx.x;
    lane = tid & 31;
    warp = tid >> 5;
    ring = reinterpret_cast<unsigned char*>(sO) + warp * DEPTH * STAGE;
    g = lane >> 2;
    c4 = lane & 3;
    GE = p.group_entries;
    BLOCK_Q = ROWS / GE;
    group = p.num_heads / p.num_kv_heads;
    kv_head = grid.y() / p.head_chunks;
    hc = grid.y() % p.head_chunks;
    seg = grid.z();
    S = p.num_segments;
    seq = grid.x();
    hs = p.head_size;
    bs = p.block_size;
    bs_pow2 = (bs & (bs - 1)) == 0;
    kv_row = (int64_t)p.num_kv_heads * hs;
    row_bytes = kv_row * (int64_t)sizeof(C);
    table = p.block_tables + (size_t)seq * p.block_table_width;
  }

  // Packed row r: query row r / GE (its position within the new tokens) and
  // head hc GE + r % GE of the KV group; `valid` needs q_len.
  __device__ __forceinline__ bool row_valid(int r, int qlen) const {
    const int ql = r / GE, gh = hc * GE + r % GE;
    return ql < BLOCK_Q && ql < qlen && gh < group;
  }
  __device__ __forceinline__ int row_head(int r) const {
    const int gh = hc * GE + r % GE;
    return kv_head * group + (gh < group ? gh : 0);
  }

  // ---- the keys of a sequence of n_keys keys and qlen new tokens ----
  // [lo, hi): every key some row sees (prefix ranges included); [cl, ch):
  // the causal / window span.
  __device__ __forceinline__ void key_span(int n_keys, int qlen, int& lo, int& hi, int& cl, int& ch) const {
    const int cx = n_keys - qlen;
    const int qf = cx, ql = cx + min(BLOCK_Q, qlen) - 1;
    const int w = p.sliding_window;
    cl = w > 0 ? max(0, qf - w + 1) : 0;
    ch = ql + 1;
    lo = cl;
    hi = ch;
    const uint32_t* rg = p.prefix_ranges ? p.prefix_ranges + (size_t)seq * p.max_ranges * 2 : nullptr;
    const int n = rg ? p.max_ranges : 0;
    for (int r = 0; r < n; ++r) {
      const int s = (int)rg[2 * r], e = (int)rg[2 * r + 1];
      if (s < e && s <= ql && qf < e) {
        lo = min(lo, s);
        hi = max(hi, e);
      }
    }
    hi = min(hi, n_keys);
  }

  // The segments of a sequence whose keys [lo, hi) span n 16-key steps:
  // the launch's, or 1 when the launch merges in its programs (arrival
  // counters) and n is at most `single_segment_steps`. Every program of a
  // (sequence, KV head, head chunk) group computes the same count.
  __device__ __forceinline__ int segments_for(int lo, int hi) const {
    const int n_steps = hi > lo ? (hi - (lo & ~15) + 15) / 16 : 0;
    const bool single = p.num_segments > 1 && p.ws_counters != nullptr && n_steps <= p.single_segment_steps;
    return single ? 1 : p.num_segments;
  }

  // This segment's 16-key steps [b, e) of keys [lo, hi) split into `segs`
  // segments, counted from base = lo rounded down to 16.
  __device__ __forceinline__ void seg_steps(int lo, int hi, int segs, int& base, int& b, int& e) const {
    base = lo & ~15;
    const int n_steps = hi > lo ? (hi - base + 15) / 16 : 0;
    const int sps = (n_steps + segs - 1) / segs;
    b = min(n_steps, seg * sps);
    e = min(n_steps, b + sps);
  }

  // The block-table entry of warp step jj (0 past the segment).
  __device__ __forceinline__ uint32_t entry_of(int jj, int base, int b, int e) const {
    const int t = b + warp + 4 * jj;
    if (t >= e) return 0u;
    const int idx = (base + 16 * t) / bs;
    return idx < p.block_table_width ? __ldg(table + idx) : 0u;
  }

  // ---- start and locate ----

  // The query rows of a span starting at token qs with qlen tokens, as raw
  // 16-byte chunks into `qv` (pass ps: row ps RPP + tid / CPR, chunk
  // tid % CPR); zeros past head_size and on invalid rows.
  static constexpr int CPR = HEAD / 8;             // 16-byte query chunks per row
  static constexpr int RPP = NT / CPR;             // rows per pass
  static constexpr int QPASSES = (ROWS + RPP - 1) / RPP;
  uint32_t qv[QPASSES][4];

  __device__ __forceinline__ void load_q_regs(int qs, int qlen) {
    const T* q = static_cast<const T*>(p.q);
#pragma unroll
    for (int ps = 0; ps < QPASSES; ++ps) {
      const int r = ps * RPP + tid / CPR, ch = tid % CPR;
      const bool ok = r < ROWS && row_valid(r, qlen) && ch * 8 < hs;
      const int64_t src = ((int64_t)(qs + r / GE) * p.num_heads + row_head(r)) * hs + ch * 8;
      ld_stream<4>(qv[ps], ok ? static_cast<const void*>(q + src) : static_cast<const void*>(q), ok);
    }
  }

  // The speculative (hinted) or real block-table entries of the warp's
  // first 64 steps.
  __device__ __forceinline__ void load_entries(int base, int b, int e) {
    ent = entry_of(lane, base, b, e);
    ent_next = entry_of(32 + lane, base, b, e);
    j0 = 0;
  }

  // The program's sequence, its rows and keys, its segment's steps; false
  // when the program has nothing to do (its sequence belongs to the other
  // launch of a mixed batch, or there is none, or it runs unsplit and this
  // is not its first segment).
  __device__ __forceinline__ bool locate(bool& q_loaded) {
    q_loaded = false;
    if (seq >= p.num_seqs) return false;
    const bool early_q = p.decode_only != 0;
    if (early_q) load_q_regs(seq, 1);
    // Entries as if the sequence held seq_len_hint keys and one new token:
    // hinted segment keys [h_begin, h_end).
    int h_begin = -1, h_end = -1;
    if (p.seq_len_hint > 0) {
      int lo, hi, cl, ch, b, e, base;
      key_span(p.seq_len_hint, 1, lo, hi, cl, ch);
      const int segs = segments_for(lo, hi);
      if (seg < segs) {
        seg_steps(lo, hi, segs, base, b, e);
        load_entries(base, b, e);
        h_begin = base + 16 * b;
        h_end = base + 16 * e;
      }
    }
    const uint32_t cu0 = p.cu_seqlens_q[seq], cu1 = p.cu_seqlens_q[seq + 1];
    const uint32_t n_keys = p.seq_lens[seq];
    q_start = (int)cu0;
    q_len = (int)cu1 - q_start;
    if (q_len == 0 || q_len < p.q_len_min || q_len > p.q_len_max) return false;
    seq_len = (int)n_keys;
    context_len = seq_len - q_len;
    q_first = context_len;
    q_last = context_len + min(BLOCK_Q, q_len) - 1;
    window = p.sliding_window;
    ranges = p.prefix_ranges ? p.prefix_ranges + (size_t)seq * p.max_ranges * 2 : nullptr;
    nr = ranges ? p.max_ranges : 0;
    key_span(seq_len, q_len, k_lo, k_hi, c_lo, c_hi);
    // A sequence short enough to run unsplit: segment 0's program does it
    // all and writes the output; the others of its group have nothing to
    // do (no partials, no arrival: its counter stays 0).
    S = segments_for(k_lo, k_hi);
    if (seg >= S) return false;
    seg_steps(k_lo, k_hi, S, k_base, st_begin, st_end);
    nw = st_end - st_begin > warp ? (st_end - st_begin - warp + 3) / 4 : 0;
    // The hinted entries serve when the real segment starts at the same key
    // and ends no later (its steps are then a prefix of the hinted ones).
    if (h_begin != k_base + 16 * st_begin || h_end < k_base + 16 * st_end) load_entries(k_base, st_begin, st_end);
    // The early query rows are those of a one-token span at row `seq`.
    q_loaded = early_q && q_len == 1 && q_start == seq;
    plain = mods.plain(nr);
#pragma unroll
    for (int n = 0; n < NR; ++n) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int r = 2 * c4 + j + 8 * n;
        rvalid[n][j] = row_valid(r, q_len);
        rq_rel[n][j] = r / GE;
        rhead[n][j] = row_head(r);
      }
    }
    return true;
  }

  // Whether some row of the program sees `key` (else it is never loaded).
  __device__ __forceinline__ bool key_live(int key) const {
    if (key >= k_hi) return false;
    if (key >= c_lo && key < c_hi) return true;
    for (int r = 0; r < nr; ++r) {
      const int s = (int)ranges[2 * r], e = (int)ranges[2 * r + 1];
      if (s < e && s <= q_last && q_first < e && s <= key && key < e) return true;
    }
    return false;
  }

  // ---- Q to shared memory ----

  // Chunk ch (8 dimensions from 8 ch) of row r into sQ's k-step order,
  // which follows the lanes' K units: dimension d of K unit u = d / EUK
  // belongs to lane u % 4 at position p = (u / 4) EUK + d % EUK of its
  // dimensions, k-step p / 4; it sits at r QS + (p / 4) 16 + (u % 4) 4 + p % 4.
  __device__ __forceinline__ void store_q_chunk(int r, int ch, uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3) {
    const int d0 = ch * 8, u = d0 / EUK, p0 = (u / 4) * EUK + d0 % EUK, kk = p0 / 4;
    MM* row = sQ + r * QS + (u % 4) * 4;
    *reinterpret_cast<uint2*>(row + kk * 16) = make_uint2(w0, w1);
    *reinterpret_cast<uint2*>(row + (kk + 1) * 16) = make_uint2(w2, w3);
  }

  // The rows' queries (loaded by `load_q_regs`) to sQ; the per-row score
  // scale factor to row_qscale (fp8 caches: the power of two that brought
  // the row into f16's range, inverted; a row holding NaN or +-inf: NaN).
  // A row's chunks are CPR consecutive lanes of one warp.
  __device__ __forceinline__ void store_q() {
#pragma unroll
    for (int ps = 0; ps < QPASSES; ++ps) {
      const int r = ps * RPP + tid / CPR, ch = tid % CPR;
      uint32_t* w = qv[ps];
      bool bad = false;
      float mx = 0.f;
      float f[8];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        f[2 * e] = bits_to_f32<T>(w[e] & 0xffffu);
        f[2 * e + 1] = bits_to_f32<T>(w[e] >> 16);
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        bad = bad || !isfinite(f[e]);
        mx = fmaxf(mx, fabsf(f[e]));
      }
      // Over the row's CPR lanes (aligned groups within the warp).
#pragma unroll
      for (int o = 1; o < CPR && o < 32; o <<= 1) {
        // Both shuffles run on every lane (a short-circuit `||` would skip
        // the second on lanes already bad, and the warp would wait forever).
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        const int other_bad = __shfl_xor_sync(0xffffffffu, (int)bad, o);
        bad = bad || other_bad != 0;
      }
      if (r >= ROWS) continue;  // past the rows (after the warp's shuffles)
      float qscale = 1.f;
      if constexpr (FP8) {
        int ex = 0;
        frexpf(mx, &ex);  // mx < 2^ex
        const float up = mx > 0.f ? ldexpf(1.f, 15 - ex) : 1.f;
        qscale = mx > 0.f ? ldexpf(1.f, ex - 15) : 1.f;
        store_q_chunk(r, ch, pack2<__half>(f[0] * up, f[1] * up), pack2<__half>(f[2] * up, f[3] * up),
                      pack2<__half>(f[4] * up, f[5] * up), pack2<__half>(f[6] * up, f[7] * up));
      } else {
        store_q_chunk(r, ch, w[0], w[1], w[2], w[3]);
      }
      if (ch == 0) row_qscale[r] = bad ? __int_as_float(0x7fc00000) : qscale;
    }
  }

  // ---- K / V loads of warp step j into buffer d ----

  __device__ __forceinline__ uint32_t block_of(int j) {
    // Steps are issued in order: at every 32nd step the next entries move
    // in and the ones after them are asked for.
    if (j - j0 >= 32) {
      j0 += 32;
      ent = ent_next;
      ent_next = entry_of(j0 + 32 + lane, k_base, st_begin, st_end);
    }
    return __shfl_sync(0xffffffffu, ent, (j - j0) & 31);
  }

  // Warp step j's 16 key rows and 16 value rows into ring stage j % DEPTH
  // (cp.async, 16 bytes each, zeros for keys no row sees and past
  // head_size); nothing past the warp's steps. The caller commits a group
  // either way. Lane l copies 16-byte chunk l % CH of rows l / CH + RSTEP t
  // (t < PASSES) of both, so its source and destination addresses advance
  // by fixed strides; a step whose 16 keys every row sees (all but the
  // edges of a span) tests no key.
  __device__ __forceinline__ void issue(int j) {
    if (j >= nw) return;
    const uint32_t blk = block_of(j);
    const int key0 = k_base + 16 * (st_begin + warp + 4 * j);
    unsigned char* st = ring + (j % DEPTH) * STAGE;
    constexpr int CH = KBYTES / 16;  // 16-byte chunks per key (and value) row
    static_assert(KBYTES == VBYTES && CH <= 32 && 32 % CH == 0, "whole passes of the warp over K and V rows alike");
    constexpr int RSTEP = 32 / CH;      // rows per pass
    constexpr int PASSES = 16 / RSTEP;  // passes per step
    const int lrow = lane / CH, ch = lane % CH;
    const bool ch_ok = ch * EUK < hs;
    const char* kc = static_cast<const char*>(p.k_cache);
    const char* vc = static_cast<const char*>(p.v_cache);
    // The step's 16 keys lie in block `blk` from row key0 % bs on.
    const int64_t blk_off = ((int64_t)blk * p.block_stride + (int64_t)kv_head * hs) * (int64_t)sizeof(C);
    const int row0 = bs_pow2 ? key0 & (bs - 1) : key0 % bs;
    const int64_t off0 = blk_off + (int64_t)(row0 + lrow) * row_bytes + ch * 16;
    unsigned char* dk = st + lrow * KROW + ch * 16;
    unsigned char* dv = st + 16 * KROW + lrow * VROW + ch * 16;
    if (key0 >= c_lo && key0 + 16 <= min(c_hi, k_hi)) {
      // Every key of the step is live: only a lane's chunk past head_size
      // (the same for all its rows) is zero-filled, from no address.
      const int64_t stride = ch_ok ? RSTEP * row_bytes : 0;
      const char* ks = ch_ok ? kc + off0 : kc;
      const char* vs = ch_ok ? vc + off0 : vc;
#pragma unroll
      for (int t = 0; t < PASSES; ++t) {
        cp_async_16(dk + t * RSTEP * KROW, ks + t * stride, ch_ok);
        cp_async_16(dv + t * RSTEP * VROW, vs + t * stride, ch_ok);
      }
    } else {
#pragma unroll
      for (int t = 0; t < PASSES; ++t) {
        const bool ok = ch_ok && key_live(key0 + lrow + RSTEP * t);
        const int64_t off = off0 + (int64_t)t * RSTEP * row_bytes;
        cp_async_16(dk + t * RSTEP * KROW, ok ? kc + off : kc, ok);
        cp_async_16(dv + t * RSTEP * VROW, ok ? vc + off : vc, ok);
      }
    }
  }

  // This lane's words of ring stage d: K rows g and g + 8 (units c + 4i),
  // V rows 2c, 2c + 1, 2c + 8, 2c + 9 (units g + 8i).
  __device__ __forceinline__ void stage_words(int d, uint32_t (&kr)[2][KW], uint32_t (&vr)[4][VW]) const {
    const unsigned char* st = ring + d * STAGE;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int i = 0; i < KB / 16; ++i) {
        const uint4 w = *reinterpret_cast<const uint4*>(st + (g + 8 * h) * KROW + (c4 + 4 * i) * 16);
        kr[h][4 * i] = w.x;
        kr[h][4 * i + 1] = w.y;
        kr[h][4 * i + 2] = w.z;
        kr[h][4 * i + 3] = w.w;
      }
    }
#pragma unroll
    for (int h = 0; h < 4; ++h) {
      const unsigned char* row = st + 16 * KROW + (2 * c4 + (h & 1) + 8 * (h >> 1)) * VROW;
#pragma unroll
      for (int i = 0; i < VB / LV; ++i) {
        if constexpr (LV == 16) {
          const uint4 w = *reinterpret_cast<const uint4*>(row + (g + 8 * i) * 16);
          vr[h][4 * i] = w.x;
          vr[h][4 * i + 1] = w.y;
          vr[h][4 * i + 2] = w.z;
          vr[h][4 * i + 3] = w.w;
        } else {
          const uint2 w = *reinterpret_cast<const uint2*>(row + (g + 8 * i) * LV);
          vr[h][2 * i] = w.x;
          vr[h][2 * i + 1] = w.y;
        }
      }
    }
  }

  // Output column of m-tile mt's slot g (slot g + 8 is the next column):
  // position 2 mt of this lane's V units g + 8i.
  __device__ __forceinline__ int out_col(int mt) const {
    const int pos = 2 * mt;
    return (g + 8 * (pos / EUV)) * EUV + pos % EUV;
  }

  // ---- one step ----

  // S^T for the step's 16 keys (held in kr) x the ROWS rows, the even and
  // odd k-steps in two accumulators (half the chain of dependent MMAs).
  __device__ __forceinline__ void qk(const uint32_t (&kr)[2][KW], float (&s)[NR][4]) const {
    float s2[2][NR][4];
#pragma unroll
    for (int x = 0; x < 2; ++x)
#pragma unroll
      for (int n = 0; n < NR; ++n) s2[x][n][0] = s2[x][n][1] = s2[x][n][2] = s2[x][n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
      uint32_t a[4];
      if constexpr (FP8) {
        a[0] = fp8x2_to_h2(kr[0][kk]);
        a[1] = fp8x2_to_h2(kr[1][kk]);
        a[2] = fp8x2_hi_to_h2(kr[0][kk]);
        a[3] = fp8x2_hi_to_h2(kr[1][kk]);
      } else {
        a[0] = kr[0][2 * kk];
        a[1] = kr[1][2 * kk];
        a[2] = kr[0][2 * kk + 1];
        a[3] = kr[1][2 * kk + 1];
      }
#pragma unroll
      for (int n = 0; n < NR; ++n) {
        const uint2 b = *reinterpret_cast<const uint2*>(sQ + (8 * n + g) * QS + kk * 16 + c4 * 4);
        mma_16816<MM>(s2[kk & 1][n], a, b.x, b.y);
      }
    }
#pragma unroll
    for (int n = 0; n < NR; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = s2[0][n][e] + s2[1][n][e];
  }

  // Scores of the step's keys to log2-unit logits (scale, softcap, mask,
  // ALiBi, qq_bias: `ScoreMods::logit`, the slope looked up per key); tmax
  // gets each row's maximum over the step's keys. A step every row sees in
  // full, with no extra terms, only scales.
  __device__ __forceinline__ void score(int key0, float (&s)[NR][4], float (&tmax)[NR][2], const float (&rsc)[NR][2],
                                        const float (&rsc_log2)[NR][2]) const {
    const bool full = plain && key0 + 15 <= q_first && key0 + 16 <= k_hi && (window == 0 || q_last - key0 < window);
#pragma unroll
    for (int n = 0; n < NR; ++n) {
      tmax[n][0] = tmax[n][1] = neg_inf();
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = e & 1;
        float x;
        if (full) {
          x = s[n][e] * rsc_log2[n][j];
        } else {
          const int key = key0 + g + 8 * (e >> 1);
          const int q_abs = context_len + rq_rel[n][j];
          // A NaN score becomes +inf: the maximum is +inf and
          // p = exp2(inf - inf) NaN, so the row is NaN.
          const auto visible = [&] { return rvalid[n][j] && key < k_hi && key_visible(q_abs, key); };
          x = mods.logit(s[n][e] * rsc[n][j], visible, HeadSlope{rhead[n][j]}, key, context_len, rq_rel[n][j]);
        }
        s[n][e] = x;
        tmax[n][j] = max_nan(tmax[n][j], x);
      }
      // Over the step's keys: the lanes of one c hold keys g and g + 8.
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) tmax[n][j] = max_nan(tmax[n][j], __shfl_xor_sync(0xffffffffu, tmax[n][j], o));
      }
    }
  }

  __device__ __forceinline__ bool key_visible(int q_abs, int key) const {
    return cpa::key_visible(q_abs, key, window, ranges, nr);
  }

  // The online softmax update of the step, then O^T += V^T P^T.
  __device__ __forceinline__ void softmax_pv(float (&s)[NR][4], const float (&tmax)[NR][2],
                                             const uint32_t (&vr)[4][VW], float (&acc)[MTILES][NR][4],
                                             float (&m_run)[NR][2], float (&l_run)[NR][2]) const {
    uint32_t b0[NR], b1[NR];
#pragma unroll
    for (int n = 0; n < NR; ++n) {
      float alpha[2], m_use[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) alpha[j] = online_max_step(m_run[n][j], l_run[n][j], tmax[n][j], m_use[j]);
      if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
        for (int mt = 0; mt < MTILES; ++mt) {
          acc[mt][n][0] *= alpha[0];
          acc[mt][n][1] *= alpha[1];
          acc[mt][n][2] *= alpha[0];
          acc[mt][n][3] *= alpha[1];
        }
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pe = exp2f(s[n][e] - m_use[e & 1]);
        s[n][e] = pe;
        l_run[n][e & 1] += pe;
      }
      b0[n] = transpose8x8(pack2<MM>(s[n][0], s[n][1]));
      b1[n] = transpose8x8(pack2<MM>(s[n][2], s[n][3]));
    }
#pragma unroll
    for (int mt = 0; mt < MTILES; ++mt) {
      uint32_t a[4];
      if constexpr (FP8) {
        const int w = mt >> 1;
        const uint32_t sel = (mt & 1) ? 0x7362u : 0x5140u;
        const uint32_t x01 = __byte_perm(vr[0][w], vr[1][w], sel);
        const uint32_t x23 = __byte_perm(vr[2][w], vr[3][w], sel);
        a[0] = fp8x2_to_h2(x01);
        a[1] = fp8x2_hi_to_h2(x01);
        a[2] = fp8x2_to_h2(x23);
        a[3] = fp8x2_hi_to_h2(x23);
      } else {
        a[0] = __byte_perm(vr[0][mt], vr[1][mt], 0x5410u);
        a[1] = __byte_perm(vr[0][mt], vr[1][mt], 0x7632u);
        a[2] = __byte_perm(vr[2][mt], vr[3][mt], 0x5410u);
        a[3] = __byte_perm(vr[2][mt], vr[3][mt], 0x7632u);
      }
#pragma unroll
      for (int n = 0; n < NR; ++n) mma_16816<MM>(acc[mt][n], a, b0[n], b1[n]);
    }
  }

  // Warp step j from its ring stage; then the loads of step j + DEPTH into
  // the stage it frees.
  __device__ __forceinline__ void step(int j, const float (&rsc)[NR][2], const float (&rsc_log2)[NR][2],
                                       float (&acc)[MTILES][NR][4], float (&m_run)[NR][2], float (&l_run)[NR][2]) {
    const int key0 = k_base + 16 * (st_begin + warp + 4 * j);
    // Step j's group has landed once at most DEPTH - 1 younger ones are pending.
    cp_async_wait<DEPTH - 1>();
    __syncwarp();
    uint32_t kr[2][KW], vr[4][VW];
    stage_words(j % DEPTH, kr, vr);
    float s[NR][4];
    qk(kr, s);
    float tmax[NR][2];
    score(key0, s, tmax, rsc, rsc_log2);
    bool seen = false;
#pragma unroll
    for (int n = 0; n < NR; ++n) seen = seen || tmax[n][0] != neg_inf() || tmax[n][1] != neg_inf();
    if (__any_sync(0xffffffffu, seen)) softmax_pv(s, tmax, vr, acc, m_run, l_run);
    // Every lane has read the stage: it takes step j + DEPTH.
    __syncwarp();
    issue(j + DEPTH);
    cp_async_commit();
  }

  // ---- epilogue ----

  // The warps' row maxima and sums, then their accumulators rescaled to the
  // common maximum (a warp that saw no key of a row contributes an exact 0).
  __device__ __forceinline__ void merge_warps(const float (&acc)[MTILES][NR][4], float (&m_run)[NR][2],
                                              float (&l_run)[NR][2]) const {
#pragma unroll
    for (int n = 0; n < NR; ++n) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) l_run[n][j] += __shfl_xor_sync(0xffffffffu, l_run[n][j], o);
        if (l_run[n][j] != l_run[n][j]) m_run[n][j] = __int_as_float(0x7fc00000);
        if (g == 0) {
          red_m[warp * ROWS + 2 * c4 + j + 8 * n] = m_run[n][j];
          red_l[warp * ROWS + 2 * c4 + j + 8 * n] = l_run[n][j];
        }
      }
    }
    __syncthreads();
#pragma unroll
    for (int n = 0; n < NR; ++n) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int r = 2 * c4 + j + 8 * n;
        float M = neg_inf();
#pragma unroll
        for (int w = 0; w < WARPS; ++w) M = max_nan(M, red_m[w * ROWS + r]);
        const bool none = m_run[n][j] == neg_inf();
        const float f = none ? 0.f : exp2f(m_run[n][j] - M);
        float* o = sO + (warp * ROWS + r) * OS;
#pragma unroll
        for (int mt = 0; mt < MTILES; ++mt) {
          const float2 v = none ? make_float2(0.f, 0.f) : make_float2(acc[mt][n][j] * f, acc[mt][n][2 + j] * f);
          *reinterpret_cast<float2*>(o + out_col(mt)) = v;
        }
      }
    }
    __syncthreads();
  }

  // Partial index of segment 0 of packed row r (partials [partial rows,
  // num_heads, S]; partial rows are tokens, or (sequence, row) pairs).
  __device__ __forceinline__ int64_t partial_base(int r) const {
    const int q_rel = r / GE;
    const int64_t prow = p.ws_seq_rows > 0 ? (int64_t)seq * p.ws_seq_rows + q_rel : (int64_t)q_start + q_rel;
    return (prow * p.num_heads + row_head(r)) * S;
  }

  // Every valid row's columns, 8 per unit: summed over the warps, then the
  // output (one segment: normalised with the sink) or the partials.
  __device__ __forceinline__ void write_output() const {
    constexpr int CH = DV / 8;
    for (int idx = tid; idx < ROWS * CH; idx += NT) {
      const int r = idx / CH, d0 = (idx % CH) * 8;
      if (d0 >= hs || !row_valid(r, q_len)) continue;
      const int ncols = min(8, hs - d0);
      float M = neg_inf(), L = 0.f, o[8];
#pragma unroll
      for (int w = 0; w < WARPS; ++w) M = max_nan(M, red_m[w * ROWS + r]);
#pragma unroll
      for (int e = 0; e < 8; ++e) o[e] = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) {
        const float mw = red_m[w * ROWS + r];
        if (mw != neg_inf()) L += red_l[w * ROWS + r] * exp2f(mw - M);
        const float4* src = reinterpret_cast<const float4*>(sO + (w * ROWS + r) * OS + d0);
        const float4 x0 = src[0], x1 = src[1];
        o[0] += x0.x; o[1] += x0.y; o[2] += x0.z; o[3] += x0.w;
        o[4] += x1.x; o[5] += x1.y; o[6] += x1.z; o[7] += x1.w;
      }
      const int head = row_head(r);
      const int64_t token = q_start + r / GE;
      if (S == 1) {
        store_output_cols<T>(p, (token * p.num_heads + head) * hs + d0, head, ncols, M, L, true, o);
      } else {
        store_partial_cols(p, partial_base(r) + seg, hs, d0, ncols, M, L, true, o);
      }
    }
  }

  // An empty segment: (-inf, 0) for each valid row, no columns.
  __device__ __forceinline__ void store_empty_partials() const {
    for (int r = tid; r < ROWS; r += NT) {
      if (!row_valid(r, q_len)) continue;
      const int64_t pi = partial_base(r) + seg;
      p.ws_ml[2 * pi] = neg_inf();
      p.ws_ml[2 * pi + 1] = 0.f;
    }
  }

  // Counts this program into its group once its partials are stored; true
  // for the last program of the group (see kernels/unified_attention.cu,
  // "Split KV", for the protocol).
  __device__ __forceinline__ bool arrive() const { return arrive_last(p, tid, grid); }

  // The last program of a group: per (valid row, 4 columns), an online merge
  // of the segments' partials, MERGE_BATCH segments' loads at a time
  // (through L2), the sink counted in the maximum from the start; then the
  // normalised output.
  __device__ __forceinline__ void merge_segments() const {
    const int C4 = (hs + 3) / 4;
    const bool vec4 = (hs & 3) == 0;
    constexpr float SKIP = -1.f;
    for (int idx = tid; idx < ROWS * C4; idx += NT) {
      const int r = idx / C4, col = (idx % C4) * 4;
      if (!row_valid(r, q_len)) continue;
      const int head = row_head(r);
      const int64_t base = partial_base(r);
      const float s2 = mods.sink_log2(head);
      float M = s2, L = 0.f;
      float o[4] = {0.f, 0.f, 0.f, 0.f};
      for (int s0 = 0; s0 < S; s0 += MERGE_BATCH) {
        float2 ml[MERGE_BATCH];
        float4 x[MERGE_BATCH];
#pragma unroll
        for (int u = 0; u < MERGE_BATCH; ++u) {
          const int sg = min(s0 + u, S - 1);
          ml[u] = __ldcg(reinterpret_cast<const float2*>(p.ws_ml) + base + sg);
          const float* a = p.ws_acc + (base + sg) * hs + col;
          if (vec4) {
            x[u] = __ldcg(reinterpret_cast<const float4*>(a));
          } else {
            x[u].x = __ldcg(a);
            x[u].y = col + 1 < hs ? __ldcg(a + 1) : 0.f;
            x[u].z = col + 2 < hs ? __ldcg(a + 2) : 0.f;
            x[u].w = col + 3 < hs ? __ldcg(a + 3) : 0.f;
          }
        }
        float Mb = M;
#pragma unroll
        for (int u = 0; u < MERGE_BATCH; ++u) {
          if (s0 + u < S && ml[u].y != 0.f) Mb = max_nan(Mb, ml[u].x);
        }
        // M == Mb covers -inf == -inf (nothing merged yet, o and L are 0).
        const float alpha = M == Mb ? 1.f : exp2f(M - Mb);
        L *= alpha;
#pragma unroll
        for (int e = 0; e < 4; ++e) o[e] *= alpha;
        M = Mb;
#pragma unroll
        for (int u = 0; u < MERGE_BATCH; ++u) {
          const float w = (s0 + u < S && ml[u].y != 0.f) ? exp2f(ml[u].x - M) : SKIP;
          if (w == SKIP) continue;
          L += ml[u].y * w;
          o[0] += x[u].x * w;
          o[1] += x[u].y * w;
          o[2] += x[u].z * w;
          o[3] += x[u].w * w;
        }
      }
      L = mods.add_sink_mass(L, s2, M);
      const float inv = L == 0.f ? 0.f : 1.f / L;
      const int64_t oi = ((int64_t)(q_start + r / GE) * p.num_heads + head) * hs + col;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (col + e >= hs) continue;
        const float y = o[e] * inv;
        if (p.out_fp8) static_cast<fp8_t*>(p.out)[oi + e] = from_f32<fp8_t>(y * p.out_inv_scale);
        else static_cast<T*>(p.out)[oi + e] = from_f32<T>(y);
      }
    }
  }
};

template <typename T, typename C, int HEAD, int NR, bool WIDE, class G = LaunchGrid>
__device__ __forceinline__ void stream_body(const AttnParams& p, const G& grid = G()) {
  using Prog = StreamProgram<T, C, HEAD, NR, WIDE, G>;
  Prog prog(p, grid);
  bool q_loaded;
  if (!prog.locate(q_loaded)) return;
  // The sequence's segments (`locate` may have made a split launch's
  // short sequence unsplit).
  const bool split = prog.S > 1;
  if (split && prog.st_begin >= prog.st_end) {
    prog.store_empty_partials();
  } else {
    // The cp.async groups of the warp's first DEPTH steps, then the query rows.
#pragma unroll
    for (int d = 0; d < Prog::DEPTH; ++d) {
      prog.issue(d);
      cp_async_commit();
    }
    if (!q_loaded) prog.load_q_regs(prog.q_start, prog.q_len);
    prog.store_q();
    __syncthreads();
    float rsc[NR][2], rsc_log2[NR][2], m_run[NR][2], l_run[NR][2];
    float acc[Prog::MTILES][NR][4];
#pragma unroll
    for (int n = 0; n < NR; ++n) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float qs = prog.row_qscale[2 * prog.c4 + j + 8 * n];
        rsc[n][j] = prog.mods.scale(qs);
        rsc_log2[n][j] = prog.mods.scale_log2(qs);
        m_run[n][j] = neg_inf();
        l_run[n][j] = 0.f;
      }
#pragma unroll
      for (int mt = 0; mt < Prog::MTILES; ++mt) acc[mt][n][0] = acc[mt][n][1] = acc[mt][n][2] = acc[mt][n][3] = 0.f;
    }
    for (int j = 0; j < prog.nw; ++j) prog.step(j, rsc, rsc_log2, acc, m_run, l_run);
    cp_async_wait<0>();
    prog.merge_warps(acc, m_run, l_run);
    prog.write_output();
  }
  if (split && p.ws_counters != nullptr && prog.arrive()) prog.merge_segments();
}

