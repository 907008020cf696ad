//! Pure functions over host index vectors that adapt one batch description to
//! one kind of layer: chunked local attention (Llama 4's `attention_chunk_size`)
//! and sliding-window groups.
//!
//! Nothing here touches a device; the metadata uploads the results once per
//! batch and every layer of that kind reuses them.
//!
//! A leaf: imports nothing from this crate.

use candle_core::{bail, Result};

/// A batch split into chunk-aligned virtual sequences (vLLM's
/// `make_local_attention_virtual_batches`), as host vectors.
///
/// Virtual sequence `v` owns query rows `cu_seqlens_q[v]..cu_seqlens_q[v + 1]`
/// (the rows keep their order, so the flat query is unchanged) and
/// `seq_lens[v]` keys: the keys of one attention chunk up to its last query,
/// starting at absolute position `key_starts[v]`. Its row of `block_tables`
/// lists the pages of that chunk: `width` entries, `chunk / block_size` or
/// the original table's width if that is smaller (a chunk larger than every
/// sequence needs no more pages than the sequences have).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalBatches {
    /// `num_virtual + 1` row offsets into the flat query.
    pub cu_seqlens_q: Vec<u32>,
    /// `num_virtual` key counts, each at most the chunk size.
    pub seq_lens: Vec<u32>,
    /// Row-major `num_virtual x width` block ids.
    pub block_tables: Vec<u32>,
    /// Columns of `block_tables`: pages per chunk, capped at the original width.
    pub width: usize,
    /// The original sequence of each virtual sequence.
    pub origin: Vec<u32>,
    /// Absolute position (in the original sequence) of each virtual
    /// sequence's first key: a multiple of the chunk size.
    pub key_starts: Vec<u32>,
}

impl LocalBatches {
    /// Number of virtual sequences.
    pub fn num_seqs(&self) -> usize {
        self.seq_lens.len()
    }

    /// Query rows of virtual sequence `v`.
    ///
    /// # Panics
    /// When `v >= num_seqs()`, as slice indexing does.
    pub fn q_len(&self, v: usize) -> usize {
        (self.cu_seqlens_q[v + 1] - self.cu_seqlens_q[v]) as usize
    }

    /// Block-table row of virtual sequence `v`.
    ///
    /// # Panics
    /// When `v >= num_seqs()`, as slice indexing does.
    pub fn block_table(&self, v: usize) -> &[u32] {
        &self.block_tables[v * self.width..(v + 1) * self.width]
    }
}

