//! Block manager bookkeeping: admission, allocation, prefix sharing,
//! sliding-window recycling and clean refusals. Each body takes the device
//! its metadata tensors are built on and runs through the shared harness
//! (`device_test!`): `NAME::cpu`, and `NAME::cuda` with the `cuda` feature.

#[macro_use]
mod common;

use anyhow::{ensure, Result};
use candle_core::Device;
use candle_paged_attention::{BlockManager, BlockManagerConfig, Work};

fn prefill(seq_id: u64, num_tokens: usize) -> Work {
    Work::Prefill { seq_id, num_tokens }
}

fn decode(seq_id: u64, token: u32) -> Work {
    Work::Decode { seq_id, token }
}

fn err_of<T: std::fmt::Debug>(r: candle_core::Result<T>) -> String {
    r.err()
        .map(|e| e.to_string())
        .unwrap_or_else(|| "no error".into())
}

fn metadata_tables_and_slots(dev: &Device) -> Result<()> {
    let mut mgr = BlockManager::new(BlockManagerConfig::new(4, 16))?;
    ensure!(mgr.add_sequence(1, &[10, 11, 12, 13, 14, 15])? == 0);
    mgr.add_sequence(2, &[20, 21])?;
    let b = mgr.schedule(&[prefill(1, 5), prefill(2, 2)], dev)?;
    ensure!(b.token_ids == [10, 11, 12, 13, 14, 20, 21]);
    ensure!(b.seq_ids == [1, 2] && b.last_rows == [4, 6] && b.ready == [false, true]);
    let host = b.metadata.batch().host();
    ensure!(host.cu_seqlens_q() == [0, 5, 7] && host.seq_lens() == [5, 2]);
    ensure!(
        host.block_tables() == [0, 1, 2, 0],
        "{:?}",
        host.block_tables()
    );
    ensure!(b.metadata.slot_mapping().host() == [0, 1, 2, 3, 4, 8, 9]);
    ensure!(b.metadata.positions_host() == [0, 1, 2, 3, 4, 0, 1]);
    // The rest of the prompt with a decode in the same batch.
    let b = mgr.schedule(&[decode(2, 22), prefill(1, 1)], dev)?;
    ensure!(b.token_ids == [22, 15] && b.ready == [true, true]);
    ensure!(b.metadata.slot_mapping().host() == [10, 5]);
    ensure!(b.metadata.positions_host() == [2, 5]);
    // Like vLLM, the metadata counts any one-token step after context as a
    // decode, the last prompt token of a chunked prefill included.
    ensure!((b.metadata.num_decodes(), b.metadata.num_prefills()) == (2, 0));
    ensure!(mgr.tokens(2) == Some(&[20, 21, 22][..]));
    ensure!(mgr.num_free_blocks() == 13);
    mgr.free(1)?;
    mgr.free(2)?;
    ensure!(mgr.num_free_blocks() == 16 && mgr.num_sequences() == 0);
    Ok(())
}

fn refuses_bad_requests(dev: &Device) -> Result<()> {
    let mut mgr = BlockManager::new(BlockManagerConfig::new(4, 8))?;
    mgr.add_sequence(1, &[1, 2, 3])?;
    let checks = [
        (
            err_of(mgr.add_sequence(1, &[1])),
            "block-manager: sequence 1 is already admitted",
        ),
        (
            err_of(mgr.add_sequence(2, &[])),
            "block-manager: sequence 2 has an empty prompt",
        ),
        (err_of(mgr.schedule(&[], dev)), "nothing to schedule"),
        (
            err_of(mgr.schedule(&[prefill(9, 1)], dev)),
            "block-manager: sequence 9 is not admitted",
        ),
        (
            err_of(mgr.schedule(&[prefill(1, 4)], dev)),
            "sequence 1 asks to prefill 4 tokens but 3 prompt tokens are left",
        ),
        (
            err_of(mgr.schedule(&[prefill(1, 0)], dev)),
            "asks to prefill 0 tokens",
        ),
        (
            err_of(mgr.schedule(&[decode(1, 5)], dev)),
            "sequence 1 cannot decode: 3 prompt tokens are not prefilled yet",
        ),
        (
            err_of(mgr.schedule(&[prefill(1, 1), prefill(1, 1)], dev)),
            "sequence 1 is scheduled twice",
        ),
        (
            err_of(mgr.free(4)),
            "cannot free sequence 4: it is not admitted",
        ),
    ];
    for (got, want) in checks {
        ensure!(got.contains(want), "expected {want:?}, got {got:?}");
    }
    ensure!(mgr.num_computed(1) == Some(0) && mgr.num_free_blocks() == 8);
    let bad_configs = [
        (
            BlockManagerConfig::new(0, 8),
            "block_size and num_blocks must be positive",
        ),
        (
            BlockManagerConfig::new(4, 8).with_window_group(0, 4),
            "window group needs window >= 1",
        ),
        (
            BlockManagerConfig::new(4, 8)
                .with_window_group(3, 4)
                .with_window_group(3, 2),
            "two window groups have window 3",
        ),
        (
            BlockManagerConfig::new(4, 8)
                .with_prefix_caching(true)
                .with_window_group(3, 4),
            "prefix caching with sliding-window groups is not supported",
        ),
    ];
    for (config, want) in bad_configs {
        let got = err_of(BlockManager::new(config));
        ensure!(got.contains(want), "expected {want:?}, got {got:?}");
    }
    Ok(())
}

