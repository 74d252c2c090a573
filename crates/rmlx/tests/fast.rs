//! `rmlx::fast` against plain-Rust f64 references: RMSNorm, LayerNorm, RoPE, attention.

#![allow(clippy::needless_range_loop, clippy::type_complexity)]

use rmlx::fast::{self, AttentionMask, RopeFreqs, RopeOffset};
use rmlx::{Array, Dtype};

const TOL: f64 = 1e-5;

/// Deterministic pseudo-random values in about [-1.5, 1.5].
fn data(n: usize, seed: f64) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as f64 * 0.731 + seed).sin() * 1.3 + (i as f64 * 0.117 + 2.0 * seed).cos() * 0.2) as f32)
        .collect()
}

fn arr(v: &[f32], shape: &[i32]) -> Array {
    Array::from_slice(v, shape).unwrap()
}

fn assert_close(got: &Array, want: &[f64], shape: &[i32], tol: f64, what: &str) {
    assert_eq!(got.shape(), shape, "{what}: shape");
    assert_eq!(got.dtype(), Dtype::Float32, "{what}: dtype");
    let g = got.to_vec::<f32>().unwrap();
    assert_eq!(g.len(), want.len(), "{what}: length");
    for (i, (&a, &b)) in g.iter().zip(want).enumerate() {
        let err = (a as f64 - b).abs();
        assert!(err <= tol * b.abs().max(1.0), "{what}: element {i}: got {a}, want {b} (err {err:e})");
    }
}

// ---------------------------------------------------------------------------------------------------
// norms

fn rms_ref(x: &[f32], d: usize, w: Option<&[f32]>, eps: f64) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(d) {
        let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / d as f64;
        let r = 1.0 / (ms + eps).sqrt();
        for (j, &v) in row.iter().enumerate() {
            out.push(v as f64 * r * w.map_or(1.0, |w| w[j] as f64));
        }
    }
    out
}

fn ln_ref(x: &[f32], d: usize, w: Option<&[f32]>, b: Option<&[f32]>, eps: f64) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(d) {
        let mean = row.iter().map(|&v| v as f64).sum::<f64>() / d as f64;
        let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / d as f64;
        let r = 1.0 / (var + eps).sqrt();
        for (j, &v) in row.iter().enumerate() {
            let y = (v as f64 - mean) * r * w.map_or(1.0, |w| w[j] as f64) + b.map_or(0.0, |b| b[j] as f64);
            out.push(y);
        }
    }
    out
}

#[test]
fn rms_norm_matches_reference() {
    let (rows, d) = (6usize, 48usize);
    let xv = data(rows * d, 0.3);
    let wv: Vec<f32> = (0..d).map(|j| 0.5 + j as f32 / d as f32).collect();
    let x = arr(&xv, &[2, 3, d as i32]);
    let w = arr(&wv, &[d as i32]);
    for eps in [1e-5f32, 1e-2] {
        let y = fast::rms_norm(&x, Some(&w), eps).unwrap();
        assert_close(&y, &rms_ref(&xv, d, Some(&wv), eps as f64), &[2, 3, d as i32], TOL, "rms_norm weight");
        let y = fast::rms_norm(&x, None, eps).unwrap();
        assert_close(&y, &rms_ref(&xv, d, None, eps as f64), &[2, 3, d as i32], TOL, "rms_norm no weight");
    }
    // eps dominates a zero row: the output is zero, not NaN
    let z = fast::rms_norm(&arr(&[0.0; 8], &[1, 8]), None, 1e-6).unwrap();
    assert_eq!(z.to_vec::<f32>().unwrap(), vec![0.0; 8]);
    // a weight of the wrong size is MLX's error
    assert!(matches!(fast::rms_norm(&x, Some(&arr(&[1.0; 5], &[5])), 1e-5), Err(rmlx::Error::Mlx(_))));
}