/// Splits every sequence of a batch into virtual sequences, one per
/// attention chunk its new tokens touch, so that plain causal attention over
/// the virtual batch equals chunked local attention over the original one: a
/// query at absolute position `p` sees keys in `[floor(p / chunk) * chunk, p]`.
///
/// This serves prefill, chunked prefill and decode alike (a decode is one
/// virtual sequence whose keys start at its chunk's first token).
///
/// # Arguments
/// * `cu_seqlens_q` - `num_seqs + 1` row offsets of the original batch,
///   starting at 0.
/// * `seq_lens` - `num_seqs` key counts (context + new tokens).
/// * `block_tables` - row-major `num_seqs x width` block ids; `width` is at
///   least `ceil(seq_len / block_size)` for every sequence.
/// * `width` - columns of `block_tables`.
/// * `block_size` - tokens per cache block; must divide `chunk`.
/// * `chunk` - the attention chunk size, at least 1.
///
/// Page indices past the end of an original row are clamped to its last
/// column, as vLLM does; those pages are never read. Unlike vLLM, a virtual
/// row is never wider than the original table (vLLM's columns past it would
/// only repeat the last one), so any chunk size, up to `usize::MAX`, costs
/// memory in proportion to the batch, not to the chunk.
pub fn chunked_local_batches(
    cu_seqlens_q: &[u32],
    seq_lens: &[u32],
    block_tables: &[u32],
    width: usize,
    block_size: usize,
    chunk: usize,
) -> Result<LocalBatches> {
    const OP: &str = "chunked-local-remap";
    if chunk == 0 || block_size == 0 {
        bail!("{OP}: attention_chunk_size and block_size must be positive, got {chunk} and {block_size}");
    }
    if !chunk.is_multiple_of(block_size) {
        bail!("{OP}: attention_chunk_size {chunk} is not a multiple of block_size {block_size}");
    }
    let num_seqs = seq_lens.len();
    if cu_seqlens_q.len() != num_seqs + 1 {
        bail!(
            "{OP}: cu_seqlens_q has {} entries but seq_lens has {num_seqs}",
            cu_seqlens_q.len()
        );
    }
    if cu_seqlens_q[0] != 0 {
        bail!(
            "{OP}: cu_seqlens_q must start at 0, got {} (row offsets into the flat query)",
            cu_seqlens_q[0]
        );
    }
    if block_tables.len() != num_seqs * width {
        bail!(
            "{OP}: block_tables holds {} ids but {num_seqs} sequences x width {width} need {}",
            block_tables.len(),
            num_seqs * width
        );
    }
    // Columns past the original width would repeat its last column.
    let pages = (chunk / block_size).min(width);
    let mut out = LocalBatches {
        cu_seqlens_q: vec![0],
        seq_lens: Vec::with_capacity(num_seqs),
        block_tables: Vec::with_capacity(num_seqs.saturating_mul(pages)),
        width: pages,
        origin: Vec::with_capacity(num_seqs),
        key_starts: Vec::with_capacity(num_seqs),
    };
    for i in 0..num_seqs {
        let (start, end) = (cu_seqlens_q[i] as usize, cu_seqlens_q[i + 1] as usize);
        let seq_len = seq_lens[i] as usize;
        if end < start || end - start > seq_len {
            bail!("{OP}: sequence {i} has rows {start}..{end} but seq_len {seq_len}");
        }
        let pages = seq_len.div_ceil(block_size);
        if pages > width {
            bail!(
                "{OP}: sequence {i} has seq_len {seq_len}, which needs {pages} blocks of {block_size} tokens, but block_tables has width {width}"
            );
        }
        let row = &block_tables[i * width..(i + 1) * width];
        let context = seq_len - (end - start);
        if end == start {
            // No query: one empty virtual sequence keeps the row count aligned.
            push_virtual(&mut out, i, end, 0..0, row, block_size);
            continue;
        }
        let first_chunk = context / chunk;
        let last_chunk = (seq_len - 1) / chunk;
        for c in first_chunk..=last_chunk {
            // c * chunk <= seq_len - 1, so neither bound overflows.
            let chunk_start = c * chunk;
            let chunk_end = chunk_start.saturating_add(chunk).min(seq_len);
            let q_end = start + (chunk_end - context);
            push_virtual(&mut out, i, q_end, chunk_start..chunk_end, row, block_size);
        }
    }
    Ok(out)
}

/// Appends virtual sequence number `seq`'s entry: rows up to `q_end`, the
/// keys `keys` (absolute positions below the sequence's `u32` seq_len, so
/// every cast is exact) and their pages from `row`.
fn push_virtual(
    out: &mut LocalBatches,
    seq: usize,
    q_end: usize,
    keys: std::ops::Range<usize>,
    row: &[u32],
    block_size: usize,
) {
    out.cu_seqlens_q.push(q_end as u32);
    out.seq_lens.push((keys.end - keys.start) as u32);
    out.origin.push(seq as u32);
    out.key_starts.push(keys.start as u32);
    let first_page = keys.start / block_size;
    let last = row.len().saturating_sub(1);
    out.block_tables
        .extend((0..out.width).map(|j| row.get((first_page + j).min(last)).copied().unwrap_or(0)));
}

/// Number of virtual sequences [`chunked_local_batches`] produces for one
/// sequence with `q_len` new tokens and `seq_len` keys.
pub fn num_local_batches(q_len: usize, seq_len: usize, chunk: usize) -> usize {
    if q_len == 0 || chunk == 0 || q_len > seq_len {
        return 1;
    }
    (seq_len - 1) / chunk - (seq_len - q_len) / chunk + 1
}