fn out_of_blocks_leaves_state_unchanged(dev: &Device) -> Result<()> {
    let mut mgr = BlockManager::new(BlockManagerConfig::new(2, 5))?;
    mgr.add_sequence(7, &[0; 9])?;
    mgr.add_sequence(8, &[0; 3])?;
    mgr.schedule(&[prefill(8, 3)], dev)?;
    let got = err_of(mgr.schedule(&[prefill(7, 9)], dev));
    ensure!(
        got.contains("block-manager: sequence 7 needs 5 more blocks but 3 are free"),
        "{got}"
    );
    ensure!(mgr.num_free_blocks() == 3 && mgr.num_computed(7) == Some(0));
    ensure!(mgr.block_table(7) == Some(&[][..]));
    // A chunk that fits goes through; the rest waits for blocks.
    mgr.schedule(&[prefill(7, 6)], dev)?;
    let got = err_of(mgr.schedule(&[prefill(7, 3)], dev));
    ensure!(
        got.contains("sequence 7 needs 2 more blocks but 0 are free"),
        "{got}"
    );
    mgr.free(8)?;
    mgr.schedule(&[prefill(7, 3)], dev)?;
    ensure!(mgr.num_free_blocks() == 0);
    Ok(())
}

fn prefix_blocks_are_shared_and_freed_when_unused(dev: &Device) -> Result<()> {
    let mut mgr = BlockManager::new(BlockManagerConfig::new(4, 12).with_prefix_caching(true))?;
    let a: Vec<u32> = (0..10).collect();
    mgr.add_sequence(1, &a)?;
    mgr.schedule(&[prefill(1, 10)], dev)?;
    let table_a = mgr.block_table(1).unwrap().to_vec();
    ensure!(
        mgr.num_cached_blocks() == 2,
        "the two full blocks are registered"
    );

    // Same first 8 tokens: two blocks shared, computation starts at 8.
    let mut b = a[..8].to_vec();
    b.extend([90, 91, 92]);
    ensure!(mgr.add_sequence(2, &b)? == 8);
    ensure!(mgr.block_table(2) == Some(&table_a[..2]));
    ensure!(mgr.block_ref_count(table_a[0]) == 2 && mgr.block_ref_count(table_a[2]) == 1);
    let batch = mgr.schedule(&[prefill(2, 3)], dev)?;
    ensure!(batch.metadata.positions_host() == [8, 9, 10]);
    ensure!(batch.metadata.batch().host().seq_lens() == [11]);
    ensure!(mgr.num_free_blocks() == 12 - 3 - 1);

    // Freeing one user keeps shared blocks in use.
    mgr.free(1)?;
    ensure!(mgr.block_ref_count(table_a[0]) == 1 && mgr.block_ref_count(table_a[2]) == 0);
    ensure!(mgr.num_cached_unused_blocks() == 0);
    mgr.free(2)?;
    ensure!(mgr.num_cached_unused_blocks() == 2 && mgr.num_free_blocks() == 12);

    // A later sequence takes the cached blocks back. The last prompt token is
    // always computed, so an 8-token prompt reuses only one block.
    ensure!(mgr.add_sequence(3, &a)? == 8);
    ensure!(mgr.block_table(3) == Some(&table_a[..2]));
    ensure!(mgr.add_sequence(4, &a[..8])? == 4);
    ensure!(mgr.block_ref_count(table_a[0]) == 2);
    // A different first block shares nothing, even with equal later blocks.
    let mut c = a.clone();
    c[0] = 77;
    ensure!(mgr.add_sequence(5, &c)? == 0);
    for id in [3, 4, 5] {
        mgr.free(id)?;
    }

    // Unused cached blocks are handed out (oldest first) when the free list
    // runs dry, and their prefixes are forgotten.
    mgr.add_sequence(6, &[5; 48])?;
    mgr.schedule(&[prefill(6, 48)], dev)?;
    ensure!(mgr.num_free_blocks() == 0 && mgr.num_cached_unused_blocks() == 0);
    mgr.free(6)?;
    ensure!(mgr.add_sequence(7, &a)? == 0);
    Ok(())
}