#[test]
fn layer_norm_matches_reference() {
    let (rows, d) = (5usize, 40usize);
    let xv: Vec<f32> = data(rows * d, 1.1).iter().map(|v| v + 0.7).collect();
    let wv: Vec<f32> = (0..d).map(|j| 1.5 - j as f32 / d as f32).collect();
    let bv: Vec<f32> = (0..d).map(|j| (j as f32 * 0.3).sin() * 0.1).collect();
    let x = arr(&xv, &[rows as i32, d as i32]);
    let w = arr(&wv, &[d as i32]);
    let b = arr(&bv, &[d as i32]);
    let shape = [rows as i32, d as i32];
    let eps = 1e-5f32;
    let cases: [(Option<&Array>, Option<&Array>, Option<&[f32]>, Option<&[f32]>, &str); 4] = [
        (Some(&w), Some(&b), Some(&wv), Some(&bv), "weight+bias"),
        (Some(&w), None, Some(&wv), None, "weight"),
        (None, Some(&b), None, Some(&bv), "bias"),
        (None, None, None, None, "none"),
    ];
    for (wa, ba, wr, br, name) in cases {
        let y = fast::layer_norm(&x, wa, ba, eps).unwrap();
        assert_close(&y, &ln_ref(&xv, d, wr, br, eps as f64), &shape, TOL, name);
    }
    // without affine parameters each row has mean 0 and variance ~1
    let y = fast::layer_norm(&x, None, None, eps).unwrap().to_vec::<f32>().unwrap();
    for row in y.chunks(d) {
        let mean: f64 = row.iter().map(|&v| v as f64).sum::<f64>() / d as f64;
        assert!(mean.abs() < 1e-5, "row mean {mean}");
    }
}

// ---------------------------------------------------------------------------------------------------
// RoPE

/// `x: [B, H, L, D]`; positions `offsets[b] + l`.
#[allow(clippy::too_many_arguments)]
fn rope_ref(
    x: &[f32],
    shape: [usize; 4],
    dims: usize,
    traditional: bool,
    inv_freq: &[f64],
    scale: f64,
    offsets: &[f64],
) -> Vec<f64> {
    let [b, h, l, d] = shape;
    let half = dims / 2;
    let mut out: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    for bi in 0..b {
        for hi in 0..h {
            for li in 0..l {
                let base = ((bi * h + hi) * l + li) * d;
                let pos = (offsets[bi] + li as f64) * scale;
                for i in 0..half {
                    let theta = pos * inv_freq[i];
                    let (s, c) = theta.sin_cos();
                    let (j1, j2) = if traditional { (2 * i, 2 * i + 1) } else { (i, i + half) };
                    let (x1, x2) = (x[base + j1] as f64, x[base + j2] as f64);
                    out[base + j1] = x1 * c - x2 * s;
                    out[base + j2] = x1 * s + x2 * c;
                }
            }
        }
    }
    out
}

fn inv_freqs(base: f64, dims: usize) -> Vec<f64> {
    (0..dims / 2).map(|i| 1.0 / base.powf(2.0 * i as f64 / dims as f64)).collect()
}

const ROPE_SHAPE: [usize; 4] = [2, 3, 5, 16];

fn rope_input() -> (Vec<f32>, Array) {
    let n: usize = ROPE_SHAPE.iter().product();
    let v = data(n, 0.9);
    let a = arr(&v, &ROPE_SHAPE.map(|s| s as i32));
    (v, a)
}

fn shape_i32() -> [i32; 4] {
    ROPE_SHAPE.map(|s| s as i32)
}

