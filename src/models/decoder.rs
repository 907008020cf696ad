//! One pre-norm decoder stack for the Llama-like families (Llama, Mistral,
//! Qwen2/2.5, Qwen3, Phi-3): embeddings, layers of
//! `x + attn(norm(x))` then `x + mlp(norm(x))`, a final norm and an LM head.
//!
//! A family is a [`DecoderSpec`]: head counts and size, q/k/v and o biases,
//! Qwen3's per-head q/k norms, each layer's sliding window, the rotary
//! frequencies (a partial rotary width, Phi-3's long factors), the norm
//! epsilon, the gated MLP and tied embeddings, plus the [`WeightNames`] of
//! its checkpoints. Each residual add runs fused with the norm after it
//! (one kernel on CUDA), and the q/k rotation with the cache write when the
//! heads rotate whole.

use std::sync::Arc;

use candle_core::{bail, DType, Device, Result, Tensor};
use candle_nn::{Activation, Linear, Module, VarBuilder};

use super::layers::{FusedLinear, FusedRmsNorm, GatedMlp};
use super::limits;
use super::rotary::RotaryEmbedding;
use super::{check_cache, check_input, select_rows, PagedKvCache, PagedModel, PagedOptions};
use crate::attention::{Attention, AttentionOptions};
use crate::cache::LayerKvCache;
use crate::metadata::AttentionMetadata;
use crate::parallel::comm::Communicator;
use crate::parallel::layers::{
    narrow_range, RowParallelLinear, VocabParallelEmbedding, VocabParallelHead,
};
use crate::parallel::shard::{ShardConfig, ShardPlan};
use crate::RotaryRows;

/// Projections of one input in a checkpoint: one joined matrix, or `N`
/// matrices that are joined at load time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Projection<const N: usize> {
    /// One `(sum(out_i), in)` weight (Phi-3's `qkv_proj`, `gate_up_proj`).
    Joined(&'static str),
    /// `N` weights `(out_i, in)` (`q_proj`, `k_proj`, `v_proj`).
    Separate([&'static str; N]),
}

/// The names of a layer's projections under `model.layers.{i}.self_attn`
/// and `model.layers.{i}.mlp`; the rest (`o_proj`, `down_proj`, the norms,
/// `model.embed_tokens`, `model.norm`, `lm_head`) are shared by the
/// families.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WeightNames {
    /// q, k, v.
    pub qkv: Projection<3>,
    /// gate, up.
    pub gate_up: Projection<2>,
}

impl WeightNames {
    /// Hugging Face's separate `q_proj`/`k_proj`/`v_proj` and
    /// `gate_proj`/`up_proj` (Llama, Mistral, Qwen).
    pub const SEPARATE: Self = Self {
        qkv: Projection::Separate(["q_proj", "k_proj", "v_proj"]),
        gate_up: Projection::Separate(["gate_proj", "up_proj"]),
    };
    /// Phi-3's joined `qkv_proj` and `gate_up_proj`.
    pub const JOINED: Self = Self {
        qkv: Projection::Joined("qkv_proj"),
        gate_up: Projection::Joined("gate_up_proj"),
    };
}

/// Which layers attend through a sliding window (a query at `p` sees keys
/// at `> p - window`, Hugging Face's convention).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Windows {
    /// Every layer attends globally.
    None,
    /// Every layer slides.
    All(usize),
    /// Layers `first..` slide (Qwen2's `max_window_layers`).
    From {
        /// The first sliding layer.
        first: usize,
        /// The window.
        window: usize,
    },
    /// Each layer's window (`layer_types`); layers past the list are global.
    PerLayer(Vec<Option<usize>>),
}

impl Windows {
    /// Hugging Face's Qwen2/Qwen3 sliding layers: none unless
    /// `use_sliding_window` and a `sliding_window`; then the `sliding_attention`
    /// entries of `layer_types`, else layers `max_window_layers..`.
    pub(crate) fn qwen(
        use_sliding_window: bool,
        sliding_window: Option<usize>,
        max_window_layers: usize,
        layer_types: Option<&[super::gemma2::LayerType]>,
    ) -> Windows {
        match (use_sliding_window, sliding_window, layer_types) {
            (true, Some(w), Some(types)) => Windows::PerLayer(
                types
                    .iter()
                    .map(|t| (*t == super::gemma2::LayerType::Sliding).then_some(w))
                    .collect(),
            ),
            (true, Some(window), None) => Windows::From {
                first: max_window_layers,
                window,
            },
            _ => Windows::None,
        }
    }