fn decoded_blocks_are_cached_too(dev: &Device) -> Result<()> {
    let mut mgr = BlockManager::new(BlockManagerConfig::new(2, 8).with_prefix_caching(true))?;
    mgr.add_sequence(1, &[1, 2, 3])?;
    mgr.schedule(&[prefill(1, 3)], dev)?;
    mgr.schedule(&[decode(1, 4)], dev)?;
    mgr.schedule(&[decode(1, 5)], dev)?;
    ensure!(mgr.num_cached_blocks() == 2);
    mgr.free(1)?;
    ensure!(mgr.add_sequence(2, &[1, 2, 3, 4, 5])? == 4);
    Ok(())
}

fn window_blocks_are_recycled(dev: &Device) -> Result<()> {
    // Window 4, blocks of 2: a query at position p needs keys p-3..=p.
    let mut mgr = BlockManager::new(BlockManagerConfig::new(2, 32).with_window_group(4, 4))?;
    mgr.add_sequence(1, &[0; 10])?;
    mgr.schedule(&[prefill(1, 6)], dev)?;
    ensure!(mgr.num_free_window_blocks(0) == Some(1));
    // Next queries start at 6 and need keys from 3: block 0 (keys 0, 1) goes.
    let b = mgr.schedule(&[prefill(1, 2)], dev)?;
    let table = mgr.window_block_table(1, 0).unwrap().to_vec();
    ensure!(
        table[0].is_none() && table[1..].iter().all(Option::is_some),
        "{table:?}"
    );
    ensure!(mgr.num_free_window_blocks(0) == Some(1));
    // The group's batch has the same lengths, its own block ids, and
    // block 0 where a block was recycled.
    let group = &b.metadata.window_groups()[0];
    ensure!(group.window() == 4);
    ensure!(group.batch().host().seq_lens() == b.metadata.batch().host().seq_lens());
    let expected: Vec<u32> = table.iter().map(|b| b.unwrap_or(0)).collect();
    ensure!(group.batch().host().block_tables() == expected);
    let s = table[3].unwrap() as i64 * 2;
    ensure!(group.slot_mapping().host() == [s, s + 1]);
    // A long decode never needs more than 3 group blocks.
    mgr.schedule(&[prefill(1, 2)], dev)?;
    for t in 0..40 {
        mgr.schedule(&[decode(1, t)], dev)?;
        let live = mgr
            .window_block_table(1, 0)
            .unwrap()
            .iter()
            .flatten()
            .count();
        ensure!(live <= 3, "step {t}: {live} live group blocks");
    }
    ensure!(mgr.block_table(1).unwrap().len() == 25);
    mgr.free(1)?;
    ensure!(mgr.num_free_window_blocks(0) == Some(4) && mgr.num_free_blocks() == 32);
    let got = err_of({
        mgr.add_sequence(2, &[0; 12])?;
        mgr.schedule(&[prefill(2, 12)], dev)
    });
    ensure!(
        got.contains("sequence 2 needs 6 more blocks but 4 are free in the window-4 pool"),
        "{got}"
    );
    Ok(())
}

