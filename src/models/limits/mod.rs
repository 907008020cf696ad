//! Limits on what a checkpoint controls, checked before anything is
//! allocated from it.
//!
//! A checkpoint downloaded from the hub is untrusted input. Each format has
//! one place here that validates it before a loader or a candle reader
//! acts on it, with errors that name the file or component, the key and the
//! value:
//!
//! * [`gguf`] - a GGUF header ([`read_gguf`]): metadata nesting, array
//!   and string lengths, `general.alignment`, every tensor's shape and bytes
//!   against the file.
//! * [`DecoderShape`] - the hyper-parameters of a decoder, from a GGUF's
//!   metadata or a `config.json`: head counts and sizes, the rotary width,
//!   the norm epsilon, rotary bases, layer counts against what the weights
//!   can hold.
//!
//! Chat templates (`chat`), tokenizers (`tokenizer`) and file names (`hub`)
//! are bounded where they are read.

pub mod gguf;

use candle_core::{bail, Result};

pub use gguf::read_gguf;

/// The decoder layers a loader reserves room for up front; a larger count
/// grows as layers load, so a count no file backs fails at the first
/// missing layer instead of reserving memory for it.
pub const PREALLOCATED_LAYERS: usize = 512;

/// The largest head size a checkpoint may declare (the attention kernels'
/// largest is smaller; this bounds what is computed before they refuse).
pub const MAX_HEAD_DIM: usize = 1 << 12;

/// Room for `num_layers` decoder layers, at most [`PREALLOCATED_LAYERS`].
pub(crate) fn layers_vec<T>(num_layers: usize) -> Vec<T> {
    Vec::with_capacity(num_layers.min(PREALLOCATED_LAYERS))
}

/// Checks that the GGUF content `ct` can hold `num_layers` decoder layers
/// (read from `key`): each layer has several tensors, so a count above the
/// file's tensor count is refused before any layer is reserved or loaded.
pub(crate) fn check_gguf_layers(
    component: &str,
    key: &str,
    num_layers: usize,
    ct: &candle_core::quantized::gguf_file::Content,
) -> Result<()> {
    let tensors = ct.tensor_infos.len();
    if num_layers > tensors {
        bail!("{component}: {key} is {num_layers}, more layers than the {tensors} tensors of the file can hold");
    }
    Ok(())
}

