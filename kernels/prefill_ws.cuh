// Warp-specialised Hopper prefill (sm_90a; included by
// kernels/unified_attention.cu under CPA_SM90A, after `AttnProgram`).
//
// `unified_attention_h{64|128}_prefill_ws_{f16|bf16}`: the warpgroup
// program of the `WG` instances (same rows, keys, score pipeline, merge and
// output; kernels/wgmma.cuh has the MMA layouts) with 128-key tiles and its
// roles split over three warpgroups, one program per SM:
// * the producer warpgroup (threads NT .. NT + 127, `produce`): warp pw
//   owns tile rows 32 pw .. + 31, lane l computes key 32 pw + l's cache
//   offset (its block-table entry read a tile ahead) and gets the offsets
//   of the four rows it copies (l / 4 + 8 m) by shuffles; it copies CPT
//   16-byte chunks of each (chunks l % 4 + 4 k: the four lanes of a row
//   copy 64 contiguous bytes per instruction, whole 32-byte sectors) with
//   cp.async into the 128-byte-swizzled stage
//   (dead keys and columns past head_size zero-filled), then arrives on the
//   stage's full barrier once its copies have landed
//   (`cp.async.mbarrier.arrive.noinc`; 128 arrivals complete a phase).
//   Iteration j loads K of tile j, then V of tile j - 1, the order the
//   consumers take them, each after the stage's empty barrier says the
//   consumers are done with it. It gives its registers to the consumers
//   (`setmaxnreg`).
// * two consumer warpgroups (threads 0 .. NT - 1, 64 packed rows each,
//   `consume`): after Q (their own cp.async loads, one named barrier of the
//   consumers), tile j runs as
//     wait K[j], V[j - 1] full; fence the async proxy (the MMAs then see the
//     copies); S = Q K_j^T and O += P_{j-1} V_{j-1} issued together;
//     wait for S; release K[j]; scores and online softmax of S -> P_j
//     (while the P V product runs); wait for it; release V[j - 1];
//     rescale O to the new maxima.
//   Empty barriers take one arrival per consumer warp (8). Tiles that every
//   row sees whole, with no per-key terms, under a positive scale, take
//   `score_full` (tree maxima on the raw scores, the scale folded into the
//   exponent's fma); the others `AttnProgram::score` (the mask and the
//   scale only on the edge tiles of a launch with no per-key terms, version
//   18 in docs/perf.md's kernels section). At head size 64 the
//   softmax step ends a basic block of its own (`end_block_after`), so that
//   in the SASS the wait for the P V product follows the exponentials.
// After the last tile the consumers merge and write their rows as the WG
// instances do, their barriers named (WS_BAR_ROWS), without the producer.
// 16-bit caches only, 16-byte loads: the plan picks these instances for
// prefills whose rows see many keys on average (`ws_prefill` in
// src/cuda/plan.rs; docs/perf.md, kernels "Version 12", has the
// measurements, and the ping-pong schedule between the two consumer
// warpgroups that was tried and measured slower).
#pragma once

namespace cpa {

// The stage barriers of a warp-specialised program, after the key offsets
// in shared memory: full[K/V][stage] (producer -> consumers) and
// empty[K/V][stage] (consumers -> producer).
template <int STAGES>
struct WsBars {
  uint64_t* base;
  __device__ __forceinline__ uint64_t* full_k(int s) const { return base + s; }
  __device__ __forceinline__ uint64_t* full_v(int s) const { return base + STAGES + s; }
  __device__ __forceinline__ uint64_t* empty_k(int s) const { return base + 2 * STAGES + s; }
  __device__ __forceinline__ uint64_t* empty_v(int s) const { return base + 3 * STAGES + s; }
};

template <typename T, class CF>
struct WsProgram : AttnProgram<T, T, CF> {
  using Base = AttnProgram<T, T, CF>;
  using typename Base::Acc;
  using typename Base::RowMax;
  using typename Base::Scores;
  static constexpr int HEAD = CF::HEAD, DV = CF::DV, BN = CF::BN, KW = CF::KW, NT = CF::NT, STAGES = CF::STAGES;
  static constexpr int PT = WS_PRODUCER_THREADS;
  static constexpr int CONSUMER_WARPS = NT / 32;
  static_assert(KW == BN && HEAD == DV, "one warp row per 16 rows over the whole tile");
  // Registers per thread after the split: the producer's few, the
  // consumers' the rest of the register file (65536 per SM, one program).
  static constexpr int PRODUCER_REGS = 56;
  static constexpr int CONSUMER_REGS = 224;
  static_assert(PRODUCER_REGS * PT + CONSUMER_REGS * NT <= 65536, "the register file of one SM");

