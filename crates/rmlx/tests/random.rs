//! Integration tests of `rmlx::random`: reproducibility from keys and the global seed, and the
//! statistics of every sampler.

use rmlx::{ops, random, Array, Dtype, Error};

fn mean(v: &[f32]) -> f64 {
    v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64
}

fn std_dev(v: &[f32]) -> f64 {
    let m = mean(v);
    (v.iter().map(|&x| (x as f64 - m).powi(2)).sum::<f64>() / v.len() as f64).sqrt()
}

/// Row `i` of a `[n, 2]` key array, as a key of shape `[2]`.
fn subkey(keys: &Array, i: i32) -> Array {
    keys.take(&Array::scalar(i), Some(0)).unwrap()
}

#[test]
fn same_key_gives_identical_samples() {
    let k = random::key(42).unwrap();
    let k_again = random::key(42).unwrap();
    let a = random::uniform(0.0, 1.0, &[64], Dtype::Float32, Some(&k)).unwrap();
    let b = random::uniform(0.0, 1.0, &[64], Dtype::Float32, Some(&k)).unwrap();
    let c = random::uniform(0.0, 1.0, &[64], Dtype::Float32, Some(&k_again)).unwrap();
    let av = a.to_vec::<f32>().unwrap();
    assert_eq!(av, b.to_vec::<f32>().unwrap());
    assert_eq!(av, c.to_vec::<f32>().unwrap());
    // The key itself is deterministic: two uint32 words.
    assert_eq!(k.shape(), &[2]);
    assert_eq!(k.dtype(), Dtype::Uint32);
    assert_eq!(k.to_vec::<u32>().unwrap(), k_again.to_vec::<u32>().unwrap());

    let n1 = random::normal(&[32], Dtype::Float32, 0.0, 1.0, Some(&k)).unwrap();
    let n2 = random::normal(&[32], Dtype::Float32, 0.0, 1.0, Some(&k)).unwrap();
    assert_eq!(n1.to_vec::<f32>().unwrap(), n2.to_vec::<f32>().unwrap());
}

#[test]
fn different_keys_give_different_samples() {
    let k1 = random::key(1).unwrap();
    let k2 = random::key(2).unwrap();
    assert_ne!(k1.to_vec::<u32>().unwrap(), k2.to_vec::<u32>().unwrap());
    let a = random::uniform(0.0, 1.0, &[64], Dtype::Float32, Some(&k1)).unwrap().to_vec::<f32>().unwrap();
    let b = random::uniform(0.0, 1.0, &[64], Dtype::Float32, Some(&k2)).unwrap().to_vec::<f32>().unwrap();
    assert_ne!(a, b);
    // Not merely one element apart: nearly every element differs.
    let differing = a.iter().zip(&b).filter(|(x, y)| x != y).count();
    assert!(differing >= 60, "only {differing} of 64 samples differ");
}

#[test]
fn global_seed_reproduces_the_sequence() {
    // The only test in this binary that uses the global key (None), so no other test advances it.
    random::seed(1234);
    let a1 = random::uniform(0.0, 1.0, &[16], Dtype::Float32, None).unwrap().to_vec::<f32>().unwrap();
    let b1 = random::uniform(0.0, 1.0, &[16], Dtype::Float32, None).unwrap().to_vec::<f32>().unwrap();
    random::seed(1234);
    let a2 = random::uniform(0.0, 1.0, &[16], Dtype::Float32, None).unwrap().to_vec::<f32>().unwrap();
    let b2 = random::uniform(0.0, 1.0, &[16], Dtype::Float32, None).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(a1, a2);
    assert_eq!(b1, b2);
    // The global key advances between calls.
    assert_ne!(a1, b1);
    // A different seed gives a different sequence.
    random::seed(4321);
    let c = random::uniform(0.0, 1.0, &[16], Dtype::Float32, None).unwrap().to_vec::<f32>().unwrap();
    assert_ne!(a1, c);
}

#[test]
fn split_gives_distinct_subkeys() {
    let k = random::key(7).unwrap();
    let keys = random::split(&k, 3).unwrap();
    assert_eq!(keys.shape(), &[3, 2]);
    assert_eq!(keys.dtype(), Dtype::Uint32);
    let words = keys.to_vec::<u32>().unwrap();
    let rows: Vec<&[u32]> = words.chunks(2).collect();
    assert_ne!(rows[0], rows[1]);
    assert_ne!(rows[0], rows[2]);
    assert_ne!(rows[1], rows[2]);
    // Subkeys differ from the parent key too.
    let parent = k.to_vec::<u32>().unwrap();
    assert!(rows.iter().all(|r| *r != parent.as_slice()));
    // Splitting is deterministic.
    assert_eq!(random::split(&k, 3).unwrap().to_vec::<u32>().unwrap(), words);
    // Each subkey drives its own stream of samples.
    let s: Vec<Vec<f32>> = (0..3)
        .map(|i| {
            let sk = subkey(&keys, i);
            assert_eq!(sk.shape(), &[2]);
            random::uniform(0.0, 1.0, &[8], Dtype::Float32, Some(&sk)).unwrap().to_vec::<f32>().unwrap()
        })
        .collect();
    assert_ne!(s[0], s[1]);
    assert_ne!(s[1], s[2]);
    assert_ne!(s[0], s[2]);
}