    /// The window of layer `i`, if it slides.
    pub fn layer(&self, i: usize) -> Option<usize> {
        match self {
            Self::None => None,
            Self::All(w) => Some(*w),
            Self::From { first, window } => (i >= *first).then_some(*window),
            Self::PerLayer(v) => v.get(i).copied().flatten(),
        }
    }
}

/// Rotary frequencies, the same table for every layer.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeSpec {
    /// `rotary_dim / 2` inverse frequencies: the first `rotary_dim`
    /// elements of each head rotate (pairs `(i, i + rotary_dim / 2)`), the
    /// rest pass through.
    pub inv_freq: Vec<f32>,
    /// Phi-3's long rope as candle-transformers applies it: positions
    /// `>= .1` rotate by the inverse frequencies `.0` instead.
    pub long: Option<(Vec<f32>, usize)>,
    /// Rotary table length: positions `0..max_positions`.
    pub max_positions: usize,
}

/// A family's decoder: what [`DecoderStack::load`] builds.
#[derive(Clone, Debug)]
pub struct DecoderSpec {
    /// The model named first in error messages (`qwen2`, ...).
    pub component: &'static str,
    /// The checkpoint's projection names.
    pub names: WeightNames,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Model width.
    pub hidden_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Query heads (every layer).
    pub num_heads: usize,
    /// KV heads (every layer).
    pub num_kv_heads: usize,
    /// Elements per head (`num_heads * head_dim` need not be `hidden_size`).
    pub head_dim: usize,
    /// Biases on q, k and v.
    pub qkv_bias: bool,
    /// A bias on o.
    pub o_bias: bool,
    /// Per-head RMS norms of q and k before the rotation (`q_norm`,
    /// `k_norm`, Qwen3), with their epsilon.
    pub qk_norm_eps: Option<f64>,
    /// Each layer's sliding window.
    pub windows: Windows,
    /// The rotary frequencies.
    pub rope: RopeSpec,
    /// Epsilon of the layer and final RMS norms.
    pub rms_norm_eps: f64,
    /// MLP width.
    pub intermediate_size: usize,
    /// MLP gate activation.
    pub activation: Activation,
    /// The LM head is the embedding matrix (no `lm_head` weight).
    pub tie_word_embeddings: bool,
}

impl DecoderSpec {
    /// The shape that decides how the decoder shards over a
    /// tensor-parallel group.
    pub fn shard_config(&self) -> ShardConfig {
        ShardConfig {
            num_heads: self.num_heads,
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            vocab_size: self.vocab_size,
        }
    }
}

/// A tensor-parallel rank: what it owns and its group.
#[derive(Clone, Copy)]
struct Rank<'a> {
    plan: &'a ShardPlan,
    comm: &'a Arc<dyn Communicator>,
}

/// The rotary tables of a stack.
#[derive(Clone, Debug)]
struct Rope {
    short: RotaryEmbedding,
    long: Option<(RotaryEmbedding, u32)>,
}

impl Rope {
    /// cos and sin rows of the batch's tokens, `(num_tokens, rotary_dim / 2)`.
    fn at(&self, metadata: &AttentionMetadata) -> Result<(Tensor, Tensor)> {
        let short = self.short.at(metadata)?;
        let (cos, sin) = (short.rows().cos.clone(), short.rows().sin.clone());
        let Some((long, from)) = &self.long else {
            return Ok((cos, sin));
        };
        let long = long.at(metadata)?;
        let positions = metadata.positions();
        let is_long = positions
            .ge(&Tensor::new(*from, positions.device())?.broadcast_as(positions.shape())?)?
            .reshape((positions.dim(0)?, 1))?
            .broadcast_as(cos.shape())?;
        Ok((
            is_long.where_cond(long.rows().cos, &cos)?,
            is_long.where_cond(long.rows().sin, &sin)?,
        ))
    }
}

