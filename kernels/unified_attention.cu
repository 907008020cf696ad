// Unified paged attention: one kernel body serves prefills, chunked prefills
// and decodes of one batch, over a paged NHD cache.
//
// * `unified_attention_h{HEAD}_{decode|prefill}_{f16|bf16}[_fp8]`: tensor-core
//   kernel. One program per (block of query rows, KV head[, head chunk],
//   segment[, value chunk]). The query heads of one KV group are packed into
//   the MMA M dimension (row r = query row r / GE, head r % GE). Key tiles
//   are streamed through shared memory with cp.async, double buffered; each
//   warp scores its rows against its keys with mma.sync m16n8k16 (f32
//   accumulation) and keeps an online softmax; warps that split the keys of a
//   tile are merged at the end. With one segment the program writes the
//   output; with several it writes (max, sum, unnormalised output) partials
//   that `reduce_segments_*` merges.
// * `reduce_segments_{f16|bf16}`: merges the split-KV partials (and the sinks).
// * `unified_attention_scalar_f32[_fp8]`: the f32 path, one warp per
//   (query row, query head), one key at a time.
//
// Semantics follow the CPU reference (src/cpu/paged_attention.rs): causal and
// window mask, then bidirectional prefix ranges; scale * q.k, softcap, -inf
// mask, ALiBi, qq_bias; sinks start the softmax with mass 1; masked keys are
// never multiplied (keys no row of the program sees are zero-filled before the
// P.V product); a row with no visible key is 0.

#include "attention_params.cuh"
#include "common.cuh"

using namespace cpa;

template <typename C>
struct IsFp8 {
  static constexpr bool value = false;
};
template <>
struct IsFp8<fp8_t> {
  static constexpr bool value = true;
};

template <int N>
struct IntC {
  static constexpr int value = N;
};

// Tile shape of one kernel instance. HEAD: padded head size (the tail past
// head_size is zero-filled); DV: output columns per program.
template <int HEAD_, int WARPS_M_, int WARPS_N_, int KW_>
struct Cfg {
  static constexpr int HEAD = HEAD_;
  static constexpr int DV = HEAD_ < 256 ? HEAD_ : 256;
  static constexpr int WARPS_M = WARPS_M_;  // warps along query rows (16 rows each)
  static constexpr int WARPS_N = WARPS_N_;  // warps along the keys of a tile
  static constexpr int KW = KW_;            // keys per warp per tile
  static constexpr int NT = 32 * WARPS_M * WARPS_N;
  static constexpr int BM = 16 * WARPS_M;   // packed rows per program
  static constexpr int BN = KW * WARPS_N;   // keys per tile
  static constexpr int QS = HEAD + 8;       // shared row strides (elements), padded against bank conflicts
  static constexpr int KS = HEAD + 8;
  static constexpr int VS = DV + 8;
  static constexpr int CS = DV + 8;         // merge buffer row stride (floats)
};

// Shared-memory bytes of one instance (mirrored in src/cuda/paged_attention.rs).
template <class CF, bool FP8>
struct Smem {
  static constexpr int Q_BYTES = CF::BM * CF::QS * 2;
  static constexpr int RED_BYTES = 2 * CF::WARPS_N * CF::BM * 4;
  static constexpr int OFF_BYTES = 2 * CF::BN * 8;  // per-key cache offsets, two tiles
  static constexpr int TILES =
      FP8 ? CF::BN * CF::KS * 2 + CF::BN * CF::VS * 2 + 2 * CF::BN * CF::HEAD + 2 * CF::BN * CF::DV
          : 2 * CF::BN * CF::KS * 2 + 2 * CF::BN * CF::VS * 2;
  static constexpr int MERGE = CF::WARPS_N * CF::BM * CF::CS * 4;
  static constexpr int TOTAL = Q_BYTES + RED_BYTES + OFF_BYTES + (TILES > MERGE ? TILES : MERGE);
};

// Whether query `q_abs` sees key `key` before score-level masking.
__device__ __forceinline__ bool key_visible(int q_abs, int key, int window, const uint32_t* ranges, int nr) {
  if (key <= q_abs && (window == 0 || q_abs - key < window)) return true;
  for (int r = 0; r < nr; ++r) {
    const int s = (int)ranges[2 * r], e = (int)ranges[2 * r + 1];
    if (s <= q_abs && q_abs < e && s <= key && key < e) return true;
  }
  return false;
}

