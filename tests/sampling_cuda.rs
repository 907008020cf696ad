//! The device sampler (`sample_rows` on CUDA) against its host reference
//! (`sample_row`): the same token for the same seed and step, and draws
//! that follow the kept distribution (chi-square). GPU only: without the
//! `cuda` and `engine` features this binary is empty.
#![cfg(all(feature = "cuda", feature = "engine"))]

#[macro_use]
mod common;

use anyhow::{ensure, Result};
use candle_core::{Device, Tensor};
use candle_paged_attention::{sample_row, sample_rows, RowSampling};

cuda_test! {
    /// Random logits of small, Llama-3-sized and larger vocabularies (a
    /// slice of 400,000 / 8 tokens is past the kernel's shared-memory cache,
    /// so those rows take the recomputing path; 7 and 400,001 are
    /// unaligned rows), each filter alone and together: the device picks
    /// the reference's token for every (row, step): top-p's masses are
    /// exact integers on both sides.
    fn device_tokens_equal_the_reference(
        dev: &Device,
        #[values(7, 1000, 128256, 400_000, 400_001)] vocab: usize,
    ) -> Result<()> {
        let rows = 6;
        let logits = (Tensor::randn(0f32, 3., (rows, vocab), &Device::Cpu)? * 1.0)?;
        let host = logits.to_vec2::<f32>()?;
        let on_dev = logits.to_device(dev)?;
        let (mut same, mut all) = (0, 0);
        for step in 0..40u64 {
            let params: Vec<RowSampling> = (0..rows)
                .map(|r| RowSampling {
                    temperature: [1.0, 0.7, 1.3, 0.9, 1.0, 0.5][r],
                    top_k: [0, 5, 0, 50, 3, 0][r],
                    top_p: [1.0, 1.0, 0.9, 0.8, 0.5, 0.95][r],
                    min_p: [0.0, 0.0, 0.0, 0.02, 0.0, 0.1][r],
                    seed: 1000 + r as u64,
                    step,
                })
                .collect();
            let got = sample_rows(&on_dev, &params)?.to_vec2::<u32>()?;
            for (r, p) in params.iter().enumerate() {
                ensure!(got[r][1] == 1, "row {r} flagged non-finite");
                ensure!((got[r][0] as usize) < vocab, "row {r}: token {}", got[r][0]);
                same += usize::from(got[r][0] == sample_row(&host[r], p)?);
                all += 1;
            }
        }
        ensure!(same == all, "{same} of {all} tokens equal the reference");
        Ok(())
    }
}

cuda_test! {
    /// 20,000 device draws of one 12-token row follow the kept
    /// distribution, and a non-finite row is flagged.
    fn device_draws_pass_chi_square(dev: &Device) -> Result<()> {
        let vocab = 12;
        let row: Vec<f32> = (0..vocab).map(|i| ((i * 7) % 12) as f32 * 0.35 - 1.0).collect();
        let n = 2000;
        let logits = Tensor::new(row.clone(), dev)?.unsqueeze(0)?.repeat((n, 1))?;
        let base = RowSampling { temperature: 1.3, top_k: 6, top_p: 0.9, ..Default::default() };
        let mut counts = vec![0u64; vocab];
        for step in 0..10u64 {
            let params: Vec<RowSampling> = (0..n as u64)
                .map(|s| RowSampling { seed: s, step, ..base })
                .collect();
            for t in sample_rows(&logits, &params)?.to_vec2::<u32>()? {
                counts[t[0] as usize] += 1;
            }
        }
        // The exact kept distribution, from the reference's own filter: a
        // token is kept when the reference ever draws it over many seeds.
        let draws = counts.iter().sum::<u64>() as f64;
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let s: Vec<f64> = row.iter().map(|&x| ((x - m) / base.temperature) as f64).collect();
        let mut kept = vec![false; vocab];
        for seed in 0..5000 {
            kept[sample_row(&row, &RowSampling { seed, ..base })? as usize] = true;
        }
        let z: f64 = s.iter().zip(&kept).filter(|(_, &k)| k).map(|(v, _)| v.exp()).sum();
        let mut chi2 = 0.0;
        for i in 0..vocab {
            if !kept[i] {
                ensure!(counts[i] == 0, "token {i} is dropped but was drawn {} times", counts[i]);
                continue;
            }
            let e = s[i].exp() / z * draws;
            chi2 += (counts[i] as f64 - e).powi(2) / e;
        }
        // At most 11 degrees of freedom: the 0.999 quantile is 31.3.
        ensure!(chi2 < 31.3, "chi-square {chi2:.1}: {counts:?}");
        let mut bad = row.clone();
        bad[3] = f32::NAN;
        let bad = Tensor::new(bad, dev)?.unsqueeze(0)?;
        let got = sample_rows(&bad, &[base])?.to_vec2::<u32>()?;
        ensure!(got[0] == [0, 0], "a NaN row gives {:?}", got[0]);
        Ok(())
    }
}

cuda_test! {
    /// The engine's per-sequence sampler picks the same token from logits
    /// on the device as from the same logits on the host: greedy, greedy
    /// with repeat, frequency and presence penalties (a gather and scatter
    /// on the device), and draws with every cut and penalty.
    fn sampler_on_the_device_equals_the_host(dev: &Device) -> Result<()> {
        use candle_paged_attention::engine::{Sampler, SamplingParams};
        let vocab = 32_000;
        let prompt: Vec<u32> = (0..40).map(|i| (i * 797) % vocab as u32).collect();
        let kinds = [
            SamplingParams::greedy(1),
            SamplingParams { repeat_penalty: 1.3, repeat_last_n: 16, ..SamplingParams::greedy(1) },
            SamplingParams { frequency_penalty: 0.7, presence_penalty: 0.4, ..SamplingParams::greedy(1) },
            SamplingParams { temperature: 0.8, top_p: Some(0.95), seed: 3, ..SamplingParams::greedy(1) },
            SamplingParams {
                temperature: 1.1,
                top_k: Some(40),
                min_p: Some(0.01),
                repeat_penalty: 1.2,
                frequency_penalty: -0.5,
                seed: 4,
                ..SamplingParams::greedy(1)
            },
        ];
        let (mut same, mut all) = (0, 0);
        for trial in 0..20u32 {
            let logits = Tensor::randn(0f32, 4., vocab, &Device::Cpu)?;
            let on_dev = logits.to_device(dev)?;
            // Generated tokens that the penalties see: some from the prompt,
            // one repeated, and the current argmax.
            let top = logits.argmax(0)?.to_scalar::<u32>()?;
            let generated = [prompt[3], top, top, trial];
            for p in &kinds {
                let s = Sampler::new(p);
                let host = s.sample(&logits, &prompt, &generated)?;
                let device = s.sample(&on_dev, &prompt, &generated)?;
                same += usize::from(host == device);
                all += 1;
                if p.temperature == 0.0 {
                    ensure!(host == device, "{p:?}: greedy {host} on the host, {device} on the device");
                }
            }
        }
        ensure!(same * 100 >= all * 99, "{same} of {all} tokens equal the host's");
        Ok(())
    }
}