#[test]
fn uniform_range_and_mean() {
    let k = random::key(11).unwrap();
    let (low, high) = (-2.0f32, 3.0f32);
    let a = random::uniform(low, high, &[100_000], Dtype::Float32, Some(&k)).unwrap();
    assert_eq!(a.shape(), &[100_000]);
    assert_eq!(a.dtype(), Dtype::Float32);
    let v = a.to_vec::<f32>().unwrap();
    assert!(v.iter().all(|&x| x >= low && x < high), "a sample falls outside [{low}, {high})");
    let m = mean(&v);
    assert!((m - 0.5).abs() < 0.02, "mean {m} is not near 0.5");
    // Uniform on [low, high): std = (high - low) / sqrt(12).
    let s = std_dev(&v);
    assert!((s - 5.0 / 12f64.sqrt()).abs() < 0.02, "std {s}");

    // Unit interval too.
    let u = random::uniform(0.0, 1.0, &[100_000], Dtype::Float32, Some(&random::key(12).unwrap()))
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    assert!(u.iter().all(|&x| (0.0..1.0).contains(&x)));
    assert!((mean(&u) - 0.5).abs() < 0.02);
}

#[test]
fn normal_mean_and_std() {
    let k = random::key(13).unwrap();
    let (loc, scale) = (3.0f32, 2.0f32);
    let a = random::normal(&[100_000], Dtype::Float32, loc, scale, Some(&k)).unwrap();
    assert_eq!(a.shape(), &[100_000]);
    let v = a.to_vec::<f32>().unwrap();
    let (m, s) = (mean(&v), std_dev(&v));
    assert!((m - loc as f64).abs() < 0.02, "mean {m}");
    assert!((s - scale as f64).abs() < 0.02, "std {s}");

    let std_normal = random::normal(&[100_000], Dtype::Float32, 0.0, 1.0, Some(&random::key(14).unwrap()))
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    assert!(mean(&std_normal).abs() < 0.02);
    assert!((std_dev(&std_normal) - 1.0).abs() < 0.02);
}

#[test]
fn truncated_normal_within_bounds() {
    let k = random::key(15).unwrap();
    let a = random::truncated_normal(-0.5, 1.5, &[50_000], Dtype::Float32, Some(&k)).unwrap();
    assert_eq!(a.shape(), &[50_000]);
    let v = a.to_vec::<f32>().unwrap();
    assert!(v.iter().all(|&x| (-0.5..=1.5).contains(&x)), "a sample is outside [-0.5, 1.5]");
    // Both ends of the interval are actually reached in the neighbourhood.
    assert!(v.iter().any(|&x| x < -0.4));
    assert!(v.iter().any(|&x| x > 1.4));
    // Mean of a standard normal truncated to [a, b]: (phi(a) - phi(b)) / (Phi(b) - Phi(a)).
    // phi(-0.5) = 0.352065, phi(1.5) = 0.129518, Phi(1.5) - Phi(-0.5) = 0.933193 - 0.308538.
    let expected = (0.352_065 - 0.129_518) / (0.933_193 - 0.308_538);
    let m = mean(&v);
    assert!((m - expected).abs() < 0.02, "mean {m}, expected {expected}");

    // Symmetric bounds: mean near zero.
    let sym = random::truncated_normal(-1.0, 1.0, &[50_000], Dtype::Float32, Some(&random::key(16).unwrap()))
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    assert!(sym.iter().all(|&x| (-1.0..=1.0).contains(&x)));
    assert!(mean(&sym).abs() < 0.02);
}