fn rollback_restores_the_state_exactly(dev: &Device) -> Result<()> {
    let mut mgr = BlockManager::new(BlockManagerConfig::new(2, 8))?;
    mgr.add_sequence(1, &[1, 2, 3])?;
    mgr.add_sequence(2, &[7, 8, 9, 10, 11])?;
    mgr.schedule(&[prefill(1, 3), prefill(2, 2)], dev)?;
    mgr.schedule(&[decode(1, 4), prefill(2, 1)], dev)?;
    let snapshot = |m: &BlockManager| {
        (
            m.tokens(1).map(<[u32]>::to_vec),
            m.num_computed(1),
            m.block_table(1).map(<[u32]>::to_vec),
            m.tokens(2).map(<[u32]>::to_vec),
            m.num_computed(2),
            m.block_table(2).map(<[u32]>::to_vec),
            m.num_free_blocks(),
        )
    };
    let before = snapshot(&mgr);
    ensure!(before.6 == 4, "{before:?}");
    // A decode that opens a block and a prefill chunk that opens another.
    let batch = mgr.schedule(&[decode(1, 5), prefill(2, 2)], dev)?;
    ensure!(batch.token_ids == [5, 10, 11]);
    ensure!(batch.metadata.positions_host() == [4, 3, 4]);
    ensure!(mgr.num_free_blocks() == 2 && mgr.num_computed(2) == Some(5));
    mgr.rollback(batch)?;
    ensure!(
        snapshot(&mgr) == before,
        "{:?} != {before:?}",
        snapshot(&mgr)
    );
    // The retry computes the same positions with the same tokens.
    let retry = mgr.schedule(&[decode(1, 5), prefill(2, 2)], dev)?;
    ensure!(retry.token_ids == [5, 10, 11]);
    ensure!(retry.metadata.positions_host() == [4, 3, 4]);
    ensure!(retry.metadata.batch().host().seq_lens() == [5, 5]);
    ensure!(mgr.tokens(1) == Some(&[1, 2, 3, 4, 5][..]));
    // Only the last batch, before any other change, can be rolled back.
    let next = mgr.schedule(&[decode(1, 6)], dev)?;
    let got = err_of(mgr.rollback(retry));
    ensure!(
        got.contains(
            "block-manager: batch 4 cannot be rolled back: only the last scheduled batch can be"
        ),
        "{got}"
    );
    mgr.free(2)?;
    let got = err_of(mgr.rollback(next));
    ensure!(got.contains("batch 5 cannot be rolled back"), "{got}");
    ensure!(mgr.tokens(1) == Some(&[1, 2, 3, 4, 5, 6][..]));
    mgr.free(1)?;
    ensure!(mgr.num_free_blocks() == 8 && mgr.num_sequences() == 0);
    Ok(())
}

fn rolled_back_prefix_blocks_are_not_shared(dev: &Device) -> Result<()> {
    let mut mgr = BlockManager::new(BlockManagerConfig::new(4, 12).with_prefix_caching(true))?;
    let prompt: Vec<u32> = (0..6).collect();
    mgr.add_sequence(1, &prompt)?;
    mgr.schedule(&[prefill(1, 6)], dev)?;
    mgr.schedule(&[decode(1, 6)], dev)?;
    // This decode fills block 1 (tokens 4..8) and registers it; its forward
    // pass fails, so the block's content is incomplete.
    let batch = mgr.schedule(&[decode(1, 7)], dev)?;
    ensure!(mgr.num_cached_blocks() == 2);
    mgr.rollback(batch)?;
    let shared: Vec<u32> = (0..9).collect();
    ensure!(
        mgr.add_sequence(2, &shared)? == 4,
        "only the complete block 0 is shared"
    );
    mgr.free(2)?;
    // The retry computes the block again: then it is shared.
    mgr.schedule(&[decode(1, 7)], dev)?;
    ensure!(mgr.add_sequence(3, &shared)? == 8);
    // A prefill that is rolled back entirely shares nothing either.
    let other: Vec<u32> = (100..110).collect();
    mgr.add_sequence(4, &other)?;
    let batch = mgr.schedule(&[prefill(4, 10)], dev)?;
    mgr.rollback(batch)?;
    ensure!(mgr.num_computed(4) == Some(0) && mgr.block_table(4) == Some(&[][..]));
    ensure!(mgr.add_sequence(5, &other)? == 0);
    for id in [1, 3, 4, 5] {
        mgr.free(id)?;
    }
    ensure!(mgr.num_free_blocks() == 12);
    Ok(())
}

