// Unified paged attention: one kernel body serves prefills, chunked prefills
// and decodes of one batch, over a paged NHD cache.
//
// * `unified_attention_h{HEAD}_{decode|prefill|prefill_m1}_{f16|bf16}[_fp8]`:
//   tensor-core kernel. One program per (block of query rows, KV head[, head
//   chunk], segment[, value chunk]); decode-shaped launches run one program
//   per sequence. The query heads of one KV group are packed into the MMA M
//   dimension (row r = query row r / GE, head r % GE). Key tiles stream
//   through a ring of shared-memory stages with cp.async (one block barrier
//   per tile; the block-table entries a tile needs are read a tile ahead);
//   each warp scores its MT x 16 rows against its keys with mma.sync
//   m16n8k16 (f32 accumulation; every K/V fragment feeds MT MMAs) and keeps
//   an online softmax, rescaling its accumulator only when a row's maximum
//   moved; warps that split the keys of a tile are merged at the end. With
//   one segment the program writes the output; with several it writes
//   (max, sum, unnormalised output) partials, which `reduce_segments_*`
//   merges, or in decode-shaped launches given arrival counters, the last
//   program of its group to finish (see "Split KV" below). fp8
//   caches are dequantised in shared memory to f16 and run f16 MMAs, the
//   queries scaled per row by a power of two into f16's range.
// * `unified_attention_h{64|128|256}_prefill_wg[_m1]_{f16|bf16}[_fp8]`: the
//   Hopper (sm_90a) prefill instances, compiled into a module of their own
//   (see "Hopper" below).
// * `unified_attention_h{64|128}_prefill_ws_{f16|bf16}`: the same Hopper
//   program with a producer warpgroup and 128-key tiles, for long
//   prefills over 16-bit caches (kernels/prefill_ws.cuh).
// * `reduce_segments_{f16|bf16}`: merges the split-KV partials (and the
//   sinks) of a launch that does not merge its own (every prefill-shaped
//   one; decode-shaped ones launched without arrival counters).
// * `unified_attention_scalar_f32[_fp8]`: the f32 path, one warp per
//   (query row, query head), one key at a time.
//
// Program structure. `attention_body` runs the phases of `AttnProgram` in
// order; every member is inlined, so the program's state lives in registers:
// * locate: the program's sequence, its query block (BLOCK_Q = BM / GE query
//   rows x GE heads of one KV group, packed as rows of the MMA M dimension),
//   the keys [k_lo, k_hi) its rows see (causal / window span plus the prefix
//   ranges that meet it) and its segment's tiles [t_begin, t_end) of BN keys.
//   The sequence's cu_seqlens_q pair and seq_lens entry are read together.
// * load_q: the BM x HEAD packed query tile into sQ. fp8 caches scale and
//   convert it with plain stores behind four block barriers; 16-bit caches
//   copy it with cp.async into the first tile's group.
// * init_tables / init_rows: cache pointers and block size; whether the warp
//   holds a real row, the per-row score scales, empty accumulators.
// * key_loop: the prologue writes the key offsets of the first STAGES tiles
//   (threads tid < BN, one key each, from block-table entries read a tile
//   ahead, and asked of L2 TABLE_AHEAD tiles before that in decode-shaped
//   programs), one block
//   barrier, then issues the first STAGES - 1 tiles as one cp.async group
//   each. Iteration t waits until at most STAGES - 2 groups
//   are pending (tile t has landed), then one block barrier: every warp is
//   done with tile t - 1 and every offset of tile t + STAGES - 1 is written.
//   It issues tile t + STAGES - 1 into tile t - 1's stage and commits a
//   group (empty past the end, so the count stays regular), writes the
//   offsets of tile t + STAGES into tile t's slot (its loads were issued
//   before the barrier), and then each warp works on tile t: fp8 tiles are
//   dequantised into the one converted tile (behind a warp barrier when each
//   warp converts only its own keys, else a block barrier; the next
//   iteration's barrier keeps it until every warp is done), the Q rows are
//   checked for NaN / inf once (16-bit caches), then QK^T, the scores (scale,
//   softcap, mask, ALiBi, qq_bias), the online softmax update and P.V on the
//   warp's KW keys. After the loop every group is waited for.
// * merge_warps: each warp's row maxima and sums to red_m / red_l, one block
//   barrier, its rescaled accumulator to the merge buffer (over the tiles),
//   one block barrier.
// * write_output: each valid row's columns summed over the warps, then
//   normalised with the sink (one segment) or stored as split-KV partials.
// * split KV, decode-shaped with arrival counters: arrive, and for the
//   last program of the group merge_segments (below).
// `reduce_body` and `ScalarProgram` (the f32 path) follow the same order:
// locate, load, attend or merge, write.
//
// Split KV (num_segments S > 1) of decode-shaped launches given arrival
// counters (ws_counters non-null): one launch. The
// gridDim.z = S x value-chunk programs that share a (blockIdx.x, blockIdx.y)
// own the same packed rows; together they are a group, with one arrival
// counter, ws_counters[y * gridDim.x + x]. Either every program of a group
// passes `locate` or none does (it depends on the sequence and query block
// only), so every group that starts has all its programs arrive.
// * Each program stores its partials to the workspace: per (partial row,
//   head, segment) the unnormalised output columns of its value chunk (times
//   v_scale) and, from value chunk 0, the (max, sum) pair. An empty segment
//   (none of its tiles holds a key the rows see, e.g. past a short
//   sequence's end) skips Q and the key loop and stores (-inf, 0) pairs
//   only, then arrives like any other; the merge skips segments whose sum
//   is 0 (their columns are loaded with the others, in bounds, and
//   selected away, never multiplied).
// * Arrival (`arrive`): every thread fences (__threadfence: its partial
//   stores are visible device-wide before anything it does next), one block
//   barrier, then thread 0 adds 1 to the counter (atomicAdd). The program
//   that reads back gridDim.z - 1 is the last of its group: every other
//   program's stores were fenced before its increment.
// * Merge (`merge_segments`), by that last program only: a __threadfence
//   (acquire side), then it reads every segment's partials through L2
//   (__ldcg, never a stale L1 line), merges them as `reduce_segments_*` does
//   (common maximum over the segments with a nonzero sum and the sink,
//   NaN-propagating; columns weighted by exp2(m_s - M); normalised; fp8
//   output scaled) and writes every column of the group's rows, all value
//   chunks. Thread 0 then sets the counter back to 0 (atomicExch): counters
//   are zero between launches, so the buffer is zeroed once, when
//   allocated, and a CUDA graph replays the launch as it is. The two
//   launches of a mixed batch run one after the other on one stream and
//   may reuse the same counters.
// A decode-shaped launch whose ws_counters is null skips the arrival and
// leaves the merge to `reduce_segments_*`, as prefill-shaped launches (split
// only under a forced segment count) always do (no merge code in the
// 255-register prefill instances).
//
// Hopper (CPA_SM90A, the `WG` instances; kernels/wgmma.cuh has the MMA
// layouts). The same program and phases, with the two matrix products as
// warpgroup MMAs: the warps of the program form warpgroups of four, warp w
// owning packed rows 16w .. 16w + 15 as before (MT = 1), and each
// warpgroup multiplies its 64 rows at once. Q, K and V tiles are stored
// 128-byte swizzled (64-column atoms, 1024-byte aligned: the dynamic
// shared memory carries 1 KiB of slack), written by the same cp.async
// loads at swizzled addresses; after its cp.async wait each thread fences
// the async proxy (`fence_async_shared`) before the tile's block barrier,
// so the MMAs, which read shared memory through that proxy, see the tile.
// QK^T is HEAD / 16 `ss` MMAs (Q and K from shared memory) into the
// scores' registers, committed and waited for; the scores, mask and online
// softmax are the mma.sync path's, per warp, except on tiles that every row
// sees whole with no per-key terms under a positive scale (`whole_wg`):
// there each row's maximum is taken over the raw scores and scaled once,
// and each probability is one fma (the scale folded in) and one
// ex2.approx.ftz (`score_whole_wg`, `softmax_update`), which also keeps
// the 128-row head-128 instances' MMAs unserialised within two programs'
// registers per SM (docs/perf.md, kernels, "Version 17"); over 16-bit
// caches, tiles at the edge of the rows' keys with no per-key terms take
// only the mask and the scale (`score`, version 18); P V is BN / 16 `rs_t` MMAs
// (P from the score registers, V transposed from shared memory) into the
// accumulator, committed and waited for before the next tile's barrier
// lets the loads overwrite the stage. Every warp of a warpgroup runs every
// tile (no per-warp skips: an MMA needs all four warps). One key loop
// iteration therefore has one block barrier, as on the mma.sync path.
// Prefill launches take their query blocks heaviest first (see `px`).
// fp8 caches stage their tiles as on the mma.sync path and dequantise them
// into the one converted tile, stored swizzled, then fence the async proxy
// before that step's block barrier; their queries are scaled into f16 as
// there, stored swizzled. Padded head sizes 64, 128 and 256 have WG
// instances; the launch plan falls back to the mma.sync ones elsewhere.
//
// Semantics follow the CPU reference (src/cpu/paged_attention.rs): causal and
// window mask, then bidirectional prefix ranges; scale * q.k, softcap, -inf
// mask, ALiBi, qq_bias (the pipeline every program shares, `ScoreMods` in
// kernels/score_mods.cuh); sinks start the softmax with mass 1; masked keys are
// never multiplied (keys no row of the program sees are zero-filled before the
// P.V product); a row with no visible key is 0.
//
// NaN is never hidden: masked scores are selected to -inf, never computed
// from the data, and the softmax maxima use a NaN-propagating max (edge
// tiles, which select per key, turn a NaN score into +inf instead, whose
// p = exp2(inf - inf) is NaN), so a NaN score (NaN in a visible key, a
// slope, the bias) turns the row's maximum, rescale factors, probabilities,
// sum and output into NaN at no cost on the NaN-free path. Query rows holding NaN or +-inf get a NaN score scale (an
// infinite query could otherwise score -inf against every key). A NaN in a
// visible value reaches the output columns it sits in through P.V; within
// one tile, P.V also carries it into rows of the same warp that mask that
// key (0 * NaN), as dense attention with an additive mask does; a value no
// row of the program sees is never loaded.

#include <type_traits>