#[test]
fn randint_range_and_coverage() {
    let k = random::key(17).unwrap();
    let a = random::randint(-3, 7, &[10_000], Dtype::Int32, Some(&k)).unwrap();
    assert_eq!(a.dtype(), Dtype::Int32);
    assert_eq!(a.shape(), &[10_000]);
    let v = a.to_vec::<i32>().unwrap();
    assert!(v.iter().all(|&x| (-3..7).contains(&x)), "a value outside [-3, 7)");
    let mut counts = [0usize; 10];
    for &x in &v {
        counts[(x + 3) as usize] += 1;
    }
    assert!(counts.iter().all(|&c| c > 0), "not every value was drawn: {counts:?}");
    // Roughly uniform: 1000 expected per value.
    assert!(counts.iter().all(|&c| (800..1200).contains(&c)), "counts {counts:?}");

    // Another integer dtype.
    let b = random::randint(0, 4, &[2, 3], Dtype::Uint8, Some(&k)).unwrap();
    assert_eq!(b.dtype(), Dtype::Uint8);
    assert_eq!(b.shape(), &[2, 3]);
    assert!(b.to_vec::<u8>().unwrap().iter().all(|&x| x < 4));
}

#[test]
fn bernoulli_frequency() {
    let k = random::key(19).unwrap();
    let p = Array::scalar(0.3f32);
    let a = random::bernoulli(&p, &[100_000], Some(&k)).unwrap();
    assert_eq!(a.dtype(), Dtype::Bool);
    assert_eq!(a.shape(), &[100_000]);
    let v = a.to_vec::<bool>().unwrap();
    let freq = v.iter().filter(|&&b| b).count() as f64 / v.len() as f64;
    assert!((freq - 0.3).abs() < 0.02, "frequency {freq}");

    // Per-element probabilities broadcast against the shape; 0 and 1 are exact.
    let ps = Array::from_slice(&[0.0f32, 1.0], &[2]).unwrap();
    let b = random::bernoulli(&ps, &[1000, 2], Some(&k)).unwrap().to_vec::<bool>().unwrap();
    for row in b.chunks(2) {
        assert_eq!(row, &[false, true]);
    }
}

#[test]
fn categorical_peaked_logits() {
    let logits = Array::from_slice(&[-1e9f32, 0.0, -1e9], &[3]).unwrap();
    for seed in 0..20 {
        let k = random::key(seed).unwrap();
        let s = random::categorical(&logits, -1, None, Some(&k)).unwrap();
        assert_eq!(s.ndim(), 0);
        assert_eq!(s.dtype(), Dtype::Uint32);
        assert_eq!(s.item::<u32>().unwrap(), 1);
    }
    let many = random::categorical(&logits, 0, Some(1000), Some(&random::key(99).unwrap())).unwrap();
    assert_eq!(many.shape(), &[1000]);
    assert!(many.to_vec::<u32>().unwrap().iter().all(|&x| x == 1));
}

#[test]
fn categorical_shapes_and_frequencies() {
    let k = random::key(23).unwrap();
    // Batch of 2 distributions over 3 classes.
    let batch = Array::from_slice(&[0.0f32, 0.0, 0.0, -1e9, -1e9, 0.0], &[2, 3]).unwrap();
    let one = random::categorical(&batch, -1, None, Some(&k)).unwrap();
    assert_eq!(one.shape(), &[2]);
    assert_eq!(one.to_vec::<u32>().unwrap()[1], 2);
    let five = random::categorical(&batch, -1, Some(5), Some(&k)).unwrap();
    assert_eq!(five.shape(), &[2, 5]);
    let v = five.to_vec::<u32>().unwrap();
    assert!(v[..5].iter().all(|&x| x < 3));
    assert_eq!(&v[5..], &[2, 2, 2, 2, 2]);

    // Frequencies follow softmax(logits).
    let probs = [0.2f64, 0.3, 0.5];
    let logits: Vec<f32> = probs.iter().map(|p| p.ln() as f32 + 1.7).collect(); // shift-invariant
    let logits = Array::from_slice(&logits, &[3]).unwrap();
    let n = 50_000;
    let s = random::categorical(&logits, 0, Some(n), Some(&random::key(29).unwrap())).unwrap();
    assert_eq!(s.shape(), &[n]);
    let mut counts = [0usize; 3];
    for x in s.to_vec::<u32>().unwrap() {
        counts[x as usize] += 1;
    }
    for (c, p) in counts.iter().zip(probs) {
        let f = *c as f64 / n as f64;
        assert!((f - p).abs() < 0.02, "frequency {f}, expected {p} ({counts:?})");
    }
}

#[test]
fn categorical_rejects_zero_samples() {
    let logits = Array::from_slice(&[0.0f32, 1.0], &[2]).unwrap();
    let k = random::key(0).unwrap();
    assert!(matches!(random::categorical(&logits, -1, Some(0), Some(&k)), Err(Error::InvalidArgument(_))));
    assert!(matches!(random::categorical(&logits, -1, Some(-3), Some(&k)), Err(Error::InvalidArgument(_))));
}

