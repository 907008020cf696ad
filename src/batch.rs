//! The batch description the ops read: which query rows belong to which
//! sequence, how many keys each sequence has, where its pages are, and where
//! new tokens go.
//!
//! Both types keep the host vectors they were built from next to the device
//! tensors. Every O(batch) check runs once, when the value is built; an op
//! call only compares a few precomputed maxima with the cache shape, so the
//! CUDA path never copies index data back to the host.
//!
//! A leaf: imports nothing from this crate.

use std::any::Any;
use std::fmt;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use candle_core::{bail, Device, Result, Tensor};

/// Half-open ranges of absolute positions inside which attention is
/// bidirectional, per sequence (`ranges[i]` belongs to sequence `i`).
pub type PrefixRanges = Vec<Vec<Range<u32>>>;

/// The sequences of one forward pass, validated once and shared by every
/// layer that attends over them.
///
/// Sequence `i` owns query rows `cu_seqlens_q[i]..cu_seqlens_q[i + 1]` of the
/// flat query and has `seq_lens[i]` keys in the cache (its context plus its
/// new tokens). Its token `t` lives in block `block_tables[i][t / block_size]`,
/// row `t % block_size`. Query row `j` of the sequence sits at absolute
/// position `seq_lens[i] - q_len_i + j`.
///
/// Device tensors (all on the device given at construction):
/// * `cu_seqlens_q` - `(num_seqs + 1,)`, u32
/// * `seq_lens` - `(num_seqs,)`, u32
/// * `block_tables` - `(num_seqs, block_table_width)`, u32
/// * `prefix_ranges` (optional) - `(num_seqs, max_ranges, 2)`, u32, half-open
///   `[start, end)` pairs; unused slots hold `[0, 0)`.
#[derive(Clone, Debug)]
pub struct PagedBatch {
    cu_seqlens_q: Tensor,
    seq_lens: Tensor,
    block_tables: Tensor,
    prefix_ranges: Option<Tensor>,
    host: Arc<BatchHost>,
    /// What the ops derive from this batch once (shared by its clones).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // read by the CUDA path
    memo: Arc<BatchMemo>,
}

/// Keys at most in one batch's [`BatchMemo`] (the layer kinds of a model
/// that share a batch: full attention, and the kinds of its window layers).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // read by the CUDA path
const MEMO_ENTRIES: usize = 8;

/// A type-erased memo key or value.
type Erased = Arc<dyn Any + Send + Sync>;

/// Values derived from one batch and reused by every layer call over it,
/// each under the key of what else it depends on (the CUDA path's launch
/// plan, keyed by the call's shape and dtypes): a plan is made once per
/// batch and layer kind, not once per layer.
#[derive(Default)]
struct BatchMemo {
    entries: Mutex<Vec<(Erased, Erased)>>,
}

impl fmt::Debug for BatchMemo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.entries.lock().map_or(0, |e| e.len());
        write!(f, "BatchMemo({n} entries)")
    }
}

/// Host copies of the batch's index arrays and the maxima derived from them;
/// read-only (built and validated by [`PagedBatch`]).
#[derive(Clone, Debug)]
pub struct BatchHost {
    /// `num_seqs + 1` row offsets into the flat query.
    cu_seqlens_q: Vec<u32>,
    /// `num_seqs` key counts (context + new tokens).
    seq_lens: Vec<u32>,
    /// Row-major `num_seqs x block_table_width` block ids.
    block_tables: Vec<u32>,
    /// Columns of `block_tables`.
    block_table_width: usize,
    /// Tokens per cache block the tables were built for.
    block_size: usize,
    /// Bidirectional ranges per sequence (empty when none were given).
    prefix_ranges: PrefixRanges,
    /// Longest query span of any sequence.
    max_seqlen_q: usize,
    /// Largest `seq_lens` entry.
    max_seqlen_k: usize,
    /// Largest block id any sequence reads (`None` when no sequence has keys).
    max_block_id: Option<u32>,
}

impl BatchHost {
    /// `num_seqs + 1` row offsets into the flat query.
    pub fn cu_seqlens_q(&self) -> &[u32] {
        &self.cu_seqlens_q
    }

    /// `num_seqs` key counts (context + new tokens).
    pub fn seq_lens(&self) -> &[u32] {
        &self.seq_lens
    }