#include "attention_params.cuh"
#include "kernel_contract.cuh"  // generated by build.rs from src/cuda/tiles.rs
#include "common.cuh"
#include "attention_rows.cuh"
#include "score_mods.cuh"
#include "wgmma.cuh"

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
// head_size is zero-filled); DV: output columns per program. WG: the
// sm_90a instances (see "Hopper" at the top): Q, K and V tiles 128-byte
// swizzled, every four warps (a warpgroup) multiplying their 64 rows with
// one warpgroup MMA.
template <int HEAD_, int WARPS_M_, int WARPS_N_, int KW_, int MT_, int STAGES_, bool WG_ = false, bool WS_ = false>
struct Cfg {
  static constexpr int HEAD = HEAD_;
  static constexpr int DV = HEAD_ < 256 ? HEAD_ : 256;
  static constexpr int WARPS_M = WARPS_M_;  // warps along query rows
  static constexpr int WARPS_N = WARPS_N_;  // warps along the keys of a tile
  static constexpr int KW = KW_;            // keys per warp per tile
  static constexpr int MT = MT_;            // 16-row MMA tiles per warp
  static constexpr int STAGES = STAGES_;    // K/V tiles in the cp.async ring
  static constexpr int NT = 32 * WARPS_M * WARPS_N;
  static constexpr int WR = 16 * MT;        // packed rows per warp
  static constexpr int BM = WR * WARPS_M;   // packed rows per program
  static constexpr int BN = KW * WARPS_N;   // keys per tile
  static constexpr int QS = HEAD + 8;       // shared row strides (elements), padded against bank conflicts
  static constexpr int KS = HEAD + 8;
  static constexpr int VS = DV + 8;
  static constexpr int CS = DV + 8;         // merge buffer row stride (floats)
  static constexpr bool WG = WG_;
  // WS: warp-specialised (kernels/prefill_ws.cuh): the NT threads above
  // are the consumer warpgroups, and one producer warpgroup of
  // WS_PRODUCER_THREADS more loads the tiles.
  static constexpr bool WS = WS_;
  static constexpr int THREADS = NT + (WS ? WS_PRODUCER_THREADS : 0);
  static_assert(!WS || (WG && STAGES == 2 && WARPS_M == 8),
                "warp-specialised instances: two consumer warpgroups of the warpgroup program, two stages");
  static_assert(!WG || (HEAD == DV && HEAD % 64 == 0 && HEAD <= 256 && MT == 1 && WARPS_N == 1 &&
                        WARPS_M % 4 == 0 && KW % 16 == 0 && KW <= 256),
                "warpgroup instances: whole 64-column atoms, one warp per 16 rows, whole tiles of keys");
};

// Shared-memory bytes of one instance (the launches plan with src/cuda/tiles.rs;
// the CPA_ATTN macros assert that both agree).
// WG instances: unpadded swizzled rows, and 1024 bytes of slack to align
// the tiles (whose swizzle is on address bits) on 1024 bytes.
template <class CF, bool FP8>
struct Smem {
  static constexpr int Q_BYTES = CF::BM * (CF::WG ? CF::HEAD : CF::QS) * 2;
  static constexpr int RED_BYTES = 2 * CF::WARPS_N * CF::BM * 4;
  static constexpr int OFF_BYTES = CF::STAGES * CF::BN * 8;  // per-key cache offsets, one slot per stage
  static constexpr int TILES =
      FP8     ? CF::BN * (CF::WG ? CF::HEAD : CF::KS) * 2 + CF::BN * (CF::WG ? CF::DV : CF::VS) * 2 +
                CF::STAGES * CF::BN * (CF::HEAD + CF::DV)
      : CF::WG ? CF::STAGES * CF::BN * (CF::HEAD + CF::DV) * 2
               : CF::STAGES * CF::BN * (CF::KS + CF::VS) * 2;
  static constexpr int MERGE = CF::WARPS_N * CF::BM * CF::CS * 4;
  static constexpr int REGION = TILES > MERGE ? TILES : MERGE;
  static constexpr int ALIGN = CF::WG ? 1024 : 0;
  // WS: the full and empty barriers of the K and V stages (`WsBars`).
  static constexpr int BAR_BYTES = CF::WS ? 4 * CF::STAGES * 8 : 0;
  static constexpr int TOTAL = ALIGN + Q_BYTES + RED_BYTES + OFF_BYTES + REGION + BAR_BYTES;
  static_assert(!CF::WG || (Q_BYTES % 1024 == 0 && (CF::BN * CF::HEAD * 2) % 1024 == 0),
                "warpgroup tiles start on 1024 bytes");
};

// One packed row of a program: which query row and head it is.
struct RowInfo {
  int valid;
  int q_rel;  // row within the sequence's new tokens
  int q_abs;  // absolute position
  int head;   // query head
  float slope;
};

// One tensor-core attention program (see the top of the file for its roles
// and synchronisation). The constructor carves shared memory and reads the
// block indices; `locate` finds the program's rows and keys; the members
// below are the phases `attention_body` runs in order. Everything is
// inlined into the kernel, so the members are registers, as locals were.
// The per-thread state the key loop updates (score scales, accumulator,
// running maxima and sums, the next block id) stays in the caller's locals,
// passed by reference. A member that writes through a pointer or reference
// first copies the fields it reads into locals: members are optimised on
// their own before they are inlined, where such a write might alias a field,
// and field re-reads there change the code generated for the kernel.
template <typename T, typename C, class CF, class G = LaunchGrid>
struct AttnProgram {
  static constexpr bool FP8 = IsFp8<C>::value;
  static constexpr int HEAD = CF::HEAD, DV = CF::DV, BM = CF::BM, BN = CF::BN, KW = CF::KW;
  static constexpr int NT = CF::NT, WARPS_N = CF::WARPS_N, MT = CF::MT, WR = CF::WR, STAGES = CF::STAGES;
  static constexpr int QS = CF::QS, KS = CF::KS, VS = CF::VS, CS = CF::CS;
  static_assert(STAGES >= 2, "the ring needs two stages");
  using SM = Smem<CF, FP8>;
  // The MMA element type. fp8 caches run f16 MMAs whatever the query dtype:
  // e4m3 converts to f16 in one instruction, and queries are scaled per row
  // by a power of two into f16's range (exact for bf16's 8-bit mantissa).
  using MM = typename std::conditional<FP8, __half, T>::type;
  // One warp's scores of a tile: MT fragment tiles x KW / 8 key octets.
  using Scores = float[MT][KW / 8][4];
  using RowMax = float[MT][2];
  // The per-thread accumulator: the warp's WR rows x DV columns as MT x
  // DV / 8 m16n8 fragments.
  using Acc = float[MT][DV / 8][4];

  const AttnParams& p;

  // ---- shared memory ----
  MM* sQ;             // [BM][QS] packed query rows
  float* red_m;       // [WARPS_N][BM] per-warp row maxima (the fp8 query scales before the key loop)
  float* red_l;       // [WARPS_N][BM] per-warp row sums
  int64_t* koff;      // [STAGES][BN] per-key cache byte offsets, -1 for a dead key
  MM* sK;             // FP8: one converted tile; else the STAGES-stage ring
  MM* sV;
  uint8_t* stK;       // FP8 staging ring [STAGES][BN][HEAD]
  uint8_t* stV;       // FP8 staging ring [STAGES][BN][DV]
  float* merge;       // [WARPS_N][BM][CS], over the tiles after the key loop
  float* row_qscale;  // fp8: 2^-k per packed row (in red_m)

  // ---- block indices ----
  int tid, lane, warp, wm, wn;
  int GE, BLOCK_Q, group, kv_head, hc, seg, dvc;
  int px;  // the program's query block slot (grid x, reordered in WG prefill launches)

  // ---- rows and keys (set by `locate`) ----
  int seq, q_start, q_len, row0, seq_len, context_len, q_first, q_last, window;
  int c_lo, c_hi;  // the causal / window span of keys the rows see
  const uint32_t* ranges;
  int nr;
  int k_lo, k_hi;  // every key some row sees, ranges included
  int t_begin, t_end;  // this segment's tiles of BN keys from k_lo
  int hs;
  bool vec;
  int64_t kv_row;
  const uint32_t* table;
  const C* kc;
  const C* vc;
  int bs, bs_shift;
  bool bs_pow2;

  // ---- per-thread rows: fragment rows g and g + 8 of each of the warp's MT tiles ----
  int g, c4, wrow0;
  bool warp_rows;  // some row of the warp is a real (query row, head)
  ScoreMods mods;  // the score pipeline (kernels/score_mods.cuh)
  bool plain;      // no per-key terms besides the mask

  // The program's place in its part's grid (kernels/attention_rows.cuh).
  G grid;

  __device__ __forceinline__ explicit AttnProgram(const AttnParams& params, const G& grid_ = G())
      : p(params), mods(params), grid(grid_) {
    extern __shared__ __align__(16) unsigned char smem[];
    if constexpr (CF::WG) {
      // [Q][K stages][V stages] from the first 1024-byte boundary (the merge
      // buffer over the tiles), then the row maxima and sums and the offsets.
      unsigned char* base = smem + ((1024u - (smem_addr(smem) & 1023u)) & 1023u);
      sQ = reinterpret_cast<MM*>(base);
      unsigned char* region = base + SM::Q_BYTES;
      sK = reinterpret_cast<MM*>(region);
      sV = sK + (FP8 ? 1 : STAGES) * BN * HEAD;
      stK = reinterpret_cast<uint8_t*>(sV + (FP8 ? 1 : STAGES) * BN * DV);
      stV = stK + STAGES * BN * HEAD;
      merge = reinterpret_cast<float*>(region);
      red_m = reinterpret_cast<float*>(region + SM::REGION);
      red_l = red_m + WARPS_N * BM;
      koff = reinterpret_cast<int64_t*>(red_l + WARPS_N * BM);
    } else {
      sQ = reinterpret_cast<MM*>(smem);
      red_m = reinterpret_cast<float*>(smem + SM::Q_BYTES);
      red_l = red_m + WARPS_N * BM;
      koff = reinterpret_cast<int64_t*>(smem + SM::Q_BYTES + SM::RED_BYTES);
      unsigned char* region = smem + SM::Q_BYTES + SM::RED_BYTES + SM::OFF_BYTES;
      sK = reinterpret_cast<MM*>(region);
      sV = sK + (FP8 ? 1 : STAGES) * BN * KS;
      stK = reinterpret_cast<uint8_t*>(sV + (FP8 ? 1 : STAGES) * BN * VS);
      stV = stK + STAGES * BN * HEAD;
      merge = reinterpret_cast<float*>(region);
    }

    tid = threadIdx.x;
    lane = tid & 31;
    warp = tid >> 5;
    wm = warp / WARPS_N;
    wn = warp % WARPS_N;
    GE = p.group_entries;
    BLOCK_Q = BM / GE;
    group = p.num_heads / p.num_kv_heads;
    // WG prefill launches take their query blocks heaviest first: linear
    // block i (x fastest) is query block nx - 1 - i / ny of (KV head, head
    // chunk) i % ny of the part's grid, so the causal blocks with the most
    // keys start in the first wave and the light ones fill the tail.
    px = grid.x();
    int py = grid.y();
    if (CF::WG && !p.seq_programs) {
      const int i = grid.x() + grid.y() * grid.nx();
      px = grid.nx() - 1 - i / grid.ny();
      py = i % grid.ny();
    }
    kv_head = py / p.head_chunks;
    hc = py % p.head_chunks;
    seg = grid.z() % p.num_segments;
    dvc = grid.z() / p.num_segments;
  }

  // Which sequence and which of its query blocks this program owns, the keys
  // its rows see and its segment's tiles; false when it has nothing to do.
  // Decode-shaped launches run one program per sequence (every span they
  // serve fits BLOCK_Q rows); others find their sequence by binary search
  // over the query blocks.
  __device__ __forceinline__ bool locate() {
    const int pid = px;
    seq = pid;
    if (!p.seq_programs) {
      int lo = 0, hi = p.num_seqs;
      while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        const int v = (int)(p.cu_seqlens_q[mid] / (uint32_t)BLOCK_Q) + mid;
        if (v <= pid) lo = mid + 1;
        else hi = mid;
      }
      seq = lo - 1;
    }
    if (seq < 0 || seq >= p.num_seqs) return false;
    // The sequence's query span and key count in one round trip: the three
    // loads are issued together, before the checks that use them.
    const uint32_t cu0 = p.cu_seqlens_q[seq], cu1 = p.cu_seqlens_q[seq + 1];
    const uint32_t n_keys = p.seq_lens[seq];
    q_start = (int)cu0;
    q_len = (int)cu1 - q_start;
    // A mixed batch runs as two launches, one per tile shape, each owning the
    // sequences whose span fits it.
    if (q_len < p.q_len_min || q_len > p.q_len_max) return false;
    row0 = p.seq_programs ? 0 : (pid - (q_start / BLOCK_Q + seq)) * BLOCK_Q;
    if (row0 >= q_len) return false;
    seq_len = (int)n_keys;
    context_len = seq_len - q_len;
    q_first = context_len + row0;
    q_last = context_len + min(row0 + BLOCK_Q, q_len) - 1;
    window = p.sliding_window;