/// The hyper-parameters of a decoder that a checkpoint declares, with the
/// keys they came from (for the messages).
#[derive(Clone, Debug)]
pub struct DecoderShape<'a> {
    /// The model or file named first in the messages (`quantized-llama`,
    /// `llama`, ...).
    pub component: &'a str,
    /// Where the keys live: `GGUF llama.` or `config.json `, prepended to
    /// each key in the messages.
    pub source: &'a str,
    /// `(key, value)` of the model width.
    pub hidden_size: (&'a str, usize),
    /// `(key, value)` of the query heads.
    pub num_heads: (&'a str, usize),
    /// `(key, value)` of the KV heads.
    pub num_kv_heads: (&'a str, usize),
    /// `(key, value)` of the elements per head.
    pub head_dim: (&'a str, usize),
    /// `(key, value)` of the decoder layers.
    pub num_layers: (&'a str, usize),
    /// The most layers the weights can hold (a GGUF's tensor count), if
    /// known (`None` checks the count only when the weights load).
    pub max_layers: Option<usize>,
    /// `(key, value)` of the rotary width (the head size when the model
    /// rotates whole heads).
    pub rope_dim: (&'a str, usize),
    /// `(key, value)` of the RMS norm epsilon.
    pub rms_norm_eps: (&'a str, f64),
    /// `(key, value)` of each rotary base.
    pub rope_bases: &'a [(&'a str, f64)],
}

impl DecoderShape<'_> {
    /// Checks the shape: every count positive, the heads a multiple of the
    /// KV heads, the head size at most [`MAX_HEAD_DIM`], the rotary width
    /// even and at most the head size, the layers no more than the weights
    /// hold, the epsilon and the rotary bases finite and positive.
    pub fn check(&self) -> Result<()> {
        let (c, s) = (self.component, self.source);
        for (key, v) in [
            self.hidden_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.num_layers,
            self.rope_dim,
        ] {
            if v == 0 || v > u32::MAX as usize {
                bail!("{c}: {s}{key} must be in 1..={}, got {v}", u32::MAX);
            }
        }
        let ((hk, h), (kk, kv)) = (self.num_heads, self.num_kv_heads);
        if !h.is_multiple_of(kv) {
            bail!("{c}: {s}{hk} {h} must be a multiple of {s}{kk} {kv}");
        }
        let (dk, d) = self.head_dim;
        if d > MAX_HEAD_DIM {
            bail!("{c}: {s}{dk} must be at most {MAX_HEAD_DIM}, got {d}");
        }
        let (rk, r) = self.rope_dim;
        if r % 2 != 0 || r > d {
            bail!("{c}: {s}{rk} must be even and at most the head size {d}, got {r}");
        }
        let (lk, layers) = self.num_layers;
        if let Some(max) = self.max_layers.filter(|&m| layers > m) {
            bail!(
                "{c}: {s}{lk} is {layers}, more layers than the {max} tensors of the file can hold"
            );
        }
        let (ek, eps) = self.rms_norm_eps;
        if !(eps.is_finite() && eps > 0.0) {
            bail!("{c}: {s}{ek} must be finite and positive, got {eps}");
        }
        for &(bk, base) in self.rope_bases {
            if !(base.is_finite() && base > 0.0) {
                bail!("{c}: {s}{bk} must be finite and positive, got {base}");
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> DecoderShape<'static> {
        DecoderShape {
            component: "m",
            source: "config.json ",
            hidden_size: ("hidden_size", 64),
            num_heads: ("num_attention_heads", 4),
            num_kv_heads: ("num_key_value_heads", 2),
            head_dim: ("head_dim", 16),
            num_layers: ("num_hidden_layers", 2),
            max_layers: Some(20),
            rope_dim: ("head_dim", 16),
            rms_norm_eps: ("rms_norm_eps", 1e-6),
            rope_bases: &[("rope_theta", 1e4)],
        }
    }

    #[test]
    fn each_bad_value_is_named() {
        shape().check().unwrap();
        let cases: Vec<(DecoderShape, &str)> = vec![
            (
                DecoderShape { num_kv_heads: ("num_key_value_heads", 0), ..shape() },
                "m: config.json num_key_value_heads must be in 1..=4294967295, got 0",
            ),
            (
                DecoderShape { num_kv_heads: ("num_key_value_heads", 3), ..shape() },
                "m: config.json num_attention_heads 4 must be a multiple of config.json num_key_value_heads 3",
            ),
            (
                DecoderShape { rope_dim: ("rope.dimension_count", 4294967295), ..shape() },
                "m: config.json rope.dimension_count must be even and at most the head size 16, got 4294967295",
            ),
            (
                DecoderShape { num_layers: ("block_count", 4294967295), ..shape() },
                "m: config.json block_count is 4294967295, more layers than the 20 tensors of the file can hold",
            ),
            (
                DecoderShape { rms_norm_eps: ("rms_norm_eps", -1e-6), ..shape() },
                "m: config.json rms_norm_eps must be finite and positive, got -0.000001",
            ),
            (
                DecoderShape { rms_norm_eps: ("rms_norm_eps", f64::NAN), ..shape() },
                "m: config.json rms_norm_eps must be finite and positive, got NaN",
            ),
            (
                DecoderShape { rope_bases: &[("rope_theta", 0.0)], ..shape() },
                "m: config.json rope_theta must be finite and positive, got 0",
            ),
            (
                DecoderShape { head_dim: ("head_dim", 1 << 20), rope_dim: ("head_dim", 16), ..shape() },
                "m: config.json head_dim must be at most 4096, got 1048576",
            ),
        ];
        for (s, want) in cases {
            let e = s.check().unwrap_err().to_string();
            assert_eq!(e.lines().next(), Some(want), "{e}");
        }
    }

    #[test]
    fn a_huge_layer_count_reserves_a_bounded_vec() {
        let v: Vec<u64> = layers_vec(usize::MAX);
        assert_eq!(v.capacity(), PREALLOCATED_LAYERS);
    }
}
