//! `AttentionMetadata`: everything the attention layers of one forward pass
//! share, passed explicitly to each layer (no global context).
//!
//! It is built once per batch (usually by
//! [`BlockManager::schedule`](crate::BlockManager::schedule)); the
//! O(batch) validation and uploads happen then. Layers only select a view:
//! the full tables, a sliding-window group's tables, or a chunked-local
//! remap, which is built on first use per chunk size and cached here.
//!
//! Imports `batch`, `remap` and `cache` (for docs only); must not import
//! `ops`, `params`, the backends, `attention` or `models`.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use candle_core::{bail, Device, Result, Tensor};

use crate::batch::{BatchHost, PagedBatch, SlotMapping};
use crate::remap::{
    blocks_out_of_window, chunked_local_batches, select_window_group, LocalBatches,
};

const OP: &str = "attention-metadata";

/// The block tables and slots of one sliding-window KV-cache group: layers
/// with this window keep their own caches, whose blocks that fell out of the
/// window may have been recycled.
///
/// The group's batch has the same `cu_seqlens_q` and `seq_lens` as the full
/// one; only block ids (and so slots) differ.
#[derive(Clone, Debug)]
pub struct WindowGroup {
    window: usize,
    batch: PagedBatch,
    slot_mapping: SlotMapping,
}

impl WindowGroup {
    /// The window, in tokens, of the layers that read this group.
    pub fn window(&self) -> usize {
        self.window
    }

    /// The group's batch: `block_tables` `(num_seqs, width)` u32 in the
    /// group's block-id space.
    pub fn batch(&self) -> &PagedBatch {
        &self.batch
    }

    /// The group's slots, `(num_tokens,)` i64.
    pub fn slot_mapping(&self) -> &SlotMapping {
        &self.slot_mapping
    }
}

/// What one layer reads from the metadata: the batch to attend over and the
/// slots to store its new keys and values into.
#[derive(Clone, Debug)]
pub struct LayerBatch<'a> {
    /// The batch (possibly remapped into chunked-local virtual sequences).
    pub batch: PagedBatch,
    /// Slots of the new tokens, `(num_tokens,)` i64.
    pub slot_mapping: &'a SlotMapping,
}

/// The batch metadata of one forward pass.
///
/// Device tensors (on the batch's device), each with its host copy:
/// * batch - `cu_seqlens_q` `(num_seqs + 1,)` u32, `seq_lens` `(num_seqs,)` u32,
///   `block_tables` `(num_seqs, width)` u32 (see [`PagedBatch`]).
/// * `slot_mapping` - `(num_tokens,)` i64, where each new token's K/V goes.
/// * `positions` - `(num_tokens,)` u32, the absolute position of each query
///   row (for rotary embeddings: `cos.index_select(positions, 0)`).
///
/// A sequence with one new token and cached context is a decode; every other
/// sequence is a prefill (or a prefill chunk). Both kinds may be interleaved.
#[derive(Debug)]
pub struct AttentionMetadata {
    batch: PagedBatch,
    slot_mapping: SlotMapping,
    positions: Tensor,
    positions_host: Arc<Vec<u32>>,
    num_prefills: usize,
    num_prefill_tokens: usize,
    num_decodes: usize,
    window_groups: Vec<WindowGroup>,
    local: Mutex<HashMap<(Option<usize>, usize), PagedBatch>>,
    /// How the step's launches are planned (see [`GraphMode`]).
    graph_mode: GraphMode,
    /// The query rows whose logits the step wants, as a device tensor (see
    /// [`Self::with_logit_rows`]).
    logit_rows: Option<LogitRows>,
}

/// The query rows whose logits a step wants: `(rows,)` u32 on the batch's
/// device and its host copy.
#[derive(Clone, Debug)]
struct LogitRows {
    host: Arc<Vec<u32>>,
    tensor: Tensor,
}

/// How the attention launches of a step are planned: for the batch alone,
/// or for its CUDA-graph bucket, so that a graph captured on one batch of
/// the bucket replays any other.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GraphMode {
    /// Planned for this batch's own lengths (steps larger than a graph
    /// bucket, and every caller outside the engine).
    #[default]
    Eager,
    /// Planned for the batch's shape alone (sequences, tokens, table width;
    /// a batch with prefills launches both parts of a mixed batch): the
    /// split-KV of the layers whose policy is
    /// [`KvSplit::Auto`](crate::KvSplit::Auto) is chosen for sequences of up
    /// to `plan_keys` keys. A graph captured on such a step replays with new
    /// lengths, and an eager step of the same batch launches the same
    /// programs (so both sum the same partials in the same order).
    Replayable {
        /// Keys the split-KV is planned for (the bucket's
        /// `table width x block_size`).
        plan_keys: usize,
    },
}