// One packed row of a program: which query row and head it is.
struct RowInfo {
  int valid;
  int q_rel;  // row within the sequence's new tokens
  int q_abs;  // absolute position
  int head;   // query head
  float slope;
};

template <typename T, typename C, class CF>
__device__ __forceinline__ void attention_body(const AttnParams& p) {
  constexpr bool FP8 = IsFp8<C>::value;
  constexpr int HEAD = CF::HEAD, DV = CF::DV, BM = CF::BM, BN = CF::BN, KW = CF::KW;
  constexpr int NT = CF::NT, WARPS_N = CF::WARPS_N;
  constexpr int QS = CF::QS, KS = CF::KS, VS = CF::VS, CS = CF::CS;
  using SM = Smem<CF, FP8>;

  extern __shared__ __align__(16) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  float* red_m = reinterpret_cast<float*>(smem + SM::Q_BYTES);
  float* red_l = red_m + WARPS_N * BM;
  int64_t* koff = reinterpret_cast<int64_t*>(smem + SM::Q_BYTES + SM::RED_BYTES);  // [2][BN]
  unsigned char* region = smem + SM::Q_BYTES + SM::RED_BYTES + SM::OFF_BYTES;
  T* sK = reinterpret_cast<T*>(region);  // FP8: one converted tile; else two stages
  T* sV = sK + (FP8 ? 1 : 2) * BN * KS;
  uint8_t* stK = reinterpret_cast<uint8_t*>(sV + (FP8 ? 1 : 2) * BN * VS);  // FP8 staging, two stages
  uint8_t* stV = stK + 2 * BN * HEAD;
  float* merge = reinterpret_cast<float*>(region);  // reused after the key loop

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / WARPS_N, wn = warp % WARPS_N;
  const int GE = p.group_entries;
  const int BLOCK_Q = BM / GE;
  const int group = p.num_heads / p.num_kv_heads;
  const int kv_head = blockIdx.y / p.head_chunks;
  const int hc = blockIdx.y % p.head_chunks;
  const int seg = blockIdx.z % p.num_segments;
  const int dvc = blockIdx.z / p.num_segments;

  // ---- which sequence and which of its query blocks this program owns ----
  const int pid = blockIdx.x;
  int lo = 0, hi = p.num_seqs;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    const int v = (int)(p.cu_seqlens_q[mid] / (uint32_t)BLOCK_Q) + mid;
    if (v <= pid) lo = mid + 1;
    else hi = mid;
  }
  const int seq = lo - 1;
  if (seq < 0) return;
  const int q_start = (int)p.cu_seqlens_q[seq];
  const int q_len = (int)p.cu_seqlens_q[seq + 1] - q_start;
  // A mixed batch runs as two launches, one per tile shape, each owning the
  // sequences whose span fits it.
  if (q_len < p.q_len_min || q_len > p.q_len_max) return;
  const int row0 = (pid - (q_start / BLOCK_Q + seq)) * BLOCK_Q;
  if (row0 >= q_len) return;
  const int seq_len = (int)p.seq_lens[seq];
  const int context_len = seq_len - q_len;
  const int q_first = context_len + row0;
  const int q_last = context_len + min(row0 + BLOCK_Q, q_len) - 1;
  const int window = p.sliding_window;

  // ---- the keys any row of this program sees: [k_lo, k_hi) ----
  const int c_lo = window > 0 ? max(0, q_first - window + 1) : 0;
  const int c_hi = q_last + 1;
  const uint32_t* ranges = p.prefix_ranges ? p.prefix_ranges + (size_t)seq * p.max_ranges * 2 : nullptr;
  const int nr = ranges ? p.max_ranges : 0;
  int k_lo = c_lo, k_hi = c_hi;
  for (int r = 0; r < nr; ++r) {
    const int s = (int)ranges[2 * r], e = (int)ranges[2 * r + 1];
    if (s < e && s <= q_last && q_first < e) {
      k_lo = min(k_lo, s);
      k_hi = max(k_hi, e);
    }
  }
  k_hi = min(k_hi, seq_len);
  // A key no row sees is zero-filled instead of loaded: its page may hold garbage.
  auto key_live = [&](int key) -> bool {
    if (key >= k_hi) return false;
    if (key >= c_lo && key < c_hi) return true;
    for (int r = 0; r < nr; ++r) {
      const int s = (int)ranges[2 * r], e = (int)ranges[2 * r + 1];
      if (s < e && s <= q_last && q_first < e && s <= key && key < e) return true;
    }
    return false;
  };

  const int n_tiles = k_hi > k_lo ? (k_hi - k_lo + BN - 1) / BN : 0;
  const int tiles_per_seg = (n_tiles + p.num_segments - 1) / p.num_segments;
  const int t_begin = min(n_tiles, seg * tiles_per_seg);
  const int t_end = min(n_tiles, t_begin + tiles_per_seg);

  auto row_info = [&](int r) -> RowInfo {
    RowInfo ri;
    const int ql = r / GE, gh = hc * GE + r % GE;
    ri.valid = ql < BLOCK_Q && row0 + ql < q_len && gh < group;
    ri.q_rel = row0 + ql;
    ri.q_abs = context_len + ri.q_rel;
    ri.head = kv_head * group + (gh < group ? gh : 0);
    ri.slope = (ri.valid && p.alibi_slopes) ? p.alibi_slopes[ri.head] : 0.f;
    return ri;
  };

  const int hs = p.head_size;
  const bool vec = p.vec_loads != 0;
  const int64_t kv_row = (int64_t)p.num_kv_heads * hs;
  const uint32_t* table = p.block_tables + (size_t)seq * p.block_table_width;

  // ---- Q: BM packed rows x HEAD columns (zero past head_size / invalid rows) ----
  {
    const T* q = static_cast<const T*>(p.q);
    constexpr int CPR = HEAD / 8;
    for (int c = tid; c < BM * CPR; c += NT) {
      const int r = c / CPR, col = (c % CPR) * 8;
      const RowInfo ri = row_info(r);
      const bool ok = ri.valid && col < hs;
      const int64_t src = ((int64_t)(q_start + ri.q_rel) * p.num_heads + ri.head) * hs + col;
      T* dst = sQ + r * QS + col;
      if (vec) {
        cp_async_16(dst, ok ? q + src : q, ok);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) dst[e] = (ok && col + e < hs) ? q[src + e] : from_f32<T>(0.f);
      }
    }
  }

  // ---- K/V tile loads: keys tile_start .. tile_start + BN of this sequence ----
  const C* kc = static_cast<const C*>(p.k_cache);
  const C* vc = static_cast<const C*>(p.v_cache);
  auto key_offset = [&](int key) -> int64_t {
    const int64_t blk = (int64_t)table[key / p.block_size];
    return blk * p.block_stride + (int64_t)(key % p.block_size) * kv_row + (int64_t)kv_head * hs;
  };
  // Copies COLS columns starting at col0 of each key row into dst (row stride
  // DST_STRIDE elements of C), zero-filling dead keys and columns.
  // Cache offset of each key row of tile t (-1: dead key, zero-filled), one
  // table read per key, written one tile ahead of its loads.
  auto tile_offsets = [&](int t, int slot) {
    if (t >= t_end) return;
    for (int kl = tid; kl < BN; kl += NT) {
      const int key = k_lo + t * BN + kl;
      koff[slot * BN + kl] = key_live(key) ? key_offset(key) : (int64_t)-1;
    }
  };
  // Copies COLS columns starting at col0 of each key row into dst (row
  // stride dst_stride elements of C), zero-filling dead keys and columns.
  auto load_rows = [&](const C* cache, const int64_t* offs, int col0, auto cols_tag, C* dst, int dst_stride) {
    constexpr int COLS = decltype(cols_tag)::value;
    constexpr int EPC = 16 / (int)sizeof(C);  // elements per 16-byte chunk
    constexpr int CPR = COLS / EPC;
    constexpr int ITERS = (BN * CPR + NT - 1) / NT;
#pragma unroll 4
    for (int i = 0; i < ITERS; ++i) {
      const int c = tid + i * NT;
      if (BN * CPR % NT != 0 && c >= BN * CPR) break;
      const int kl = c / CPR, col = (c % CPR) * EPC;
      const int gcol = col0 + col;
      const int64_t ko = offs[kl];
      const bool ok = ko >= 0 && gcol < hs;
      const int64_t off = ok ? ko + gcol : 0;
      C* d = dst + kl * dst_stride + col;
      if (vec) {
        cp_async_16(d, cache + off, ok);
      } else {
#pragma unroll
        for (int e = 0; e < EPC; ++e) {
          if (ok && gcol + e < hs) {
            d[e] = cache[off + e];
          } else {
            if constexpr (FP8) d[e].bits = 0;
            else d[e] = from_f32<C>(0.f);
          }
        }
      }
    }
  };
  using HeadCols = IntC<HEAD>;
  using ValCols = IntC<DV>;
  // Tile t goes to buffer `stage`; its key offsets are in slot `stage`.
  auto load_tile = [&](int stage) {
    const int64_t* offs = koff + stage * BN;
    if constexpr (FP8) {
      load_rows(kc, offs, 0, HeadCols{}, reinterpret_cast<C*>(stK + stage * BN * HEAD), HEAD);
      load_rows(vc, offs, dvc * DV, ValCols{}, reinterpret_cast<C*>(stV + stage * BN * DV), DV);
    } else {
      load_rows(kc, offs, 0, HeadCols{}, reinterpret_cast<C*>(sK + stage * BN * KS), KS);
      load_rows(vc, offs, dvc * DV, ValCols{}, reinterpret_cast<C*>(sV + stage * BN * VS), VS);
    }
  };

  // ---- per-thread rows (MMA fragment rows g and g + 8 of this warp) ----
  const int g = lane >> 2, c4 = lane & 3;
  const RowInfo rows[2] = {row_info(wm * 16 + g), row_info(wm * 16 + g + 8)};
  const bool warp_rows = __any_sync(0xffffffffu, rows[0].valid || rows[1].valid);
  const float sc = p.scale, cap = p.softcap, sc_log2 = p.scale * LOG2E;
  const float* qq = p.qq_bias;
  // No per-key terms besides the mask: full tiles only need scaling.
  const bool plain = nr == 0 && cap <= 0.f && qq == nullptr && p.alibi_slopes == nullptr;

  float acc[DV / 8][4];