/// Rotates the first `rotary_dim` (`2 * cos.dim(1)`) elements of each of
/// the `heads` heads of `x` `(num_tokens, heads * head_dim)`; the rest pass.
fn rotate_partial(x: &Tensor, cos: &Tensor, sin: &Tensor, heads: usize) -> Result<Tensor> {
    let (n, half) = cos.dims2()?;
    let d = x.dim(1)? / heads;
    let x = x.reshape((n, heads, d))?;
    let rot = x.narrow(2, 0, 2 * half)?.contiguous()?;
    let rot = candle_nn::rotary_emb::rope(
        &rot.reshape((n, heads, 1, 2 * half))?,
        &cos.reshape((n, 1, half))?,
        &sin.reshape((n, 1, half))?,
    )?;
    let pass = x.narrow(2, 2 * half, d - 2 * half)?;
    Tensor::cat(&[&rot.reshape((n, heads, 2 * half))?, &pass], 2)?.reshape((n, heads * d))
}

#[derive(Clone, Debug)]
struct SelfAttention {
    /// q, k and v as one matmul.
    qkv_proj: FusedLinear,
    o_proj: RowParallelLinear,
    qk_norms: Option<(FusedRmsNorm, FusedRmsNorm)>,
    /// Whole heads rotate.
    full_rotary: bool,
    attn: Attention,
}

impl SelfAttention {
    /// Loads layer `i`'s attention; a rank's heads when `rank` is given.
    fn load(
        spec: &DecoderSpec,
        i: usize,
        options: PagedOptions,
        vb: VarBuilder,
        rank: Option<Rank>,
    ) -> Result<Self> {
        let (h, kvh, d) = (spec.num_heads, spec.num_kv_heads, spec.head_dim);
        let (local_h, local_kvh) = match rank {
            Some(r) => (r.plan.q_heads().len(), r.plan.kv_heads().len()),
            None => (h, kvh),
        };
        let attn = Attention::new(
            local_h,
            local_kvh,
            d,
            1.0 / (d as f32).sqrt(),
            AttentionOptions {
                sliding_window: spec.windows.layer(i),
                block_size: options.block_size,
                kv_cache_dtype: options.kv_cache_dtype,
                ..Default::default()
            },
        )?;
        let (hidden, bias) = (spec.hidden_size, spec.qkv_bias);
        let outs = [h * d, kvh * d, kvh * d];
        let qkv_proj = match spec.names.qkv {
            Projection::Joined(name) => FusedLinear::load_joined(hidden, name, &outs, bias, &vb)?,
            Projection::Separate([q, k, v]) => FusedLinear::load(
                hidden,
                &[(q, outs[0]), (k, outs[1]), (v, outs[2])],
                bias,
                &vb,
            )?,
        };
        let o_proj = candle_nn::linear_b(h * d, hidden, spec.o_bias, vb.pp("o_proj"))?;
        let (qkv_proj, o_proj) = match rank {
            Some(r) => {
                let (q, kv) = (r.plan.q_rows(), r.plan.kv_rows());
                (
                    qkv_proj.shard_rows(&[q.clone(), kv.clone(), kv])?,
                    RowParallelLinear::shard(&o_proj, &q, r.comm.clone())?,
                )
            }
            None => (qkv_proj, RowParallelLinear::whole(o_proj)),
        };
        let qk_norms = match spec.qk_norm_eps {
            Some(eps) => Some((
                FusedRmsNorm::load(d, eps, vb.pp("q_norm"))?,
                FusedRmsNorm::load(d, eps, vb.pp("k_norm"))?,
            )),
            None => None,
        };
        Ok(Self {
            qkv_proj,
            o_proj,
            qk_norms,
            full_rotary: 2 * spec.rope.inv_freq.len() == d,
            attn,
        })
    }