#[test]
fn rope_non_traditional_and_traditional() {
    let (xv, x) = rope_input();
    let base = 10000.0f32;
    for traditional in [false, true] {
        for (scale, offset) in [(1.0f32, 0i32), (1.0, 7), (0.5, 3)] {
            let y = fast::rope(&x, 16, traditional, RopeFreqs::Base(base), scale, offset).unwrap();
            let want = rope_ref(
                &xv,
                ROPE_SHAPE,
                16,
                traditional,
                &inv_freqs(base as f64, 16),
                scale as f64,
                &[offset as f64; 2],
            );
            assert_close(&y, &want, &shape_i32(), TOL, &format!("rope trad={traditional} scale={scale} off={offset}"));
        }
    }
    // position 0 with offset 0 is the identity
    let y = fast::rope(&x, 16, false, RopeFreqs::Base(base), 1.0, 0).unwrap().to_vec::<f32>().unwrap();
    for bh in 0..6 {
        let at = bh * 5 * 16;
        assert_eq!(&y[at..at + 16], &xv[at..at + 16]);
    }
    // a small base on a few features: check a value by hand.
    // x = [1, 0, 0, 0], dims 4, base 100, position 1: inv_freq = [1, 1/10].
    // non-traditional pairs (0,2), (1,3): out = [cos 1, 0, sin 1, 0]
    let one = arr(&[1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0], &[1, 1, 2, 4]);
    let y = fast::rope(&one, 4, false, RopeFreqs::Base(100.0), 1.0, 0).unwrap().to_vec::<f32>().unwrap();
    let (s1, c1) = 1f32.sin_cos();
    let expect = [1.0, 0.0, 0.0, 0.0, c1, 0.0, s1, 0.0];
    for (g, e) in y.iter().zip(expect) {
        assert!((g - e).abs() < 1e-6, "{y:?}");
    }
    // traditional pairs (0,1), (2,3): out = [cos 1, sin 1, 0, 0]
    let y = fast::rope(&one, 4, true, RopeFreqs::Base(100.0), 1.0, 0).unwrap().to_vec::<f32>().unwrap();
    let expect = [1.0, 0.0, 0.0, 0.0, c1, s1, 0.0, 0.0];
    for (g, e) in y.iter().zip(expect) {
        assert!((g - e).abs() < 1e-6, "{y:?}");
    }
}

#[test]
fn rope_offset_array() {
    let (xv, x) = rope_input();
    let base = 10000.0f32;
    let inv = inv_freqs(base as f64, 16);
    for traditional in [false, true] {
        let off = Array::scalar(3i32);
        let y = fast::rope(&x, 16, traditional, RopeFreqs::Base(base), 1.0, RopeOffset::Array(&off)).unwrap();
        let want = rope_ref(&xv, ROPE_SHAPE, 16, traditional, &inv, 1.0, &[3.0; 2]);
        assert_close(&y, &want, &shape_i32(), TOL, "rope offset array");
        // via From<&Array>, equal to the fixed offset
        let y2 = fast::rope(&x, 16, traditional, RopeFreqs::Base(base), 1.0, &off).unwrap();
        let y3 = fast::rope(&x, 16, traditional, RopeFreqs::Base(base), 1.0, 3).unwrap();
        assert_eq!(y2.to_vec::<f32>().unwrap(), y.to_vec::<f32>().unwrap());
        let d = y3.to_vec::<f32>().unwrap();
        for (a, b) in d.iter().zip(y.to_vec::<f32>().unwrap()) {
            assert!((a - b).abs() <= 1e-6);
        }
    }
    // one offset per batch row
    let offs = Array::from_slice(&[2i32, 9], &[2]).unwrap();
    let y = fast::rope(&x, 16, false, RopeFreqs::Base(base), 1.0, &offs).unwrap();
    let want = rope_ref(&xv, ROPE_SHAPE, 16, false, &inv, 1.0, &[2.0, 9.0]);
    assert_close(&y, &want, &shape_i32(), TOL, "rope per-batch offsets");
}

#[test]
fn rope_partial_dims_keep_tail() {
    let (xv, x) = rope_input();
    let base = 500.0f32;
    for traditional in [false, true] {
        let y = fast::rope(&x, 8, traditional, RopeFreqs::Base(base), 1.0, 2).unwrap();
        let want = rope_ref(&xv, ROPE_SHAPE, 8, traditional, &inv_freqs(base as f64, 8), 1.0, &[2.0; 2]);
        assert_close(&y, &want, &shape_i32(), TOL, &format!("rope dims=8 trad={traditional}"));
        // the features past `dims` are copied bit for bit
        let yv = y.to_vec::<f32>().unwrap();
        for row in 0..(yv.len() / 16) {
            assert_eq!(&yv[row * 16 + 8..row * 16 + 16], &xv[row * 16 + 8..row * 16 + 16], "tail of row {row}");
        }
    }
}

