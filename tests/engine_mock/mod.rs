//! A tiny deterministic `PagedModel` for engine tests, whose next token is
//! an exact function of what its KV cache holds, and which fails on chosen
//! forward calls.
//!
//! Each token stores `[token id, position + 1, 1, 0]` as its key and value
//! through a real [`Attention`] layer (the paged store and attention run as
//! in a real model). The logits of a row are one-hot at a hash of every
//! `(token, position + 1)` pair the row's sequence has in the cache,
//! positions `0..=p`, read back through the batch's block tables; a second,
//! sliding-window layer adds the pairs of its window, read through its
//! window group's tables. So a missing, stale or misplaced cache entry (a
//! rollback that forgot a position, say) changes the token, and the tokens
//! of a correct engine equal [`oracle_next`] applied to the context.

#![allow(dead_code)]

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;

use candle_core::{bail, DType, Device, Result, Tensor};
use candle_paged_attention::models::{CacheConfig, PagedKvCache, PagedModel};
use candle_paged_attention::{Attention, AttentionMetadata, AttentionOptions};

/// Elements of each stored key and value.
const HEAD: usize = 4;

/// The text of every injected error.
pub const INJECTED: &str = "mock: injected failure";

/// Where a chosen forward call fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fail {
    /// Before anything is stored.
    BeforeStore,
    /// After every layer stored its keys and values (a partial step).
    AfterStore,
}

/// Logits a chosen sequence gets instead of its one-hot row (a hostile
/// checkpoint's NaN or infinity).
#[derive(Clone, Copy, Debug)]
pub struct Poison {
    /// The token at position 0 of the poisoned sequences.
    pub first_token: u32,
    /// Rows at this position or later are poisoned.
    pub from_position: usize,
    /// The value written.
    pub value: f32,
    /// Every logit of the row, or only one beside the one-hot peak (which
    /// keeps its 1).
    pub whole_row: bool,
}

/// The mock model: a full-attention layer and, optionally, a sliding-window
/// layer.
pub struct MockModel {
    layers: Vec<Attention>,
    window: Option<usize>,
    vocab: usize,
    max_seq_len: usize,
    device: Device,
    calls: Cell<usize>,
    failures: RefCell<BTreeMap<usize, Fail>>,
    poisons: RefCell<Vec<Poison>>,
}