/// Leading blocks of a sequence that a sliding window of `window` tokens no
/// longer needs once every future query sits at position `context_len` or
/// later: blocks whose last token is before `context_len + 1 - window`.
pub fn blocks_out_of_window(context_len: usize, window: usize, block_size: usize) -> usize {
    if block_size == 0 {
        return 0;
    }
    (context_len + 1).saturating_sub(window) / block_size
}

/// The sliding-window group a layer reads: the group whose window equals the
/// layer's, or `None` (the full block tables and slot mapping) for a layer
/// without a window or when no group matches.
pub fn select_window_group(
    group_windows: impl IntoIterator<Item = usize>,
    layer_window: Option<usize>,
) -> Option<usize> {
    let w = layer_window?;
    group_windows.into_iter().position(|g| g == w)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An arange block table like vLLM's test helper: row `i` holds
    /// `i * width .. (i + 1) * width`, width `ceil(max seq_len / block_size)`.
    fn arange_tables(seq_lens: &[u32], block_size: usize) -> (Vec<u32>, usize) {
        let width = seq_lens
            .iter()
            .map(|&s| (s as usize).div_ceil(block_size))
            .max()
            .unwrap_or(0);
        ((0..(seq_lens.len() * width) as u32).collect(), width)
    }

    fn cu(q_lens: &[u32]) -> Vec<u32> {
        let mut cu = vec![0];
        for q in q_lens {
            cu.push(cu.last().unwrap() + q);
        }
        cu
    }

    fn q_lens(l: &LocalBatches) -> Vec<u32> {
        l.cu_seqlens_q.windows(2).map(|w| w[1] - w[0]).collect()
    }

    struct Case {
        q_lens: &'static [u32],
        seq_lens: &'static [u32],
        chunk: usize,
        block_size: usize,
        expected_q: &'static [u32],
        expected_k: &'static [u32],
        expected_tables: &'static [&'static [u32]],
    }

    // The expected tables of vLLM's tests/v1/attention/test_chunked_local_attention.py.
    const VLLM_CASES: &[Case] = &[
        Case {
            q_lens: &[4, 10, 5],
            seq_lens: &[6, 17, 9],
            chunk: 4,
            block_size: 2,
            expected_q: &[2, 2, 1, 4, 4, 1, 4, 1],
            expected_k: &[4, 2, 4, 4, 4, 1, 4, 1],
            expected_tables: &[
                &[0, 1],
                &[2, 3],
                &[11, 12],
                &[13, 14],
                &[15, 16],
                &[17, 17],
                &[20, 21],
                &[22, 23],
            ],
        },
        Case {
            q_lens: &[8],
            seq_lens: &[12],
            chunk: 4,
            block_size: 2,
            expected_q: &[4, 4],
            expected_k: &[4, 4],
            expected_tables: &[&[2, 3], &[4, 5]],
        },
        Case {
            q_lens: &[7],
            seq_lens: &[10],
            chunk: 4,
            block_size: 2,
            expected_q: &[1, 4, 2],
            expected_k: &[4, 4, 2],
            expected_tables: &[&[0, 1], &[2, 3], &[4, 4]],
        },
        Case {
            q_lens: &[4],
            seq_lens: &[6],
            chunk: 10,
            block_size: 2,
            expected_q: &[4],
            expected_k: &[6],
            expected_tables: &[&[0, 1, 2, 2, 2]],
        },
        Case {
            q_lens: &[6, 6],
            seq_lens: &[8, 8],
            chunk: 4,
            block_size: 4,
            expected_q: &[2, 4, 2, 4],
            expected_k: &[4, 4, 4, 4],
            expected_tables: &[&[0], &[1], &[2], &[3]],
        },
        Case {
            q_lens: &[1],
            seq_lens: &[5],
            chunk: 4,
            block_size: 2,
            expected_q: &[1],
            expected_k: &[1],
            expected_tables: &[&[2, 2]],
        },
    ];

    #[test]
    fn matches_vllm_expected_tables() {
        for (n, case) in VLLM_CASES.iter().enumerate() {
            let (tables, width) = arange_tables(case.seq_lens, case.block_size);
            let got = chunked_local_batches(
                &cu(case.q_lens),
                case.seq_lens,
                &tables,
                width,
                case.block_size,
                case.chunk,
            )
            .unwrap();
            assert_eq!(q_lens(&got), case.expected_q, "case {n}: q lens");
            assert_eq!(got.seq_lens, case.expected_k, "case {n}: k lens");
            // vLLM's rows are chunk / block_size wide; ours stop at the
            // original table's width, the columns past it only repeating
            // the last page (never read).
            assert_eq!(got.width, (case.chunk / case.block_size).min(width));
            let rows: Vec<&[u32]> = (0..got.num_seqs()).map(|v| got.block_table(v)).collect();
            let expected: Vec<&[u32]> = case
                .expected_tables
                .iter()
                .map(|row| {
                    let tail = &row[got.width..];
                    assert!(tail.iter().all(|&b| Some(&b) == row[..got.width].last()));
                    &row[..got.width]
                })
                .collect();
            assert_eq!(rows, expected, "case {n}: block tables");
            assert!(got.seq_lens.iter().all(|&k| k as usize <= case.chunk));
            assert!(q_lens(&got).iter().all(|&q| q as usize <= case.chunk));
            assert_eq!(
                *got.cu_seqlens_q.last().unwrap(),
                case.q_lens.iter().sum::<u32>()
            );
        }
    }

    #[test]
    fn matches_vllm_virtual_batch_counts() {
        let cases: &[(&[u32], &[u32], usize, usize)] = &[
            (&[1000], &[1000], 256, 4),
            (&[1000], &[1255], 256, 5),
            (&[300, 700, 90], &[300, 1400, 90], 128, 10),
            (&[64, 64], &[64, 64], 256, 2),
            (&[1, 1, 1, 1], &[16, 32, 48, 64], 16, 4),
        ];
        for &(q, s, chunk, expected) in cases {
            let (tables, width) = arange_tables(s, 16);
            let got = chunked_local_batches(&cu(q), s, &tables, width, 16, chunk).unwrap();
            assert_eq!(got.num_seqs(), expected, "q {q:?} seq {s:?} chunk {chunk}");
            let counted: usize = q
                .iter()
                .zip(s)
                .map(|(&q, &s)| num_local_batches(q as usize, s as usize, chunk))
                .sum();
            assert_eq!(counted, expected);
        }
    }

    /// vLLM's Triton `_chunked_decode_remap` misses this: 5 keys, chunk 4, the new token
    /// (position 4) sees only itself.
    #[test]
    fn decode_sees_its_own_chunk_only() {
        let got = chunked_local_batches(&[0, 1], &[5], &[7, 8, 9], 3, 2, 4).unwrap();
        assert_eq!(got.seq_lens, [1]);
        assert_eq!(got.block_table(0), [9, 9]);
        // With 8 keys the decode (position 7) sees keys 4..=7: table columns 2 and 3.
        let got = chunked_local_batches(&[0, 1], &[8], &[7, 8, 9, 6], 4, 2, 4).unwrap();
        assert_eq!(got.seq_lens, [4]);
        assert_eq!(got.block_table(0), [9, 6]);
    }

    /// Splitmix64: a tiny deterministic generator for the property test.
    fn next(state: &mut u64) -> u64 {
        *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Causal attention over the virtual batch reads exactly the keys the
    /// chunk mask allows, at the right cache slots, for random batches.
    #[test]
    fn virtual_batches_equal_chunk_mask() {
        let mut rng = 42u64;
        for _ in 0..300 {
            let block_size = [1usize, 2, 4][(next(&mut rng) % 3) as usize];
            let chunk = block_size * (1 + (next(&mut rng) % 4) as usize);
            let num_seqs = 1 + (next(&mut rng) % 4) as usize;
            let mut q_lens = Vec::new();
            let mut seq_lens = Vec::new();
            for _ in 0..num_seqs {
                let seq_len = (next(&mut rng) % 30) as u32;
                let q_len = if seq_len == 0 {
                    0
                } else {
                    1 + (next(&mut rng) % seq_len as u64) as u32
                };
                q_lens.push(q_len);
                seq_lens.push(seq_len);
            }
            let width = seq_lens
                .iter()
                .map(|&s| (s as usize).div_ceil(block_size))
                .max()
                .unwrap_or(0);
            let tables: Vec<u32> = (0..num_seqs * width)
                .map(|_| (next(&mut rng) % 1000) as u32)
                .collect();
            let cu_q = cu(&q_lens);
            let got =
                chunked_local_batches(&cu_q, &seq_lens, &tables, width, block_size, chunk).unwrap();
            assert_eq!(got.cu_seqlens_q.last(), cu_q.last());
            // Physical slots each flat query row sees, through the original
            // table and the chunk mask, and through the virtual batch.
            let mut expected = vec![Vec::new(); *cu_q.last().unwrap() as usize];
            for i in 0..num_seqs {
                let ctx = (seq_lens[i] - q_lens[i]) as usize;
                for j in 0..q_lens[i] as usize {
                    let p = ctx + j;
                    expected[cu_q[i] as usize + j] = (p / chunk * chunk..=p)
                        .map(|k| (tables[i * width + k / block_size], k % block_size))
                        .collect::<Vec<_>>();
                }
            }
            for v in 0..got.num_seqs() {
                let ctx = got.seq_lens[v] as usize - got.q_len(v);
                assert!(got.seq_lens[v] as usize <= chunk);
                for j in 0..got.q_len(v) {
                    let p = ctx + j;
                    let seen: Vec<_> = (0..=p)
                        .map(|k| (got.block_table(v)[k / block_size], k % block_size))
                        .collect();
                    assert_eq!(seen, expected[got.cu_seqlens_q[v] as usize + j]);
                }
            }
        }
    }

    #[test]
    fn rejects_bad_arguments() {
        let err = chunked_local_batches(&[0, 1], &[5], &[0, 1, 2], 3, 4, 6).unwrap_err();
        assert!(
            err.to_string()
                .contains("attention_chunk_size 6 is not a multiple of block_size 4"),
            "{err}"
        );
        let err = chunked_local_batches(&[0, 3], &[2], &[0], 1, 2, 4).unwrap_err();
        assert!(
            err.to_string()
                .contains("sequence 0 has rows 0..3 but seq_len 2"),
            "{err}"
        );
        assert!(chunked_local_batches(&[0], &[5], &[], 0, 2, 4).is_err());
        let err = chunked_local_batches(&[2, 3], &[5], &[0, 1, 2], 3, 2, 4).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("chunked-local-remap: cu_seqlens_q must start at 0, got 2"),
            "{err}"
        );
        // 5 keys in blocks of 2 need 3 columns; the table has 2.
        let err = chunked_local_batches(&[0, 1], &[5], &[0, 1], 2, 2, 4).unwrap_err();
        assert!(
            err.to_string().starts_with(
                "chunked-local-remap: sequence 0 has seq_len 5, which needs 3 blocks of 2 tokens, but block_tables has width 2"
            ),
            "{err}"
        );
        // Exactly wide enough is fine, and so is a row wider than needed.
        assert!(chunked_local_batches(&[0, 1], &[5], &[0, 1, 2], 3, 2, 4).is_ok());
        assert!(chunked_local_batches(&[0, 1, 2], &[4, 1], &[0, 1, 2, 3], 2, 2, 4).is_ok());
    }

    #[test]
    fn window_helpers() {
        // Window 4, block 2: a query at 5 needs keys 2..=5, so block 0 (keys 0, 1) can go.
        assert_eq!(blocks_out_of_window(5, 4, 2), 1);
        assert_eq!(blocks_out_of_window(2, 4, 2), 0);
        assert_eq!(blocks_out_of_window(10, 1, 4), 2);
        assert_eq!(select_window_group([512, 4096], Some(4096)), Some(1));
        assert_eq!(select_window_group([512], Some(128)), None);
        assert_eq!(select_window_group([512], None), None);
    }
}