#[test]
fn gumbel_mean_is_euler_gamma() {
    let k = random::key(31).unwrap();
    let g = random::gumbel(&[100_000], Dtype::Float32, Some(&k)).unwrap();
    assert_eq!(g.shape(), &[100_000]);
    assert_eq!(g.dtype(), Dtype::Float32);
    let v = g.to_vec::<f32>().unwrap();
    let m = mean(&v);
    assert!((m - 0.577_215_7).abs() < 0.02, "mean {m}");
    // Standard Gumbel std = pi / sqrt(6).
    let s = std_dev(&v);
    assert!((s - std::f64::consts::PI / 6f64.sqrt()).abs() < 0.03, "std {s}");
}

#[test]
fn permutations_are_permutations() {
    let n = 100;
    let k1 = random::key(37).unwrap();
    let k2 = random::key(38).unwrap();
    let p1 = random::permutation_n(n, Some(&k1)).unwrap();
    assert_eq!(p1.shape(), &[n]);
    assert_eq!(p1.dtype(), Dtype::Int32);
    let v1 = p1.to_vec::<i32>().unwrap();
    let mut sorted = v1.clone();
    sorted.sort();
    assert_eq!(sorted, (0..n).collect::<Vec<_>>());
    // Sorting in MLX gives arange as well.
    assert_eq!(ops::sort(&p1, None).unwrap().to_vec::<i32>().unwrap(), (0..n).collect::<Vec<_>>());
    assert_ne!(v1, (0..n).collect::<Vec<_>>(), "identity permutation of 100 elements");
    // Depends on the key (and only on it).
    assert_eq!(random::permutation_n(n, Some(&k1)).unwrap().to_vec::<i32>().unwrap(), v1);
    assert_ne!(random::permutation_n(n, Some(&k2)).unwrap().to_vec::<i32>().unwrap(), v1);

    // Permuting an array along an axis moves whole rows.
    let x = ops::arange(0.0, 20.0, 1.0, Dtype::Float32).unwrap().reshape(&[10, 2]).unwrap();
    let px = random::permutation(&x, 0, Some(&k1)).unwrap();
    assert_eq!(px.shape(), &[10, 2]);
    let rows = px.to_vec::<f32>().unwrap();
    let mut firsts = Vec::new();
    for r in rows.chunks(2) {
        assert_eq!(r[1], r[0] + 1.0, "row {r:?} was split");
        assert_eq!(r[0] as i32 % 2, 0);
        firsts.push(r[0] as i32);
    }
    let mut sorted_firsts = firsts.clone();
    sorted_firsts.sort();
    assert_eq!(sorted_firsts, (0..10).map(|i| 2 * i).collect::<Vec<_>>());
    let px2 = random::permutation(&x, 0, Some(&k2)).unwrap().to_vec::<f32>().unwrap();
    assert_ne!(rows, px2);
}

#[test]
fn requested_dtypes() {
    let k = random::key(41).unwrap();
    let u16_ = random::uniform(0.0, 1.0, &[1000], Dtype::Float16, Some(&k)).unwrap();
    assert_eq!(u16_.dtype(), Dtype::Float16);
    assert!(u16_.to_vec::<rmlx::f16>().unwrap().iter().all(|x| (0.0..=1.0).contains(&x.to_f32())));
    let ub = random::uniform(-1.0, 1.0, &[1000], Dtype::Bfloat16, Some(&k)).unwrap();
    assert_eq!(ub.dtype(), Dtype::Bfloat16);
    assert!(ub.to_vec::<rmlx::bf16>().unwrap().iter().all(|x| (-1.0..=1.0).contains(&x.to_f32())));

    let n16 = random::normal(&[10_000], Dtype::Float16, 0.0, 1.0, Some(&k)).unwrap();
    assert_eq!(n16.dtype(), Dtype::Float16);
    let v = n16.to_vec_f32().unwrap();
    assert!(mean(&v).abs() < 0.05 && (std_dev(&v) - 1.0).abs() < 0.05);
    let nb = random::normal(&[10_000], Dtype::Bfloat16, 0.0, 1.0, Some(&k)).unwrap();
    assert_eq!(nb.dtype(), Dtype::Bfloat16);
    let v = nb.to_vec_f32().unwrap();
    assert!(mean(&v).abs() < 0.05 && (std_dev(&v) - 1.0).abs() < 0.05);

    let t = random::truncated_normal(-1.0, 1.0, &[100], Dtype::Float16, Some(&k)).unwrap();
    assert_eq!(t.dtype(), Dtype::Float16);
    assert!(t.to_vec_f32().unwrap().iter().all(|x| (-1.0..=1.0).contains(x)));
    let g = random::gumbel(&[100], Dtype::Bfloat16, Some(&k)).unwrap();
    assert_eq!(g.dtype(), Dtype::Bfloat16);
    assert_eq!(g.shape(), &[100]);
}