impl AttentionMetadata {
    /// Metadata for `batch` whose new tokens go to `slot_mapping`.
    ///
    /// Checks, once per batch and O(tokens) on the host copies, that every
    /// non-negative slot is where attention will read the token back: new
    /// token `j` of sequence `i`, at position `p = context_len_i + j`, must
    /// go to slot `block_tables[i][p / block_size] * block_size + p % block_size`.
    /// Negative slots (padding, the token is not stored) are allowed.
    ///
    /// # Arguments
    /// * `batch` - the validated batch (full-attention block tables, and the
    ///   bidirectional prefix ranges if any; see [`Self::for_layer`] for how
    ///   window groups and chunked-local layers apply them).
    /// * `slot_mapping` - one slot per query row, on the batch's device.
    pub fn new(batch: PagedBatch, slot_mapping: SlotMapping) -> Result<Self> {
        check_slots("slot_mapping", &slot_mapping, &batch)?;
        let host = batch.host();
        let mut positions = Vec::with_capacity(host.num_tokens());
        let (mut num_prefills, mut num_prefill_tokens, mut num_decodes) = (0, 0, 0);
        for i in 0..host.num_seqs() {
            let q_len = host.q_len(i).unwrap_or(0);
            let context = host.seq_lens()[i] as usize - q_len;
            positions.extend((context..context + q_len).map(|p| p as u32));
            if q_len == 1 && context > 0 {
                num_decodes += 1;
            } else if q_len > 0 {
                num_prefills += 1;
                num_prefill_tokens += q_len;
            }
        }
        let tensor = Tensor::from_slice(&positions, positions.len(), batch.device())?;
        Ok(Self {
            batch,
            slot_mapping,
            positions: tensor,
            positions_host: Arc::new(positions),
            num_prefills,
            num_prefill_tokens,
            num_decodes,
            window_groups: Vec::new(),
            local: Mutex::new(HashMap::new()),
            graph_mode: GraphMode::Eager,
            logit_rows: None,
        })
    }

    /// This metadata with its launches planned as `mode` says.
    pub fn with_graph_mode(mut self, mode: GraphMode) -> Self {
        self.graph_mode = mode;
        self
    }

    /// How the step's launches are planned ([`GraphMode::Eager`] unless
    /// [`with_graph_mode`](Self::with_graph_mode) said otherwise).
    pub fn graph_mode(&self) -> GraphMode {
        self.graph_mode
    }

    /// This metadata with the query rows whose logits the step wants
    /// uploaded as a `(rows.len(),)` u32 tensor on the batch's device, which
    /// the models index their last hidden states with when asked for the
    /// same rows (see [`Self::logit_rows`]). A captured CUDA graph reads the
    /// rows from that tensor, so a replay may want other rows than the
    /// capture did: they are listed in [`Self::tensors`] and refreshed like
    /// the tables.
    ///
    /// Fails when `rows` is empty or a row is `>= num_tokens`.
    pub fn with_logit_rows(mut self, rows: &[usize]) -> Result<Self> {
        let n = self.num_tokens();
        if rows.is_empty() {
            bail!("{OP}: logit rows must not be empty");
        }
        if let Some(&bad) = rows.iter().find(|&&r| r >= n) {
            bail!("{OP}: logit row {bad} is out of range for {n} tokens");
        }
        let host: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let tensor = Tensor::from_slice(&host, host.len(), self.device())?;
        self.logit_rows = Some(LogitRows {
            host: Arc::new(host),
            tensor,
        });
        Ok(self)
    }

    /// The logit rows set by [`Self::with_logit_rows`]: their host values
    /// and the `(rows,)` u32 device tensor holding them.
    pub fn logit_rows(&self) -> Option<(&[u32], &Tensor)> {
        self.logit_rows
            .as_ref()
            .map(|r| (r.host.as_slice(), &r.tensor))
    }

