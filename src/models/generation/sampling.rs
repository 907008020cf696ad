//! Next-token sampling: greedy by default, or temperature with optional
//! top-p, seeded per sequence.

use candle_core::{bail, Result, Tensor};
use candle_transformers::generation::LogitsProcessor;

/// How one sequence picks its tokens and when it stops.
///
/// * `temperature` - finite; below `1e-7` (0 included) is greedy (argmax),
///   as in candle-transformers' `LogitsProcessor`.
/// * `top_p` - nucleus sampling threshold in `(0, 1]` (with a temperature);
///   it is applied in f32, so it must be at least `f32::MIN_POSITIVE`
///   (about `1.2e-38`), below which it would round to 0 and keep no token.
/// * `seed` - the sequence's random seed.
/// * `max_tokens` - new tokens to generate at most.
/// * `stop_tokens` - generation stops after any of these (it is kept in the output).
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; below `1e-7` is greedy.
    pub temperature: f64,
    /// Nucleus sampling threshold.
    pub top_p: Option<f64>,
    /// Random seed.
    pub seed: u64,
    /// Maximum new tokens.
    pub max_tokens: usize,
    /// Tokens that end the sequence.
    pub stop_tokens: Vec<u32>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: None,
            seed: 299_792_458,
            max_tokens: 128,
            stop_tokens: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// Greedy decoding of `max_tokens` tokens with no stop token.
    pub fn greedy(max_tokens: usize) -> Self {
        Self {
            max_tokens,
            ..Default::default()
        }
    }

    /// Checks the ranges of the parameters.
    pub fn validate(&self) -> Result<()> {
        if !self.temperature.is_finite() {
            bail!(
                "sampling: temperature must be finite, got {}",
                self.temperature
            );
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                bail!("sampling: top_p must be in (0, 1], got {p}");
            }
            if (p as f32) < f32::MIN_POSITIVE {
                bail!(
                    "sampling: top_p {p:e} is too small: it is applied in f32 and must be at least {:e}",
                    f32::MIN_POSITIVE
                );
            }
        }
        if self.max_tokens == 0 {
            bail!("sampling: max_tokens must be at least 1, got 0");
        }
        Ok(())
    }
}

/// Temperatures below this are greedy (candle-transformers' threshold).
const GREEDY_BELOW: f64 = 1e-7;

/// The sampler of one sequence (candle-transformers' `LogitsProcessor`).
pub struct Sampler {
    inner: LogitsProcessor,
    greedy: bool,
}

impl Sampler {
    /// A sampler for `params` (greedy when the temperature is below `1e-7`).
    pub fn new(params: &SamplingParams) -> Self {
        let temperature = (params.temperature >= GREEDY_BELOW).then_some(params.temperature);
        Self {
            inner: LogitsProcessor::new(params.seed, temperature, params.top_p),
            greedy: temperature.is_none(),
        }
    }

    /// True when the sampler takes the argmax (temperature below `1e-7`), so a
    /// batch's greedy tokens can be picked on the device in one pass.
    pub fn is_greedy(&self) -> bool {
        self.greedy
    }

    /// Picks a token from `logits` `(vocab,)`.
    pub fn sample(&mut self, logits: &Tensor) -> Result<u32> {
        self.inner.sample(logits)
    }
}

impl std::fmt::Debug for Sampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sampler")
    }
}
