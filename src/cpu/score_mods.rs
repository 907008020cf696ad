//! The score pipeline of the CPU kernel as one object: which keys a query
//! row sees (causal, sliding window, bidirectional prefix ranges), the
//! modifiers that turn a scaled score into a logit (softcap, ALiBi,
//! qq_bias, in the order of vLLM's Triton unified attention) and the sink
//! each row's softmax starts from. The CUDA programs share the same
//! pipeline through `ScoreMods` in kernels/score_mods.cuh; the
//! specification both follow is [`crate::reference`], which stays
//! independent of either.
//!
//! Imports `params`; never `ops` or `cuda`.

use candle_core::{Result, Tensor};

use crate::params::PagedAttentionParams;

/// The score modifiers and mask of one call, read into host vectors.
pub(crate) struct ScoreMods {
    /// Sliding window: a query at `p` sees keys `> p - w`.
    window: Option<usize>,
    /// `c > 0`: scores become `c * tanh(s / c)`.
    softcap: Option<f32>,
    /// One slope per query head.
    alibi_slopes: Option<Vec<f32>>,
    /// Row-major bias and its column count.
    qq_bias: Option<(Vec<f32>, usize)>,
    /// One logit per query head.
    sinks: Option<Vec<f32>>,
}

fn head_vector(t: &Option<Tensor>) -> Result<Option<Vec<f32>>> {
    t.as_ref().map(|t| t.to_vec1::<f32>()).transpose()
}

impl ScoreMods {
    /// The modifiers of `params` (one host copy of each tensor).
    pub(crate) fn new(params: &PagedAttentionParams) -> Result<Self> {
        let qq_bias = match &params.qq_bias {
            Some(b) => Some((b.flatten_all()?.to_vec1::<f32>()?, b.dims()[1])),
            None => None,
        };
        Ok(Self {
            window: params.sliding_window,
            softcap: params.active_softcap(),
            alibi_slopes: head_vector(&params.alibi_slopes)?,
            qq_bias,
            sinks: head_vector(&params.sinks)?,
        })
    }

    /// The sliding window, if any.
    pub(crate) fn window(&self) -> Option<usize> {
        self.window
    }

    /// The mask: whether the query at absolute position `q_abs` sees key
    /// `key` (both `< seq_len`) before score-level masking (a `-inf` bias):
    /// causal within the window, or both inside one of `ranges`.
    #[inline(always)]
    pub(crate) fn visible(
        &self,
        q_abs: usize,
        key: usize,
        ranges: &[std::ops::Range<u32>],
    ) -> bool {
        let causal = key <= q_abs && self.window.is_none_or(|w| q_abs - key < w);
        causal
            || ranges.iter().any(|r| {
                let (s, e) = (r.start as usize, r.end as usize);
                s <= q_abs && q_abs < e && s <= key && key < e
            })
    }

    /// The logits transform of a visible key: the scaled score `score` of
    /// new-token row `q_rel` (query head `head`) against `key`, softcapped,
    /// plus ALiBi and qq_bias.
    #[inline(always)]
    pub(crate) fn logit(
        &self,
        score: f32,
        head: usize,
        key: usize,
        context_len: usize,
        q_rel: usize,
    ) -> f32 {
        let mut sc = score;
        if let Some(c) = self.softcap {
            sc = c * (sc / c).tanh();
        }
        if let Some(slopes) = &self.alibi_slopes {
            sc += slopes[head] * (key as f32 - context_len as f32);
        }
        if let Some((bias, cols)) = &self.qq_bias {
            if key >= context_len && key - context_len < *cols {
                sc += bias[q_rel * cols + key - context_len];
            }
        }
        sc
    }

    /// The online-softmax state `(running max, running sum)` a row of query
    /// head `head` starts from: the sink (whose `exp(sink - max) = 1` is
    /// then the running sum), else `-inf` with sum 0. A NaN or +inf sink
    /// makes the row NaN, as `exp(sink - max)` does in dense softmax; a
    /// `-inf` sink carries no mass (the first key's rescale zeroes it).
    pub(crate) fn softmax_start(&self, head: usize) -> (f32, f32) {
        match &self.sinks {
            Some(sinks) if sinks[head].is_nan() || sinks[head] == f32::INFINITY => {
                (f32::NAN, f32::NAN)
            }
            Some(sinks) => (sinks[head], 1.0),
            None => (f32::NEG_INFINITY, 0.0),
        }
    }
}