    /// This batch with `num_seqs - self.num_seqs()` padding sequences
    /// appended and every block table widened to `width` columns, uploaded
    /// to `device`.
    ///
    /// A padding sequence has one new token at position 0 whose keys and
    /// values are not stored (slot -1) and whose table is all block 0: it
    /// reads one cache row and its output is meant to be ignored. Window
    /// groups are padded the same way; the split plan and the logit rows
    /// are kept. Use it to give a decode step the fixed shape of a captured
    /// CUDA graph, or (with the same sizes) to move host-built metadata to a
    /// device.
    ///
    /// Fails when the batch has prefix ranges, when `num_seqs` is smaller
    /// than the batch, or when `width` is narrower than its tables.
    pub fn padded(&self, num_seqs: usize, width: usize, device: &Device) -> Result<Self> {
        let n = self.num_seqs();
        let Some(pad_seqs) = num_seqs.checked_sub(n) else {
            bail!("{OP}: cannot pad {n} sequences to {num_seqs} sequences");
        };
        self.pad_with(&vec![1; pad_seqs], width, device)
    }

    /// This batch padded to `num_seqs` sequences of `num_tokens` new tokens
    /// in all, with tables `width` blocks wide, uploaded to `device`: the
    /// fixed shape of a captured CUDA graph of a step with prefills.
    ///
    /// The first padding sequence takes every padding token: it has `q`
    /// new tokens at positions `0..q` (no context), none of them stored
    /// (slots -1), over a table of block 0; its rows attend to `q` keys of
    /// that block's rows and are meant to be ignored. The other padding
    /// sequences have no token and no key (a sequence with no new token is
    /// skipped by every launch). Window groups are padded the same way; the
    /// split plan and the logit rows are kept.
    ///
    /// Fails when the batch has prefix ranges, when `num_seqs`,
    /// `num_tokens` or `width` is smaller than the batch's, when padding
    /// tokens have no padding sequence to take them (`num_seqs ==
    /// self.num_seqs()` but `num_tokens` is larger), or when they do not
    /// fit a table of `width` blocks.
    pub fn padded_to(
        &self,
        num_seqs: usize,
        num_tokens: usize,
        width: usize,
        device: &Device,
    ) -> Result<Self> {
        let n = self.num_seqs();
        let total = self.num_tokens();
        let pad_seqs = num_seqs.checked_sub(n);
        let pad_tokens = num_tokens.checked_sub(total);
        let (Some(pad_seqs), Some(pad_tokens)) = (pad_seqs, pad_tokens) else {
            bail!("{OP}: cannot pad {n} sequences of {total} tokens to {num_seqs} sequences of {num_tokens} tokens");
        };
        if pad_seqs == 0 && pad_tokens > 0 {
            bail!("{OP}: {pad_tokens} padding tokens but no padding sequence to take them");
        }
        let Ok(first) = u32::try_from(pad_tokens) else {
            bail!("{OP}: {num_tokens} padded tokens overflow cu_seqlens_q (u32)");
        };
        let lens: Vec<u32> = (0..pad_seqs)
            .map(|k| if k == 0 { first } else { 0 })
            .collect();
        self.pad_with(&lens, width, device)
    }

    /// This batch with one padding sequence of `lens[k]` new tokens (no
    /// context, none stored, a table of block 0) per entry of `lens`, every
    /// table widened to `width`, uploaded to `device` (see [`Self::padded`]
    /// and [`Self::padded_to`]).
    fn pad_with(&self, lens: &[u32], width: usize, device: &Device) -> Result<Self> {
        let n = self.num_seqs();
        let num_seqs = n + lens.len();
        let added: u64 = lens.iter().map(|&q| q as u64).sum();
        if (self.num_tokens() as u64).saturating_add(added) > u32::MAX as u64 {
            bail!("{OP}: {added} padding tokens overflow cu_seqlens_q (u32)");
        }
        let pad = |batch: &PagedBatch, slots: &SlotMapping| -> Result<(PagedBatch, SlotMapping)> {
            let host = batch.host();
            if has_ranges(host) {
                bail!("{OP}: a batch with prefix ranges cannot be padded");
            }
            if width < host.block_table_width() {
                bail!(
                    "{OP}: cannot pad tables of width {} to width {width}",
                    host.block_table_width()
                );
            }
            let Some(cells) = num_seqs.checked_mul(width) else {
                bail!("{OP}: {num_seqs} sequences of width {width} overflow the batch's indices");
            };
            let mut cu = host.cu_seqlens_q().to_vec();
            let mut seq_lens = host.seq_lens().to_vec();
            let mut tables = vec![0u32; cells];
            for i in 0..n {
                let row = host.block_table(i);
                tables[i * width..i * width + row.len()].copy_from_slice(row);
            }
            let mut slot_vec = slots.host().to_vec();
            // Sums stay <= the padded token count, which fits u32 (checked
            // above).
            let mut last = cu.last().copied().unwrap_or(0);
            for &q in lens {
                last += q;
                cu.push(last);
                seq_lens.push(q);
                slot_vec.extend(std::iter::repeat_n(-1, q as usize));
            }
            let batch = PagedBatch::new(&cu, &seq_lens, &tables, width, host.block_size(), device)?;
            Ok((batch, SlotMapping::new(&slot_vec, device)?))
        };
        let (batch, slots) = pad(&self.batch, &self.slot_mapping)?;
        let mut out = Self::new(batch, slots)?;
        for g in &self.window_groups {
            let (batch, slots) = pad(&g.batch, &g.slot_mapping)?;
            out = out.with_window_group(g.window, batch, slots)?;
        }
        out.graph_mode = self.graph_mode;
        if let Some(rows) = &self.logit_rows {
            let rows: Vec<usize> = rows.host.iter().map(|&r| r as usize).collect();
            out = out.with_logit_rows(&rows)?;
        }
        Ok(out)
    }

