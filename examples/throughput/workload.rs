//! The requests of a run: prompt and output lengths drawn from a stated,
//! seeded distribution, random prompt tokens and arrival times.

use std::time::Duration;

use anyhow::{bail, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Exp, LogNormal};

/// The shape of a length distribution.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Dist {
    /// Every request gets the mean.
    Fixed,
    /// Integers uniform on `[min, max]`.
    Uniform,
    /// `exp(N(mu, sigma))` with `mu` chosen so that the mean is the stated
    /// mean, rounded and clamped to `[min, max]`.
    Lognormal,
}

/// A length distribution with its parameters resolved.
#[derive(Clone, Copy, Debug)]
pub struct LenDist {
    dist: Dist,
    mean: usize,
    min: usize,
    max: usize,
    sigma: f64,
}

impl LenDist {
    /// Resolves the defaults: uniform on `[mean / 2, mean + mean / 2]`,
    /// lognormal clamped to `[1, 4 * mean]`.
    pub fn new(
        what: &str,
        dist: Dist,
        mean: usize,
        min: Option<usize>,
        max: Option<usize>,
        sigma: f64,
    ) -> Result<Self> {
        if mean == 0 {
            bail!("{what}: the mean length must be at least 1");
        }
        let (min, max) = match dist {
            Dist::Fixed => (mean, mean),
            Dist::Uniform => {
                let lo = min.unwrap_or((mean / 2).max(1));
                (lo, max.unwrap_or(mean + (mean - lo.min(mean))))
            }
            Dist::Lognormal => (min.unwrap_or(1), max.unwrap_or(4 * mean)),
        };
        if min == 0 || min > max {
            bail!("{what}: need 1 <= min <= max, got min {min} and max {max}");
        }
        if dist == Dist::Lognormal && !(sigma > 0.0 && sigma.is_finite()) {
            bail!("{what}: the lognormal sigma must be positive, got {sigma}");
        }
        Ok(Self {
            dist,
            mean,
            min,
            max,
            sigma,
        })
    }

    /// The largest length this distribution can give.
    pub fn max(&self) -> usize {
        self.max
    }

    /// One length.
    pub fn sample(&self, rng: &mut StdRng) -> usize {
        match self.dist {
            Dist::Fixed => self.mean,
            Dist::Uniform => rng.random_range(self.min..=self.max),
            Dist::Lognormal => {
                let mu = (self.mean as f64).ln() - self.sigma * self.sigma / 2.0;
                // Both parameters are checked in `new`: sigma > 0, mu finite.
                let d = LogNormal::new(mu, self.sigma).expect("valid lognormal parameters");
                (d.sample(rng).round() as usize).clamp(self.min, self.max)
            }
        }
    }

    /// The distribution in words, for the report.
    pub fn describe(&self) -> String {
        match self.dist {
            Dist::Fixed => format!("fixed {}", self.mean),
            Dist::Uniform => format!("uniform on [{}, {}]", self.min, self.max),
            Dist::Lognormal => format!(
                "lognormal (mean {}, sigma {}) clamped to [{}, {}]",
                self.mean, self.sigma, self.min, self.max
            ),
        }
    }
}

/// What to generate.
pub struct WorkloadSpec {
    pub num_requests: usize,
    pub prompt: LenDist,
    pub output: LenDist,
    /// Requests per second of a Poisson arrival process; `None`: all at t = 0.
    pub request_rate: Option<f64>,
    /// Every prompt is a prefix of one random token sequence.
    pub same_prompt: bool,
    /// The first `shared_prefix` tokens of every prompt are the same.
    pub shared_prefix: usize,
    pub seed: u64,
    /// How every request picks its tokens: `None` is greedy.
    pub draw: Option<Draw>,
}

/// A sampled request's draw (its seed is its index).
#[derive(Clone, Copy, Debug)]
pub struct Draw {
    pub temperature: f64,
    pub top_p: Option<f64>,
}

/// One request.
#[derive(Clone, Debug)]
pub struct WorkItem {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    /// When it arrives, from the start of the run.
    pub arrival: Duration,
    /// How it picks its tokens: `None` is greedy.
    pub draw: Option<Draw>,
}

/// The requests of `spec`, prompt tokens drawn uniformly from `pool`.
///
/// Lengths, tokens and arrivals use three generators seeded from
/// `spec.seed`, so changing one flag keeps the draws of the others.
pub fn build(spec: &WorkloadSpec, pool: &[u32]) -> Result<Vec<WorkItem>> {
    if spec.num_requests == 0 {
        bail!("--num-requests must be at least 1");
    }
    if pool.is_empty() {
        bail!("the vocabulary has no ordinary token to draw prompts from");
    }
    if let Some(r) = spec.request_rate {
        if !(r > 0.0 && r.is_finite()) {
            bail!("--request-rate must be positive, got {r}");
        }
    }
    let mut len_rng = StdRng::seed_from_u64(spec.seed);
    let mut tok_rng = StdRng::seed_from_u64(spec.seed.wrapping_add(1));
    let mut arrival_rng = StdRng::seed_from_u64(spec.seed.wrapping_add(2));
    let mut draw = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| pool[tok_rng.random_range(0..pool.len())])
            .collect()
    };
    let lens: Vec<(usize, usize)> = (0..spec.num_requests)
        .map(|_| {
            (
                spec.prompt.sample(&mut len_rng),
                spec.output.sample(&mut len_rng),
            )
        })
        .collect();
    let longest = lens.iter().map(|l| l.0).max().unwrap_or(0);
    let common = if spec.same_prompt {
        draw(longest)
    } else {
        draw(spec.shared_prefix.min(longest))
    };
    let gaps = spec.request_rate.map(Exp::new).transpose()?;
    let mut t = 0.0f64;
    let mut items = Vec::with_capacity(spec.num_requests);
    for (i, &(p, max_tokens)) in lens.iter().enumerate() {
        let shared = common.len().min(p);
        let mut prompt = common[..shared].to_vec();
        prompt.extend(draw(p - shared));
        if let (Some(g), true) = (&gaps, i > 0) {
            t += g.sample(&mut arrival_rng);
        }
        items.push(WorkItem {
            prompt,
            max_tokens,
            arrival: Duration::from_secs_f64(t),
            draw: spec.draw,
        });
    }
    Ok(items)
}

/// True when every prompt has one length and every request one output
/// length, and all arrive at t = 0: the dense reference can batch them.
pub fn batchable(items: &[WorkItem]) -> bool {
    items.iter().all(|w| {
        w.prompt.len() == items[0].prompt.len()
            && w.max_tokens == items[0].max_tokens
            && w.arrival.is_zero()
    })
}
