// The score pipeline of paged attention, written once for every program:
// the tensor-core and f32 programs and the split-KV merges of
// kernels/unified_attention.cu (the warpgroup instances included) and the
// stream-decode programs of kernels/stream_decode.cu.
//
// A raw score q.k of query row (head h, new-token row q_rel at absolute
// position q_abs = context_len + q_rel) against key `key` becomes, in order
// (the order of vLLM's Triton unified attention and of
// src/cpu/paged_attention.rs):
//   scale        s = scale * q.k (the scale folds k_scale, and for fp8
//                caches the query row's power-of-two scale qs)
//   softcap      c > 0: s = c * tanh(s / c)
//   mask         not `key_visible`: -inf (selected, never computed from data)
//   ALiBi        s += slope_h * (key - context_len)
//   qq_bias      s += bias[q_rel][key - context_len] for keys among the new
//                tokens (key - context_len < qq_cols)
//   log2 units   s * log2(e), the unit every program's softmax runs in
// and the head's sink joins the row's softmax denominator with no value.
//
// `ScoreMods` is that pipeline as one object over the launch's `AttnParams`
// (after FlashInfer's attention variants: one object whose methods are the
// logits transform, the mask and the sink): a view of the parameters that
// reads the softcap once, where it is built. A program keeps one as a
// member; the short paths build one wherever they need it. Its
// methods are the pieces each program composes: the fast paths keep their
// specialisations (a tile every row sees in full with no modifier on, `plain`,
// only scales by `scale_log2`), the edge paths call `logit`. Every method is
// force-inlined and keeps the arithmetic of the code it replaced, in the same
// order, so that the programs compute the same bits.
#pragma once

#include <stdint.h>

#include "attention_params.cuh"
#include "common.cuh"

namespace cpa {

// Whether query `q_abs` sees key `key` before score-level masking: causal
// within `window` (0: no window), or both inside one of the `nr`
// bidirectional ranges [ranges[2r], ranges[2r + 1]).
__device__ __forceinline__ bool key_visible(int q_abs, int key, int window, const uint32_t* ranges, int nr) {
  if (key <= q_abs && (window == 0 || q_abs - key < window)) return true;
  for (int r = 0; r < nr; ++r) {
    const int s = (int)ranges[2 * r], e = (int)ranges[2 * r + 1];
    if (s <= q_abs && q_abs < e && s <= key && key < e) return true;
  }
  return false;
}

// exp2(s2 - M) of a sink logit s2 (log2 units) against the row maximum M
// (M >= s2 or NaN): a -inf sink carries no mass, even when M is -inf too
// (where exp2(-inf - -inf) would be NaN); a NaN or +inf sink gives NaN, as
// dense softmax does.
__device__ __forceinline__ float sink_mass(float s2, float M) { return s2 == neg_inf() ? 0.f : exp2f(s2 - M); }

// The ALiBi slope of a query head, looked up per key (and only when ALiBi is
// on) rather than held per row: for programs short of registers.
struct HeadSlope {
  int head;
};

// The score modifiers of one launch (see the top of the file).
struct ScoreMods {
  const AttnParams& params;
  float cap;  // the softcap, read once (<= 0: off)

  __device__ __forceinline__ explicit ScoreMods(const AttnParams& p) : params(p), cap(p.softcap) {}

  // ---- scale ----

  // The scale of a raw score of a query row scaled by `qs` (fp8 caches; 1
  // otherwise): a plain score is `q.k * scale(qs)` before the modifiers.
  __device__ __forceinline__ float scale(float qs) const { return params.scale * qs; }
  // The same scale with the conversion to log2 units folded in: the whole
  // pipeline of a visible key when `plain`.
  __device__ __forceinline__ float scale_log2(float qs) const { return params.scale * LOG2E * qs; }

  // True when no per-key term besides the causal / window mask is on (no
  // prefix ranges among the `nr` of the program's sequence, softcap, qq_bias
  // or ALiBi): a tile every row sees in full then only scales.
  __device__ __forceinline__ bool plain(int nr) const {
    return nr == 0 && cap <= 0.f && params.qq_bias == nullptr && params.alibi_slopes == nullptr;
  }