    /// Row-major `num_seqs x block_table_width` block ids.
    pub fn block_tables(&self) -> &[u32] {
        &self.block_tables
    }

    /// Columns of `block_tables`.
    pub fn block_table_width(&self) -> usize {
        self.block_table_width
    }

    /// Tokens per cache block the tables were built for.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Bidirectional ranges per sequence (empty when none were given).
    pub fn prefix_ranges(&self) -> &[Vec<Range<u32>>] {
        &self.prefix_ranges
    }

    /// Longest query span of any sequence.
    pub fn max_seqlen_q(&self) -> usize {
        self.max_seqlen_q
    }

    /// Largest `seq_lens` entry.
    pub fn max_seqlen_k(&self) -> usize {
        self.max_seqlen_k
    }

    /// Largest block id any sequence reads (`None` when no sequence has keys).
    pub fn max_block_id(&self) -> Option<u32> {
        self.max_block_id
    }

    /// Number of sequences.
    pub fn num_seqs(&self) -> usize {
        self.seq_lens.len()
    }

    /// Total query rows (`cu_seqlens_q[num_seqs]`).
    pub fn num_tokens(&self) -> usize {
        *self.cu_seqlens_q.last().unwrap_or(&0) as usize
    }

    /// New query tokens of sequence `i`, or `None` when `i >= num_seqs()`.
    pub fn q_len(&self, i: usize) -> Option<usize> {
        let end = *self.cu_seqlens_q.get(i.checked_add(1)?)?;
        // Validation made cu_seqlens_q non-decreasing, so this cannot underflow.
        Some((end - self.cu_seqlens_q[i]) as usize)
    }

    /// Block table row of sequence `i` (`block_table_width` entries).
    ///
    /// # Panics
    /// When `i >= num_seqs()`, as slice indexing does.
    pub fn block_table(&self, i: usize) -> &[u32] {
        let w = self.block_table_width;
        // Validation checked num_seqs * width == block_tables.len(), so for
        // i < num_seqs neither product overflows.
        &self.block_tables[i * w..(i + 1) * w]
    }

    /// True when every sequence has exactly one new query token.
    pub fn is_pure_decode(&self) -> bool {
        self.num_seqs() > 0 && self.max_seqlen_q == 1 && self.num_tokens() == self.num_seqs()
    }
}

impl PagedBatch {
    /// Validates the batch on the host and uploads it to `device`.
    ///
    /// # Arguments
    /// * `cu_seqlens_q` - `num_seqs + 1` non-decreasing row offsets starting at 0.
    /// * `seq_lens` - `num_seqs` key counts; each at least the sequence's query span.
    /// * `block_tables` - row-major `num_seqs x block_table_width` block ids;
    ///   only the first `ceil(seq_len / block_size)` entries of a row are read,
    ///   the rest may hold anything. Ids may repeat.
    /// * `block_table_width` - columns of `block_tables`.
    /// * `block_size` - tokens per cache block, the cache's dimension 1.
    pub fn new(
        cu_seqlens_q: &[u32],
        seq_lens: &[u32],
        block_tables: &[u32],
        block_table_width: usize,
        block_size: usize,
        device: &Device,
    ) -> Result<Self> {
        let host = BatchHost::validated(
            cu_seqlens_q.to_vec(),
            seq_lens.to_vec(),
            block_tables.to_vec(),
            block_table_width,
            block_size,
        )?;
        Self::upload(host, device)
    }

    /// Like [`PagedBatch::new`], from one block-table row per sequence; rows
    /// are padded with block 0 to the longest.
    pub fn from_rows(
        cu_seqlens_q: &[u32],
        seq_lens: &[u32],
        block_table_rows: &[Vec<u32>],
        block_size: usize,
        device: &Device,
    ) -> Result<Self> {
        let width = block_table_rows.iter().map(Vec::len).max().unwrap_or(0);
        let Some(len) = width.checked_mul(block_table_rows.len()) else {
            bail!(
                "paged-attention: {} block-table rows of width {width} overflow usize",
                block_table_rows.len()
            );
        };
        let mut flat = vec![0u32; len];
        for (row, ids) in flat.chunks_mut(width.max(1)).zip(block_table_rows) {
            row[..ids.len()].copy_from_slice(ids);
        }
        if block_table_rows.len() != seq_lens.len() {
            bail!(
                "paged-attention: block_tables has {} rows but seq_lens describes {} sequences",
                block_table_rows.len(),
                seq_lens.len()
            );
        }
        Self::new(cu_seqlens_q, seq_lens, &flat, width, block_size, device)
    }

