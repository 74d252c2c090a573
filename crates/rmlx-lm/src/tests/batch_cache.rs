//! The batched KV cache on its own: a sliding-window layer drops what no query can see any more,
//! keeping each row's RoPE offset and the last window of its keys, and its memory bounded.

use crate::cache::{BatchCache, RowKv, Stored};
use rmlx::{ops, Array, Dtype};

/// `[rows, 1, n, 1]` keys whose values are their positions (plus 1000 per row).
fn positions(rows: i32, start: i32, n: i32) -> Array {
    let v: Vec<f32> = (0..rows).flat_map(|r| (start..start + n).map(move |p| (p + 1000 * r) as f32)).collect();
    Array::from_slice(&v, &[rows, 1, n, 1]).unwrap()
}

fn values(a: &Array) -> Vec<f32> {
    a.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap()
}

#[test]
fn a_windowed_layer_drops_positions_out_of_every_window() {
    let mut c = BatchCache::new(2, Some(8));
    let k = positions(2, 0, 20);
    c.update(&k, &k).unwrap();
    let mut peak = 0;
    for p in 20..300 {
        let k = positions(2, p, 1);
        let (keys, _, _) = c.update(&k, &k).unwrap();
        let keys = keys.unpacked(Dtype::Float32).unwrap();
        peak = peak.max(c.width());
        // The last 8 positions are the last 8 keys returned, in both rows.
        let n = keys.shape()[2];
        let last = keys.slice_axis(2, n - 8, n, 1).unwrap();
        let want: Vec<f32> = (0..2).flat_map(|r| (p - 7..=p).map(move |q| (q + 1000 * r) as f32)).collect();
        assert_eq!(values(&last), want, "after position {p}");
    }
    assert_eq!(c.lengths(), vec![300, 300]);
    assert_eq!(c.offsets().unwrap().to_vec::<i32>().unwrap(), vec![300, 300]);
    // Without dropping, 300 columns; with it, fewer than the window and 64 waiting positions.
    assert!(peak < 8 + 64, "width reached {peak}");
    assert!(c.nbytes() <= 2 * 2 * 4 * BatchCache::held_bound(8, 1), "{} bytes", c.nbytes());
    // What a row gives the prompt cache: its last positions, saying where they start.
    let row = c.extract(1).unwrap().unwrap();
    assert_eq!(row.start + row.len(), 300);
    assert!(row.start > 0);
    let keys = row.keys.unpacked(Dtype::Float32).unwrap();
    assert_eq!(values(&keys.slice_axis(2, row.len() as i32 - 1, row.len() as i32, 1).unwrap()), vec![1299.0]);
    // A cache built again from it goes on at position 300.
    let again = BatchCache::from_prefix(&row, Some(8));
    assert_eq!(again.offsets().unwrap().to_vec::<i32>().unwrap(), vec![300]);
}

#[test]
fn a_prefix_that_dropped_positions_takes_only_the_columns_it_holds() {
    // Row 0 reuses positions 40..50 of a windowed layer (a batch 50 positions wide); row 1 has no
    // prefix and 6 positions of padding before its prompt.
    let held = ops::ones(&[1, 1, 10, 1], Dtype::Float32).unwrap();
    let prefix = RowKv { keys: Stored::Plain(held.clone()), values: Stored::Plain(held), start: 40 };
    let c = BatchCache::padded(vec![Some(prefix.clone()), None], vec![0, 56], 50, Some(8)).unwrap();
    assert_eq!(c.width(), 10);
    assert_eq!(c.lengths(), vec![50, 0]);
    assert_eq!(c.offsets().unwrap().to_vec::<i32>().unwrap(), vec![50, -6]);
    // The prefix must end where the row's computed positions begin.
    let wrong = BatchCache::padded(vec![Some(prefix), None], vec![1, 56], 50, Some(8));
    assert!(matches!(wrong, Err(crate::Error::InvalidParameter(_))));
}

/// Normal values of `shape` drawn with `seed`.
fn rand(shape: &[i32], seed: u64) -> Array {
    let key = rmlx::random::key(seed).unwrap();
    rmlx::random::normal(shape, Dtype::Float32, 0.0, 1.0, Some(&key)).unwrap()
}

/// Attention of `q: [rows, H, L, D]` over what `c.update` returns, with its mask.
fn attend(c: &mut BatchCache, k: &Array, q: &Array) -> Array {
    let (keys, values, mask) = c.update(k, k).unwrap();
    let (keys, values) = (keys.unpacked(Dtype::Float32).unwrap(), values.unpacked(Dtype::Float32).unwrap());
    crate::models::few_query_attention(q, &keys, &values, 1.0, &mask).unwrap()
}