    /// Every tensor a forward pass reads from this metadata, in a fixed
    /// order: the batch's `cu_seqlens_q`, `seq_lens`, `block_tables` and
    /// prefix ranges (when present), the slots, the positions, then the same
    /// of each window group (batch tensors, slots), then the logit rows
    /// when set. Two metadata of the same shape list tensors of the same
    /// shapes: a captured graph's inputs are refreshed by copying one list
    /// into the other. Chunked-local remaps are not listed (they are derived
    /// per layer and cached).
    pub fn tensors(&self) -> Vec<&Tensor> {
        fn push_batch<'a>(b: &'a PagedBatch, out: &mut Vec<&'a Tensor>) {
            out.extend([b.cu_seqlens_q(), b.seq_lens(), b.block_tables()]);
            out.extend(b.prefix_ranges());
        }
        let mut out = Vec::new();
        push_batch(&self.batch, &mut out);
        out.push(self.slot_mapping.slots());
        out.push(&self.positions);
        for g in &self.window_groups {
            push_batch(&g.batch, &mut out);
            out.push(g.slot_mapping.slots());
        }
        out.extend(self.logit_rows.as_ref().map(|r| &r.tensor));
        out
    }

    /// Adds the tables and slots of the sliding-window group read by layers
    /// whose window is `window` tokens.
    ///
    /// The full batch's prefix ranges apply to the group too (they are
    /// copied onto `batch` when it has none). A group may have recycled the
    /// blocks of keys that fell out of the window, which a range would make
    /// visible again, so a range that reaches a new token of this batch must
    /// start at or after the first block any of the sequence's queries keeps
    /// (block `(context_len + 1 - window) / block_size`); otherwise this is an
    /// error.
    ///
    /// # Arguments
    /// * `window` - the layers' sliding window, at least 1, one group per window.
    /// * `batch` - same `cu_seqlens_q`, `seq_lens` and block size as the full
    ///   batch; block ids in the group's own cache; no prefix ranges, or the
    ///   full batch's.
    /// * `slot_mapping` - the group's slots for the new tokens, checked
    ///   against the group's tables as [`Self::new`] checks the full ones.
    pub fn with_window_group(
        mut self,
        window: usize,
        batch: PagedBatch,
        slot_mapping: SlotMapping,
    ) -> Result<Self> {
        if window == 0 {
            bail!("{OP}: window group window must be at least 1, got 0");
        }
        if self.window_groups.iter().any(|g| g.window == window) {
            bail!("{OP}: a window group for window {window} already exists");
        }
        let (main, group) = (self.batch.host(), batch.host());
        if group.cu_seqlens_q() != main.cu_seqlens_q() {
            bail!(
                "{OP}: window group {window} has cu_seqlens_q {:?} but the batch has {:?}",
                group.cu_seqlens_q(),
                main.cu_seqlens_q()
            );
        }
        if group.seq_lens() != main.seq_lens() {
            bail!(
                "{OP}: window group {window} has seq_lens {:?} but the batch has {:?}",
                group.seq_lens(),
                main.seq_lens()
            );
        }
        if group.block_size() != main.block_size() {
            bail!(
                "{OP}: window group {window} has block_size {} but the batch has {}",
                group.block_size(),
                main.block_size()
            );
        }
        if !batch.device().same_device(self.batch.device()) {
            bail!("{OP}: window group {window} is on another device than the batch");
        }
        let same_ranges = group.prefix_ranges() == main.prefix_ranges();
        if !same_ranges && has_ranges(group) {
            bail!(
                "{OP}: window group {window} has prefix ranges {:?} but the batch has {:?}",
                group.prefix_ranges(),
                main.prefix_ranges()
            );
        }
        let batch = if has_ranges(main) {
            check_ranges_in_window(window, main)?;
            if same_ranges {
                batch
            } else {
                let ranges = main.prefix_ranges().to_vec();
                batch.with_prefix_ranges(&ranges)?
            }
        } else {
            batch
        };
        check_slots(
            &format!("window group {window} slot_mapping"),
            &slot_mapping,
            &batch,
        )?;
        self.window_groups.push(WindowGroup {
            window,
            batch,
            slot_mapping,
        });
        Ok(self)
    }

    /// Builds the chunked-local remaps for these chunk sizes now (for the
    /// full tables and every window group) instead of on first use.
    pub fn with_local_chunks(self, chunks: &[usize]) -> Result<Self> {
        for &chunk in chunks {
            self.local_batch(None, chunk)?;
            for g in 0..self.window_groups.len() {
                self.local_batch(Some(g), chunk)?;
            }
        }
        Ok(self)
    }

    /// The full-attention batch.
    pub fn batch(&self) -> &PagedBatch {
        &self.batch
    }

    /// Slots of the new tokens in the full-attention caches, `(num_tokens,)` i64.
    pub fn slot_mapping(&self) -> &SlotMapping {
        &self.slot_mapping
    }

    /// Absolute position of each query row, `(num_tokens,)` u32.
    pub fn positions(&self) -> &Tensor {
        &self.positions
    }

    /// Host copy of [`positions`](Self::positions).
    pub fn positions_host(&self) -> &[u32] {
        &self.positions_host
    }

    /// The sliding-window groups, in the order they were added.
    pub fn window_groups(&self) -> &[WindowGroup] {
        &self.window_groups
    }

    /// The device every tensor lives on.
    pub fn device(&self) -> &Device {
        self.batch.device()
    }

    /// Query rows of the whole batch.
    pub fn num_tokens(&self) -> usize {
        self.batch.num_tokens()
    }

    /// Sequences in the batch.
    pub fn num_seqs(&self) -> usize {
        self.batch.num_seqs()
    }

    /// Sequences that run a prefill or a prefill chunk.
    pub fn num_prefills(&self) -> usize {
        self.num_prefills
    }

    /// Query rows of those prefills.
    pub fn num_prefill_tokens(&self) -> usize {
        self.num_prefill_tokens
    }

    /// Sequences that decode one token (after cached context).
    pub fn num_decodes(&self) -> usize {
        self.num_decodes
    }

    /// Query rows of those decodes (one each).
    pub fn num_decode_tokens(&self) -> usize {
        self.num_decodes
    }

    /// Longest query span of any sequence.
    pub fn max_seqlen_q(&self) -> usize {
        self.batch.host().max_seqlen_q()
    }

    /// Largest key count of any sequence.
    pub fn max_seqlen_k(&self) -> usize {
        self.batch.host().max_seqlen_k()
    }

    /// True when the batch is one prefill of one token with no context (the
    /// layer's attention output is then the value itself).
    pub fn is_single_token_prefill(&self) -> bool {
        let host = self.batch.host();
        host.num_seqs() == 1 && host.num_tokens() == 1 && host.seq_lens()[0] == 1
    }

    /// The batch and slots a layer reads: its window group's when the layer
    /// has a sliding window and the metadata carries a group for exactly that
    /// window, the full ones otherwise; remapped into chunked-local virtual
    /// sequences when `attention_chunk_size` is set.
    ///
    /// Prefix ranges are never dropped: window groups carry the batch's
    /// ranges (see [`Self::with_window_group`]), and a chunked-local remap
    /// moves each range into the virtual sequence of its chunk, or fails
    /// when a range that reaches a new token crosses a chunk boundary (a
    /// virtual sequence holds the keys of one chunk only). Ranges that end
    /// before a sequence's first new token affect no query and are left out.
    pub fn for_layer(
        &self,
        sliding_window: Option<usize>,
        attention_chunk_size: Option<usize>,
    ) -> Result<LayerBatch<'_>> {
        let windows = self.window_groups.iter().map(|g| g.window);
        let group = select_window_group(windows, sliding_window);
        let slot_mapping = match group {
            Some(g) => &self.window_groups[g].slot_mapping,
            None => &self.slot_mapping,
        };
        let batch = match attention_chunk_size {
            Some(chunk) => self.local_batch(group, chunk)?,
            None => self.group_batch(group).clone(),
        };
        Ok(LayerBatch {
            batch,
            slot_mapping,
        })
    }

    fn group_batch(&self, group: Option<usize>) -> &PagedBatch {
        match group {
            Some(g) => &self.window_groups[g].batch,
            None => &self.batch,
        }
    }

    /// The chunked-local virtual batch of the full tables (`group = None`)
    /// or of window group `group`, built once per chunk size and cached.
    pub fn local_batch(&self, group: Option<usize>, chunk: usize) -> Result<PagedBatch> {
        if let Some(g) = group {
            if g >= self.window_groups.len() {
                bail!(
                    "{OP}: window group {g} does not exist ({} groups)",
                    self.window_groups.len()
                );
            }
        }
        let Ok(mut cache) = self.local.lock() else {
            bail!("{OP}: the chunked-local remap cache lock is poisoned");
        };
        if let Some(b) = cache.get(&(group, chunk)) {
            return Ok(b.clone());
        }
        let source = self.group_batch(group);
        let host = source.host();
        let local = chunked_local_batches(
            host.cu_seqlens_q(),
            host.seq_lens(),
            host.block_tables(),
            host.block_table_width(),
            host.block_size(),
            chunk,
        )?;
        let mut batch = PagedBatch::new(
            &local.cu_seqlens_q,
            &local.seq_lens,
            &local.block_tables,
            local.width,
            host.block_size(),
            source.device(),
        )?;
        if !host.prefix_ranges().is_empty() {
            batch = batch.with_prefix_ranges(&local_prefix_ranges(host, &local, chunk)?)?;
        }
        cache.insert((group, chunk), batch.clone());
        Ok(batch)
    }
}

