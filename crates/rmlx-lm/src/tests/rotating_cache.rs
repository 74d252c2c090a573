//! The rotating cache's layout: after any mix of prompts (several positions at once) and single
//! positions, position `p` sits in slot `Ring::slot(p)` once a single position is written, which
//! the CUDA attention kernel and the captured decoding step rely on (they compute the slot from
//! the position), and the positions visible are exactly the window's.

use crate::cache::{KvCache, Ring};
use rmlx::{Array, Device};

/// Keys and values `[1, 1, len, 1]` holding their own positions `start..start + len`.
fn positions(start: usize, len: usize) -> Array {
    let v: Vec<f32> = (start..start + len).map(|p| p as f32).collect();
    Array::from_slice(&v, &[1, 1, len as i32, 1]).unwrap()
}

#[test]
fn single_positions_sit_in_their_ring_slots_after_any_prompt() {
    rmlx::with_device(Device::cpu(), || {
        // (window, keep, prompt lengths between runs of single positions)
        for (window, keep) in [(8usize, 0usize), (8, 2), (5, 4), (1, 0), (16, 3)] {
            for prompts in [&[3usize, 9, 1, 20][..], &[8, 8], &[1, 30, 2], &[12]] {
                let mut cache = KvCache::rotating(window, keep);
                let ring = Ring { window, keep };
                let mut offset = 0;
                for (round, &prompt) in prompts.iter().enumerate() {
                    let what = format!("window {window}, keep {keep}, prompts {prompts:?}, round {round}");
                    let x = positions(offset, prompt);
                    cache.update(&x, &x).unwrap();
                    offset += prompt;
                    for _ in 0..(2 * window + 3) {
                        let x = positions(offset, 1);
                        let (keys, values, _) = cache.update(&x, &x).unwrap();
                        let KvCache::Rotating(c) = &cache else { unreachable!() };
                        let buffer = c.keys.as_ref().unwrap().to_vec_f32().unwrap();
                        assert_eq!(keys.to_vec_f32().unwrap(), values.to_vec_f32().unwrap(), "{what}");
                        // Every position still visible sits in its slot, and nothing else is attended.
                        let visible: Vec<usize> =
                            (0..=offset).filter(|&q| q < keep || offset - q < window - keep).collect();
                        for &q in &visible {
                            assert_eq!(buffer[ring.slot(q)], q as f32, "{what}: position {q} at offset {offset}");
                        }
                        let mut seen: Vec<usize> = keys.to_vec_f32().unwrap().iter().map(|&k| k as usize).collect();
                        seen.sort();
                        assert_eq!(seen, visible, "{what}: the positions attended at offset {offset}");
                        assert!(c.next_slot().is_none_or(|s| s == ring.slot(offset + 1)), "{what}");
                        offset += 1;
                    }
                }
            }
        }
    });
}