    /// Adds bidirectional prefix ranges: inside one half-open range
    /// `start..end` of absolute positions every query also sees every key
    /// (before or after it), on top of the causal/window mask.
    ///
    /// `ranges[i]` lists sequence `i`'s ranges; an empty range is ignored.
    /// Ranges are clipped to the sequence's keys (`end <= seq_len`).
    pub fn with_prefix_ranges(self, ranges: &[Vec<Range<u32>>]) -> Result<Self> {
        let host = &self.host;
        if ranges.len() != host.num_seqs() {
            bail!(
                "paged-attention: prefix_ranges has {} entries but the batch has {} sequences",
                ranges.len(),
                host.num_seqs()
            );
        }
        for (i, seq_ranges) in ranges.iter().enumerate() {
            for r in seq_ranges {
                if r.start > r.end {
                    bail!(
                        "paged-attention: prefix_ranges[{i}] = {}..{} has start > end",
                        r.start,
                        r.end
                    );
                }
                if r.end > host.seq_lens[i] {
                    bail!(
                        "paged-attention: prefix_ranges[{i}] = {}..{} ends past seq_len {}",
                        r.start,
                        r.end,
                        host.seq_lens[i]
                    );
                }
            }
        }
        let max_ranges = ranges.iter().map(Vec::len).max().unwrap_or(0);
        // Each sequence's ranges are a Vec already, so this cannot overflow
        // unless the ranges themselves fill the address space; checked anyway.
        let Some(len) = host
            .num_seqs()
            .checked_mul(max_ranges)
            .and_then(|n| n.checked_mul(2))
        else {
            bail!(
                "paged-attention: {} sequences x {max_ranges} prefix ranges overflow usize",
                host.num_seqs()
            );
        };
        let mut flat = vec![0u32; len];
        for (i, seq_ranges) in ranges.iter().enumerate() {
            for (j, r) in seq_ranges.iter().enumerate() {
                flat[(i * max_ranges + j) * 2] = r.start;
                flat[(i * max_ranges + j) * 2 + 1] = r.end;
            }
        }
        let device = self.seq_lens.device().clone();
        let tensor = Tensor::from_vec(flat, (host.num_seqs(), max_ranges, 2), &device)?;
        let host = BatchHost {
            prefix_ranges: ranges.to_vec(),
            ..(**host).clone()
        };
        Ok(Self {
            prefix_ranges: Some(tensor),
            host: Arc::new(host),
            memo: Arc::default(),
            ..self
        })
    }

    fn upload(host: BatchHost, device: &Device) -> Result<Self> {
        let n = host.num_seqs();
        let cu_seqlens_q = Tensor::from_slice(&host.cu_seqlens_q, n + 1, device)?;
        let seq_lens = Tensor::from_slice(&host.seq_lens, n, device)?;
        let block_tables =
            Tensor::from_slice(&host.block_tables, (n, host.block_table_width), device)?;
        Ok(Self {
            cu_seqlens_q,
            seq_lens,
            block_tables,
            prefix_ranges: None,
            host: Arc::new(host),
            memo: Arc::default(),
        })
    }

    /// The value `make` derives from this batch and `key`: made on the first
    /// call with an equal key, then shared by every call (and every clone of
    /// the batch). The ops keep per-batch work here, such as the CUDA launch
    /// plan that every layer of one kind shares. At most 8 keys are kept;
    /// past that the oldest is dropped (and made again if asked for). An
    /// error of `make` is returned and nothing is kept.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // read by the CUDA path
    pub(crate) fn memo<K, V>(&self, key: K, make: impl FnOnce() -> Result<V>) -> Result<Arc<V>>
    where
        K: PartialEq + Send + Sync + 'static,
        V: Send + Sync + 'static,
    {
        let found = |entries: &[(Erased, Erased)]| {
            entries.iter().find_map(|(k, v)| {
                let same = k.downcast_ref::<K>() == Some(&key);
                same.then(|| Arc::clone(v).downcast::<V>().ok()).flatten()
            })
        };
        let lock = || {
            self.memo
                .entries
                .lock()
                .map_err(|_| candle_core::Error::Msg("batch memo: poisoned lock".into()))
        };
        if let Some(v) = found(&lock()?) {
            return Ok(v);
        }
        // Made without the lock held: another thread may make the same value;
        // the first one stored wins.
        let value = Arc::new(make()?);
        let mut entries = lock()?;
        if let Some(v) = found(&entries) {
            return Ok(v);
        }
        if entries.len() == MEMO_ENTRIES {
            entries.remove(0);
        }
        entries.push((Arc::new(key), Arc::clone(&value) as Erased));
        Ok(value)
    }