    /// `x` `(num_tokens, hidden)` -> `(num_tokens, hidden)`; `cos`, `sin`
    /// `(num_tokens, rotary_dim / 2)`.
    fn forward(
        &self,
        x: &Tensor,
        (cos, sin): (&Tensor, &Tensor),
        cache: &LayerKvCache,
        metadata: &AttentionMetadata,
    ) -> Result<Tensor> {
        let rows = RotaryRows {
            cos,
            sin,
            interleaved: false,
        };
        let qkv = self.qkv_proj.forward_joined(x)?;
        if self.qk_norms.is_none() && self.full_rotary {
            return self
                .attn
                .forward_rotary_qkv(&qkv, rows, cache, metadata)?
                .apply(&self.o_proj);
        }
        let (h, kvh, d) = (
            self.attn.num_heads(),
            self.attn.num_kv_heads(),
            self.attn.head_size(),
        );
        let n = qkv.dim(0)?;
        let mut q = qkv.narrow(1, 0, h * d)?;
        let mut k = qkv.narrow(1, h * d, kvh * d)?;
        let v = qkv.narrow(1, (h + kvh) * d, kvh * d)?;
        if let Some((q_norm, k_norm)) = &self.qk_norms {
            q = q_norm
                .forward(&q.reshape((n * h, d))?)?
                .reshape((n, h * d))?;
            k = k_norm
                .forward(&k.reshape((n * kvh, d))?)?
                .reshape((n, kvh * d))?;
        }
        let out = if self.full_rotary {
            let qkv = Tensor::cat(&[&q, &k, &v], 1)?;
            self.attn.forward_rotary_qkv(&qkv, rows, cache, metadata)?
        } else {
            let q = rotate_partial(&q, cos, sin, h)?;
            let k = rotate_partial(&k, cos, sin, kvh)?;
            self.attn.forward(&q, &k, &v, cache, metadata)?
        };
        out.apply(&self.o_proj)
    }
}

#[derive(Clone, Debug)]
struct DecoderLayer {
    input_layernorm: FusedRmsNorm,
    self_attn: SelfAttention,
    post_attention_layernorm: FusedRmsNorm,
    mlp: GatedMlp,
}

/// A paged pre-norm decoder: embeddings, layers, final norm, LM head and
/// the rotary table, built from a [`DecoderSpec`].
#[derive(Clone, Debug)]
pub struct DecoderStack {
    component: &'static str,
    embed_tokens: VocabParallelEmbedding,
    layers: Vec<DecoderLayer>,
    norm: FusedRmsNorm,
    lm_head: VocabParallelHead,
    rope: Rope,
    vocab_size: usize,
    device: Device,
    dtype: DType,
}

impl DecoderStack {
    /// Loads the weights of `spec` (`model.embed_tokens`,
    /// `model.layers.{i}.*`, `model.norm`, `lm_head` unless tied) from
    /// `vb`; the dtype and device are `vb`'s. The family's loader checks its
    /// config ([`limits::DecoderShape`]) first.
    pub fn load(vb: VarBuilder, spec: &DecoderSpec, options: PagedOptions) -> Result<Self> {
        Self::load_inner(vb, spec, options, None)
    }

    /// Loads rank `comm.rank()`'s shard of `spec` for a tensor-parallel
    /// group of `comm.world_size()` ranks (see
    /// [`ShardPlan`]): the full weights are read
    /// from `vb` and sliced. q/k/v and gate/up keep this rank's output rows
    /// (heads, intermediate columns), o and down its input columns (their
    /// partial outputs are summed over the group, then o's bias is added
    /// once), the embedding and the LM head its vocabulary rows (lookups
    /// summed, logits gathered); norms and rotary tables are whole. The
    /// attention layers hold this rank's KV heads only, so the caches built
    /// from [`attention_layers`](PagedModel::attention_layers) do too.
    ///
    /// Every rank of the group must run each forward pass with the same
    /// inputs (see [`TensorParallel`](crate::parallel::TensorParallel)).
    /// With a world size of 1 this is [`load`](Self::load): no collective.
    pub fn load_shard(
        vb: VarBuilder,
        spec: &DecoderSpec,
        options: PagedOptions,
        comm: Arc<dyn Communicator>,
    ) -> Result<Self> {
        let plan = ShardPlan::new(&spec.shard_config(), comm.world_size(), comm.rank())?;
        if plan.world_size() == 1 {
            return Self::load(vb, spec, options);
        }
        let rank = Rank {
            plan: &plan,
            comm: &comm,
        };
        Self::load_inner(vb, spec, options, Some(rank))
    }