fn prefix_blocks_are_taken_when_scheduled(dev: &Device) -> Result<()> {
    let mut mgr = BlockManager::new(BlockManagerConfig::new(4, 12).with_prefix_caching(true))?;
    let a: Vec<u32> = (0..10).collect();
    let mut b = a[..9].to_vec();
    b.push(50);
    // Admitted together: nothing is cached yet.
    ensure!(mgr.add_sequence(1, &a)? == 0 && mgr.add_sequence(2, &b)? == 0);
    ensure!(mgr.cached_prefix_len(2) == 0);
    // Sequence 1 computes blocks 0 and 1 in this batch; sequence 2 takes
    // them (one forward pass stores them before any query attends) and
    // computes its last two tokens only, though it asked for up to 10.
    ensure!(mgr.shortfall(&[prefill(1, 10), prefill(2, 10)])?.is_none());
    let batch = mgr.schedule(&[prefill(1, 10), prefill(2, 10)], dev)?;
    ensure!(batch.prefix_hits == [0, 8], "{:?}", batch.prefix_hits);
    ensure!(batch.metadata.positions_host() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 8, 9]);
    ensure!(batch.token_ids[10..] == [8, 50] && batch.ready == [true, true]);
    let (ta, tb) = (
        mgr.block_table(1).unwrap().to_vec(),
        mgr.block_table(2).unwrap().to_vec(),
    );
    ensure!(ta[..2] == tb[..2] && ta[2] != tb[2], "{ta:?} {tb:?}");
    ensure!(mgr.block_ref_count(ta[0]) == 2 && mgr.num_used_blocks() == 4);
    ensure!(mgr.prefix_cache_hit_tokens() == 8 && mgr.peak_used_blocks() == 4);
    // A failed forward pass: both are undone, and the registered blocks are
    // forgotten (their content may be incomplete).
    mgr.rollback(batch)?;
    ensure!(mgr.num_computed(1) == Some(0) && mgr.num_computed(2) == Some(0));
    ensure!(mgr.block_table(2) == Some(&[][..]) && mgr.num_used_blocks() == 0);
    ensure!(mgr.num_cached_blocks() == 0 && mgr.num_free_blocks() == 12);
    ensure!(mgr.prefix_cache_hit_tokens() == 0 && mgr.peak_used_blocks() == 0);
    // The retry computes them; a later batch takes them from the cache, and
    // the hits count when that batch is scheduled.
    mgr.schedule(&[prefill(1, 10)], dev)?;
    ensure!(mgr.cached_prefix_len(2) == 8 && mgr.prefix_cache_hit_tokens() == 0);
    ensure!(mgr.shared_prefix_blocks(&b) == 2 && mgr.shared_prefix_blocks(&a[..5]) == 1);
    let batch = mgr.schedule(&[prefill(2, 2)], dev)?;
    ensure!(batch.prefix_hits == [8] && batch.metadata.positions_host() == [8, 9]);
    ensure!(mgr.prefix_cache_hit_tokens() == 8);
    // Admission hits count with the sequence's first batch.
    ensure!(mgr.add_sequence(3, &a)? == 8);
    ensure!(mgr.prefix_cache_hit_tokens() == 8);
    mgr.schedule(&[prefill(3, 2)], dev)?;
    ensure!(mgr.prefix_cache_hit_tokens() == 16);
    for id in [1, 2, 3] {
        mgr.free(id)?;
    }
    ensure!(mgr.num_used_blocks() == 0 && mgr.peak_used_blocks() == 5);
    // Unused cached blocks a batch takes leave the pool's available blocks:
    // sequence 4 is admitted before its prefix is cached, then takes two
    // unused cached blocks when it is scheduled.
    let c: Vec<u32> = (20..30).collect();
    mgr.add_sequence(4, &c)?;
    mgr.add_sequence(6, &c)?;
    mgr.schedule(&[prefill(6, 10)], dev)?;
    mgr.free(6)?;
    mgr.add_sequence(5, &[9; 40])?;
    ensure!(mgr.num_free_blocks() == 12 && mgr.num_cached_unused_blocks() == 4);
    let why = mgr.shortfall(&[prefill(4, 10), prefill(5, 40)])?;
    ensure!(
        why.as_deref()
            == Some("block-manager: sequence 5 needs 10 more blocks but 9 are free in the full-attention pool (10 of 12 blocks free before this batch)"),
        "{why:?}"
    );
    let got = err_of(mgr.schedule(&[prefill(4, 10), prefill(5, 40)], dev));
    ensure!(got.starts_with(why.as_deref().unwrap_or("-")), "{got}");
    ensure!(mgr.num_free_blocks() == 12 && mgr.num_cached_unused_blocks() == 4);
    let batch = mgr.schedule(&[prefill(4, 10), prefill(5, 36)], dev)?;
    ensure!(batch.prefix_hits == [8, 0] && mgr.num_free_blocks() == 0);
    Ok(())
}