#pragma unroll
  for (int i = 0; i < DV / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  float m_run[2] = {neg_inf(), neg_inf()};
  float l_run[2] = {0.f, 0.f};

  tile_offsets(t_begin, 0);
  tile_offsets(t_begin + 1, 1);
  __syncthreads();
  if (t_begin < t_end) load_tile(0);
  cp_async_commit();

  for (int t = t_begin; t < t_end; ++t) {
    const int stage = (t - t_begin) & 1;
    if (t + 1 < t_end) {
      load_tile(stage ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    // Slot `stage` held tile t's offsets: every thread issued those loads
    // before the barrier above; the loads of tile t + 2 read them after the
    // barrier that ends this iteration.
    tile_offsets(t + 2, stage);
    const T* tK;
    const T* tV;
    if constexpr (FP8) {
      // Dequantise the staged fp8 tile into the T tile (exact: e4m3 fits f16/bf16).
      const uint8_t* sk = stK + stage * BN * HEAD;
      const uint8_t* sv = stV + stage * BN * DV;
      for (int i = tid; i < BN * HEAD / 2; i += NT) {
        const int kl = (2 * i) / HEAD, col = (2 * i) % HEAD;
        fp8_t a{sk[2 * i]}, b{sk[2 * i + 1]};
        *reinterpret_cast<uint32_t*>(sK + kl * KS + col) = pack2<T>(to_f32(a), to_f32(b));
      }
      for (int i = tid; i < BN * DV / 2; i += NT) {
        const int kl = (2 * i) / DV, col = (2 * i) % DV;
        fp8_t a{sv[2 * i]}, b{sv[2 * i + 1]};
        *reinterpret_cast<uint32_t*>(sV + kl * VS + col) = pack2<T>(to_f32(a), to_f32(b));
      }
      __syncthreads();
      tK = sK;
      tV = sV;
    } else {
      tK = sK + stage * BN * KS;
      tV = sV + stage * BN * VS;
    }
    // Warps whose 16 rows are all padding (a decode row in a prefill-shaped
    // program, say) skip the tile.
    if (warp_rows) {
    const int tile_start = k_lo + t * BN;
    const int warp_key0 = tile_start + wn * KW;

    // S = Q K^T for this warp's 16 rows x KW keys.
    float s[KW / 8][4];
#pragma unroll
    for (int i = 0; i < KW / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < HEAD / 16; ++kk) {
      if (kk * 16 < hs) {
        uint32_t a[4];
        ldmatrix_x4(a, sQ + (wm * 16 + (lane & 15)) * QS + kk * 16 + (lane >> 4) * 8);
#pragma unroll
        for (int np = 0; np < KW / 16; ++np) {
          uint32_t b[4];
          ldmatrix_x4(b, tK + (wn * KW + np * 16 + (lane & 7) + (lane >> 4) * 8) * KS + kk * 16 + ((lane >> 3) & 1) * 8);
          mma_16816<T>(s[2 * np], a, b[0], b[1]);
          mma_16816<T>(s[2 * np + 1], a, b[2], b[3]);
        }
      }
    }

    // Scores: scale, softcap, mask, ALiBi, qq_bias; then log2 units. A warp
    // whose keys every row of the program sees, with no extra terms, only
    // scales (rows past the program's valid rows are never written).
    float tmax[2] = {neg_inf(), neg_inf()};
    const bool full = plain && warp_key0 + KW - 1 <= q_first && warp_key0 + KW <= k_hi &&
                      (window == 0 || q_last - warp_key0 < window);
    if (full) {
#pragma unroll
      for (int nt = 0; nt < KW / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float x = s[nt][e] * sc_log2;
          s[nt][e] = x;
          tmax[e >> 1] = fmaxf(tmax[e >> 1], x);
        }
      }
    } else {
#pragma unroll
      for (int nt = 0; nt < KW / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const RowInfo& ri = rows[e >> 1];
          const int key = warp_key0 + nt * 8 + 2 * c4 + (e & 1);
          float x = s[nt][e] * sc;
          if (cap > 0.f) x = cap * tanhf(x / cap);
          if (ri.valid && key < k_hi && key_visible(ri.q_abs, key, window, ranges, nr)) {
            x += ri.slope * (float)(key - context_len);
            if (qq != nullptr && key >= context_len && key - context_len < p.qq_cols)
              x += qq[(int64_t)ri.q_rel * p.qq_cols + (key - context_len)];
            x *= LOG2E;
          } else {
            x = neg_inf();
          }
          s[nt][e] = x;
          tmax[e >> 1] = fmaxf(tmax[e >> 1], x);
        }
      }
    }
    tmax[0] = quad_max(tmax[0]);
    tmax[1] = quad_max(tmax[1]);
    // A warp with nothing visible in this tile skips the P.V product.
    const bool any = __any_sync(0xffffffffu, tmax[0] != neg_inf() || tmax[1] != neg_inf());
    if (any) {
      float alpha[2], m_use[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float m_new = fmaxf(m_run[i], tmax[i]);
        m_use[i] = m_new == neg_inf() ? 0.f : m_new;
        alpha[i] = exp2f(m_run[i] - m_use[i]);
        m_run[i] = m_new;
        l_run[i] *= alpha[i];
      }
#pragma unroll
      for (int i = 0; i < DV / 8; ++i) {
        acc[i][0] *= alpha[0];
        acc[i][1] *= alpha[0];
        acc[i][2] *= alpha[1];
        acc[i][3] *= alpha[1];
      }
#pragma unroll
      for (int nt = 0; nt < KW / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float pe = exp2f(s[nt][e] - m_use[e >> 1]);
          s[nt][e] = pe;
          l_run[e >> 1] += pe;
        }
      }
      // O += P V: P from the score registers, V^T fragments via ldmatrix.trans.
#pragma unroll
      for (int j = 0; j < KW / 16; ++j) {
        uint32_t a[4];
        a[0] = pack2<T>(s[2 * j][0], s[2 * j][1]);
        a[1] = pack2<T>(s[2 * j][2], s[2 * j][3]);
        a[2] = pack2<T>(s[2 * j + 1][0], s[2 * j + 1][1]);
        a[3] = pack2<T>(s[2 * j + 1][2], s[2 * j + 1][3]);
#pragma unroll
        for (int dp = 0; dp < DV / 16; ++dp) {
          if (dvc * DV + dp * 16 < hs) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, tV + (wn * KW + j * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * VS + dp * 16 + (lane >> 4) * 8);
            mma_16816<T>(acc[2 * dp], a, b[0], b[1]);
            mma_16816<T>(acc[2 * dp + 1], a, b[2], b[3]);
          }
        }
      }
    }
    }  // warp_rows
    __syncthreads();
  }
  cp_async_wait<0>();

  // ---- merge the warps that split the keys, then write ----
  l_run[0] = quad_sum(l_run[0]);
  l_run[1] = quad_sum(l_run[1]);
  if (c4 == 0) {
    red_m[wn * BM + wm * 16 + g] = m_run[0];
    red_l[wn * BM + wm * 16 + g] = l_run[0];
    red_m[wn * BM + wm * 16 + g + 8] = m_run[1];
    red_l[wn * BM + wm * 16 + g + 8] = l_run[1];
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = wm * 16 + g + 8 * i;
    float M = neg_inf();
#pragma unroll
    for (int w = 0; w < WARPS_N; ++w) M = fmaxf(M, red_m[w * BM + r]);
    const float f = m_run[i] == neg_inf() ? 0.f : exp2f(m_run[i] - M);
#pragma unroll
    for (int n = 0; n < DV / 8; ++n) {
      float2 v = make_float2(acc[n][2 * i] * f, acc[n][2 * i + 1] * f);
      *reinterpret_cast<float2*>(merge + (wn * BM + r) * CS + n * 8 + 2 * c4) = v;
    }
  }
  __syncthreads();

  const int S = p.num_segments;
  for (int idx = tid; idx < BM * DV; idx += NT) {
    const int r = idx / DV, d = idx % DV;
    const int gcol = dvc * DV + d;
    if (gcol >= hs) continue;
    const RowInfo ri = row_info(r);
    if (!ri.valid) continue;
    float M = neg_inf();
#pragma unroll
    for (int w = 0; w < WARPS_N; ++w) M = fmaxf(M, red_m[w * BM + r]);
    float L = 0.f, o = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS_N; ++w) {
      const float mw = red_m[w * BM + r];
      if (mw != neg_inf()) L += red_l[w * BM + r] * exp2f(mw - M);
      o += merge[(w * BM + r) * CS + d];
    }
    const int64_t token = q_start + ri.q_rel;
    if (S == 1) {
      if (p.sinks != nullptr) {
        const float s2 = p.sinks[ri.head] * LOG2E;
        const float Mn = fmaxf(M, s2);
        const float f = M == neg_inf() ? 0.f : exp2f(M - Mn);
        L = L * f + exp2f(s2 - Mn);
        o *= f;
      }
      const float y = L > 0.f ? o / L * p.v_scale : 0.f;
      const int64_t oi = (token * p.num_heads + ri.head) * hs + gcol;
      if (p.out_fp8) static_cast<fp8_t*>(p.out)[oi] = from_f32<fp8_t>(y * p.out_inv_scale);
      else static_cast<T*>(p.out)[oi] = from_f32<T>(y);
    } else {
      const int64_t pi = (token * p.num_heads + ri.head) * S + seg;
      p.ws_acc[pi * hs + gcol] = o * p.v_scale;
      if (gcol == 0) {
        p.ws_ml[2 * pi] = M;
        p.ws_ml[2 * pi + 1] = L;
      }
    }
  }
}