    /// Host copies and derived maxima.
    pub fn host(&self) -> &BatchHost {
        &self.host
    }

    /// `(num_seqs + 1,)` u32 row offsets into the flat query.
    pub fn cu_seqlens_q(&self) -> &Tensor {
        &self.cu_seqlens_q
    }

    /// `(num_seqs,)` u32 key counts.
    pub fn seq_lens(&self) -> &Tensor {
        &self.seq_lens
    }

    /// `(num_seqs, block_table_width)` u32 block ids.
    pub fn block_tables(&self) -> &Tensor {
        &self.block_tables
    }

    /// `(num_seqs, max_ranges, 2)` u32 half-open ranges, when given.
    pub fn prefix_ranges(&self) -> Option<&Tensor> {
        self.prefix_ranges.as_ref()
    }

    /// The device the tensors live on.
    pub fn device(&self) -> &Device {
        self.seq_lens.device()
    }

    /// Number of sequences.
    pub fn num_seqs(&self) -> usize {
        self.host.num_seqs()
    }

    /// Total query rows.
    pub fn num_tokens(&self) -> usize {
        self.host.num_tokens()
    }
}

impl BatchHost {
    fn validated(
        cu_seqlens_q: Vec<u32>,
        seq_lens: Vec<u32>,
        block_tables: Vec<u32>,
        block_table_width: usize,
        block_size: usize,
    ) -> Result<Self> {
        const OP: &str = "paged-attention";
        let num_seqs = seq_lens.len();
        if block_size == 0 {
            bail!("{OP}: block_size must be positive, got 0");
        }
        if cu_seqlens_q.len() != num_seqs + 1 {
            bail!(
                "{OP}: cu_seqlens_q has {} entries but seq_lens has {num_seqs} (expected num_seqs + 1 = {})",
                cu_seqlens_q.len(),
                num_seqs + 1
            );
        }
        if cu_seqlens_q[0] != 0 {
            bail!(
                "{OP}: cu_seqlens_q must start at 0, got {}",
                cu_seqlens_q[0]
            );
        }
        if num_seqs.checked_mul(block_table_width) != Some(block_tables.len()) {
            bail!(
                "{OP}: block_tables holds {} ids but {num_seqs} sequences x width {block_table_width} need {}",
                block_tables.len(),
                num_seqs as u128 * block_table_width as u128
            );
        }
        let mut max_seqlen_q = 0;
        let mut max_seqlen_k = 0;
        let mut max_block_id: Option<u32> = None;
        for i in 0..num_seqs {
            let (start, end) = (cu_seqlens_q[i], cu_seqlens_q[i + 1]);
            if end < start {
                bail!(
                    "{OP}: cu_seqlens_q must be non-decreasing, got cu_seqlens_q[{i}] = {start} > cu_seqlens_q[{}] = {end}",
                    i + 1
                );
            }
            let q_len = (end - start) as usize;
            let seq_len = seq_lens[i] as usize;
            if q_len > seq_len {
                bail!("{OP}: sequence {i} has q_len {q_len} > seq_len {seq_len}");
            }
            let blocks_needed = seq_len.div_ceil(block_size);
            if blocks_needed > block_table_width {
                bail!(
                    "{OP}: block_tables has width {block_table_width} but sequence {i} with seq_len {seq_len} needs {blocks_needed} blocks of {block_size}"
                );
            }
            let row = &block_tables[i * block_table_width..i * block_table_width + blocks_needed];
            if let Some(&m) = row.iter().max() {
                max_block_id = Some(max_block_id.map_or(m, |x| x.max(m)));
            }
            max_seqlen_q = max_seqlen_q.max(q_len);
            max_seqlen_k = max_seqlen_k.max(seq_len);
        }
        Ok(Self {
            cu_seqlens_q,
            seq_lens,
            block_tables,
            block_table_width,
            block_size,
            prefix_ranges: Vec::new(),
            max_seqlen_q,
            max_seqlen_k,
            max_block_id,
        })
    }
}