/// True when some sequence of `host` has a non-empty prefix range.
fn has_ranges(host: &BatchHost) -> bool {
    host.prefix_ranges()
        .iter()
        .flatten()
        .any(|r| r.start < r.end)
}

/// The prefix ranges of `host`'s sequences moved into the chunked-local
/// virtual sequences of `local`: a range lying in chunk `c` goes to the
/// virtual sequence of chunk `c`, shifted by the chunk's start. Ranges that
/// end before a sequence's first new token are left out (no query of this
/// batch lies in them); one that reaches a new token and crosses a chunk
/// boundary is an error.
fn local_prefix_ranges(
    host: &BatchHost,
    local: &LocalBatches,
    chunk: usize,
) -> Result<Vec<Vec<Range<u32>>>> {
    // Virtual sequences are in order of origin, then chunk: the first one of
    // each original sequence, and its first chunk, locate all the others.
    let mut first_virtual = vec![usize::MAX; host.num_seqs()];
    for (v, &o) in local.origin.iter().enumerate().rev() {
        if let Some(f) = first_virtual.get_mut(o as usize) {
            *f = v;
        }
    }
    let mut out = vec![Vec::new(); local.num_seqs()];
    for (i, ranges) in host.prefix_ranges().iter().enumerate() {
        let context = host.seq_lens()[i] as usize - host.q_len(i).unwrap_or(0);
        for r in ranges {
            let (start, end) = (r.start as usize, r.end as usize);
            if start >= end || end <= context {
                continue;
            }
            let c = start / chunk;
            if (end - 1) / chunk != c {
                bail!(
                    "{OP}: prefix range {start}..{end} of sequence {i} crosses a boundary of attention_chunk_size {chunk}; chunked-local layers need each range inside one chunk"
                );
            }
            // The virtual sequence of chunk c exists: the range holds a new
            // token, so c lies between the first and the last chunk the
            // sequence's new tokens touch.
            // The range holds a new token, so c is at least the chunk of the
            // first new token (the sequence's first virtual sequence).
            let v = c
                .checked_sub(context / chunk)
                .and_then(|d| first_virtual[i].checked_add(d))
                .filter(|&v| {
                    local.origin.get(v) == Some(&(i as u32))
                        && local.key_starts.get(v).map(|&k| k as usize) == Some(c * chunk)
                });
            let Some(v) = v else {
                bail!("{OP}: no chunked-local sequence holds chunk {c} of sequence {i}");
            };
            let shift = (c * chunk) as u32;
            out[v].push(r.start - shift..r.end - shift);
        }
    }
    Ok(out)
}