// Merges the split-KV partials of one (token, head) and the head's sink.
// Grid (num_tokens, num_heads), any block size.
template <typename T>
__device__ __forceinline__ void reduce_body(const AttnParams& p) {
  const int token = blockIdx.x, head = blockIdx.y, S = p.num_segments, hs = p.head_size;
  const int64_t base = ((int64_t)token * p.num_heads + head) * S;
  float M = neg_inf();
  for (int s = 0; s < S; ++s) {
    if (p.ws_ml[2 * (base + s) + 1] > 0.f) M = fmaxf(M, p.ws_ml[2 * (base + s)]);
  }
  float s2 = neg_inf();
  if (p.sinks != nullptr) {
    s2 = p.sinks[head] * LOG2E;
    M = fmaxf(M, s2);
  }
  float L = 0.f;
  for (int s = 0; s < S; ++s) {
    const float l = p.ws_ml[2 * (base + s) + 1];
    if (l > 0.f) L += l * exp2f(p.ws_ml[2 * (base + s)] - M);
  }
  if (p.sinks != nullptr) L += exp2f(s2 - M);
  const float inv = L > 0.f ? 1.f / L : 0.f;
  for (int d = threadIdx.x; d < hs; d += blockDim.x) {
    float o = 0.f;
    for (int s = 0; s < S; ++s) {
      const float l = p.ws_ml[2 * (base + s) + 1];
      if (l > 0.f) o += p.ws_acc[(base + s) * hs + d] * exp2f(p.ws_ml[2 * (base + s)] - M);
    }
    const float y = o * inv;
    const int64_t oi = ((int64_t)token * p.num_heads + head) * hs + d;
    if (p.out_fp8) static_cast<fp8_t*>(p.out)[oi] = from_f32<fp8_t>(y * p.out_inv_scale);
    else static_cast<T*>(p.out)[oi] = from_f32<T>(y);
  }
}