#[test]
fn rope_explicit_freqs_equal_base() {
    let (xv, x) = rope_input();
    let base = 10000.0f64;
    for dims in [16usize, 8] {
        let freqs: Vec<f32> = (0..dims / 2).map(|i| base.powf(2.0 * i as f64 / dims as f64) as f32).collect();
        let f = arr(&freqs, &[(dims / 2) as i32]);
        for traditional in [false, true] {
            let a = fast::rope(&x, dims as i32, traditional, RopeFreqs::Explicit(&f), 1.0, 4).unwrap();
            let b = fast::rope(&x, dims as i32, traditional, RopeFreqs::Base(base as f32), 1.0, 4).unwrap();
            let want = rope_ref(&xv, ROPE_SHAPE, dims, traditional, &inv_freqs(base, dims), 1.0, &[4.0; 2]);
            assert_close(&a, &want, &shape_i32(), TOL, "rope explicit freqs");
            let (av, bv) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
            for (p, q) in av.iter().zip(&bv) {
                assert!((p - q).abs() <= 1e-5, "explicit {p} vs base {q}");
            }
        }
    }
    // scaled frequencies (e.g. Llama-3 style): doubling every freq halves every angle, same as scale 0.5
    let freqs: Vec<f32> = (0..8).map(|i| 2.0 * base.powf(2.0 * i as f64 / 16.0) as f32).collect();
    let f = arr(&freqs, &[8]);
    let a = fast::rope(&x, 16, false, RopeFreqs::Explicit(&f), 1.0, 6).unwrap();
    let want = rope_ref(&xv, ROPE_SHAPE, 16, false, &inv_freqs(base, 16), 0.5, &[6.0; 2]);
    assert_close(&a, &want, &shape_i32(), TOL, "rope doubled freqs");
    // the wrong number of frequencies is MLX's error
    let bad = arr(&[1.0; 3], &[3]);
    assert!(matches!(fast::rope(&x, 16, false, RopeFreqs::Explicit(&bad), 1.0, 0), Err(rmlx::Error::Mlx(_))));
}

// ---------------------------------------------------------------------------------------------------
// attention

enum RefMask<'a> {
    None,
    Causal,
    Add(&'a [f64]),   // [L, S]
    Keep(&'a [bool]), // [L, S]
}

/// `q: [B, Hq, L, D]`, `k, v: [B, Hkv, S, D]`.
#[allow(clippy::too_many_arguments)]
fn sdpa_ref(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    b: usize,
    hq: usize,
    hkv: usize,
    l: usize,
    s: usize,
    d: usize,
    scale: f64,
    mask: &RefMask,
) -> Vec<f64> {
    let group = hq / hkv;
    let mut out = vec![0.0; b * hq * l * d];
    for bi in 0..b {
        for h in 0..hq {
            let kh = h / group;
            for i in 0..l {
                let qrow = &q[((bi * hq + h) * l + i) * d..][..d];
                let mut scores = vec![f64::NEG_INFINITY; s];
                for j in 0..s {
                    let krow = &k[((bi * hkv + kh) * s + j) * d..][..d];
                    let mut sc = qrow.iter().zip(krow).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() * scale;
                    match mask {
                        RefMask::None => {}
                        RefMask::Causal => {
                            if j > i + (s - l) {
                                sc = f64::NEG_INFINITY;
                            }
                        }
                        RefMask::Add(m) => sc += m[i * s + j],
                        RefMask::Keep(m) => {
                            if !m[i * s + j] {
                                sc = f64::NEG_INFINITY;
                            }
                        }
                    }
                    scores[j] = sc;
                }
                let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|&x| (x - mx).exp()).collect();
                let z: f64 = e.iter().sum();
                for c in 0..d {
                    let mut acc = 0.0;
                    for j in 0..s {
                        acc += e[j] / z * v[((bi * hkv + kh) * s + j) * d + c] as f64;
                    }
                    out[((bi * hq + h) * l + i) * d + c] = acc;
                }
            }
        }
    }
    out
}

struct Qkv {
    qv: Vec<f32>,
    kv: Vec<f32>,
    vv: Vec<f32>,
    q: Array,
    k: Array,
    v: Array,
}