fn shortfall_predicts_schedule(dev: &Device) -> Result<()> {
    let mut mgr = BlockManager::new(BlockManagerConfig::new(2, 5))?;
    mgr.add_sequence(7, &[0; 9])?;
    mgr.add_sequence(8, &[0; 3])?;
    mgr.schedule(&[prefill(8, 3)], dev)?;
    let why = mgr.shortfall(&[prefill(7, 9)])?;
    let got = err_of(mgr.schedule(&[prefill(7, 9)], dev));
    ensure!(
        why.as_deref()
            == Some("block-manager: sequence 7 needs 5 more blocks but 3 are free in the full-attention pool (3 of 5 blocks free before this batch)"),
        "{why:?}"
    );
    ensure!(got.starts_with(why.as_deref().unwrap_or("-")), "{got}");
    ensure!(mgr.shortfall(&[prefill(7, 6), decode(8, 1)])?.is_none());
    ensure!(err_of(mgr.shortfall(&[prefill(9, 1)])).contains("sequence 9 is not admitted"));
    // Window pools count the blocks that fall out of the window first.
    let mut mgr = BlockManager::new(BlockManagerConfig::new(2, 32).with_window_group(4, 3))?;
    mgr.add_sequence(1, &[0; 8])?;
    mgr.schedule(&[prefill(1, 6)], dev)?;
    ensure!(mgr.num_free_window_blocks(0) == Some(0));
    ensure!(mgr.shortfall(&[prefill(1, 2)])?.is_none());
    mgr.schedule(&[prefill(1, 2)], dev)?;
    ensure!(mgr.num_free_window_blocks(0) == Some(0));
    let why = mgr.shortfall(&[decode(1, 1)])?;
    ensure!(why.is_none(), "{why:?}");
    Ok(())
}

fn refuses_absurd_sizes_before_allocating(_dev: &Device) -> Result<()> {
    let checks = [
        (
            BlockManagerConfig::new(16, u32::MAX as usize),
            "block-manager: 4294967295 blocks would take 171798691800 bytes of bookkeeping (40 bytes per block), more than the 4294967296 bytes allowed",
        ),
        (
            BlockManagerConfig::new(16, 1 << 20).with_window_group(8, u32::MAX as usize),
            "block-manager: 4296015871 blocks would take 171840634840 bytes of bookkeeping",
        ),
        (
            BlockManagerConfig::new(1 << 60, 16),
            "block-manager: the full-attention pool's 16 blocks of 1152921504606846976 tokens have more slots than an i64 can index",
        ),
        (
            BlockManagerConfig::new(usize::MAX, 2),
            "have more slots than an i64 can index",
        ),
    ];
    for (config, want) in checks {
        let got = err_of(BlockManager::new(config));
        ensure!(got.contains(want), "expected {want:?}, got {got:?}");
    }
    // The largest pool allowed is built.
    let mgr = BlockManager::new(BlockManagerConfig::new(16, 1 << 20))?;
    ensure!(mgr.num_free_blocks() == 1 << 20);
    Ok(())
}

device_test!(
    metadata_tables_and_slots,
    refuses_bad_requests,
    out_of_blocks_leaves_state_unchanged,
    prefix_blocks_are_shared_and_freed_when_unused,
    decoded_blocks_are_cached_too,
    window_blocks_are_recycled,
    rollback_restores_the_state_exactly,
    rolled_back_prefix_blocks_are_not_shared,
    prefix_blocks_are_taken_when_scheduled,
    shortfall_predicts_schedule,
    refuses_absurd_sizes_before_allocating,
);