// The f32 path: one warp per (query row, query head); lane l holds columns
// l, l + 32, ... Grid (num_tokens, ceil(num_heads / 4)), 128 threads.
template <typename C>
__device__ __forceinline__ void scalar_body(const AttnParams& p) {
  constexpr int MAXJ = 512 / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int token = blockIdx.x, head = blockIdx.y * 4 + warp;
  if (head >= p.num_heads || token >= p.num_tokens) return;
  int lo = 0, hi = p.num_seqs;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if ((int)p.cu_seqlens_q[mid] <= token) lo = mid + 1;
    else hi = mid;
  }
  const int seq = lo - 1;
  if (seq < 0) return;
  const int hs = p.head_size, group = p.num_heads / p.num_kv_heads, kv_head = head / group;
  const int q_len = (int)(p.cu_seqlens_q[seq + 1] - p.cu_seqlens_q[seq]);
  const int q_rel = token - (int)p.cu_seqlens_q[seq];
  const int seq_len = (int)p.seq_lens[seq];
  const int context_len = seq_len - q_len;
  const int q_abs = context_len + q_rel;
  const int window = p.sliding_window;
  const uint32_t* ranges = p.prefix_ranges ? p.prefix_ranges + (size_t)seq * p.max_ranges * 2 : nullptr;
  const int nr = ranges ? p.max_ranges : 0;
  int k_lo = window > 0 ? max(0, q_abs - window + 1) : 0, k_hi = q_abs + 1;
  for (int r = 0; r < nr; ++r) {
    const int s = (int)ranges[2 * r], e = (int)ranges[2 * r + 1];
    if (s <= q_abs && q_abs < e) {
      k_lo = min(k_lo, s);
      k_hi = max(k_hi, e);
    }
  }
  k_hi = min(k_hi, seq_len);

  const float* q = static_cast<const float*>(p.q) + ((int64_t)token * p.num_heads + head) * hs;
  float qv[MAXJ], acc[MAXJ];