fn qkv(b: usize, hq: usize, hkv: usize, l: usize, s: usize, d: usize) -> Qkv {
    let qv = data(b * hq * l * d, 0.1);
    let kv = data(b * hkv * s * d, 1.7);
    let vv = data(b * hkv * s * d, 2.9);
    let q = arr(&qv, &[b as i32, hq as i32, l as i32, d as i32]);
    let k = arr(&kv, &[b as i32, hkv as i32, s as i32, d as i32]);
    let v = arr(&vv, &[b as i32, hkv as i32, s as i32, d as i32]);
    Qkv { qv, kv, vv, q, k, v }
}

#[test]
fn sdpa_no_mask() {
    let (b, h, l, s, d) = (2, 2, 4, 6, 16);
    let t = qkv(b, h, h, l, s, d);
    let scale = 1.0 / (d as f32).sqrt();
    let y = fast::scaled_dot_product_attention(&t.q, &t.k, &t.v, scale, AttentionMask::None).unwrap();
    let want = sdpa_ref(&t.qv, &t.kv, &t.vv, b, h, h, l, s, d, scale as f64, &RefMask::None);
    assert_close(&y, &want, &[b as i32, h as i32, l as i32, d as i32], TOL, "sdpa none");
    // a single query (the decode case)
    let t1 = qkv(1, 2, 2, 1, 7, 8);
    let y = fast::scaled_dot_product_attention(&t1.q, &t1.k, &t1.v, 0.3, AttentionMask::None).unwrap();
    let want = sdpa_ref(&t1.qv, &t1.kv, &t1.vv, 1, 2, 2, 1, 7, 8, 0.3, &RefMask::None);
    assert_close(&y, &want, &[1, 2, 1, 8], TOL, "sdpa decode");
}

#[test]
fn sdpa_causal() {
    let scale = 0.25f32;
    // square
    let t = qkv(1, 2, 2, 5, 5, 8);
    let y = fast::scaled_dot_product_attention(&t.q, &t.k, &t.v, scale, AttentionMask::Causal).unwrap();
    let want = sdpa_ref(&t.qv, &t.kv, &t.vv, 1, 2, 2, 5, 5, 8, scale as f64, &RefMask::Causal);
    assert_close(&y, &want, &[1, 2, 5, 8], TOL, "sdpa causal square");
    // the first query sees only the first key: its output is v[0]
    let yv = y.to_vec::<f32>().unwrap();
    for c in 0..8 {
        assert!((yv[c] - t.vv[c]).abs() < 1e-6);
    }
    // more keys than queries: queries are aligned to the end
    let t = qkv(2, 2, 2, 3, 7, 8);
    let y = fast::scaled_dot_product_attention(&t.q, &t.k, &t.v, scale, AttentionMask::Causal).unwrap();
    let want = sdpa_ref(&t.qv, &t.kv, &t.vv, 2, 2, 2, 3, 7, 8, scale as f64, &RefMask::Causal);
    assert_close(&y, &want, &[2, 2, 3, 8], TOL, "sdpa causal L<S");
    // and it differs from no mask (the first query cannot see the last two keys)
    let un = sdpa_ref(&t.qv, &t.kv, &t.vv, 2, 2, 2, 3, 7, 8, scale as f64, &RefMask::None);
    assert!(un.iter().zip(&want).any(|(a, b)| (a - b).abs() > 1e-3));
    // the last query sees every key
    let yv = y.to_vec::<f32>().unwrap();
    for c in 0..8 {
        assert!((yv[2 * 8 + c] as f64 - un[2 * 8 + c]).abs() < 1e-5);
    }
}