    // The keys any row of this program sees: [k_lo, k_hi).
    c_lo = window > 0 ? max(0, q_first - window + 1) : 0;
    c_hi = q_last + 1;
    ranges = p.prefix_ranges ? p.prefix_ranges + (size_t)seq * p.max_ranges * 2 : nullptr;
    nr = ranges ? p.max_ranges : 0;
    k_lo = c_lo;
    k_hi = c_hi;
    for (int r = 0; r < nr; ++r) {
      const int s = (int)ranges[2 * r], e = (int)ranges[2 * r + 1];
      if (s < e && s <= q_last && q_first < e) {
        k_lo = min(k_lo, s);
        k_hi = max(k_hi, e);
      }
    }
    k_hi = min(k_hi, seq_len);

    const int n_tiles = k_hi > k_lo ? (k_hi - k_lo + BN - 1) / BN : 0;
    const int tiles_per_seg = (n_tiles + p.num_segments - 1) / p.num_segments;
    t_begin = min(n_tiles, seg * tiles_per_seg);
    t_end = min(n_tiles, t_begin + tiles_per_seg);

    hs = p.head_size;
    vec = p.vec_loads != 0;
    kv_row = (int64_t)p.num_kv_heads * hs;
    table = p.block_tables + (size_t)seq * p.block_table_width;
    return true;
  }

  // Whether some row of the program sees `key`. A key no row sees is
  // zero-filled instead of loaded: its page may hold garbage.
  __device__ __forceinline__ bool key_live(int key) const {
    const int k_hi = this->k_hi, c_lo = this->c_lo, c_hi = this->c_hi, nr = this->nr;
    const int q_first = this->q_first, q_last = this->q_last;
    const uint32_t* ranges = this->ranges;
    if (key >= k_hi) return false;
    if (key >= c_lo && key < c_hi) return true;
    for (int r = 0; r < nr; ++r) {
      const int s = (int)ranges[2 * r], e = (int)ranges[2 * r + 1];
      if (s < e && s <= q_last && q_first < e && s <= key && key < e) return true;
    }
    return false;
  }

  // Packed row r: query row r / GE, head hc * GE + r % GE of the KV group.
  __device__ __forceinline__ RowInfo row_info(int r) const {
    RowInfo ri;
    const int ql = r / GE, gh = hc * GE + r % GE;
    ri.valid = ql < BLOCK_Q && row0 + ql < q_len && gh < group;
    ri.q_rel = row0 + ql;
    ri.q_abs = context_len + ri.q_rel;
    ri.head = kv_head * group + (gh < group ? gh : 0);
    ri.slope = ri.valid ? mods.slope(ri.head) : 0.f;
    return ri;
  }

  // ---- Q: BM packed rows x HEAD columns (zero past head_size / invalid rows) ----

  // Eight query values of chunk c of q (packed row c / CPR, columns (c % CPR) * 8
  // on) as f32, zero past head_size and on invalid rows; returns the row.
  __device__ __forceinline__ int q_chunk(const T* q, int c, float (&v)[8]) const {
    constexpr int CPR = HEAD / 8;
    const int r = c / CPR, col = (c % CPR) * 8;
    const RowInfo ri = row_info(r);
    const int64_t src = ((int64_t)(q_start + ri.q_rel) * p.num_heads + ri.head) * hs + col;
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = (ri.valid && col + e < hs) ? to_f32(q[src + e]) : 0.f;
    return r;
  }

  // fp8 caches: each row is scaled by 2^k, k chosen so that its largest
  // magnitude lands in [2^14, 2^15), and converted to f16 into sQ;
  // `row_qscale` (in the red_m area until the key loop) keeps 2^-k for the
  // scores, or NaN for a row holding NaN or +-inf, whose every score then is
  // NaN. Four block barriers: the row maxima cleared, gathered, sQ written,
  // the scales written.
  __device__ __forceinline__ void load_q_scaled() {
    const int tid = this->tid;
    MM* sQ = this->sQ;
    float* row_qscale = this->row_qscale;
    const T* q = static_cast<const T*>(p.q);
    constexpr int CPR = HEAD / 8;
    int* row_max_bits = reinterpret_cast<int*>(this->red_m);
    for (int r = tid; r < BM; r += NT) row_max_bits[r] = 0;
    __syncthreads();
    // The largest |q| of each row as int bits: for non-negative floats the
    // integer order is the float order, with +inf above every finite value
    // and NaN above +inf, so a row holding NaN or inf ends non-finite.
    for (int c = tid; c < BM * CPR; c += NT) {
      float v[8];
      const int r = q_chunk(q, c, v);
      int mb = 0;
#pragma unroll
      for (int e = 0; e < 8; ++e) mb = max(mb, __float_as_int(fabsf(v[e])));
      if (mb > 0) atomicMax(row_max_bits + r, mb);
    }
    __syncthreads();
    for (int c = tid; c < BM * CPR; c += NT) {
      float v[8];
      const int r = q_chunk(q, c, v);
      const float m = __int_as_float(row_max_bits[r]);
      int ex = 0;
      frexpf(m, &ex);  // m < 2^ex
      const float up = (m > 0.f && isfinite(m)) ? ldexpf(1.f, 15 - ex) : 1.f;
      uint4 w;
      w.x = pack2<__half>(v[0] * up, v[1] * up);
      w.y = pack2<__half>(v[2] * up, v[3] * up);
      w.z = pack2<__half>(v[4] * up, v[5] * up);
      w.w = pack2<__half>(v[6] * up, v[7] * up);
      *reinterpret_cast<uint4*>(CF::WG ? reinterpret_cast<unsigned char*>(sQ) + sw128_offset(BM, r, c % CPR)
                                       : reinterpret_cast<unsigned char*>(sQ + r * QS + (c % CPR) * 8)) = w;
    }
    __syncthreads();
    for (int r = tid; r < BM; r += NT) {
      const float m = __int_as_float(row_max_bits[r]);
      int ex = 0;
      frexpf(m, &ex);
      row_qscale[r] = !isfinite(m) ? __int_as_float(0x7fc00000) : m > 0.f ? ldexpf(1.f, ex - 15) : 1.f;
    }
    __syncthreads();
  }

  // 16-bit caches: the query rows go to sQ as they are, by cp.async (into the
  // first tile's group) when 16-byte loads are allowed. Their NaN / inf
  // check waits for the first tile (`check_q_rows`).
  __device__ __forceinline__ void load_q_direct() {
    const AttnParams& p = this->p;
    const int tid = this->tid, hs = this->hs, q_start = this->q_start;
    const bool vec = this->vec;
    MM* sQ = this->sQ;
    const T* q = static_cast<const T*>(p.q);
    constexpr int CPR = HEAD / 8;
    for (int c = tid; c < BM * CPR; c += NT) {
      const int r = c / CPR, col = (c % CPR) * 8;
      const RowInfo ri = row_info(r);
      const bool ok = ri.valid && col < hs;
      const int64_t src = ((int64_t)(q_start + ri.q_rel) * p.num_heads + ri.head) * hs + col;
      T* dst = CF::WG ? reinterpret_cast<T*>(reinterpret_cast<unsigned char*>(sQ) + sw128_offset(BM, r, col / 8))
                      : sQ + r * QS + col;
      if (vec) {
        cp_async_16(dst, ok ? q + src : q, ok);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) dst[e] = (ok && col + e < hs) ? q[src + e] : from_f32<T>(0.f);
      }
    }
  }

  __device__ __forceinline__ void load_q() {
    row_qscale = red_m;
    if constexpr (FP8) load_q_scaled();
    else load_q_direct();
  }

  // ---- K/V tiles: keys k_lo + t * BN .. + BN of this sequence ----
  // Per-key cache offsets of a tile (-1: dead key, zero-filled) go to the
  // tile's slot of `koff`, written one iteration before the tile's loads
  // read them. Threads tid < BN own one key each; the block id of the key
  // they handle next is read from the table one call ahead (`next_blk`), so
  // the table read's latency hides behind a whole tile.
  // Offsets are in bytes; block sizes that are powers of two use shifts.

  __device__ __forceinline__ void init_tables() {
    kc = static_cast<const C*>(p.k_cache);
    vc = static_cast<const C*>(p.v_cache);
    bs = p.block_size;
    bs_pow2 = (bs & (bs - 1)) == 0;
    bs_shift = __ffs(bs) - 1;
  }

  // The block-table entry of this thread's key of tile t (0 past the segment / keys).
  __device__ __forceinline__ uint32_t table_entry(int t) const {
    return (tid < BN && t < t_end) ? key_block(k_lo + t * BN + tid) : 0u;
  }

  // The block-table entry of key `key` of the sequence (0 past its keys:
  // never dereferenced).
  __device__ __forceinline__ uint32_t key_block(int key) const {
    return key < k_hi ? table[bs_pow2 ? key >> bs_shift : key / bs] : 0u;
  }

  // The byte offset of key `key` (in block `blk`) in the caches, or -1 for
  // a key no row sees (zero-filled instead of loaded).
  __device__ __forceinline__ int64_t key_offset(int key, uint32_t blk) const {
    const int in_blk = bs_pow2 ? key & (bs - 1) : key % bs;
    return key_live(key) ? ((int64_t)blk * p.block_stride + (int64_t)in_blk * kv_row + (int64_t)kv_head * hs) *
                               (int64_t)sizeof(C)
                         : (int64_t)-1;
  }

  // Tiles ahead of its use that a block-table entry is asked of L2 for:
  // decode-shaped programs only (few tiles, latency-bound; in the 255-register
  // prefill instances the prefetch costs spills).
  static constexpr int TABLE_AHEAD = CF::WARPS_M == 1 ? 4 : 0;

  // Asks L2 for the block-table entries of tile t, TABLE_AHEAD tiles before
  // `table_entry` reads them (no register, nothing waits): one request per
  // 32 keys, from the thread of the first (a tile's entries span a line or
  // two of the table).
  __device__ __forceinline__ void prefetch_table(int t) const {
    const int key = k_lo + t * BN + tid;
    if ((tid & 31) == 0 && tid < BN && t < t_end && key < k_hi) {
      const uint32_t* e = table + (bs_pow2 ? key >> bs_shift : key / bs);
      asm volatile("prefetch.global.L2 [%0];" ::"l"(e));
    }
  }

  // This thread's key of tile t, in block `blk`: its byte offset (or -1)
  // into the tile's koff slot.
  __device__ __forceinline__ void tile_offsets(int t, uint32_t blk) {
    if (tid >= BN || t >= t_end) return;
    koff[((t - t_begin) % STAGES) * BN + tid] = key_offset(k_lo + t * BN + tid, blk);
  }

  // WG: element (row, col) of a swizzled tile of BN rows (col a multiple of
  // 8: the 16-byte chunk it starts).
  template <typename E>
  __device__ __forceinline__ static E* wg_tile_at(E* tile, int row, int col) {
    return reinterpret_cast<E*>(reinterpret_cast<unsigned char*>(tile) + sw128_offset(BN, row, col / 8));
  }

  // Copies COLS columns starting at col0 of each key row into dst (row
  // stride dst_stride elements of C; WG: swizzled), zero-filling dead keys
  // and columns.
  // With 16-byte loads each thread owns one column chunk and every
  // (NT / CPR)-th row, so its addresses are a base plus the row's offset.
  template <int COLS>
  __device__ __forceinline__ void load_rows(const C* cache, const int64_t* offs, int col0, IntC<COLS>, C* dst,
                                            int dst_stride) {
    constexpr int EPC = 16 / (int)sizeof(C);  // elements per 16-byte chunk
    constexpr int CPR = COLS / EPC;
    // WG tiles of 16-bit caches are swizzled; fp8 staging rows never are.
    constexpr bool SWIZZLED = CF::WG && !FP8;
    const char* base = reinterpret_cast<const char*>(cache);
    if (vec) {
      static_assert(NT % CPR == 0 && BN % (NT / CPR) == 0, "a pass covers whole rows");
      constexpr int RSTEP = NT / CPR;
      const int col = (tid % CPR) * EPC;
      const int r0 = tid / CPR;
      const bool col_ok = col0 + col < hs;
      C* d = dst + r0 * dst_stride + col;
      const char* src = base + (int64_t)(col0 + col) * (int64_t)sizeof(C);
#pragma unroll
      for (int i = 0; i < BN / RSTEP; ++i) {
        const int64_t ko = offs[r0 + i * RSTEP];
        const bool ok = col_ok && ko >= 0;
        cp_async_16(SWIZZLED ? wg_tile_at(dst, r0 + i * RSTEP, col) : d + i * RSTEP * dst_stride, ok ? src + ko : base,
                    ok);
      }
      return;
    }
    for (int c = tid; c < BN * CPR; c += NT) {
      const int kl = c / CPR, col = (c % CPR) * EPC;
      const int gcol = col0 + col;
      const int64_t ko = offs[kl];
      C* d = SWIZZLED ? wg_tile_at(dst, kl, col) : dst + kl * dst_stride + col;
      const C* row = reinterpret_cast<const C*>(base + (ko >= 0 ? ko : 0));
#pragma unroll
      for (int e = 0; e < EPC; ++e) {
        if (ko >= 0 && gcol + e < hs) {
          d[e] = row[gcol + e];
        } else {
          if constexpr (FP8) d[e].bits = 0;
          else d[e] = from_f32<C>(0.f);
        }
      }
    }
  }

  // K and V rows of one tile with 16-byte loads, one offset read per row
  // for both (16-bit caches whose values span the whole head).
  __device__ __forceinline__ void load_kv_rows(const int64_t* offs, C* dk, C* dv) {
    constexpr int EPC = 16 / (int)sizeof(C);
    constexpr int CPR = HEAD / EPC;
    static_assert(NT % CPR == 0 && BN % (NT / CPR) == 0, "a pass covers whole rows");
    constexpr int RSTEP = NT / CPR;
    const int col = (tid % CPR) * EPC;
    const int r0 = tid / CPR;
    const bool col_ok = col < hs;
    const char* kb = reinterpret_cast<const char*>(kc) + col * (int)sizeof(C);
    const char* vb = reinterpret_cast<const char*>(vc) + col * (int)sizeof(C);
    if constexpr (CF::WG) {
#pragma unroll
      for (int i = 0; i < BN / RSTEP; ++i) {
        const int64_t ko = offs[r0 + i * RSTEP];
        const bool ok = col_ok && ko >= 0;
        const uint32_t o = sw128_offset(BN, r0 + i * RSTEP, col / 8);
        cp_async_16(reinterpret_cast<unsigned char*>(dk) + o, ok ? kb + ko : kb, ok);
        cp_async_16(reinterpret_cast<unsigned char*>(dv) + o, ok ? vb + ko : vb, ok);
      }
      return;
    }
    C* k_dst = dk + r0 * KS + col;
    C* v_dst = dv + r0 * VS + col;
#pragma unroll
    for (int i = 0; i < BN / RSTEP; ++i) {
      const int64_t ko = offs[r0 + i * RSTEP];
      const bool ok = col_ok && ko >= 0;
      cp_async_16(k_dst + i * RSTEP * KS, ok ? kb + ko : kb, ok);
      cp_async_16(v_dst + i * RSTEP * VS, ok ? vb + ko : vb, ok);
    }
  }

  // Issues the loads of tile t into ring stage (t - t_begin) % STAGES, the
  // stage of its offsets' slot (fp8: the staging ring; else sK / sV).
  __device__ __forceinline__ void load_tile(int t) {
    const int64_t* koff = this->koff;
    const C* kc = this->kc;
    const C* vc = this->vc;
    uint8_t* stK = this->stK;
    uint8_t* stV = this->stV;
    MM* sK = this->sK;
    MM* sV = this->sV;
    const int t_begin = this->t_begin, dvc = this->dvc;
    const bool vec = this->vec;
    const int stage = (t - t_begin) % STAGES;
    const int64_t* offs = koff + stage * BN;
    if constexpr (FP8) {
      load_rows(kc, offs, 0, IntC<HEAD>{}, reinterpret_cast<C*>(stK + stage * BN * HEAD), HEAD);
      load_rows(vc, offs, dvc * DV, IntC<DV>{}, reinterpret_cast<C*>(stV + stage * BN * DV), DV);
    } else {
      C* dk = reinterpret_cast<C*>(sK + stage * BN * (CF::WG ? HEAD : KS));
      C* dv = reinterpret_cast<C*>(sV + stage * BN * (CF::WG ? DV : VS));
      if (HEAD == DV && vec) {
        load_kv_rows(offs, dk, dv);
      } else {
        load_rows(kc, offs, 0, IntC<HEAD>{}, dk, KS);
        load_rows(vc, offs, dvc * DV, IntC<DV>{}, dv, VS);
      }
    }
  }

  // ---- per-thread state ----

  // Whether the warp has a real row, the score scales of this thread's
  // fragment rows (the query's f16 scaling folded in), and empty
  // accumulators. The per-thread state (scales, accumulator, running maxima
  // and sums) stays in the caller's registers and is passed by reference.
  __device__ __forceinline__ void init_rows(RowMax& rsc, RowMax& rsc_log2, Acc& acc, RowMax& m_run, RowMax& l_run) {
    const float* row_qscale = this->row_qscale;
    const int g = lane >> 2, wrow0 = wm * WR;
    this->g = g;
    c4 = lane & 3;
    this->wrow0 = wrow0;
    bool any_row = false;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      any_row = any_row || row_info(wrow0 + mt * 16 + g).valid || row_info(wrow0 + mt * 16 + g + 8).valid;
    warp_rows = __any_sync(0xffffffffu, any_row);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float qs = FP8 ? row_qscale[wrow0 + mt * 16 + g + 8 * i] : 1.f;
        rsc[mt][i] = mods.scale(qs);
        rsc_log2[mt][i] = mods.scale_log2(qs);
      }
    }
    plain = mods.plain(nr);