  WsBars<STAGES> bars;

  __device__ __forceinline__ explicit WsProgram(const AttnParams& params) : Base(params) {
    bars.base = reinterpret_cast<uint64_t*>(this->koff + STAGES * BN);
  }

  __device__ __forceinline__ int n_tiles() const { return max(0, this->t_end - this->t_begin); }

  // One thread initialises every barrier; the caller's block barrier
  // publishes them.
  __device__ __forceinline__ void init_barriers() const {
    if (this->tid != 0) return;
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(bars.full_k(s), PT);
      mbar_init(bars.full_v(s), PT);
      mbar_init(bars.empty_k(s), CONSUMER_WARPS);
      mbar_init(bars.empty_v(s), CONSUMER_WARPS);
    }
  }

  // ---- producer ----

  // The producer's share of a tile: producer warp pw owns tile rows
  // 32 pw .. 32 pw + 31 (one key each, lane l computing key 32 pw + l's
  // offset); lane l copies chunks l % 4 + 4 k, k < CPT, of rows l / 4 + 8 m,
  // m < 4, so each row's chunks are 16-byte copies from one row pointer,
  // one instruction's four lanes of a row cover 64 contiguous bytes (whole
  // 32-byte sectors; with chunks CPT (l % 4) + k, each instruction asked
  // for every sector twice, half used: docs/perf.md, kernels, "Version
  // 16"), and every row l / 4 + 8 m has the same swizzle phase (l / 4).
  static constexpr int CPR = HEAD / 8;   // 16-byte chunks per row
  static constexpr int CPT = CPR / 4;    // chunks per lane per row
  static constexpr int CHUNK_STEP = 4;   // between one lane's chunks of a row
  static constexpr int ROWS_PER_LANE = 4;
  static_assert(PT == 128 && BN == 128 && CPR % 4 == 0, "four producer warps of 32 rows, four lanes per row");