#[test]
fn sdpa_additive_and_boolean_masks() {
    let (b, h, l, s, d) = (1, 2, 4, 6, 8);
    let t = qkv(b, h, h, l, s, d);
    let scale = 0.35f32;
    let add: Vec<f32> = (0..l * s).map(|i| ((i * 7) % 5) as f32 * -0.6 + if i % 4 == 1 { -1e9 } else { 0.0 }).collect();
    let add64: Vec<f64> = add.iter().map(|&v| v as f64).collect();
    let m = arr(&add, &[l as i32, s as i32]);
    let y = fast::scaled_dot_product_attention(&t.q, &t.k, &t.v, scale, AttentionMask::Array(&m)).unwrap();
    let want = sdpa_ref(&t.qv, &t.kv, &t.vv, b, h, h, l, s, d, scale as f64, &RefMask::Add(&add64));
    assert_close(&y, &want, &[1, 2, 4, 8], TOL, "sdpa additive mask");
    // the same mask given as [1, 1, L, S]
    let m4 = m.reshape(&[1, 1, l as i32, s as i32]).unwrap();
    let y4 = fast::scaled_dot_product_attention(&t.q, &t.k, &t.v, scale, AttentionMask::Array(&m4)).unwrap();
    assert_close(&y4, &want, &[1, 2, 4, 8], TOL, "sdpa additive mask 4-D");

    // boolean: true = attend; every row keeps at least one key
    let keep: Vec<bool> = (0..l * s).map(|i| (i % s) == 0 || (i * 3) % 4 != 1).collect();
    let mb = Array::from_slice(&keep, &[l as i32, s as i32]).unwrap();
    assert_eq!(mb.dtype(), Dtype::Bool);
    let y = fast::scaled_dot_product_attention(&t.q, &t.k, &t.v, scale, AttentionMask::Array(&mb)).unwrap();
    let want = sdpa_ref(&t.qv, &t.kv, &t.vv, b, h, h, l, s, d, scale as f64, &RefMask::Keep(&keep));
    assert_close(&y, &want, &[1, 2, 4, 8], TOL, "sdpa bool mask");
    // a boolean causal mask equals AttentionMask::Causal
    let causal: Vec<bool> = (0..l * s).map(|i| (i % s) <= (i / s) + (s - l)).collect();
    let mc = Array::from_slice(&causal, &[l as i32, s as i32]).unwrap();
    let a = fast::scaled_dot_product_attention(&t.q, &t.k, &t.v, scale, AttentionMask::Array(&mc)).unwrap();
    let c = fast::scaled_dot_product_attention(&t.q, &t.k, &t.v, scale, AttentionMask::Causal).unwrap();
    let (av, cv) = (a.to_vec::<f32>().unwrap(), c.to_vec::<f32>().unwrap());
    for (x, y) in av.iter().zip(&cv) {
        assert!((x - y).abs() < 1e-6);
    }
}

#[test]
fn sdpa_grouped_query_attention() {
    let (b, hq, hkv, l, s, d) = (2, 4, 2, 3, 5, 16);
    let t = qkv(b, hq, hkv, l, s, d);
    let scale = 1.0 / (d as f32).sqrt();
    for (mask, rm, name) in
        [(AttentionMask::None, RefMask::None, "gqa"), (AttentionMask::Causal, RefMask::Causal, "gqa causal")]
    {
        let y = fast::scaled_dot_product_attention(&t.q, &t.k, &t.v, scale, mask).unwrap();
        let want = sdpa_ref(&t.qv, &t.kv, &t.vv, b, hq, hkv, l, s, d, scale as f64, &rm);
        assert_close(&y, &want, &[b as i32, hq as i32, l as i32, d as i32], TOL, name);
    }
    // GQA equals repeating each kv head for its query heads
    let kr = rmlx::ops::repeat(&t.k, 2, Some(1)).unwrap();
    let vr = rmlx::ops::repeat(&t.v, 2, Some(1)).unwrap();
    let g = fast::scaled_dot_product_attention(&t.q, &t.k, &t.v, scale, AttentionMask::None).unwrap();
    let r = fast::scaled_dot_product_attention(&t.q, &kr, &vr, scale, AttentionMask::None).unwrap();
    for (x, y) in g.to_vec::<f32>().unwrap().iter().zip(r.to_vec::<f32>().unwrap()) {
        assert!((x - y).abs() < 1e-6);
    }
    // Hq not a multiple of Hkv is MLX's error
    let bad = qkv(1, 3, 2, 2, 2, 8);
    assert!(matches!(
        fast::scaled_dot_product_attention(&bad.q, &bad.k, &bad.v, 1.0, AttentionMask::None),
        Err(rmlx::Error::Mlx(_))
    ));
}
