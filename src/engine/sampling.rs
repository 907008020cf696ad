//! How a sequence picks its next token: greedy by default, or a draw at a
//! temperature with optional top-k, top-p and min-p cuts, seeded per
//! request; after optional repeat, frequency and presence penalties.
//!
//! A draw follows [`crate::ops::sample`]'s definition (a counter-based
//! random stream keyed by the request's seed and counted by its output token
//! index), so the same request gives the same tokens on the CPU and on a
//! GPU, whatever else shares its batches, and a rolled-back step draws the
//! same token again. The engine picks a whole batch's tokens on the logits'
//! device ([`super::pick`]); [`Sampler::sample`] picks one row the same way.

use std::collections::BTreeMap;

use candle_core::{bail, DType, Result, Tensor};

use super::pick::{first_non_finite, pick_tokens, DevicePicking, RowPick};
use crate::ops::sample::RowSampling;

/// How one sequence picks its tokens and when it stops.
///
/// * `temperature` - finite and at most `f32::MAX`; below `1e-7` (0
///   included) is greedy (argmax).
/// * `top_k` - with a temperature, sample among the `k >= 1` most likely
///   tokens only (every token tied with the k-th is kept too); ignored when
///   greedy.
/// * `top_p` - nucleus sampling threshold in `(0, 1]` (with a temperature),
///   applied after top-k; it is applied in f32, so it must be at least
///   `f32::MIN_POSITIVE` (about `1.2e-38`).
/// * `min_p` - with a temperature, keep only the tokens at least `min_p`
///   times as likely as the most likely one, in `[0, 1]` (applied first).
/// * `repeat_penalty` - finite and positive; 1 is off. The logits of the
///   tokens among the last `repeat_last_n` tokens of the sequence (prompt
///   and generated tokens) are divided by it where `>= 0` and multiplied by
///   it where negative (candle-transformers' `apply_repeat_penalty`).
/// * `repeat_last_n` - how many of the latest tokens the repeat penalty
///   looks at (0: none, the penalty is off).
/// * `frequency_penalty`, `presence_penalty` - finite; 0 is off. A token
///   generated `c > 0` times so far (the prompt does not count) loses
///   `frequency_penalty * c + presence_penalty` from its logit, after the
///   repeat penalty (OpenAI's and vLLM's definition).
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
    /// Keep tokens at least this fraction as likely as the most likely one.
    pub min_p: Option<f64>,
    /// Penalty of recently seen tokens; 1 is off.
    pub repeat_penalty: f32,
    /// Tokens the repeat penalty looks back over.
    pub repeat_last_n: usize,
    /// Logit subtracted per earlier occurrence in the generated tokens; 0 is off.
    pub frequency_penalty: f32,
    /// Logit subtracted from every token generated before; 0 is off.
    pub presence_penalty: f32,
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
            min_p: None,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
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
        // A draw divides f32 logits by it: past f32's range it would be
        // infinite there.
        if self.temperature > f32::MAX as f64 {
            bail!(
                "sampling: temperature {:e} is too large: it is applied in f32 and must be at most {:e}",
                self.temperature,
                f32::MAX
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
        if let Some(p) = self.min_p {
            if !(0.0..=1.0).contains(&p) {
                bail!("sampling: min_p must be in [0, 1], got {p}");
            }
        }
        if self.top_k == Some(0) {
            bail!("sampling: top_k must be at least 1, got 0");
        }
        let p = self.repeat_penalty;
        if !(p.is_finite() && p > 0.0) {
            bail!("sampling: repeat_penalty must be finite and positive, got {p}");
        }
        for (name, v) in [
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ] {
            if !v.is_finite() {
                bail!("sampling: {name} must be finite, got {v}");
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

/// The sampler of one sequence: its parameters, ready to give each step's
/// row pick (its penalties and its draw; see [`Sampler::sample`]).
#[derive(Clone, Debug)]
pub struct Sampler {
    /// The draw's parameters (step 0); `None` when greedy.
    draw: Option<RowSampling>,
    repeat_penalty: f32,
    repeat_last_n: usize,
    frequency_penalty: f32,
    presence_penalty: f32,
}

impl Sampler {
    /// A sampler for `params` (greedy when the temperature is below `1e-7`).
    pub fn new(params: &SamplingParams) -> Self {
        let draw = (params.temperature >= GREEDY_BELOW).then(|| RowSampling {
            temperature: params.temperature as f32,
            top_k: params
                .top_k
                .map_or(0, |k| u32::try_from(k).unwrap_or(u32::MAX)),
            top_p: params.top_p.map_or(1.0, |p| p as f32),
            min_p: params.min_p.map_or(0.0, |p| p as f32),
            seed: params.seed,
            step: 0,
        });
        Self {
            draw,
            repeat_penalty: params.repeat_penalty,
            repeat_last_n: params.repeat_last_n,
            frequency_penalty: params.frequency_penalty,
            presence_penalty: params.presence_penalty,
        }
    }

    /// True when a penalty may change logits.
    fn penalizes(&self) -> bool {
        (self.repeat_penalty != 1.0 && self.repeat_last_n > 0)
            || self.frequency_penalty != 0.0
            || self.presence_penalty != 0.0
    }

    /// True when the sampler takes the plain argmax of the logits
    /// (temperature below `1e-7` and no penalty).
    pub fn is_greedy(&self) -> bool {
        self.draw.is_none() && !self.penalizes()
    }

    /// What the next token of a sequence that holds `prompt` followed by
    /// `generated` needs: the penalties over those tokens, and the draw
    /// numbered by `generated.len()` (the output token it picks).
    pub(crate) fn row_pick(&self, prompt: &[u32], generated: &[u32]) -> RowPick {
        let draw = self.draw.map(|d| RowSampling {
            step: generated.len() as u64,
            ..d
        });
        if !self.penalizes() {
            return RowPick {
                penalties: Vec::new(),
                draw,
            };
        }
        // token -> (factor, subtract)
        let mut touched: BTreeMap<u32, (f32, f32)> = BTreeMap::new();
        if self.repeat_penalty != 1.0 {
            let total = prompt.len() + generated.len();
            let recent = prompt
                .iter()
                .chain(generated)
                .skip(total.saturating_sub(self.repeat_last_n));
            for &t in recent {
                touched.entry(t).or_insert((1.0, 0.0)).0 = self.repeat_penalty;
            }
        }
        if self.frequency_penalty != 0.0 || self.presence_penalty != 0.0 {
            let mut counts: BTreeMap<u32, u32> = BTreeMap::new();
            for &t in generated {
                *counts.entry(t).or_default() += 1;
            }
            for (t, c) in counts {
                touched.entry(t).or_insert((1.0, 0.0)).1 =
                    self.frequency_penalty * c as f32 + self.presence_penalty;
            }
        }
        RowPick {
            penalties: touched.into_iter().map(|(t, (f, s))| (t, f, s)).collect(),
            draw,
        }
    }

    /// Picks the next token from `logits` `(vocab,)` of a sequence holding
    /// `prompt` followed by `generated`, as the engine does for a batch.
    ///
    /// Logits with a NaN or an infinity are an error (naming the first
    /// such token and its value), greedy or sampled: no token is picked.
    pub fn sample(&self, logits: &Tensor, prompt: &[u32], generated: &[u32]) -> Result<u32> {
        check_finite(logits)?;
        let rows = logits.to_dtype(DType::F32)?.unsqueeze(0)?;
        let picked = pick_tokens(
            &rows,
            &[self.row_pick(prompt, generated)],
            DevicePicking::from_env(),
        )?;
        match picked.first() {
            Some(Some(t)) => Ok(*t),
            _ => bail!("sampling: the penalised logits are not finite"),
        }
    }
}

/// Refuses `logits` `(vocab,)` holding a NaN or an infinity.
fn check_finite(logits: &Tensor) -> Result<()> {
    if let Some(what) = first_non_finite(logits)? {
        bail!("sampling: non-finite logits: {what}");
    }
    Ok(())
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
        let s = Sampler::new(&params);
        // A penalty changes the logits before the argmax.
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
            let s = Sampler::new(&p);
            assert!(s.is_greedy());
            assert_eq!(s.sample(&l, &[1], &[2]).unwrap(), 1);
        }
    }

    #[test]
    fn top_k_keeps_the_k_most_likely_tokens() {
        let l = logits(&[0.0, 3.0, 2.9, -5.0]);
        for seed in 0..20 {
            let one = Sampler::new(&SamplingParams {
                temperature: 1.0,
                top_k: Some(1),
                seed,
                ..Default::default()
            });
            assert!(!one.is_greedy());
            assert_eq!(one.sample(&l, &[], &[]).unwrap(), 1);
            let two = Sampler::new(&SamplingParams {
                temperature: 1.0,
                top_k: Some(2),
                top_p: Some(0.99),
                seed,
                ..Default::default()
            });
            assert!(matches!(two.sample(&l, &[], &[]).unwrap(), 1 | 2));
        }
        // Greedy ignores top-k.
        let g = Sampler::new(&SamplingParams {
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
                let s = Sampler::new(&params);
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
        for bad in [-0.5, 1.5, f64::NAN] {
            check(
                SamplingParams {
                    min_p: Some(bad),
                    ..Default::default()
                },
                &format!("sampling: min_p must be in [0, 1], got {bad}"),
            );
        }
        check(
            SamplingParams {
                temperature: 1e300,
                ..Default::default()
            },
            "sampling: temperature 1e300 is too large: it is applied in f32",
        );
        check(
            SamplingParams {
                frequency_penalty: f32::NAN,
                ..Default::default()
            },
            "sampling: frequency_penalty must be finite, got NaN",
        );
        check(
            SamplingParams {
                presence_penalty: f32::INFINITY,
                ..Default::default()
            },
            "sampling: presence_penalty must be finite, got inf",
        );
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