    fn load_inner(
        vb: VarBuilder,
        spec: &DecoderSpec,
        options: PagedOptions,
        rank: Option<Rank>,
    ) -> Result<Self> {
        let c = spec.component;
        let rotary_dim = 2 * spec.rope.inv_freq.len();
        if rotary_dim == 0 || rotary_dim > spec.head_dim {
            bail!(
                "{c}: the rotary width {rotary_dim} must be in 2..={} (the head size)",
                spec.head_dim
            );
        }
        if let Some((long, _)) = &spec.rope.long {
            if long.len() != spec.rope.inv_freq.len() {
                bail!(
                    "{c}: {} long rotary frequencies for {} short ones",
                    long.len(),
                    spec.rope.inv_freq.len()
                );
            }
        }
        let (hidden, eps) = (spec.hidden_size, spec.rms_norm_eps);
        let vb_m = vb.pp("model");
        let embed_tokens = candle_nn::embedding(spec.vocab_size, hidden, vb_m.pp("embed_tokens"))?;
        let lm_head = if spec.tie_word_embeddings {
            Linear::new(embed_tokens.embeddings().clone(), None)
        } else {
            candle_nn::linear_no_bias(hidden, spec.vocab_size, vb.pp("lm_head"))?
        };
        let (embed_tokens, lm_head) = match rank {
            Some(r) => {
                let (rows, comm) = (r.plan.vocab(), r.comm.clone());
                let embed = VocabParallelEmbedding::shard(embed_tokens.embeddings(), &rows, comm)?;
                let weight = match spec.tie_word_embeddings {
                    true => embed.table().clone(),
                    false => narrow_range(lm_head.weight(), 0, &rows)?,
                };
                let head = VocabParallelHead::shard(
                    weight,
                    r.plan.vocab_chunk(),
                    spec.vocab_size,
                    r.comm.clone(),
                )?;
                (embed, head)
            }
            None => (
                VocabParallelEmbedding::whole(embed_tokens),
                VocabParallelHead::whole(lm_head),
            ),
        };
        let norm = FusedRmsNorm::load(hidden, eps, vb_m.pp("norm"))?;
        let mut layers = limits::layers_vec(spec.num_layers);
        for i in 0..spec.num_layers {
            let vb_l = vb_m.pp(format!("layers.{i}"));
            let rms = |name| FusedRmsNorm::load(hidden, eps, vb_l.pp(name));
            let input_layernorm = rms("input_layernorm")?;
            let self_attn = SelfAttention::load(spec, i, options, vb_l.pp("self_attn"), rank)?;
            let post_attention_layernorm = rms("post_attention_layernorm")?;
            let (vb_mlp, inter) = (vb_l.pp("mlp"), spec.intermediate_size);
            let gate_up = match spec.names.gate_up {
                Projection::Joined(name) => {
                    FusedLinear::load_joined(hidden, name, &[inter, inter], false, &vb_mlp)?
                }
                Projection::Separate([g, u]) => {
                    FusedLinear::load(hidden, &[(g, inter), (u, inter)], false, &vb_mlp)?
                }
            };
            let down = candle_nn::linear_no_bias(inter, hidden, vb_mlp.pp("down_proj"))?;
            let (gate_up, down) = match rank {
                Some(r) => {
                    let cols = r.plan.intermediate();
                    (
                        gate_up.shard_rows(&[cols.clone(), cols.clone()])?,
                        RowParallelLinear::shard(&down, &cols, r.comm.clone())?,
                    )
                }
                None => (gate_up, RowParallelLinear::whole(down)),
            };
            layers.push(DecoderLayer {
                input_layernorm,
                self_attn,
                post_attention_layernorm,
                mlp: GatedMlp::from_parts(gate_up, down, spec.activation),
            });
        }
        let table = |inv: &[f32]| {
            RotaryEmbedding::new(inv, spec.rope.max_positions, false, vb.dtype(), vb.device())
        };
        let long = match &spec.rope.long {
            Some((inv, from)) => Some((table(inv)?, u32::try_from(*from).unwrap_or(u32::MAX))),
            None => None,
        };
        Ok(Self {
            component: c,
            embed_tokens,
            layers,
            norm,
            lm_head,
            rope: Rope {
                short: table(&spec.rope.inv_freq)?,
                long,
            },
            vocab_size: spec.vocab_size,
            device: vb.device().clone(),
            dtype: vb.dtype(),
        })
    }
}