#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int i = 0; i < DV / 8; ++i) acc[mt][i][0] = acc[mt][i][1] = acc[mt][i][2] = acc[mt][i][3] = 0.f;
      m_run[mt][0] = m_run[mt][1] = neg_inf();
      l_run[mt][0] = l_run[mt][1] = 0.f;
    }
  }

  // ---- the key loop ----

  // Offsets of the first STAGES tiles, then the loads of the first
  // STAGES - 1, one cp.async group each (Q rides in the first group).
  __device__ __forceinline__ void prologue(uint32_t& next_blk) {
    const int t_begin = this->t_begin, t_end = this->t_end;
#pragma unroll
    for (int s = 0; s < STAGES; ++s) tile_offsets(t_begin + s, table_entry(t_begin + s));
    next_blk = table_entry(t_begin + STAGES);
#pragma unroll
    for (int s = 1; s <= TABLE_AHEAD; ++s) prefetch_table(t_begin + STAGES + s);
    __syncthreads();
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (t_begin + s < t_end) load_tile(t_begin + s);
      cp_async_commit();  // Q rides in the first group
    }
  }

  // The K / V tile the MMAs read for ring stage `stage`. fp8: dequantises
  // the staged tile into the one converted tile, four values per step
  // (exact: every e4m3 value is a f16 and a bf16 value). With one row of
  // warps each warp reads only its own KW keys, so it converts just those
  // and no block barrier is needed.
  __device__ __forceinline__ void stage_tile(int stage, const MM*& tK, const MM*& tV) {
    MM* sK = this->sK;
    MM* sV = this->sV;
    if constexpr (FP8) {
      constexpr bool OWN = CF::WARPS_M == 1 && WARPS_N > 1;
      const uint8_t* stK = this->stK;
      const uint8_t* stV = this->stV;
      const int k0 = OWN ? wn * KW : 0;
      constexpr int NK = OWN ? KW : BN;
      const int t0 = OWN ? lane : tid;
      constexpr int TS = OWN ? 32 : NT;
      const uint32_t* sk = reinterpret_cast<const uint32_t*>(stK + stage * BN * HEAD + k0 * HEAD);
      const uint32_t* sv = reinterpret_cast<const uint32_t*>(stV + stage * BN * DV + k0 * DV);
#pragma unroll 4
      for (int i = t0; i < NK * HEAD / 4; i += TS) {
        const int kl = k0 + (4 * i) / HEAD, col = (4 * i) % HEAD;
        *reinterpret_cast<uint2*>(CF::WG ? wg_tile_at(sK, kl, col) + col % 8 : sK + kl * KS + col) =
            fp8x4_to<MM>(sk[i]);
      }
#pragma unroll 4
      for (int i = t0; i < NK * DV / 4; i += TS) {
        const int kl = k0 + (4 * i) / DV, col = (4 * i) % DV;
        *reinterpret_cast<uint2*>(CF::WG ? wg_tile_at(sV, kl, col) + col % 8 : sV + kl * VS + col) =
            fp8x4_to<MM>(sv[i]);
      }
      // WG: the converted tile, to the MMAs' async proxy.
      if constexpr (CF::WG) fence_async_shared();
      if constexpr (OWN) __syncwarp();
      else __syncthreads();
      tK = sK;
      tV = sV;
    } else {
      tK = sK + stage * BN * (CF::WG ? HEAD : KS);
      tV = sV + stage * BN * (CF::WG ? DV : VS);
    }
  }

  // 16-bit caches, once, when Q has landed with the first tile: each lane
  // checks a quarter of its fragment rows g and g + 8 (the quad shares the
  // rest), and a row holding NaN or +-inf gets a NaN score scale, so that
  // every score it makes, and so the row, is NaN.
  __device__ __forceinline__ void check_q_rows(RowMax& rsc, RowMax& rsc_log2) const {
    const MM* sQ = this->sQ;
    const int wrow0 = this->wrow0, g = this->g, c4 = this->c4;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = wrow0 + mt * 16 + g + 8 * i;
        const MM* row = sQ + r * QS;
        int bad = 0;
#pragma unroll
        for (int cc = c4; cc < HEAD / 8; cc += 4)
          bad |= any_nonfinite8<MM>(*reinterpret_cast<const uint4*>(
              CF::WG ? reinterpret_cast<const unsigned char*>(sQ) + sw128_offset(BM, r, cc)
                     : reinterpret_cast<const unsigned char*>(row + cc * 8)));
        bad |= __shfl_xor_sync(0xffffffffu, bad, 1);
        bad |= __shfl_xor_sync(0xffffffffu, bad, 2);
        if (bad) {
          rsc[mt][i] = __int_as_float(0x7fc00000);
          rsc_log2[mt][i] = __int_as_float(0x7fc00000);
        }
      }
    }
  }

  // S = Q K^T for this warp's WR rows x KW keys of the tile in tK; each K
  // fragment feeds MT MMAs.
  __device__ __forceinline__ void qk(const MM* tK, Scores& s) const {
    if constexpr (CF::WG) {
      qk_wg(tK, s);
      return;
    }
    const MM* sQ = this->sQ;
    const int wrow0 = this->wrow0, lane = this->lane, hs = this->hs, wn = this->wn;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < KW / 8; ++i) s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < HEAD / 16; ++kk) {
      if (kk * 16 < hs) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
          ldmatrix_x4(a[mt], sQ + (wrow0 + mt * 16 + (lane & 15)) * QS + kk * 16 + (lane >> 4) * 8);
#pragma unroll
        for (int np = 0; np < KW / 16; ++np) {
          uint32_t b[4];
          ldmatrix_x4(b, tK + (wn * KW + np * 16 + (lane & 7) + (lane >> 4) * 8) * KS + kk * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_16816<MM>(s[mt][2 * np], a[mt], b[0], b[1]);
            mma_16816<MM>(s[mt][2 * np + 1], a[mt], b[2], b[3]);
          }
        }
      }
    }
  }

  // WG: S = Q K^T for the warpgroup's 64 rows x the BN keys of the tile in
  // tK, in 16-column steps of one warpgroup MMA each (all HEAD / 16 of them:
  // the columns past head_size are zero, and skipping steps would make the
  // compiler serialise the MMAs); this warp's 16 rows land in s as from
  // mma.sync.
  __device__ __forceinline__ void qk_wg(const MM* tK, Scores& s) const {
    float(&d)[KW / 2] = reinterpret_cast<float(&)[KW / 2]>(s);
    const uint32_t q0 = smem_addr(sQ) + (warp / 4) * 64 * 128;
    const uint32_t k0 = smem_addr(tK);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < HEAD / 16; ++kk) {
      const uint32_t col = (kk % 4) * 32;  // bytes of the 16-column step within its atom
      const uint64_t a = sw128_desc(q0 + (kk / 4) * BM * 128 + col, 16, 1024);
      const uint64_t b = sw128_desc(k0 + (kk / 4) * BN * 128 + col, 16, 1024);
      WgMma<MM, BN>::ss(d, a, b, kk > 0);
    }
    wg_commit();
    wg_wait<0>();
    wg_fence_operands(d);
  }

  // The warp's raw scores of its keys warp_key0 .. + KW to log2-unit logits: scale, softcap,
  // mask, ALiBi, qq_bias (`ScoreMods::logit`); tmax gets each fragment row's maximum over the
  // quad. A warp whose keys every row of the program sees, with no extra
  // terms, only scales (rows past the program's valid rows are never
  // written). Masked keys are selected to -inf, never computed from data.
  __device__ __forceinline__ void score(int warp_key0, Scores& s, RowMax& tmax, const RowMax& rsc,
                                        const RowMax& rsc_log2) const {
    const int k_hi = this->k_hi, q_first = this->q_first, q_last = this->q_last;
    const int window = this->window, nr = this->nr, context_len = this->context_len, wrow0 = this->wrow0;
    const int g = this->g, c4 = this->c4;
    const bool plain = this->plain;
    const ScoreMods& mods = this->mods;
    const uint32_t* ranges = this->ranges;
    const bool full = plain && warp_key0 + KW - 1 <= q_first && warp_key0 + KW <= k_hi &&
                      (window == 0 || q_last - warp_key0 < window);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      tmax[mt][0] = tmax[mt][1] = neg_inf();
      if (full) {
#pragma unroll
        for (int nt = 0; nt < KW / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float x = s[mt][nt][e] * rsc_log2[mt][e >> 1];
            s[mt][nt][e] = x;
            tmax[mt][e >> 1] = max_nan(tmax[mt][e >> 1], x);
          }
        }
      } else if (CF::WG && !FP8 && plain) {
        // WG over a 16-bit cache (the warp-specialised instances too), a
        // tile at the edge of the rows' keys with no per-key terms: only
        // the causal / window mask and the sequence's end, the scale in
        // log2 units and NaN-propagating maxima, as on the full path
        // (`ScoreMods::logit` with every term off, in fewer instructions).
        const RowInfo rows2[2] = {row_info(wrow0 + mt * 16 + g), row_info(wrow0 + mt * 16 + g + 8)};
#pragma unroll
        for (int nt = 0; nt < KW / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const RowInfo& ri = rows2[e >> 1];
            const int key = warp_key0 + nt * 8 + 2 * c4 + (e & 1);
            const bool visible =
                ri.valid && key < k_hi && key <= ri.q_abs && (window == 0 || ri.q_abs - key < window);
            const float x = visible ? s[mt][nt][e] * rsc_log2[mt][e >> 1] : neg_inf();
            s[mt][nt][e] = x;
            tmax[mt][e >> 1] = max_nan(tmax[mt][e >> 1], x);
          }
        }
      } else {
        // Row details are recomputed here, off the full-tile path, to keep
        // registers free.
        const RowInfo rows2[2] = {row_info(wrow0 + mt * 16 + g), row_info(wrow0 + mt * 16 + g + 8)};
#pragma unroll
        for (int nt = 0; nt < KW / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const RowInfo& ri = rows2[e >> 1];
            const int key = warp_key0 + nt * 8 + 2 * c4 + (e & 1);
            // A NaN score becomes +inf (`ScoreMods::to_log2`): the fmaxf
            // below then makes the maximum +inf and p = exp2(inf - inf)
            // NaN, so the row is NaN as it would be.
            const auto visible = [&] {
              return ri.valid && key < k_hi && key_visible(ri.q_abs, key, window, ranges, nr);
            };
            const float x =
                mods.logit(s[mt][nt][e] * rsc[mt][e >> 1], visible, ri.slope, key, context_len, ri.q_rel);
            s[mt][nt][e] = x;
            tmax[mt][e >> 1] = fmaxf(tmax[mt][e >> 1], x);
          }
        }
      }
      tmax[mt][0] = quad_max(tmax[mt][0]);
      tmax[mt][1] = quad_max(tmax[mt][1]);
    }
  }

  // WG: whether every row of the program sees every key of the warp's keys
  // from `warp_key0`, with no per-key terms (`score`'s full-tile
  // condition), under a positive scale (`score_whole_wg`'s maxima of raw
  // scores).
  __device__ __forceinline__ bool whole_wg(int warp_key0) const {
    return this->plain && this->mods.params.scale > 0.f && warp_key0 + KW - 1 <= this->q_first &&
           warp_key0 + KW <= this->k_hi && (this->window == 0 || this->q_last - warp_key0 < this->window);
  }

  // WG: the scores of a tile `whole_wg` holds for (`score`'s fast path with
  // the scale moved out of the loop): each row's maximum over its raw
  // values in two chains (NaN-propagating), then over the quad, scaled
  // once to log2 units by the row's score scale c (positive, or NaN for a
  // query row holding NaN or +-inf, which makes the row NaN; x -> c x is
  // monotonic). The scores stay raw: `softmax_update` scales them inside
  // its fma, by c1 = c.
  __device__ __forceinline__ static void score_whole_wg(const Scores& s, RowMax& tmax, const RowMax& c,
                                                        float (&c1)[2]) {
    float m[2][2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      m[i][0] = max_nan(s[0][0][2 * i], s[0][0][2 * i + 1]);
      m[i][1] = max_nan(s[0][1][2 * i], s[0][1][2 * i + 1]);
    }
#pragma unroll
    for (int nt = 2; nt < KW / 8; ++nt) {
#pragma unroll
      for (int i = 0; i < 2; ++i) m[i][nt & 1] = max_nan(m[i][nt & 1], max_nan(s[0][nt][2 * i], s[0][nt][2 * i + 1]));
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      c1[i] = c[0][i];
      tmax[0][i] = quad_max(max_nan(m[i][0], m[i][1])) * c1[i];
    }
  }

  // Whether some row of the warp sees a key of the tile (else the warp skips
  // the softmax update and the P.V product).
  __device__ __forceinline__ bool tile_seen(const RowMax& tmax) const {
    bool seen = false;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) seen = seen || tmax[mt][0] != neg_inf() || tmax[mt][1] != neg_inf();
    return __any_sync(0xffffffffu, seen);
  }

  // Online softmax over the tile: moves each row's running maximum, rescales
  // its sum (and its accumulator, when the maximum moved for some row of the
  // warp) and turns the logits in s into probabilities added to the sum.
  __device__ __forceinline__ void softmax_update(Scores& s, const RowMax& tmax, Acc& acc, RowMax& m_run,
                                                 RowMax& l_run, const float (&c1)[2]) const {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      float alpha[2], m_use[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        alpha[i] = online_max_step(m_run[mt][i], l_run[mt][i], tmax[mt][i], m_use[i]);
      }
      // The running max rarely moves once a few tiles are in: rescale only
      // when it did for some row of the warp.
      if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
        for (int i = 0; i < DV / 8; ++i) {
          acc[mt][i][0] *= alpha[0];
          acc[mt][i][1] *= alpha[0];
          acc[mt][i][2] *= alpha[1];
          acc[mt][i][3] *= alpha[1];
        }
      }
      if constexpr (CF::WG) {
        // Scores times c1 (`score_whole_wg`; 1 after `score`) in one fma
        // and one ex2.approx.ftz each (every argument is at most an ulp
        // above 0, or NaN, which stays NaN), summed in two chains per row.
        float sum[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
#pragma unroll
        for (int nt = 0; nt < KW / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float pe = ex2_ftz(fmaf(s[mt][nt][e], c1[e >> 1], -m_use[e >> 1]));
            s[mt][nt][e] = pe;
            sum[e >> 1][nt & 1] += pe;
          }
        }
        l_run[mt][0] += sum[0][0] + sum[0][1];
        l_run[mt][1] += sum[1][0] + sum[1][1];
      } else {
#pragma unroll
        for (int nt = 0; nt < KW / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float pe = exp2f(s[mt][nt][e] - m_use[e >> 1]);
            s[mt][nt][e] = pe;
            l_run[mt][e >> 1] += pe;
          }
        }
      }
    }
  }

  // O += P V over the warp's KW keys of the tile in tV: P from the score
  // registers, V^T fragments via ldmatrix.trans, each V fragment feeding MT
  // MMAs.
  __device__ __forceinline__ void pv(const Scores& s, const MM* tV, Acc& acc) const {
    if constexpr (CF::WG) {
      pv_wg(s, tV, acc);
      return;
    }
    const int wn = this->wn, lane = this->lane, dvc = this->dvc, hs = this->hs;
#pragma unroll
    for (int j = 0; j < KW / 16; ++j) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        a[mt][0] = pack2<MM>(s[mt][2 * j][0], s[mt][2 * j][1]);
        a[mt][1] = pack2<MM>(s[mt][2 * j][2], s[mt][2 * j][3]);
        a[mt][2] = pack2<MM>(s[mt][2 * j + 1][0], s[mt][2 * j + 1][1]);
        a[mt][3] = pack2<MM>(s[mt][2 * j + 1][2], s[mt][2 * j + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < DV / 16; ++dp) {
        if (dvc * DV + dp * 16 < hs) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, tV + (wn * KW + j * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * VS + dp * 16 + (lane >> 4) * 8);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_16816<MM>(acc[mt][2 * dp], a[mt], b[0], b[1]);
            mma_16816<MM>(acc[mt][2 * dp + 1], a[mt], b[2], b[3]);
          }
        }
      }
    }
  }

  // WG: the probabilities in s (one 16-row tile) as the A operand of the
  // P V warpgroup MMAs, 16 keys per step.
  __device__ __forceinline__ static void pack_p(const Scores& s, uint32_t (&a)[KW / 16][4]) {
#pragma unroll
    for (int j = 0; j < KW / 16; ++j) {
      a[j][0] = pack2<MM>(s[0][2 * j][0], s[0][2 * j][1]);
      a[j][1] = pack2<MM>(s[0][2 * j][2], s[0][2 * j][3]);
      a[j][2] = pack2<MM>(s[0][2 * j + 1][0], s[0][2 * j + 1][1]);
      a[j][3] = pack2<MM>(s[0][2 * j + 1][2], s[0][2 * j + 1][3]);
    }
  }

  // WG: O += P V for the warpgroup's 64 rows over the BN keys of the tile in
  // tV (MN-major: keys as rows, value columns along the atoms), P from the
  // score registers in 16-key steps of one warpgroup MMA each.
  __device__ __forceinline__ void pv_wg(const Scores& s, const MM* tV, Acc& acc) const {
    float(&o)[DV / 2] = reinterpret_cast<float(&)[DV / 2]>(acc);
    uint32_t a[KW / 16][4];
    pack_p(s, a);
    const uint32_t v0 = smem_addr(tV);
    wg_fence_operands(o);
    wg_fence();
#pragma unroll
    for (int j = 0; j < KW / 16; ++j) WgMma<MM, DV>::rs_t(o, a[j], sw128_desc(v0 + j * 16 * 128, BN * 128, 1024));
    wg_commit();
    wg_wait<0>();
    wg_fence_operands(o);
  }

  // The segment's tiles t_begin .. t_end through the ring: wait for tile t,
  // one block barrier, refill the stage tile t - 1 freed with tile
  // t + STAGES - 1 (one cp.async group per iteration, empty past the end),
  // write the offsets of tile t + STAGES into tile t's slot, then score and
  // accumulate tile t.
  __device__ __forceinline__ void key_loop(RowMax& rsc, RowMax& rsc_log2, Acc& acc, RowMax& m_run, RowMax& l_run) {
    uint32_t next_blk = 0;  // block id of the key this thread handles next (read a tile ahead)
    const int t_begin = this->t_begin, t_end = this->t_end, k_lo = this->k_lo, wn = this->wn;
    const bool warp_rows = this->warp_rows;
    prologue(next_blk);
    for (int t = t_begin; t < t_end; ++t) {
      const int stage = (t - t_begin) % STAGES;
      // Tile t has landed once at most STAGES - 2 younger groups are pending.
      cp_async_wait<STAGES - 2>();
      if constexpr (CF::WG) fence_async_shared();  // the tile, to the MMAs' async proxy
      __syncthreads();
      // Every warp is done with tile t - 1: its stage takes tile t + STAGES - 1,
      // whose offsets were written before the barrier; tile t's offset slot
      // (read by loads issued earlier) takes tile t + STAGES.
      if (t + STAGES - 1 < t_end) load_tile(t + STAGES - 1);
      cp_async_commit();
      tile_offsets(t + STAGES, next_blk);
      next_blk = table_entry(t + STAGES + 1);
      if constexpr (TABLE_AHEAD > 0) prefetch_table(t + STAGES + 1 + TABLE_AHEAD);
      const MM* tK;
      const MM* tV;
      stage_tile(stage, tK, tV);
      // Warps whose rows are all padding (a decode row in a prefill-shaped
      // program, say) skip the tile; WG warps never do (their warpgroup
      // multiplies together).
      if (!CF::WG && !warp_rows) continue;
      if constexpr (!FP8) {
        if (t == t_begin) check_q_rows(rsc, rsc_log2);
      }
      const int tile_start = k_lo + t * BN;
      const int warp_key0 = tile_start + wn * KW;
      Scores s;
      qk(tK, s);
      RowMax tmax;
      float c1[2] = {1.f, 1.f};
      if constexpr (CF::WG) {
        if (whole_wg(warp_key0)) {
          score_whole_wg(s, tmax, rsc_log2, c1);
        } else {
          score(warp_key0, s, tmax, rsc, rsc_log2);
        }
      } else {
        score(warp_key0, s, tmax, rsc, rsc_log2);
      }
      if (!CF::WG && !tile_seen(tmax)) continue;
      softmax_update(s, tmax, acc, m_run, l_run, c1);
      pv(s, tV, acc);
    }
    cp_async_wait<0>();
  }

  // ---- epilogue ----

  // A barrier of the threads that hold rows: the whole block, or in a
  // warp-specialised program its consumer warpgroups (named barrier
  // WS_BAR_ROWS; the producer may have exited).
  __device__ __forceinline__ static void rows_sync() {
    if constexpr (CF::WS) named_bar_sync(WS_BAR_ROWS, NT);
    else __syncthreads();
  }

  // Merges the warps that split the keys: each warp's row maxima and sums
  // to red_m / red_l, then its accumulator rescaled to the common maximum
  // into its slice of the merge buffer (over the tiles). Two barriers of the
  // rows' threads (`rows_sync`).
  __device__ __forceinline__ void merge_warps(const Acc& acc, RowMax& m_run, RowMax& l_run) const {
    float* red_m = this->red_m;
    float* red_l = this->red_l;
    float* merge = this->merge;
    const int wrow0 = this->wrow0, g = this->g, c4 = this->c4, wn = this->wn;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      l_run[mt][0] = quad_sum(l_run[mt][0]);
      l_run[mt][1] = quad_sum(l_run[mt][1]);
      // A NaN probability left the sum NaN: make the row's maximum NaN too
      // (it may be +inf, from a NaN score on an edge tile), so that the merge
      // propagates it whatever the other warps hold.
#pragma unroll
      for (int i = 0; i < 2; ++i)
        if (l_run[mt][i] != l_run[mt][i]) m_run[mt][i] = __int_as_float(0x7fc00000);
      if (c4 == 0) {
        const int r = wrow0 + mt * 16 + g;
        red_m[wn * BM + r] = m_run[mt][0];
        red_l[wn * BM + r] = l_run[mt][0];
        red_m[wn * BM + r + 8] = m_run[mt][1];
        red_l[wn * BM + r + 8] = l_run[mt][1];
      }
    }
    rows_sync();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = wrow0 + mt * 16 + g + 8 * i;
        float M = neg_inf();