  // Copies this lane's part of one tile's rows (their byte offsets `off`,
  // -1: zero-fill) from `cache` into the swizzled stage at shared address
  // `stage`. Per lane, the chunks' byte offsets within a source row
  // (`col`), their positions within a stage row (`pos`, swizzled for the
  // lane's phase) and whether they lie inside head_size (`col_ok`) are the
  // same for every row.
  __device__ __forceinline__ static void copy_rows(const T* cache, const int64_t (&off)[ROWS_PER_LANE],
                                                   uint32_t stage_row0, const uint32_t (&pos)[CPT], int col,
                                                   const bool (&col_ok)[CPT]) {
    const char* base = reinterpret_cast<const char*>(cache);
#pragma unroll
    for (int m = 0; m < ROWS_PER_LANE; ++m) {
      const bool live = off[m] >= 0;
      const char* src = base + (live ? off[m] : 0) + col;
      const uint32_t row = stage_row0 + 8 * m * 128;
#pragma unroll
      for (int k = 0; k < CPT; ++k)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(row + pos[k]),
                     "l"(src + k * CHUNK_STEP * 16),
                     "r"(live && col_ok[k] ? 16 : 0));
    }
  }

  // The producer warpgroup: every tile of the segment into the ring, in the
  // order the consumers take them: iteration j loads K of tile j, then V of
  // tile j - 1 (the consumers' iteration j multiplies Q K_j^T and
  // P_{j-1} V_{j-1}); the rows' offsets stay in registers from one to the
  // other.
  __device__ __forceinline__ void produce() {
    const int ptid = this->tid - NT;
    const int pw = ptid >> 5, lane = ptid & 31;
    const int n = n_tiles();
    const int key0 = this->k_lo + this->t_begin * BN + pw * 32 + lane;
    const uint32_t sK = smem_addr(this->sK);
    const uint32_t sV = smem_addr(this->sV);
    const T* kc = this->kc;
    const T* vc = this->vc;
    uint32_t blk = this->key_block(key0);
    int64_t off_k[ROWS_PER_LANE] = {-1, -1, -1, -1}, off_v[ROWS_PER_LANE];
    // This lane's chunks: c0 + CHUNK_STEP k of its rows (see `copy_rows`).
    const int c0 = lane & 3;
    const uint32_t row0 = (uint32_t)(pw * 32 + (lane >> 2)) * 128;
    uint32_t pos[CPT];
    bool col_ok[CPT];
#pragma unroll
    for (int k = 0; k < CPT; ++k) {
      const int c = c0 + CHUNK_STEP * k;
      pos[k] = (uint32_t)(c >> 3) * BN * 128 + (uint32_t)(((c & 7) ^ (lane >> 2)) << 4);
      col_ok[k] = c * 8 < this->hs;
    }
    for (int j = 0; j <= n; ++j) {
      if (j < n) {
        const int64_t mine = this->key_offset(key0 + j * BN, blk);
        blk = this->key_block(key0 + (j + 1) * BN);  // the next tile's, ahead of its use
#pragma unroll
        for (int m = 0; m < ROWS_PER_LANE; ++m) {
          off_v[m] = off_k[m];  // tile j - 1's rows, for its V
          off_k[m] = __shfl_sync(0xffffffffu, mine, (lane >> 2) + 8 * m);
        }
        const int stage = j % STAGES;
        const uint32_t fill = (uint32_t)(j / STAGES);
        if (fill > 0) mbar_wait(bars.empty_k(stage), (fill - 1) & 1);
        copy_rows(kc, off_k, sK + stage * BN * HEAD * (uint32_t)sizeof(T) + row0, pos, c0 * 16, col_ok);
        mbar_cp_async_arrive(bars.full_k(stage));
      } else {
#pragma unroll
        for (int m = 0; m < ROWS_PER_LANE; ++m) off_v[m] = off_k[m];
      }
      if (j > 0) {
        const int v = j - 1;
        const int stage = v % STAGES;
        const uint32_t fill = (uint32_t)(v / STAGES);
        if (fill > 0) mbar_wait(bars.empty_v(stage), (fill - 1) & 1);
        copy_rows(vc, off_v, sV + stage * BN * DV * (uint32_t)sizeof(T) + row0, pos, c0 * 16, col_ok);
        mbar_cp_async_arrive(bars.full_v(stage));
      }
    }
    cp_async_wait<0>();
  }

  // ---- consumers ----

  // One arrival of this warp on an empty barrier (after its MMAs that read
  // the stage have completed).
  __device__ __forceinline__ void release(uint64_t* bar) const {
    if (this->lane == 0) mbar_arrive(bar);
  }

  // Waits for full stages (`mbar_wait`), then makes their copies visible
  // to the MMAs (once for every stage waited for).
  __device__ __forceinline__ static void to_mmas() { fence_async_shared(); }

  // Matrix descriptors of the operands at their tiles' first byte; a step
  // adds its byte offset / 16 to the start-address field (the offsets stay
  // inside the 18-bit shared window, so the field never carries).
  __device__ __forceinline__ uint64_t q_desc() const {
    return sw128_desc(smem_addr(this->sQ) + (this->warp / 4) * 64 * 128, 16, 1024);
  }
  __device__ __forceinline__ static uint64_t k_desc(const T* tK) { return sw128_desc(smem_addr(tK), 16, 1024); }
  __device__ __forceinline__ static uint64_t v_desc(const T* tV) {
    return sw128_desc(smem_addr(tV), BN * 128, 1024);
  }

  // S = Q K^T for the warpgroup's 64 rows over the K tile of descriptor kd
  // (qd: the warpgroup's Q rows): issued and committed, not waited for.
  __device__ __forceinline__ static void issue_qk(uint64_t qd, uint64_t kd, Scores& s) {
    float(&d)[KW / 2] = reinterpret_cast<float(&)[KW / 2]>(s);
    // The steps add to the low words only (the start address never carries,
    // see above): 32-bit adds, and Q's descriptors stay out of the loop.
    const uint32_t q_lo = (uint32_t)qd, k_lo = (uint32_t)kd;
    const uint64_t q_hi = qd & ~0xffffffffull, k_hi = kd & ~0xffffffffull;
#pragma unroll
    for (int kk = 0; kk < HEAD / 16; ++kk) {
      const uint32_t col = (kk % 4) * 32;
      const uint64_t a = q_hi | (q_lo + (((kk / 4) * CF::BM * 128 + col) >> 4));
      const uint64_t b = k_hi | (k_lo + (((kk / 4) * BN * 128 + col) >> 4));
      WgMma<T, BN>::ss(d, a, b, kk > 0);
    }
    wg_commit();
  }

  // O += P V over the V tile of descriptor vd, P as packed registers:
  // issued and committed, not waited for.
  __device__ __forceinline__ static void issue_pv(const uint32_t (&a)[KW / 16][4], uint64_t vd, Acc& acc) {
    float(&o)[DV / 2] = reinterpret_cast<float(&)[DV / 2]>(acc);
#pragma unroll
    for (int j = 0; j < KW / 16; ++j) WgMma<T, DV>::rs_t(o, a[j], vd + ((j * 16 * 128) >> 4));
    wg_commit();
  }

  // v[0] op ... op v[15] as a tree of depth 4 (fixed indices: the values
  // stay in registers).
  template <class Op>
  __device__ __forceinline__ static float tree16(float (&v)[16], Op op) {
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = op(v[k], v[k + 8]);
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = op(v[k], v[k + 4]);
#pragma unroll
    for (int k = 0; k < 2; ++k) v[k] = op(v[k], v[k + 2]);
    return op(v[0], v[1]);
  }

  // Scores of a tile that every row of the program sees whole, with no
  // per-key terms, under a positive launch scale (`score`'s fast path; see
  // `whole`): each row's maximum as a tree over its 32 raw values
  // (NaN-propagating), then over the quad, scaled once to log2 units by the
  // row's score scale c (positive, or NaN for a query row holding NaN or
  // +-inf, which makes the row NaN; x -> c x is monotonic). The scores stay
  // raw: `softmax_step` scales them inside its fma, by c1 = c.
  __device__ __forceinline__ static void score_full(const Scores& s, RowMax& tmax, const RowMax& c, float (&c1)[2]) {
    float m[2][16];
#pragma unroll
    for (int nt = 0; nt < KW / 8; ++nt) {
#pragma unroll
      for (int i = 0; i < 2; ++i) m[i][nt] = max_nan(s[0][nt][2 * i], s[0][nt][2 * i + 1]);
    }
    tmax[0][0] = quad_max(tree16(m[0], [](float a, float b) { return max_nan(a, b); }));
    tmax[0][1] = quad_max(tree16(m[1], [](float a, float b) { return max_nan(a, b); }));
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      c1[i] = c[0][i];
      tmax[0][i] *= c1[i];
    }
  }

  // The online-softmax step of one tile without touching O: moves the
  // running maxima, rescales the sums, turns the scores in s (times c1, see
  // `score_full`) into probabilities (one fma and one ex2.approx.ftz each:
  // every argument is at most an ulp above 0, or NaN, which stays NaN) and
  // adds each row's, as a tree, to its sum; alpha: the factor O needs once
  // the P V product in flight has landed.
  __device__ __forceinline__ static void softmax_step(Scores& s, const RowMax& tmax, const float (&c1)[2],
                                                      RowMax& m_run, RowMax& l_run, float (&alpha)[2]) {
    float m_use[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) alpha[i] = online_max_step(m_run[0][i], l_run[0][i], tmax[0][i], m_use[i]);
    float sum[2][16];
#pragma unroll
    for (int nt = 0; nt < KW / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[0][nt][e] = ex2_ftz(fmaf(s[0][nt][e], c1[e >> 1], -m_use[e >> 1]));
#pragma unroll
      for (int i = 0; i < 2; ++i) sum[i][nt] = s[0][nt][2 * i] + s[0][nt][2 * i + 1];
    }
    l_run[0][0] += tree16(sum[0], [](float a, float b) { return a + b; });
    l_run[0][1] += tree16(sum[1], [](float a, float b) { return a + b; });
  }

  // The scores of a tile: `score_full` where the tile is whole, else
  // `score` (masks, softcap, ALiBi, qq_bias, ranges), already in log2 units.
  __device__ __forceinline__ void scores(int key0, Scores& s, RowMax& tmax, const RowMax& rsc, const RowMax& rsc_log2,
                                         float (&c1)[2]) const {
    if (whole(key0)) {
      score_full(s, tmax, rsc_log2, c1);
    } else {
      this->score(key0, s, tmax, rsc, rsc_log2);
      c1[0] = c1[1] = 1.f;
    }
  }

  // Ends the code's basic block once the row sums `l_run` are known, which
  // every probability of the tile feeds. ptxas places the wait for a
  // warpgroup MMA (an instruction that reads no register) as early as its
  // basic block allows: with the scores, the softmax step and the wait for
  // P_{j-1} V_{j-1} in one block, it put that wait above the tile's
  // exponentials, so the softmax ran after the product instead of beside
  // it. The branch is taken only by a warp with a NaN row sum, and sleeps
  // for no time. Head size 64 only: on an H100, with it at every head size,
  // this file's changes made the head-64 instances 0.2-4.8% faster and the
  // head-128 ones 1.3-6.2% slower on the prefills the plan gives them
  // (docs/perf.md, kernels, "The softmax-overlap patch measured" and
  // "Version 15").
  __device__ __forceinline__ static void end_block_after(const RowMax& l_run) {
    if constexpr (HEAD <= 64) {
      if (__any_sync(0xffffffffu, l_run[0][0] != l_run[0][0] || l_run[0][1] != l_run[0][1])) __nanosleep(0);
    }
  }

  __device__ __forceinline__ static void rescale(Acc& acc, const float (&alpha)[2]) {
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int i = 0; i < DV / 8; ++i) {
        acc[0][i][0] *= alpha[0];
        acc[0][i][1] *= alpha[0];
        acc[0][i][2] *= alpha[1];
        acc[0][i][3] *= alpha[1];
      }
    }
  }

  // Whether every row of the program sees every key of the tile from
  // `key0`, with no per-key terms (`score`'s condition for its fast path),
  // under a positive scale (`score_full`'s maxima of raw scores).
  __device__ __forceinline__ bool whole(int key0) const {
    return this->plain && this->mods.params.scale > 0.f && key0 + KW - 1 <= this->q_first && key0 + KW <= this->k_hi &&
           (this->window == 0 || this->q_last - key0 < this->window);
  }

  // The consumer warpgroups' key loop (see the top of the file).
  __device__ __forceinline__ void consume(RowMax& rsc, RowMax& rsc_log2, Acc& acc, RowMax& m_run, RowMax& l_run) {
    const int n = n_tiles();
    if (n == 0) return;
    const T* sK = reinterpret_cast<const T*>(this->sK);
    const T* sV = reinterpret_cast<const T*>(this->sV);
    const int tile0 = this->k_lo + this->t_begin * BN;
    float(&o)[DV / 2] = reinterpret_cast<float(&)[DV / 2]>(acc);
    Scores s;
    float(&sd)[KW / 2] = reinterpret_cast<float(&)[KW / 2]>(s);
    uint32_t a[KW / 16][4];
    RowMax tmax;
    float alpha[2], c1[2];
    const uint64_t qd = q_desc();
    // Tile 0: S only.
    mbar_wait(bars.full_k(0), 0);
    to_mmas();
    this->check_q_rows(rsc, rsc_log2);
    wg_fence();
    issue_qk(qd, k_desc(sK), s);
    wg_wait<0>();
    wg_fence_operands(sd);
    release(bars.empty_k(0));
    scores(tile0, s, tmax, rsc, rsc_log2, c1);
    softmax_step(s, tmax, c1, m_run, l_run, alpha);
    Base::pack_p(s, a);
    for (int j = 1; j < n; ++j) {
      const int stage = j % STAGES, prev = (j - 1) % STAGES;
      mbar_wait(bars.full_k(stage), (uint32_t)(j / STAGES) & 1);
      mbar_wait(bars.full_v(prev), (uint32_t)((j - 1) / STAGES) & 1);
      to_mmas();
      wg_fence_operands(o);
      wg_fence();
      issue_qk(qd, k_desc(sK + stage * BN * HEAD), s);
      issue_pv(a, v_desc(sV + prev * BN * DV), acc);
      wg_wait<1>();
      wg_fence_operands(sd);
      release(bars.empty_k(stage));
      scores(tile0 + j * BN, s, tmax, rsc, rsc_log2, c1);
      softmax_step(s, tmax, c1, m_run, l_run, alpha);
      end_block_after(l_run);
      wg_wait<0>();
      wg_fence_operands(o);
      release(bars.empty_v(prev));
      rescale(acc, alpha);
      Base::pack_p(s, a);
    }
    // The last tile's P V.
    const int last = (n - 1) % STAGES;
    mbar_wait(bars.full_v(last), (uint32_t)((n - 1) / STAGES) & 1);
    to_mmas();
    wg_fence_operands(o);
    wg_fence();
    issue_pv(a, v_desc(sV + last * BN * DV), acc);
    wg_wait<0>();
    wg_fence_operands(o);
    release(bars.empty_v(last));
  }
};

// One warp-specialised program (see the top of the file).
template <typename T, class CF>
__device__ __forceinline__ void ws_attention_body(const AttnParams& p) {
  using Prog = WsProgram<T, CF>;
  Prog prog(p);
  if (!prog.locate()) return;  // the whole block: it depends on the block's indices only
  prog.init_tables();
  prog.init_barriers();
  __syncthreads();
  if (prog.tid >= CF::NT) {
    set_max_regs_dec<Prog::PRODUCER_REGS>();
    prog.produce();
    return;
  }
  set_max_regs_inc<Prog::CONSUMER_REGS>();
  prog.load_q();
  cp_async_commit();
  cp_async_wait<0>();
  fence_async_shared();
  named_bar_sync(WS_BAR_ROWS, CF::NT);
  typename Prog::RowMax rsc, rsc_log2, m_run, l_run;
  typename Prog::Acc acc;
  prog.init_rows(rsc, rsc_log2, acc, m_run, l_run);
  prog.consume(rsc, rsc_log2, acc, m_run, l_run);
  prog.merge_warps(acc, m_run, l_run);
  prog.write_output();
}

}  // namespace cpa