/// Rejects a prefix range that a window group cannot serve: one that reaches
/// a new token but starts in a block that falls out of the window before
/// this batch's first query of that sequence (the group may have recycled it).
fn check_ranges_in_window(window: usize, host: &BatchHost) -> Result<()> {
    let bs = host.block_size();
    for (i, ranges) in host.prefix_ranges().iter().enumerate() {
        let context = host.seq_lens()[i] as usize - host.q_len(i).unwrap_or(0);
        let first_kept = blocks_out_of_window(context, window, bs) * bs;
        for r in ranges {
            let (start, end) = (r.start as usize, r.end as usize);
            if start < end && end > context && start < first_kept {
                bail!(
                    "{OP}: prefix range {start}..{end} of sequence {i} reaches keys before position {first_kept}, whose blocks window group {window} may have recycled"
                );
            }
        }
    }
    Ok(())
}

/// Checks the slot count and device, and that every non-negative slot of
/// new token `j` of sequence `i` is the cache row attention reads position
/// `context_len_i + j` from through `batch`'s block table.
fn check_slots(name: &str, slots: &SlotMapping, batch: &PagedBatch) -> Result<()> {
    if slots.len() != batch.num_tokens() {
        bail!(
            "{OP}: {name} has {} slots but the batch has {} tokens",
            slots.len(),
            batch.num_tokens()
        );
    }
    if !slots.slots().device().same_device(batch.device()) {
        bail!("{OP}: {name} is on another device than the batch");
    }
    let host = batch.host();
    let bs = host.block_size();
    let slots = slots.host();
    for i in 0..host.num_seqs() {
        let first = host.cu_seqlens_q()[i] as usize;
        let q_len = host.q_len(i).unwrap_or(0);
        let context = host.seq_lens()[i] as usize - q_len;
        let table = host.block_table(i);
        for j in 0..q_len {
            let slot = slots[first + j];
            if slot < 0 {
                continue;
            }
            // Validation made the table wide enough for every position < seq_len.
            let pos = context + j;
            let block = table[pos / bs];
            let want = block as u128 * bs as u128 + (pos % bs) as u128;
            if slot as u128 != want {
                bail!(
                    "{OP}: {name}[{}] = {slot} but token {j} of sequence {i} (position {pos}) belongs in slot {want} (block_tables[{i}][{}] = {block}, row {})",
                    first + j,
                    pos / bs,
                    pos % bs
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metadata() -> AttentionMetadata {
        let dev = Device::Cpu;
        // A prefill of 3 tokens, a decode after 4 cached tokens, block size 2.
        let batch =
            PagedBatch::from_rows(&[0, 3, 4], &[3, 5], &[vec![0, 1], vec![2, 3, 4]], 2, &dev)
                .unwrap();
        let slots = SlotMapping::new(&[0, 1, 2, 8], &dev).unwrap();
        AttentionMetadata::new(batch, slots).unwrap()
    }

    #[test]
    fn counts_and_positions() {
        let m = metadata();
        assert_eq!(m.positions_host(), [0, 1, 2, 4]);
        assert_eq!(m.positions().to_vec1::<u32>().unwrap(), [0, 1, 2, 4]);
        assert_eq!((m.num_prefills(), m.num_prefill_tokens()), (1, 3));
        assert_eq!((m.num_decodes(), m.num_decode_tokens()), (1, 1));
        assert_eq!((m.max_seqlen_q(), m.max_seqlen_k()), (3, 5));
        assert!(!m.is_single_token_prefill());
    }

    /// [`metadata`] with a window group of window 4 (blocks 5-7, slots
    /// 10-14).
    fn with_group() -> AttentionMetadata {
        let dev = Device::Cpu;
        let group =
            PagedBatch::from_rows(&[0, 3, 4], &[3, 5], &[vec![5, 6], vec![0, 0, 7]], 2, &dev)
                .unwrap();
        let slots = SlotMapping::new(&[10, 11, 12, 14], &dev).unwrap();
        metadata().with_window_group(4, group, slots).unwrap()
    }

    #[test]
    fn pads_to_a_graph_shape_with_rows_kept() {
        let dev = Device::Cpu;
        let m = with_group().with_logit_rows(&[2, 3]).unwrap();
        // 2 -> 4 sequences, 4 -> 9 tokens, width 3 -> 4: the first padding
        // sequence takes the 5 padding tokens, the second none.
        let p = m.padded_to(4, 9, 4, &dev).unwrap();
        let host = p.batch().host();
        assert_eq!(host.cu_seqlens_q(), [0, 3, 4, 9, 9]);
        assert_eq!(host.seq_lens(), [3, 5, 5, 0]);
        assert_eq!(host.block_table_width(), 4);
        assert_eq!(host.block_table(1), [2, 3, 4, 0]);
        assert_eq!(p.slot_mapping().host(), [0, 1, 2, 8, -1, -1, -1, -1, -1]);
        assert_eq!(p.positions_host(), [0, 1, 2, 4, 0, 1, 2, 3, 4]);
        assert_eq!(
            p.window_groups()[0].slot_mapping().host()[..4],
            [10, 11, 12, 14]
        );
        assert_eq!(p.logit_rows().unwrap().0, [2, 3]);
        assert_eq!(p.logit_rows().unwrap().1.to_vec1::<u32>().unwrap(), [2, 3]);
        // Every tensor, the logit rows last; the same list for the same shape.
        let tensors = p.tensors();
        assert_eq!(tensors.len(), 10);
        assert_eq!(tensors[9].to_vec1::<u32>().unwrap(), [2, 3]);
        // No padding token: empty padding sequences.
        let e = m.padded_to(4, 4, 3, &dev).unwrap();
        assert_eq!(e.batch().host().cu_seqlens_q(), [0, 3, 4, 4, 4]);
        assert_eq!(e.batch().host().seq_lens(), [3, 5, 0, 0]);
        // `padded` still adds one token per sequence.
        let d = m.padded(4, 3, &dev).unwrap();
        assert_eq!(d.batch().host().cu_seqlens_q(), [0, 3, 4, 5, 6]);
        // Refused: extra tokens and no padding sequence, padding tokens past
        // their table, rows out of range.
        let err = m.padded_to(2, 6, 4, &dev).unwrap_err().to_string();
        assert!(
            err.contains("2 padding tokens but no padding sequence"),
            "{err}"
        );
        let err = m.padded_to(3, 14, 4, &dev).unwrap_err().to_string();
        assert!(err.contains("needs 5 blocks of 2"), "{err}");
        let err = metadata().with_logit_rows(&[4]).unwrap_err().to_string();
        assert!(
            err.contains("logit row 4 is out of range for 4 tokens"),
            "{err}"
        );
    }

    #[test]
    fn selects_groups_and_caches_remaps() {
        let m = with_group().with_local_chunks(&[2]).unwrap();
        assert_eq!(
            m.for_layer(Some(4), None).unwrap().slot_mapping.host(),
            [10, 11, 12, 14]
        );
        assert_eq!(
            m.for_layer(Some(8), None).unwrap().slot_mapping.host(),
            [0, 1, 2, 8]
        );
        assert_eq!(
            m.for_layer(None, None).unwrap().batch.host().block_tables(),
            [0, 1, 0, 2, 3, 4]
        );
        let local = m.for_layer(None, Some(2)).unwrap().batch;
        assert_eq!(local.host().seq_lens(), [2, 1, 1]);
        assert_eq!(local.host().block_tables(), [0, 1, 4]);
        assert_eq!(m.local.lock().unwrap().len(), 2);
        let windowed = m.for_layer(Some(4), Some(2)).unwrap().batch;
        assert_eq!(windowed.host().block_tables(), [5, 6, 7]);
    }

    #[test]
    fn rejects_malformed_groups() {
        let dev = Device::Cpu;
        let slots = SlotMapping::new(&[0, 1, 2], &dev).unwrap();
        let batch =
            PagedBatch::from_rows(&[0, 3, 4], &[3, 5], &[vec![0, 1], vec![2, 3, 4]], 2, &dev)
                .unwrap();
        let err = AttentionMetadata::new(batch, slots).unwrap_err();
        assert!(
            err.to_string()
                .contains("slot_mapping has 3 slots but the batch has 4 tokens"),
            "{err}"
        );

        let other =
            PagedBatch::from_rows(&[0, 2, 4], &[3, 5], &[vec![0, 1], vec![2, 3, 4]], 2, &dev)
                .unwrap();
        let slots = SlotMapping::new(&[0, 1, 2, 3], &dev).unwrap();
        let err = metadata().with_window_group(4, other, slots).unwrap_err();
        assert!(
            err.to_string()
                .contains("window group 4 has cu_seqlens_q [0, 2, 4]"),
            "{err}"
        );
        let err = metadata().with_local_chunks(&[3]).unwrap_err();
        assert!(
            err.to_string().contains("not a multiple of block_size 2"),
            "{err}"
        );
    }
}