#pragma unroll
  for (int j = 0; j < MAXJ; ++j) {
    const int d = lane + 32 * j;
    qv[j] = d < hs ? q[d] : 0.f;
    acc[j] = 0.f;
  }
  const C* kc = static_cast<const C*>(p.k_cache);
  const C* vc = static_cast<const C*>(p.v_cache);
  const uint32_t* table = p.block_tables + (size_t)seq * p.block_table_width;
  const int64_t kv_row = (int64_t)p.num_kv_heads * hs;
  const float slope = p.alibi_slopes ? p.alibi_slopes[head] : 0.f;
  float m = neg_inf(), l = 0.f;
  for (int key = k_lo; key < k_hi; ++key) {
    if (!key_visible(q_abs, key, window, ranges, nr)) continue;
    const int64_t off = (int64_t)table[key / p.block_size] * p.block_stride +
                        (int64_t)(key % p.block_size) * kv_row + (int64_t)kv_head * hs;
    float dot = 0.f;
#pragma unroll
    for (int j = 0; j < MAXJ; ++j) {
      const int d = lane + 32 * j;
      if (d < hs) dot += qv[j] * to_f32(kc[off + d]);
    }
    float x = warp_sum(dot) * p.scale;
    if (p.softcap > 0.f) x = p.softcap * tanhf(x / p.softcap);
    x += slope * (float)(key - context_len);
    if (p.qq_bias != nullptr && key >= context_len && key - context_len < p.qq_cols)
      x += p.qq_bias[(int64_t)q_rel * p.qq_cols + (key - context_len)];
    x *= LOG2E;
    if (x == neg_inf()) continue;
    const float m_new = fmaxf(m, x);
    const float alpha = exp2f(m - m_new);
    const float pe = exp2f(x - m_new);
    l = l * alpha + pe;
#pragma unroll
    for (int j = 0; j < MAXJ; ++j) {
      const int d = lane + 32 * j;
      if (d < hs) acc[j] = acc[j] * alpha + pe * to_f32(vc[off + d]);
    }
    m = m_new;
  }
  float f = 1.f;
  if (p.sinks != nullptr) {
    const float s2 = p.sinks[head] * LOG2E;
    const float Mn = fmaxf(m, s2);
    f = m == neg_inf() ? 0.f : exp2f(m - Mn);
    l = l * f + exp2f(s2 - Mn);
  }
  const float scale_out = l > 0.f ? f / l * p.v_scale : 0.f;
  const int64_t ob = ((int64_t)token * p.num_heads + head) * hs;