/// FNV-1a over the pairs, reduced to a token id.
fn hash_pairs(pairs: impl Iterator<Item = (u32, u32)>, vocab: usize) -> u32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (a, b) in pairs {
        for x in [a, b] {
            h ^= x as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    (h % vocab as u64) as u32
}

/// The token the mock predicts after `context` (a correct cache holds
/// exactly these pairs).
pub fn oracle_next(context: &[u32], window: Option<usize>, vocab: usize) -> u32 {
    let p = context.len() - 1;
    let full = context
        .iter()
        .enumerate()
        .map(|(t, &id)| (id, t as u32 + 1));
    let windowed = window.map(|w| {
        let from = (p + 1).saturating_sub(w);
        context[from..]
            .iter()
            .enumerate()
            .map(move |(j, &id)| (id, (from + j) as u32 + 1))
    });
    hash_pairs(full.chain(windowed.into_iter().flatten()), vocab)
}

impl MockModel {
    /// A mock with blocks of `block_size` tokens, an optional sliding-window
    /// layer, `vocab` tokens and a context of `max_seq_len`.
    pub fn new(
        block_size: usize,
        window: Option<usize>,
        vocab: usize,
        max_seq_len: usize,
    ) -> Result<Self> {
        let options = |sliding_window| AttentionOptions {
            block_size,
            sliding_window,
            ..Default::default()
        };
        let mut layers = vec![Attention::new(1, 1, HEAD, 1.0, options(None))?];
        if let Some(w) = window {
            layers.push(Attention::new(1, 1, HEAD, 1.0, options(Some(w)))?);
        }
        Ok(Self {
            layers,
            window,
            vocab,
            max_seq_len,
            device: Device::Cpu,
            calls: Cell::new(0),
            failures: RefCell::new(BTreeMap::new()),
            poisons: RefCell::new(Vec::new()),
        })
    }

    /// Makes forward call number `call` (counted from 0 over the model's
    /// life) fail `how`.
    pub fn fail_at(&self, call: usize, how: Fail) {
        self.failures.borrow_mut().insert(call, how);
    }

    /// Makes the rows `poison` names non-finite from now on.
    pub fn poison(&self, poison: Poison) {
        self.poisons.borrow_mut().push(poison);
    }

    /// Forward calls so far.
    pub fn calls(&self) -> usize {
        self.calls.get()
    }

    /// The window of the second layer, if any.
    pub fn window(&self) -> Option<usize> {
        self.window
    }

    /// Caches for this model: `num_blocks` full-attention blocks, and
    /// `window_blocks` for the window layer's group (or prefix caching).
    pub fn cache(
        &self,
        num_blocks: usize,
        window_blocks: Option<usize>,
        prefix_caching: bool,
    ) -> Result<PagedKvCache> {
        let config = CacheConfig {
            num_blocks,
            window_blocks,
            prefix_caching,
        };
        PagedKvCache::new(&self.attention_layers(), config, DType::F32, &self.device)
    }
}

/// The `(token, position + 1)` pairs of sequence `seq` at positions
/// `from..=to`, read from `values` (a layer's value cache, flattened)
/// through `table` (the sequence's block table).
fn read_pairs(
    values: &[f32],
    table: &[u32],
    block_size: usize,
    from: usize,
    to: usize,
) -> Vec<(u32, u32)> {
    (from..=to)
        .map(|t| {
            let block = table.get(t / block_size).copied().unwrap_or(u32::MAX) as usize;
            let at = (block * block_size + t % block_size) * HEAD;
            match values.get(at..at + 2) {
                Some(v) => (v[0] as u32, v[1] as u32),
                None => (u32::MAX, u32::MAX),
            }
        })
        .collect()
}

impl PagedModel for MockModel {
    fn attention_layers(&self) -> Vec<&Attention> {
        self.layers.iter().collect()
    }

    fn vocab_size(&self) -> usize {
        self.vocab
    }

    fn max_seq_len(&self) -> usize {
        self.max_seq_len
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn dtype(&self) -> DType {
        DType::F32
    }

    fn forward(
        &self,
        input_ids: &Tensor,
        metadata: &AttentionMetadata,
        cache: &PagedKvCache,
        rows: &[usize],
    ) -> Result<Tensor> {
        let call = self.calls.get();
        self.calls.set(call + 1);
        let fail = self.failures.borrow().get(&call).copied();
        if fail == Some(Fail::BeforeStore) {
            bail!("{INJECTED} before storing (forward call {call})");
        }
        let ids = input_ids.to_vec1::<u32>()?;
        let positions = metadata.positions_host().to_vec();
        let n = ids.len();
        let kv: Vec<f32> = ids
            .iter()
            .zip(&positions)
            .flat_map(|(&id, &p)| [id as f32, p as f32 + 1.0, 1.0, 0.0])
            .collect();
        let kv = Tensor::from_vec(kv, (n, HEAD), &self.device)?;
        let q = Tensor::zeros((n, HEAD), DType::F32, &self.device)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let out = layer.forward(&q, &kv, &kv, cache.layer(i)?, metadata)?;
            if out.dims() != [n, HEAD] {
                bail!("mock: attention output {:?}", out.dims());
            }
        }
        if fail == Some(Fail::AfterStore) {
            bail!("{INJECTED} after storing (forward call {call})");
        }
        let host = metadata.batch().host();
        let width = host.block_table_width();
        let bs = host.block_size();
        let full: Vec<f32> = cache.layer(0)?.value().flatten_all()?.to_vec1()?;
        let windowed = match (self.window, self.layers.len()) {
            (Some(w), 2) => {
                let values: Vec<f32> = cache.layer(1)?.value().flatten_all()?.to_vec1()?;
                let tables = match metadata.window_groups().first() {
                    Some(g) => g.batch().host().block_tables().to_vec(),
                    None => host.block_tables().to_vec(),
                };
                Some((w, values, tables))
            }
            _ => None,
        };
        let mut logits = vec![0f32; rows.len() * self.vocab];
        for (r, &row) in rows.iter().enumerate() {
            let Some(seq) = (0..host.cu_seqlens_q().len() - 1).find(|&i| {
                (host.cu_seqlens_q()[i] as usize..host.cu_seqlens_q()[i + 1] as usize)
                    .contains(&row)
            }) else {
                bail!("mock: row {row} outside the batch");
            };
            let p = positions[row] as usize;
            let table = &host.block_tables()[seq * width..(seq + 1) * width];
            let mut pairs = read_pairs(&full, table, bs, 0, p);
            if let Some((w, values, tables)) = &windowed {
                let table = &tables[seq * width..(seq + 1) * width];
                pairs.extend(read_pairs(values, table, bs, (p + 1).saturating_sub(*w), p));
            }
            let first = pairs.first().map(|&(t, _)| t);
            let next = hash_pairs(pairs.into_iter(), self.vocab) as usize;
            let out = &mut logits[r * self.vocab..(r + 1) * self.vocab];
            out[next] = 1.0;
            for poison in self.poisons.borrow().iter() {
                if Some(poison.first_token) == first && p >= poison.from_position {
                    if poison.whole_row {
                        out.fill(poison.value);
                    } else {
                        out[(next + 1) % self.vocab] = poison.value;
                    }
                }
            }
        }
        Tensor::from_vec(logits, (rows.len(), self.vocab), &self.device)
    }
}