  // ---- the logits transform ----

  // The ALiBi slope of query `head`, 0 when ALiBi is off.
  __device__ __forceinline__ float slope(int head) const { return params.alibi_slopes ? params.alibi_slopes[head] : 0.f; }

  // Softcap of a scaled score (off when softcap <= 0).
  __device__ __forceinline__ float softcap(float x) const {
    const float cap = this->cap;
    if (cap > 0.f) x = cap * tanhf(x / cap);
    return x;
  }

  // ALiBi with the row's slope (0 when off; added unconditionally).
  __device__ __forceinline__ float alibi(float x, float slope, int key, int context_len) const {
    return x + slope * (float)(key - context_len);
  }
  // ALiBi with the head's slope, loaded and added only when ALiBi is on.
  __device__ __forceinline__ float alibi(float x, HeadSlope h, int key, int context_len) const {
    if (params.alibi_slopes) x += params.alibi_slopes[h.head] * (float)(key - context_len);
    return x;
  }

  // qq_bias of new-token row `q_rel` against a key among the new tokens.
  __device__ __forceinline__ float qq_bias(float x, int key, int context_len, int q_rel) const {
    const float* qq = params.qq_bias;
    if (qq != nullptr && key >= context_len && key - context_len < params.qq_cols)
      x += qq[(int64_t)q_rel * params.qq_cols + (key - context_len)];
    return x;
  }

  // The terms of a visible key after the softcap: ALiBi, then qq_bias.
  template <typename Slope>
  __device__ __forceinline__ float bias(float x, Slope slope, int key, int context_len, int q_rel) const {
    return qq_bias(alibi(x, slope, key, context_len), key, context_len, q_rel);
  }

  // A modified score to log2 units for the tensor-core softmax. A NaN score
  // becomes +inf (fminf drops the NaN): the maximum becomes +inf and
  // p = exp2(inf - inf) NaN, so the row is NaN as it would be, for one
  // instruction and no register (a NaN-propagating max in the edge paths
  // costs registers).
  __device__ __forceinline__ static float to_log2(float x) { return fminf(x * LOG2E, __int_as_float(0x7f800000)); }

  // The whole pipeline after the scale: a scaled score `x` of row (q_rel,
  // head of `slope`) against `key` to its log2-unit logit, -inf when the
  // row does not see the key. `visible()` (`key_visible`, the row and the
  // key in range) is asked after the softcap, as the programs always did:
  // the compiler keeps the short-circuit branches that way.
  template <typename Slope, typename Visible>
  __device__ __forceinline__ float logit(float x, Visible visible, Slope slope, int key, int context_len,
                                         int q_rel) const {
    x = softcap(x);
    if (visible()) return to_log2(bias(x, slope, key, context_len, q_rel));
    return neg_inf();
  }

  // ---- the sink ----

  __device__ __forceinline__ bool has_sinks() const { return params.sinks != nullptr; }

  // The sink logit of query `head` in log2 units; -inf (no mass) without
  // sinks.
  __device__ __forceinline__ float sink_log2(int head) const {
    return params.sinks != nullptr ? params.sinks[head] * LOG2E : neg_inf();
  }

  // A merge's sum L over segments of common maximum M (which already counts
  // the sink logit s2) plus the sink's mass.
  __device__ __forceinline__ float add_sink_mass(float L, float s2, float M) const {
    if (params.sinks != nullptr) L += sink_mass(s2, M);
    return L;
  }

  // A finished row of running maximum M and sum L joins the sink of `head`:
  // L becomes the sum against the new maximum, sink mass included; returns
  // the factor that rescales the row's columns to that maximum (1 without
  // sinks; 0 for a row that saw no key).
  __device__ __forceinline__ float fold_sink(int head, float M, float& L) const {
    float f = 1.f;
    if (params.sinks != nullptr) {
      const float s2 = params.sinks[head] * LOG2E;
      const float Mn = max_nan(M, s2);
      f = M == neg_inf() ? 0.f : exp2f(M - Mn);
      L = L * f + sink_mass(s2, Mn);
    }
    return f;
  }
};

}  // namespace cpa
