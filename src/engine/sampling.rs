//! Next-token sampling: greedy by default, or temperature with optional
//! top-k and top-p, seeded per sequence, after an optional repeat penalty
//! (candle-transformers' `LogitsProcessor` and `utils::apply_repeat_penalty`).

use candle_core::{bail, DType, Result, Tensor};
use candle_transformers::generation::{LogitsProcessor, Sampling};
use candle_transformers::utils::apply_repeat_penalty;

/// How one sequence picks its tokens and when it stops.
///
/// * `temperature` - finite; below `1e-7` (0 included) is greedy (argmax),
///   as in candle-transformers' `LogitsProcessor`.
/// * `top_k` - with a temperature, sample among the `k >= 1` most likely
///   tokens only (then `top_p` within them, when both are given); ignored
///   when greedy.
/// * `top_p` - nucleus sampling threshold in `(0, 1]` (with a temperature);
///   it is applied in f32, so it must be at least `f32::MIN_POSITIVE`
///   (about `1.2e-38`), below which it would round to 0 and keep no token.
/// * `repeat_penalty` - finite and positive; 1 is off. The logits of the
///   tokens among the last `repeat_last_n` tokens of the sequence (prompt
///   and generated tokens) are divided by it where positive and multiplied
///   by it where negative, before the token is picked, greedy or sampled
///   (a greedy sequence with a penalty takes the host path of sampled ones).
/// * `repeat_last_n` - how many of the latest tokens the penalty looks at
///   (0: none, the penalty is off).
/// * `seed` - the sequence's random seed.
/// * `max_tokens` - new tokens to generate at most.
/// * `stop_tokens` - generation stops after any of these (it is kept in the output).
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; below `1e-7` is greedy.
    pub temperature: f64,
    /// Sample among the `k` most likely tokens.
    pub top_k: Option<usize>,
    /// Nucleus sampling threshold.
    pub top_p: Option<f64>,
    /// Penalty of recently seen tokens; 1 is off.
    pub repeat_penalty: f32,
    /// Tokens the repeat penalty looks back over.
    pub repeat_last_n: usize,
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
            top_k: None,
            top_p: None,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
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
        if self.top_k == Some(0) {
            bail!("sampling: top_k must be at least 1, got 0");
        }
        let p = self.repeat_penalty;
        if !(p.is_finite() && p > 0.0) {
            bail!("sampling: repeat_penalty must be finite and positive, got {p}");
        }
        if self.max_tokens == 0 {
            bail!("sampling: max_tokens must be at least 1, got 0");
        }
        Ok(())
    }
}

/// Temperatures below this are greedy (candle-transformers' threshold).
const GREEDY_BELOW: f64 = 1e-7;

/// The sampler of one sequence (candle-transformers' `LogitsProcessor`,
/// after its `apply_repeat_penalty`).
pub struct Sampler {
    inner: LogitsProcessor,
    greedy: bool,
    repeat_penalty: f32,
    repeat_last_n: usize,
}

impl Sampler {
    /// A sampler for `params` (greedy when the temperature is below `1e-7`).
    pub fn new(params: &SamplingParams) -> Self {
        let t = params.temperature;
        let sampling = match (t >= GREEDY_BELOW, params.top_k, params.top_p) {
            (false, _, _) => Sampling::ArgMax,
            (true, None, None) => Sampling::All { temperature: t },
            (true, Some(k), None) => Sampling::TopK { k, temperature: t },
            (true, None, Some(p)) => Sampling::TopP { p, temperature: t },
            (true, Some(k), Some(p)) => Sampling::TopKThenTopP {
                k,
                p,
                temperature: t,
            },
        };
        Self {
            inner: LogitsProcessor::from_sampling(params.seed, sampling),
            greedy: t < GREEDY_BELOW,
            repeat_penalty: params.repeat_penalty,
            repeat_last_n: params.repeat_last_n,
        }
    }

    /// True when the penalty changes logits: a penalty other than 1 over at
    /// least one token.
    fn penalizes(&self) -> bool {
        self.repeat_penalty != 1.0 && self.repeat_last_n > 0
    }

    /// True when the sampler takes the plain argmax of the logits
    /// (temperature below `1e-7` and no repeat penalty), so a batch's greedy
    /// tokens can be picked on the device in one pass.
    pub fn is_greedy(&self) -> bool {
        self.greedy && !self.penalizes()
    }

    /// Picks a token from `logits` `(vocab,)`, penalising the tokens among
    /// the last `repeat_last_n` of `prompt` followed by `generated`.
    ///
    /// Logits with a NaN or an infinity are an error (naming the first
    /// such token and its value), greedy or sampled: no token is picked.
    pub fn sample(&mut self, logits: &Tensor, prompt: &[u32], generated: &[u32]) -> Result<u32> {
        check_finite(logits)?;
        if !self.penalizes() {
            return self.inner.sample(logits);
        }
        let total = prompt.len() + generated.len();
        let recent: Vec<u32> = prompt
            .iter()
            .chain(generated)
            .skip(total.saturating_sub(self.repeat_last_n))
            .copied()
            .collect();
        let logits = apply_repeat_penalty(logits, self.repeat_penalty, &recent)?;
        self.inner.sample(&logits)
    }
}

/// Refuses `logits` `(vocab,)` holding a NaN or an infinity.
fn check_finite(logits: &Tensor) -> Result<()> {
    let values = logits
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    if let Some((t, v)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
        bail!(
            "sampling: non-finite logits: token {t} of {} has logit {v}",
            values.len()
        );
    }
    Ok(())
}