/// Where each new token's K/V goes in the paged cache:
/// `slot = block * block_size + row`; a negative slot marks padding and is
/// skipped. No slot appears twice (two tokens cannot share a cache row).
///
/// Device tensor: `slots` - `(num_tokens,)`, i64.
#[derive(Clone, Debug)]
pub struct SlotMapping {
    slots: Tensor,
    host: Arc<Vec<i64>>,
    max_slot: Option<i64>,
}

impl SlotMapping {
    /// Checks `slots` (one per new token) and uploads them to `device`.
    ///
    /// A non-negative slot may appear only once: two tokens written to one
    /// cache row would leave only one of them there (and, on CUDA, which
    /// one would be unspecified). Checking sorts a copy of the slots, once
    /// per batch.
    pub fn new(slots: &[i64], device: &Device) -> Result<Self> {
        let mut sorted: Vec<i64> = slots.iter().copied().filter(|&s| s >= 0).collect();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            let dup = w[0];
            let mut tokens = slots.iter().enumerate().filter(|&(_, &s)| s == dup);
            let first = tokens.next().map_or(0, |(t, _)| t);
            let second = tokens.next().map_or(0, |(t, _)| t);
            bail!(
                "reshape-and-cache: slot_mapping holds slot {dup} twice (tokens {first} and {second}); each cache row takes at most one token"
            );
        }
        let max_slot = sorted.last().copied();
        let tensor = Tensor::from_slice(slots, slots.len(), device)?;
        Ok(Self {
            slots: tensor,
            host: Arc::new(slots.to_vec()),
            max_slot,
        })
    }

    /// `(num_tokens,)` i64 slots on the device.
    pub fn slots(&self) -> &Tensor {
        &self.slots
    }

    /// Host copy of the slots.
    pub fn host(&self) -> &[i64] {
        &self.host
    }

    /// Number of tokens (padding included).
    pub fn len(&self) -> usize {
        self.host.len()
    }

    /// True when there are no tokens.
    pub fn is_empty(&self) -> bool {
        self.host.is_empty()
    }

    /// Largest non-negative slot, if any.
    pub fn max_slot(&self) -> Option<i64> {
        self.max_slot
    }
}

#[cfg(test)]
mod memo_tests {
    use super::*;
    use std::cell::Cell;

    fn batch() -> Result<PagedBatch> {
        PagedBatch::new(&[0, 1, 4], &[5, 3], &[0, 1, 2, 3], 2, 4, &Device::Cpu)
    }

    #[test]
    fn a_memo_is_made_once_per_key_and_shared_by_clones() -> Result<()> {
        let b = batch()?;
        let made = Cell::new(0);
        let make = |v: u32| {
            made.set(made.get() + 1);
            Ok(v)
        };
        assert_eq!(*b.memo(("full", 64usize), || make(1))?, 1);
        assert_eq!(*b.clone().memo(("full", 64usize), || make(2))?, 1);
        assert_eq!(made.get(), 1);
        // Another key, and the same key with another value type, are made anew.
        assert_eq!(*b.memo(("window", 64usize), || make(3))?, 3);
        assert_eq!(*b.memo(("full", 64usize), || Ok(7u64))?, 7);
        assert_eq!(made.get(), 2);
        // A new batch starts empty.
        assert_eq!(*batch()?.memo(("full", 64usize), || make(4))?, 4);
        // Errors are returned and not kept.
        assert!(b.memo(9u8, || -> Result<u32> { bail!("no") }).is_err());
        assert_eq!(*b.memo(9u8, || make(5))?, 5);
        Ok(())
    }

    #[test]
    fn a_full_memo_drops_its_oldest_key() -> Result<()> {
        let b = batch()?;
        for k in 0..=MEMO_ENTRIES {
            b.memo(k, || Ok(k))?;
        }
        assert_eq!(*b.memo(0usize, || Ok(100usize))?, 100);
        assert_eq!(*b.memo(MEMO_ENTRIES, || Ok(100usize))?, MEMO_ENTRIES);
        Ok(())
    }
}