impl PagedModel for DecoderStack {
    fn attention_layers(&self) -> Vec<&Attention> {
        self.layers.iter().map(|l| &l.self_attn.attn).collect()
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn max_seq_len(&self) -> usize {
        self.rope.short.max_positions()
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn dtype(&self) -> DType {
        self.dtype
    }

    fn forward(
        &self,
        input_ids: &Tensor,
        metadata: &AttentionMetadata,
        cache: &PagedKvCache,
        rows: &[usize],
    ) -> Result<Tensor> {
        let c = self.component;
        check_input(c, input_ids, metadata, self.vocab_size)?;
        check_cache(c, cache, self.layers.len())?;
        self.run(input_ids, metadata, cache.layers(), rows)
    }
}

impl DecoderStack {
    /// Decoder layers.
    pub(crate) fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// [`PagedModel::forward`] over one cache per layer (`caches`, at least
    /// `num_layers()` of them: a tensor-parallel rank's slice of a cache
    /// shared by the ranks).
    pub(crate) fn forward_layers(
        &self,
        input_ids: &Tensor,
        metadata: &AttentionMetadata,
        caches: &[LayerKvCache],
        rows: &[usize],
    ) -> Result<Tensor> {
        check_input(self.component, input_ids, metadata, self.vocab_size)?;
        self.run(input_ids, metadata, caches, rows)
    }

    /// The forward pass over checked inputs.
    fn run(
        &self,
        input_ids: &Tensor,
        metadata: &AttentionMetadata,
        caches: &[LayerKvCache],
        rows: &[usize],
    ) -> Result<Tensor> {
        let c = self.component;
        let (cos, sin) = self.rope.at(metadata)?;
        let mut x = self.embed_tokens.forward(input_ids)?;
        let Some(first) = self.layers.first() else {
            bail!("{c}: the model has no layers");
        };
        // Each residual add runs with the norm after it (one kernel on CUDA);
        // the last one with the output norm, over every row (the norm is
        // per row, so selecting the rows after it changes nothing).
        let mut normed = first.input_layernorm.forward(&x)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let h = layer.self_attn.forward(
                &normed,
                (&cos, &sin),
                layer_cache(c, caches, i)?,
                metadata,
            )?;
            (x, normed) = layer.post_attention_layernorm.add_forward(&x, &h)?;
            let h = normed.apply(&layer.mlp)?;
            let next = self
                .layers
                .get(i + 1)
                .map_or(&self.norm, |l| &l.input_layernorm);
            (x, normed) = next.add_forward(&x, &h)?;
        }
        select_rows(c, &normed, rows, metadata)?
            .apply(&self.lm_head)?
            .to_dtype(DType::F32)
    }
}

/// The cache of layer `i` among `caches`.
fn layer_cache<'a>(
    component: &str,
    caches: &'a [LayerKvCache],
    i: usize,
) -> Result<&'a LayerKvCache> {
    match caches.get(i) {
        Some(c) => Ok(c),
        None => bail!(
            "{component}: layer {i} has no cache; {} layer caches were given",
            caches.len()
        ),
    }
}

/// `hidden / heads`, the head size of a config without `head_dim`, or an
/// error naming the keys.
pub(crate) fn head_dim_of(component: &str, hidden: usize, heads: usize) -> Result<usize> {
    if heads == 0 || !hidden.is_multiple_of(heads) {
        bail!("{component}: config.json hidden_size {hidden} is not a multiple of num_attention_heads {heads}");
    }
    Ok(hidden / heads)
}

/// Refuses a `rope_scaling` other than `null`: the family runs the plain
/// rotary table only.
pub(crate) fn no_rope_scaling(
    component: &str,
    rope_scaling: &Option<serde_json::Value>,
) -> Result<()> {
    match rope_scaling {
        None | Some(serde_json::Value::Null) => Ok(()),
        Some(v) => bail!("{component}: config.json rope_scaling {v} is not supported (only null)"),
    }
}

/// `rope_theta` when a config has none.
pub(crate) fn default_rope_theta() -> f64 {
    10_000.0
}

/// `hidden_act` when a config has none.
pub(crate) fn default_hidden_act() -> Activation {
    Activation::Silu
}