#pragma unroll
        for (int w = 0; w < WARPS_N; ++w) M = max_nan(M, red_m[w * BM + r]);
        // A warp that saw no key of this row contributes an exact 0 (selected,
        // not multiplied: its accumulator may have met NaN values that only
        // other rows see).
        const bool none = m_run[mt][i] == neg_inf();
        const float f = none ? 0.f : exp2f(m_run[mt][i] - M);
#pragma unroll
        for (int n = 0; n < DV / 8; ++n) {
          float2 v = none ? make_float2(0.f, 0.f) : make_float2(acc[mt][n][2 * i] * f, acc[mt][n][2 * i + 1] * f);
          *reinterpret_cast<float2*>(merge + (wn * BM + r) * CS + n * 8 + 2 * c4) = v;
        }
      }
    }
    rows_sync();
  }

  // Packed row r, columns d0 .. d0 + 8 of the merge buffer summed over the
  // warps into o, with the row's maximum M and sum L.
  __device__ __forceinline__ void merged_row(int r, int d0, float& M, float& L, float (&o)[8]) const {
    const float* red_m = this->red_m;
    const float* red_l = this->red_l;
    const float* merge = this->merge;
    M = neg_inf();
#pragma unroll
    for (int w = 0; w < WARPS_N; ++w) M = max_nan(M, red_m[w * BM + r]);
    L = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS_N; ++w) {
      const float mw = red_m[w * BM + r];
      if (mw != neg_inf()) L += red_l[w * BM + r] * exp2f(mw - M);
      const float4* mp = reinterpret_cast<const float4*>(merge + (w * BM + r) * CS + d0);
      const float4 x0 = mp[0], x1 = mp[1];
      o[0] += x0.x; o[1] += x0.y; o[2] += x0.z; o[3] += x0.w;
      o[4] += x1.x; o[5] += x1.y; o[6] += x1.z; o[7] += x1.w;
    }
  }

  // One segment: ncols output columns from gcol0 of (token, head),
  // normalised, with the head's sink.
  __device__ __forceinline__ void store_output(int64_t token, int head, int gcol0, int ncols, float M, float L,
                                               const float (&o)[8]) const {
    const int64_t oi = (token * this->p.num_heads + head) * this->hs + gcol0;
    store_output_cols<T>(this->p, oi, head, ncols, M, L, this->vec, o);
  }

  // Index of segment 0's partial of packed row `ri` (partials
  // [partial rows, num_heads, S]): partial rows are tokens, or (sequence,
  // row) for a mixed batch's decode launch.
  __device__ __forceinline__ int64_t partial_base(const RowInfo& ri) const {
    const int64_t prow =
        p.ws_seq_rows > 0 ? (int64_t)seq * p.ws_seq_rows + ri.q_rel : (int64_t)q_start + ri.q_rel;
    return (prow * p.num_heads + ri.head) * p.num_segments;
  }

  // Split KV: the segment's unnormalised columns (times v_scale) and, once
  // per row, its (max, sum) to the workspace, for `merge_segments`.
  __device__ __forceinline__ void store_partial(const RowInfo& ri, int gcol0, int ncols, float M, float L,
                                                const float (&o)[8]) const {
    store_partial_cols(this->p, partial_base(ri) + this->seg, this->hs, gcol0, ncols, M, L, this->vec, o);
  }

  // Every valid packed row's columns of this program's value chunk, eight
  // per step (one 16-byte store when they are whole): the output, or the
  // partials when the keys are split into segments.
  __device__ __forceinline__ void write_output() const {
    const AttnParams& p = this->p;
    const int tid = this->tid, dvc = this->dvc, hs = this->hs, q_start = this->q_start;
    const int S = p.num_segments;
    constexpr int CH = DV / 8;
    for (int idx = tid; idx < BM * CH; idx += NT) {
      const int r = idx / CH, d0 = (idx % CH) * 8;
      const int gcol0 = dvc * DV + d0;
      if (gcol0 >= hs) continue;
      const RowInfo ri = row_info(r);
      if (!ri.valid) continue;
      const int ncols = min(8, hs - gcol0);
      float M, L, o[8];
      merged_row(r, d0, M, L, o);
      const int64_t token = q_start + ri.q_rel;
      if (S == 1) store_output(token, ri.head, gcol0, ncols, M, L, o);
      else store_partial(ri, gcol0, ncols, M, L, o);
    }
  }

  // ---- split KV: arrival and the last program's merge (see "Split KV" at the top) ----

  // An empty segment: a (-inf, 0) pair for each valid row (from value chunk
  // 0, as `store_partial` does), no columns.
  __device__ __forceinline__ void store_empty_partials() const {
    if (dvc != 0) return;
    for (int r = tid; r < BM; r += NT) {
      const RowInfo ri = row_info(r);
      if (!ri.valid) continue;
      const int64_t pi = partial_base(ri) + seg;
      p.ws_ml[2 * pi] = neg_inf();
      p.ws_ml[2 * pi + 1] = 0.f;
    }
  }

  // Counts this program into its group once its partials are stored; true
  // for the last program of the group, which then merges. Every thread of
  // the program calls it (two block barriers).
  __device__ __forceinline__ bool arrive() const { return arrive_last(this->p, this->tid, this->grid); }

  // The last program of a split group. Per valid row, one warp: its lanes
  // read the segments' (max, sum) pairs (a lane per segment), the common
  // maximum M over the segments with a nonzero sum and the head's sink
  // (NaN-propagating), the total sum L, each segment's weight exp2(m_s - M)
  // (into the tile region while BM x S of them fit, else recomputed per
  // column chunk) and M and 1 / L (into red_m / red_l). A segment whose sum
  // is 0 saw no key of the row: it is skipped (its columns, which this
  // launch never wrote, are loaded with the others and selected away, never
  // multiplied). One block barrier, then every column of
  // each row (all value chunks), four per step, as the weighted sum of the
  // segments' columns (the reads of MERGE_BATCH segments in flight at once),
  // normalised, to the output.
  // Segments whose partial columns one merge step loads at once.
  static constexpr int MERGE_BATCH = 16;

  __device__ __forceinline__ void merge_segments() const {
    const AttnParams& p = this->p;
    const int tid = this->tid, lane = this->lane, warp = this->warp, hs = this->hs, q_start = this->q_start;
    const int S = p.num_segments;
    float* row_m = this->red_m;
    float* row_inv = this->red_l;
    float* wts = this->merge;  // [BM][S] when they fit
    constexpr int REGION_FLOATS = (SM::TILES > SM::MERGE ? SM::TILES : SM::MERGE) / 4;
    const bool wts_fit = BM * S <= REGION_FLOATS;
    // Weight of a segment the merge skips (a real weight is >= 0 or NaN).
    constexpr float SKIP = -1.f;
    const float* ml = p.ws_ml;
    for (int r = warp; r < BM; r += NT / 32) {
      const RowInfo ri = row_info(r);
      if (!ri.valid) continue;  // uniform over the warp
      const int64_t base = partial_base(ri);
      float M = neg_inf();
      for (int s = lane; s < S; s += 32) {
        if (__ldcg(ml + 2 * (base + s) + 1) != 0.f) M = max_nan(M, __ldcg(ml + 2 * (base + s)));
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) M = max_nan(M, __shfl_xor_sync(0xffffffffu, M, o));
      const float s2 = mods.sink_log2(ri.head);
      if (mods.has_sinks()) M = max_nan(M, s2);
      float L = 0.f;
      for (int s = lane; s < S; s += 32) {
        const float l = __ldcg(ml + 2 * (base + s) + 1);
        const float w = l != 0.f ? exp2f(__ldcg(ml + 2 * (base + s)) - M) : SKIP;
        if (l != 0.f) L += l * w;
        if (wts_fit) wts[r * S + s] = w;
      }
      L = mods.add_sink_mass(warp_sum(L), s2, M);
      if (lane == 0) {
        row_m[r] = M;
        // L is 0 only for a row that saw no key and has no sink mass (every
        // segment is skipped, so its columns are an exact 0); else >= 1 or NaN.
        row_inv[r] = L == 0.f ? 0.f : 1.f / L;
      }
    }
    __syncthreads();
    const int C4 = (hs + 3) / 4;
    const bool vec4 = (hs & 3) == 0;
    for (int idx = tid; idx < BM * C4; idx += NT) {
      const int r = idx / C4, col = (idx % C4) * 4;
      const RowInfo ri = row_info(r);
      if (!ri.valid) continue;
      const int64_t base = partial_base(ri);
      const float M = row_m[r];
      float o[4] = {0.f, 0.f, 0.f, 0.f};
      // MERGE_BATCH segments' loads in flight at once: each is issued
      // whatever the segment's weight (every segment owns its slot of the
      // workspace, so the address is in bounds) and a skipped segment's
      // columns, never written by this launch, are selected away, not
      // multiplied.
      for (int s0 = 0; s0 < S; s0 += MERGE_BATCH) {
        float4 x[MERGE_BATCH];
        float w[MERGE_BATCH];
#pragma unroll
        for (int u = 0; u < MERGE_BATCH; ++u) {
          const int s = s0 + u;
          w[u] = s >= S ? SKIP
                 : wts_fit ? wts[r * S + s]
                 : __ldcg(ml + 2 * (base + s) + 1) != 0.f ? exp2f(__ldcg(ml + 2 * (base + s)) - M)
                                                          : SKIP;
          const float* a = p.ws_acc + (base + min(s, S - 1)) * hs + col;
          if (vec4) {
            x[u] = __ldcg(reinterpret_cast<const float4*>(a));
          } else {
            x[u].x = __ldcg(a);
            x[u].y = col + 1 < hs ? __ldcg(a + 1) : 0.f;
            x[u].z = col + 2 < hs ? __ldcg(a + 2) : 0.f;
            x[u].w = col + 3 < hs ? __ldcg(a + 3) : 0.f;
          }
        }
#pragma unroll
        for (int u = 0; u < MERGE_BATCH; ++u) {
          if (w[u] == SKIP) continue;
          o[0] += x[u].x * w[u];
          o[1] += x[u].y * w[u];
          o[2] += x[u].z * w[u];
          o[3] += x[u].w * w[u];
        }
      }
      const float inv = row_inv[r];
      const int64_t oi = ((int64_t)(q_start + ri.q_rel) * p.num_heads + ri.head) * hs + col;
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

// One tensor-core program: its rows and keys, Q staged, its segment's key
// tiles streamed and accumulated, its warps merged, the output (or the
// split-KV partials) written; with split KV, in decode-shaped programs, the
// last program of the group then merges the partials into the output.
template <typename T, typename C, class CF, class G = LaunchGrid>
__device__ __forceinline__ void attention_body(const AttnParams& p, const G& grid = G()) {
  AttnProgram<T, C, CF, G> prog(p, grid);
  if (!prog.locate()) return;
  // Decode-shaped programs merge their own split groups; prefill-shaped
  // ones leave it to `reduce_segments_*` (see "Split KV").
  const bool split = CF::WARPS_M == 1 && p.num_segments > 1;
  if (split && prog.t_begin >= prog.t_end) {
    prog.store_empty_partials();
  } else {
    prog.load_q();
    prog.init_tables();
    using Prog = AttnProgram<T, C, CF, G>;
    // This thread's fragment rows: score scales, running maxima and sums, and
    // its WR x DV accumulator fragments.
    typename Prog::RowMax rsc, rsc_log2, m_run, l_run;
    typename Prog::Acc acc;
    prog.init_rows(rsc, rsc_log2, acc, m_run, l_run);
    prog.key_loop(rsc, rsc_log2, acc, m_run, l_run);
    prog.merge_warps(acc, m_run, l_run);
    prog.write_output();
  }
  // A null counter buffer leaves the merge to `reduce_segments_*`.
  if (split && p.ws_counters != nullptr && prog.arrive()) prog.merge_segments();
}

// Split KV merged by a second launch: prefill-shaped launches (only under a
// forced segment count) always, so that the 255-register prefill instances
// carry no merge code, and decode-shaped ones launched without counters
// (the plan's default, see `Merge` in src/cuda/plan.rs). Their
// programs store the same partials, and `reduce_segments_*` merges them.

// Program x of the reduce: the partial row `prow` it merges and its token;
// false when there is none, or when the token's sequence belongs to the
// other launch of a mixed batch (its new-token count is outside
// [q_len_min, q_len_max]). Partial rows are tokens (grid x = num_tokens), or
// with ws_seq_rows > 0, (sequence, row of its span) pairs (grid x =
// num_seqs x ws_seq_rows), so a mixed batch's reduce runs no program per
// prefill token.
__device__ __forceinline__ bool reduce_token(const AttnParams& p, int row, int64_t& token, int64_t& prow) {
  prow = row;
  int seq, q_rel;
  if (p.ws_seq_rows > 0) {
    seq = row / p.ws_seq_rows;
    q_rel = row % p.ws_seq_rows;
    if (seq >= p.num_seqs) return false;
  } else {
    // The token's sequence (binary search over the query spans).
    int lo = 0, hi = p.num_seqs;
    while (lo < hi) {
      const int mid = (lo + hi) >> 1;
      if ((int)p.cu_seqlens_q[mid] <= row) lo = mid + 1;
      else hi = mid;
    }
    seq = lo - 1;
    if (seq < 0 || seq >= p.num_seqs) return false;
    q_rel = row - (int)p.cu_seqlens_q[seq];
  }
  const int q_len = (int)(p.cu_seqlens_q[seq + 1] - p.cu_seqlens_q[seq]);
  token = (int64_t)p.cu_seqlens_q[seq] + q_rel;
  return q_rel < q_len && q_len >= p.q_len_min && q_len <= p.q_len_max;
}

// Merges the split-KV partials of one (partial row, head) and the head's
// sink. Grid (partial rows, num_heads) (see `reduce_token`), any block
// size, S floats of dynamic shared memory. Warp 0: its lanes read the segments' (max, sum) pairs in
// parallel, the common maximum M over the segments with a nonzero sum and
// the sink (NaN-propagating), the total sum L, and each segment's weight
// exp2(m_s - M) into shared memory (SKIP for a segment whose sum is 0: it saw
// no key of this row). One block barrier; then each thread's columns as the
// weighted sum of the segments' columns, the loads of REDUCE_BATCH segments
// in flight at once (a skipped segment's columns, never written, are loaded
// in bounds and selected away, never multiplied).
template <typename T>
__device__ __forceinline__ void reduce_body(const AttnParams& p) {
  constexpr int REDUCE_BATCH = 8;
  constexpr float SKIP = -1.f;
  extern __shared__ float wts[];  // [S]
  __shared__ float row_inv;
  const int row = blockIdx.x, head = blockIdx.y, S = p.num_segments, hs = p.head_size;
  int64_t token, prow;
  if (!reduce_token(p, row, token, prow)) return;
  const int64_t base = (prow * p.num_heads + head) * S;
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    float M = neg_inf();
    for (int s = lane; s < S; s += 32) {
      if (p.ws_ml[2 * (base + s) + 1] != 0.f) M = max_nan(M, p.ws_ml[2 * (base + s)]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) M = max_nan(M, __shfl_xor_sync(0xffffffffu, M, o));
    const ScoreMods mods(p);
    const float s2 = mods.sink_log2(head);
    if (mods.has_sinks()) M = max_nan(M, s2);
    float L = 0.f;
    for (int s = lane; s < S; s += 32) {
      const float l = p.ws_ml[2 * (base + s) + 1];
      const float w = l != 0.f ? exp2f(p.ws_ml[2 * (base + s)] - M) : SKIP;
      if (l != 0.f) L += l * w;
      wts[s] = w;
    }
    L = mods.add_sink_mass(warp_sum(L), s2, M);
    // L is 0 only for a row that saw no key and has no sink mass (every
    // segment is skipped, so its columns are an exact 0); else >= 1 or NaN.
    if (lane == 0) row_inv = L == 0.f ? 0.f : 1.f / L;
  }
  __syncthreads();
  const float inv = row_inv;
  for (int d = threadIdx.x; d < hs; d += blockDim.x) {
    float o = 0.f;
    for (int s0 = 0; s0 < S; s0 += REDUCE_BATCH) {
      float x[REDUCE_BATCH], w[REDUCE_BATCH];
#pragma unroll
      for (int u = 0; u < REDUCE_BATCH; ++u) {
        const int s = s0 + u;
        w[u] = s < S ? wts[s] : SKIP;
        x[u] = p.ws_acc[(base + min(s, S - 1)) * hs + d];
      }
#pragma unroll
      for (int u = 0; u < REDUCE_BATCH; ++u) {
        if (w[u] != SKIP) o += x[u] * w[u];
      }
    }
    const float y = o * inv;
    const int64_t oi = ((int64_t)token * p.num_heads + head) * hs + d;
    if (p.out_fp8) static_cast<fp8_t*>(p.out)[oi] = from_f32<fp8_t>(y * p.out_inv_scale);
    else static_cast<T*>(p.out)[oi] = from_f32<T>(y);
  }
}

// The f32 path: one warp per (query row, query head); lane l holds columns
// l, l + 32, ... Grid (num_tokens, ceil(num_heads / 4)), 128 threads. The
// members are the phases `scalar_body` runs in order.
template <typename C>
struct ScalarProgram {
  static constexpr int MAXJ = 512 / 32;
  const AttnParams& p;
  int lane, token, head;
  int seq, hs, kv_head, q_rel, context_len, q_abs, window;
  const uint32_t* ranges;
  int nr;
  int k_lo, k_hi;  // the keys the row may see
  float qv[MAXJ], acc[MAXJ];
  float m, l;  // running maximum (log2 units) and sum

  __device__ __forceinline__ explicit ScalarProgram(const AttnParams& params) : p(params) {}

  // The warp's (token, head), its sequence and the key range its row sees;
  // false when the warp has nothing to do.
  __device__ __forceinline__ bool locate() {
    lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    token = blockIdx.x;
    head = blockIdx.y * 4 + warp;
    if (head >= p.num_heads || token >= p.num_tokens) return false;
    int lo = 0, hi = p.num_seqs;
    while (lo < hi) {
      const int mid = (lo + hi) >> 1;
      if ((int)p.cu_seqlens_q[mid] <= token) lo = mid + 1;
      else hi = mid;
    }
    seq = lo - 1;
    if (seq < 0) return false;
    hs = p.head_size;
    const int group = p.num_heads / p.num_kv_heads;
    kv_head = head / group;
    const int q_len = (int)(p.cu_seqlens_q[seq + 1] - p.cu_seqlens_q[seq]);
    q_rel = token - (int)p.cu_seqlens_q[seq];
    const int seq_len = (int)p.seq_lens[seq];
    context_len = seq_len - q_len;
    q_abs = context_len + q_rel;
    window = p.sliding_window;
    ranges = p.prefix_ranges ? p.prefix_ranges + (size_t)seq * p.max_ranges * 2 : nullptr;
    nr = ranges ? p.max_ranges : 0;
    k_lo = window > 0 ? max(0, q_abs - window + 1) : 0;
    k_hi = q_abs + 1;
    for (int r = 0; r < nr; ++r) {
      const int s = (int)ranges[2 * r], e = (int)ranges[2 * r + 1];
      if (s <= q_abs && q_abs < e) {
        k_lo = min(k_lo, s);
        k_hi = max(k_hi, e);
      }
    }
    k_hi = min(k_hi, seq_len);
    return true;
  }

  // The query row into the lanes' registers and an empty accumulator. A
  // query holding NaN or +-inf scores NaN against every key it sees.
  __device__ __forceinline__ void load_q() {
    const int lane = this->lane, hs = this->hs;
    const float* q = static_cast<const float*>(p.q) + ((int64_t)token * p.num_heads + head) * hs;
    bool q_bad = false;
#pragma unroll
    for (int j = 0; j < MAXJ; ++j) {
      const int d = lane + 32 * j;
      qv[j] = d < hs ? q[d] : 0.f;
      q_bad = q_bad || !isfinite(qv[j]);
      acc[j] = 0.f;
    }
    if (__any_sync(0xffffffffu, q_bad)) {
#pragma unroll
      for (int j = 0; j < MAXJ; ++j) qv[j] = __int_as_float(0x7fc00000);
    }
  }

  // Every visible key of [k_lo, k_hi), one at a time: its score (scale,
  // softcap, ALiBi, qq_bias), then the online softmax update of m, l and acc.
  __device__ __forceinline__ void attend() {
    const int lane = this->lane, hs = this->hs, head = this->head, kv_head = this->kv_head, seq = this->seq;
    const int q_rel = this->q_rel, q_abs = this->q_abs, context_len = this->context_len, window = this->window;
    const int nr = this->nr, k_lo = this->k_lo, k_hi = this->k_hi;
    const uint32_t* ranges = this->ranges;
    const C* kc = static_cast<const C*>(p.k_cache);
    const C* vc = static_cast<const C*>(p.v_cache);
    const uint32_t* table = p.block_tables + (size_t)seq * p.block_table_width;
    const int64_t kv_row = (int64_t)p.num_kv_heads * hs;
    const ScoreMods mods(p);
    const float slope = mods.slope(head);
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
      // Only visible keys get here; max_nan below carries a NaN score.
      float x = mods.softcap(warp_sum(dot) * p.scale);
      x = mods.bias(x, slope, key, context_len, q_rel) * LOG2E;
      if (x == neg_inf()) continue;
      const float m_new = max_nan(m, x);
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
    this->m = m;
    this->l = l;
  }

  // The head's sink, the normalisation and the row's output columns.
  __device__ __forceinline__ void write_output() {
    const int lane = this->lane, hs = this->hs, head = this->head, token = this->token;
    const float m = this->m;
    float l = this->l;
    const float f = ScoreMods(p).fold_sink(head, m, l);
    // l is 0 only for a row that saw no key and has no sink mass (acc is 0).
    const float scale_out = l == 0.f ? 0.f : f / l * p.v_scale;
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
};

template <typename C>
__device__ __forceinline__ void scalar_body(const AttnParams& p) {
  ScalarProgram<C> prog(p);
  if (!prog.locate()) return;
  prog.load_q();
  prog.attend();
  prog.write_output();
}

#if defined(CPA_SM90A)
#include "prefill_ws.cuh"
#include "mixed_attention.cuh"
#endif

// ---- entry points ---------------------------------------------------------------
// Decode-shaped programs: 16 packed rows, 4 warps splitting 64 keys per tile.
// Prefill-shaped programs: 4 warps of MT x 16 rows (MT = 2 up to head size
// 128), 1 warp per key tile.
// The sm_90a module (build.rs compiles this file a second time, for
// compute_90a with CPA_SM90A defined) holds only the warpgroup prefill
// instances: 8 warps (two warpgroups of 64 rows) or 4, 64 keys per tile.
// Each instance checks its threads and shared memory against the figures the
// Rust launches plan with (kernel_contract.cuh, generated from src/cuda/tiles.rs).
#define CPA_ATTN_WITH(HEAD, KIND, WM, WN, KW, MT, ST, WG, MINB, TNAME, T, CNAME, C)                          \
  static_assert(Cfg<HEAD, WM, WN, KW, MT, ST, WG>::NT == cpa_plan_h##HEAD##_##KIND##CNAME##_threads,        \
                "threads of unified_attention_h" #HEAD "_" #KIND #CNAME " differ from src/cuda/tiles.rs");  \
  static_assert(Smem<Cfg<HEAD, WM, WN, KW, MT, ST, WG>, std::is_same<C, fp8_t>::value>::TOTAL ==            \
                    cpa_plan_h##HEAD##_##KIND##CNAME##_smem,                                                \
                "shared memory of unified_attention_h" #HEAD "_" #KIND #CNAME " differs from src/cuda/tiles.rs"); \
  extern "C" __global__ void __launch_bounds__(32 * WM * WN, MINB)                                        \
      unified_attention_h##HEAD##_##KIND##_##TNAME##CNAME(const AttnParams p) {                          \
    attention_body<T, C, Cfg<HEAD, WM, WN, KW, MT, ST, WG>>(p);                                          \
  }
// The warp-specialised instances (kernels/prefill_ws.cuh): NT consumer
// threads plus the producer warpgroup, one program per SM; 16-bit caches.
#define CPA_ATTN_WS(HEAD, KIND, WM, WN, KW, MT, ST, MINB, TNAME, T, CNAME, C)                                \
  static_assert(Cfg<HEAD, WM, WN, KW, MT, ST, true, true>::THREADS == cpa_plan_h##HEAD##_##KIND##CNAME##_threads, \
                "threads of unified_attention_h" #HEAD "_" #KIND #CNAME " differ from src/cuda/tiles.rs");      \
  static_assert(Smem<Cfg<HEAD, WM, WN, KW, MT, ST, true, true>, false>::TOTAL ==                                 \
                    cpa_plan_h##HEAD##_##KIND##CNAME##_smem,                                                    \
                "shared memory of unified_attention_h" #HEAD "_" #KIND #CNAME " differs from src/cuda/tiles.rs"); \
  extern "C" __global__ void __launch_bounds__(Cfg<HEAD, WM, WN, KW, MT, ST, true, true>::THREADS, MINB)      \
      unified_attention_h##HEAD##_##KIND##_##TNAME##CNAME(const AttnParams p) {                              \
    ws_attention_body<T, Cfg<HEAD, WM, WN, KW, MT, ST, true, true>>(p);                                      \
  }
#define CPA_ATTN(HEAD, KIND, WM, WN, KW, MT, ST, MINB, TNAME, T, CNAME, C) \
  CPA_ATTN_WITH(HEAD, KIND, WM, WN, KW, MT, ST, false, MINB, TNAME, T, CNAME, C)

// The instances themselves, one `CPA_ATTN` line per tile of src/cuda/tiles.rs
// (`instances`), query dtype and cache kind (`CPA_ATTN_WITH` lines for the
// warpgroup ones under CPA_SM90A).
#include "attention_instances.cuh"  // generated by build.rs from src/cuda/tiles.rs

#if !defined(CPA_SM90A)

extern "C" __global__ void reduce_segments_bf16(const AttnParams p) { reduce_body<__nv_bfloat16>(p); }
extern "C" __global__ void reduce_segments_f16(const AttnParams p) { reduce_body<__half>(p); }

extern "C" __global__ void __launch_bounds__(128) unified_attention_scalar_f32(const AttnParams p) {
  scalar_body<float>(p);
}
extern "C" __global__ void __launch_bounds__(128) unified_attention_scalar_f32_fp8(const AttnParams p) {
  scalar_body<fp8_t>(p);
}

#endif  // !CPA_SM90A