impl std::fmt::Debug for Sampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sampler")
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    fn logits(values: &[f32]) -> Tensor {
        Tensor::new(values, &Device::Cpu).unwrap()
    }

    #[test]
    fn greedy_with_a_repeat_penalty_skips_recent_tokens() {
        let params = SamplingParams {
            repeat_penalty: 4.0,
            repeat_last_n: 2,
            ..SamplingParams::greedy(1)
        };
        let mut s = Sampler::new(&params);
        // A penalty needs the logits on the host: not the device argmax.
        assert!(!s.is_greedy());
        // Token 1 (2.0 -> 0.5) and token 2 (-1.0 -> -4.0) were seen last.
        let l = logits(&[1.0, 2.0, -1.0, 0.8]);
        assert_eq!(s.sample(&l, &[1], &[2]).unwrap(), 0);
        // Only the last 2 tokens count: token 1 is older than that here.
        assert_eq!(s.sample(&l, &[1, 3], &[2]).unwrap(), 1);
        // The prompt counts as much as the generated tokens.
        assert_eq!(s.sample(&l, &[2, 1], &[]).unwrap(), 0);
        // A penalty of 1, or a window of 0 tokens, is off.
        for p in [
            SamplingParams::greedy(1),
            SamplingParams {
                repeat_last_n: 0,
                ..params.clone()
            },
        ] {
            let mut s = Sampler::new(&p);
            assert!(s.is_greedy());
            assert_eq!(s.sample(&l, &[1], &[2]).unwrap(), 1);
        }
    }

    #[test]
    fn top_k_keeps_the_k_most_likely_tokens() {
        let l = logits(&[0.0, 3.0, 2.9, -5.0]);
        for seed in 0..20 {
            let mut one = Sampler::new(&SamplingParams {
                temperature: 1.0,
                top_k: Some(1),
                seed,
                ..Default::default()
            });
            assert!(!one.is_greedy());
            assert_eq!(one.sample(&l, &[], &[]).unwrap(), 1);
            let mut two = Sampler::new(&SamplingParams {
                temperature: 1.0,
                top_k: Some(2),
                top_p: Some(0.99),
                seed,
                ..Default::default()
            });
            assert!(matches!(two.sample(&l, &[], &[]).unwrap(), 1 | 2));
        }
        // Greedy ignores top-k.
        let mut g = Sampler::new(&SamplingParams {
            top_k: Some(3),
            ..SamplingParams::greedy(1)
        });
        assert!(g.is_greedy());
        assert_eq!(g.sample(&l, &[], &[]).unwrap(), 1);
    }

    #[test]
    fn non_finite_logits_pick_no_token_greedy_penalised_or_sampled() {
        let greedy = SamplingParams::greedy(1);
        let penalised = SamplingParams {
            repeat_penalty: 2.0,
            ..greedy.clone()
        };
        let sampled = SamplingParams {
            temperature: 1.0,
            top_k: Some(2),
            ..greedy.clone()
        };
        for params in [greedy, penalised, sampled] {
            for (values, bad) in [
                ([f32::NAN; 4], "token 0 of 4 has logit NaN"),
                ([1.0, 2.0, f32::INFINITY, 0.5], "token 2 of 4 has logit inf"),
                (
                    [1.0, f32::NEG_INFINITY, 3.0, 0.5],
                    "token 1 of 4 has logit -inf",
                ),
                ([1.0, 2.0, 0.0, f32::NAN], "token 3 of 4 has logit NaN"),
            ] {
                let mut s = Sampler::new(&params);
                for dtype in [DType::F32, DType::BF16, DType::F16] {
                    let l = logits(&values).to_dtype(dtype).unwrap();
                    let err = s.sample(&l, &[1], &[0]).unwrap_err().to_string();
                    assert!(
                        err.starts_with(&format!("sampling: non-finite logits: {bad}")),
                        "{params:?} {dtype:?}: {err}"
                    );
                }
                // Finite logits still give a token: the argmax (1), the
                // penalised argmax (2: token 1 was seen), or one of the top 2.
                let t = s.sample(&logits(&[1.0, 3.0, 2.9, 0.5]), &[1], &[]).unwrap();
                let ok = match (params.temperature > 0.0, params.repeat_penalty != 1.0) {
                    (true, _) => t == 1 || t == 2,
                    (false, true) => t == 2,
                    (false, false) => t == 1,
                };
                assert!(ok, "{params:?}: {t}");
            }
        }
    }

    #[test]
    fn invalid_top_k_and_repeat_penalty_are_refused() {
        let check = |p: SamplingParams, want: &str| {
            let err = p.validate().unwrap_err().to_string();
            assert!(err.starts_with(want), "{err}");
        };
        check(
            SamplingParams {
                top_k: Some(0),
                ..Default::default()
            },
            "sampling: top_k must be at least 1, got 0",
        );
        for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            check(
                SamplingParams {
                    repeat_penalty: bad,
                    ..Default::default()
                },
                &format!("sampling: repeat_penalty must be finite and positive, got {bad}"),
            );
        }
        assert!(SamplingParams {
            top_k: Some(40),
            repeat_penalty: 1.1,
            repeat_last_n: 0,
            ..Default::default()
        }
        .validate()
        .is_ok());
    }
}