#[test]
fn rows_trimmed_apart_attend_as_their_own_sequences() {
    // Two rows take 5 positions; row 0 keeps 2 of them and row 1 keeps 4 (speculative decoding's
    // rejected drafts), then both go on. Each row must then see exactly its own positions, as a
    // one-row cache that only ever held them does.
    let first = rand(&[2, 1, 5, 4], 0);
    let mut batch = BatchCache::new(2, Some(6));
    batch.update(&first, &first).unwrap();
    batch.trim_rows(&[3, 1]).unwrap();
    assert_eq!(batch.lengths(), vec![2, 4]);
    assert_eq!(batch.offsets().unwrap().to_vec::<i32>().unwrap(), vec![2, 4]);
    let kept = [2, 4];
    let mut alone: Vec<BatchCache> = (0..2)
        .map(|r| {
            let mut c = BatchCache::new(1, Some(6));
            let k = first.slice_axis(0, r, r + 1, 1).unwrap().slice_axis(2, 0, kept[r as usize], 1).unwrap();
            c.update(&k, &k).unwrap();
            c
        })
        .collect();
    // 60 updates of 1..4 positions, each row then taking back its own share of them: past 64
    // columns, the window drops what no row's queries see any more.
    let (mut lengths, mut dropped_columns) = (kept.map(|n| n as usize), false);
    for step in 0..60u64 {
        let len = 1 + (step % 4) as i32;
        let k = rand(&[2, 1, len, 4], 1 + step);
        let q = rand(&[2, 1, len, 4], 100 + step);
        let together = values(&attend(&mut batch, &k, &q));
        let mut apart = Vec::new();
        for (r, c) in alone.iter_mut().enumerate() {
            let row = |a: &Array| a.slice_axis(0, r as i32, r as i32 + 1, 1).unwrap();
            apart.extend(values(&attend(c, &row(&k), &row(&q))));
        }
        for (a, b) in together.iter().zip(&apart) {
            assert!((a - b).abs() < 1e-5, "step {step}: {a} != {b}");
        }
        let drop = [(step % 3) as usize % len as usize, ((step + 1) % 2) as usize % len as usize];
        batch.trim_rows(&drop).unwrap();
        for (r, c) in alone.iter_mut().enumerate() {
            c.trim_rows(&[drop[r]]).unwrap();
            lengths[r] += len as usize - drop[r];
        }
        dropped_columns |= batch.extract(0).unwrap().unwrap().start > 0;
    }
    assert!(dropped_columns, "the window never dropped a column");
    assert_eq!(batch.lengths(), lengths.to_vec());
    for (r, c) in alone.iter().enumerate() {
        let (a, b) = (batch.extract(r).unwrap().unwrap(), c.extract(0).unwrap().unwrap());
        assert_eq!(a.start + a.len(), b.start + b.len(), "row {r}");
        let tail = |kv: &RowKv| {
            let k = kv.keys.unpacked(Dtype::Float32).unwrap();
            let n = k.shape()[2];
            values(&k.slice_axis(2, n - 6, n, 1).unwrap())
        };
        assert_eq!(tail(&a), tail(&b), "row {r}");
    }
    // More than a row holds is refused.
    assert!(matches!(batch.trim_rows(&[0, 100]), Err(crate::Error::InvalidParameter(_))));
}

#[test]
fn rows_not_started_join_holding_nothing() {
    // Batch rows: an empty one, a started one (3 positions), then another empty one; all three then
    // attend over two new positions. The empty rows must see only those, as a fresh cache does,
    // and the started one its 3 + 2, as alone.
    let first = rand(&[1, 1, 3, 4], 0);
    let mut started = BatchCache::new(1, None);
    started.update(&first, &first).unwrap();
    let mut batch = BatchCache::new(1, None);
    batch.extend(started).unwrap();
    batch.extend(BatchCache::new(1, None)).unwrap();
    assert_eq!(batch.lengths(), vec![0, 3, 0]);
    let (k, q) = (rand(&[3, 1, 2, 4], 1), rand(&[3, 1, 2, 4], 2));
    let together = values(&attend(&mut batch, &k, &q));
    assert_eq!(batch.lengths(), vec![2, 5, 2]);
    assert_eq!(batch.offsets().unwrap().to_vec::<i32>().unwrap(), vec![2, 5, 2]);
    let row = |a: &Array, r: i32| a.slice_axis(0, r, r + 1, 1).unwrap();
    let mut apart = Vec::new();
    for r in 0..3 {
        let mut c = BatchCache::new(1, None);
        if r == 1 {
            c.update(&first, &first).unwrap();
        }
        apart.extend(values(&attend(&mut c, &row(&k, r), &row(&q, r))));
    }
    for (a, b) in together.iter().zip(&apart) {
        assert!((a - b).abs() < 1e-5, "{a} != {b}");
    }
}

#[test]
fn a_lone_sequence_is_handed_over_as_standard_caches() {
    use crate::cache::{with_lone_caches, KvCache};
    let started = |rows: i32, window: Option<usize>| {
        let mut c = BatchCache::new(rows as usize, window);
        let k = positions(rows, 0, 3);
        c.update(&k, &k).unwrap();
        KvCache::Batch(c)
    };
    // One row: a standard cache at its position, whose writes the batch then holds.
    let mut caches = vec![started(1, None), started(1, None)];
    let seen = with_lone_caches(&mut caches, |c| {
        c.iter_mut()
            .map(|c| match c {
                KvCache::Standard(s) => {
                    let k = positions(1, 3, 2);
                    s.write(&k, &k).unwrap();
                    s.offset
                }
                _ => 0,
            })
            .collect::<Vec<_>>()
    });
    assert_eq!(seen, vec![3 + 2, 3 + 2]);
    for c in &caches {
        let KvCache::Batch(b) = c else { panic!("handed back as a batch") };
        assert_eq!(b.lengths(), vec![5]);
        let row = b.extract(0).unwrap().unwrap();
        assert_eq!(values(&row.keys.unpacked(Dtype::Float32).unwrap()), vec![0.0, 1.0, 2.0, 3.0, 4.0]);
    }
    // Two rows, a window, or a window in one layer only: the batches as they are.
    for mut caches in [vec![started(2, None)], vec![started(1, Some(8))], vec![started(1, None), started(1, Some(8))]] {
        let batches = with_lone_caches(&mut caches, |c| c.iter().all(|c| matches!(c, KvCache::Batch(_))));
        assert!(batches);
    }
}