#pragma unroll
  for (int j = 0; j < MAXJ; ++j) {
    const int d = lane + 32 * j;
    if (d < hs) {
      const float y = acc[j] * scale_out;
      if (p.out_fp8) static_cast<fp8_t*>(p.out)[ob + d] = from_f32<fp8_t>(y * p.out_inv_scale);
      else static_cast<float*>(p.out)[ob + d] = y;
    }
  }
}

// ---- entry points ---------------------------------------------------------------
// Decode-shaped programs: 16 packed rows, 4 warps splitting 64 keys per tile.
// Prefill-shaped programs: 64 packed rows (4 warps x 16), 1 warp per key tile.
#define CPA_ATTN(HEAD, KIND, WM, WN, KW, TNAME, T, CNAME, C)                                              \
  extern "C" __global__ void __launch_bounds__(32 * WM * WN, (WM == 1 && HEAD <= 128) ? 3 : 1)           \
      unified_attention_h##HEAD##_##KIND##_##TNAME##CNAME(const AttnParams p) {                          \
    attention_body<T, C, Cfg<HEAD, WM, WN, KW>>(p);                                                      \
  }

#define CPA_ATTN_HEAD(HEAD, PKW)                                                                          \
  CPA_ATTN(HEAD, decode, 1, 4, 16, bf16, __nv_bfloat16, , __nv_bfloat16)                                 \
  CPA_ATTN(HEAD, decode, 1, 4, 16, f16, __half, , __half)                                                \
  CPA_ATTN(HEAD, decode, 1, 4, 16, bf16, __nv_bfloat16, _fp8, fp8_t)                                     \
  CPA_ATTN(HEAD, decode, 1, 4, 16, f16, __half, _fp8, fp8_t)                                             \
  CPA_ATTN(HEAD, prefill, 4, 1, PKW, bf16, __nv_bfloat16, , __nv_bfloat16)                               \
  CPA_ATTN(HEAD, prefill, 4, 1, PKW, f16, __half, , __half)                                              \
  CPA_ATTN(HEAD, prefill, 4, 1, PKW, bf16, __nv_bfloat16, _fp8, fp8_t)                                   \
  CPA_ATTN(HEAD, prefill, 4, 1, PKW, f16, __half, _fp8, fp8_t)

CPA_ATTN_HEAD(32, 64)
CPA_ATTN_HEAD(64, 64)
CPA_ATTN_HEAD(128, 64)
CPA_ATTN_HEAD(256, 32)
CPA_ATTN_HEAD(512, 32)

extern "C" __global__ void reduce_segments_bf16(const AttnParams p) { reduce_body<__nv_bfloat16>(p); }
extern "C" __global__ void reduce_segments_f16(const AttnParams p) { reduce_body<__half>(p); }

extern "C" __global__ void __launch_bounds__(128) unified_attention_scalar_f32(const AttnParams p) {
  scalar_body<float>(p);
}
extern "C" __global__ void __launch_bounds__(128) unified_attention_scalar_f32_fp8(const AttnParams p) {
  scalar_body<fp8_t>(p);
}
