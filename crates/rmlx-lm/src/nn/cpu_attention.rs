//! Attention over a key/value cache on the CPU: a prompt's causal queries or a decoding step's,
//! as one primitive ([`cache_attention`]), and the per-head arithmetic the fused decoding step
//! ([`super::cpu_layer`]) shares ([`attend_heads`]).
//!
//! A query row's scores, softmax and weighted sum of values are computed in float32, and the rows
//! that read the same keys and values go together, up to four: a decoding step's query heads of
//! one key/value head, a prompt's consecutive positions of one head. For the common head sizes
//! (64, 128, 256) the sizes are known to the compiler, and with AVX2 and FMA the rows' dot
//! products and weighted sums run as vector instructions, each key and value loaded once for all
//! rows (a lone row: four keys at a time, its sum in registers). Every row's arithmetic is the
//! same in any company, so a prompt's last row equals the decoding step's bit for bit. Done one
//! row at a time with a dot product's one chain of additions, a 2,048-token prompt of the default
//! model ran at 120–137 tokens/s against 180–209 now (BENCHMARKS.md).

use super::cpu_fast::{dot_as as dot, madd, mlx_exp, store, Floats};
use crate::nn::cpu_pool::for_each;
use crate::nn::cpu_qmm::to_f32;
use rmlx::custom::{apply, CpuTensor, CpuTensorMut, CustomPrimitive};
use rmlx::fast::TensorSpec;
use rmlx::{Array, Error, Result};

/// Attention of the last `L` of `valid` positions, queries `q` `[B, Hq, L, D]`, over the first
/// `valid` positions of the cache buffers `keys`, `values` `[B, Hkv, capacity, D]` (`Hq` a multiple
/// of `Hkv`: query head `h` reads key/value head `h / (Hq / Hkv)`), causally (query `l` sees
/// positions `0..=valid - L + l`), scores multiplied by `scale`. Softmax and sums in float32.
/// The query rows are split over the threads.
pub fn cache_attention(q: &Array, keys: &Array, values: &Array, valid: usize, scale: f32) -> Result<Array> {
    let op = CacheAttentionCpu { valid, scale };
    let out = apply(op, &[q.clone(), keys.clone(), values.clone()])?;
    Ok(out.into_iter().next().expect("one output"))
}

struct CacheAttentionCpu {
    valid: usize,
    scale: f32,
}

impl CustomPrimitive for CacheAttentionCpu {
    fn name(&self) -> String {
        "CpuCacheAttention".into()
    }

    fn output_specs(&self, inputs: &[TensorSpec]) -> Result<Vec<TensorSpec>> {
        let (q, k, v) = (&inputs[0], &inputs[1], &inputs[2]);
        let fits = q.shape.len() == 4
            && q.shape[2] >= 1
            && k.shape.len() == 4
            && k.shape == v.shape
            && k.shape[0] == q.shape[0]
            && k.shape[1] > 0
            && q.shape[1] % k.shape[1] == 0
            && k.shape[3] == q.shape[3]
            && self.valid >= q.shape[2] as usize
            && self.valid <= k.shape[2] as usize
            && q.dtype == k.dtype
            && k.dtype == v.dtype;
        if !fits {
            return Err(Error::InvalidArgument(format!(
                "cache attention: q {:?}, keys {:?}, values {:?}, {} valid positions",
                q.shape, k.shape, v.shape, self.valid
            )));
        }
        Ok(vec![q.clone()])
    }

    fn eval_cpu(&self, inputs: &[CpuTensor<'_>], outputs: &mut [CpuTensorMut<'_>]) -> Result<()> {
        let (qs, ks) = (inputs[0].shape(), inputs[1].shape());
        let (b, hq, len, d) = (qs[0] as usize, qs[1] as usize, qs[2] as usize, qs[3] as usize);
        let (hkv, capacity) = (ks[1] as usize, ks[2] as usize);
        let q = to_f32(&inputs[0])?;
        let (keys, values) = (Floats::of(&inputs[1])?, Floats::of(&inputs[2])?);
        // Every key/value head's valid rows in float32 (borrowed when they are).
        let n = self.valid * d;
        let heads: Vec<_> = (0..b * hkv)
            .map(|h| (keys.at(h * capacity * d).widened(0..n), values.at(h * capacity * d).widened(0..n)))
            .collect();
        let mut y = vec![0f32; q.len()];
        let (group, first_visible) = (hq / hkv, self.valid - len + 1);
        // Query row `r` is head `r / L` (of all sequences), position `r % L`. A step's parts are
        // the query heads of a key/value head, a prompt's a head's consecutive positions.
        let parts = if len == 1 { row_parts(b * hq, group) } else { row_parts(b * hq * len, len) };
        let kv = |r: usize| {
            let head = r / len;
            let (k, v) = &heads[(head / hq) * hkv + (head % hq) / group];
            (&k[..], &v[..])
        };
        attend_parts(&q, d, self.scale, &mut y, &parts, kv, |r| first_visible + r % len);
        store(&mut outputs[0], &y)
    }

    fn is_equivalent(&self, other: &Self) -> bool {
        self.valid == other.valid && self.scale == other.scale
    }
}

/// The query heads `q` (`[Hq, D]`, one position) over the first `valid` rows of their key/value
/// heads (`heads[h]`: key and value rows of head `h`, `[_, D]`; query head `i` reads head
/// `i / (Hq / heads)`), over the threads; the result into `out` (`[Hq, D]`).
pub(crate) fn attend_heads(
    q: &[f32],
    heads: &[(Floats<'_>, Floats<'_>)],
    valid: usize,
    d: usize,
    scale: f32,
    out: &mut [f32],
) {
    let group = (q.len() / d) / heads.len().max(1);
    let rows: Vec<_> = heads.iter().map(|(k, v)| (k.widened(0..valid * d), v.widened(0..valid * d))).collect();
    let kv = |r: usize| {
        let (k, v) = &rows[r / group];
        (&k[..], &v[..])
    };
    attend_parts(q, d, scale, out, &row_parts(q.len() / d, group), kv, |_| valid);
}

/// The most query rows computed together over one pass of their keys and values.
const ROWS_TOGETHER: usize = 4;

/// Rows `0..rows` as parts of at most [`ROWS_TOGETHER`] consecutive rows that do not cross a
/// multiple of `run` (the rows of one run read the same keys and values): (first row, count).
fn row_parts(rows: usize, run: usize) -> Vec<(usize, usize)> {
    let run = run.max(1);
    (0..rows)
        .step_by(run)
        .flat_map(|start| {
            let end = (start + run).min(rows);
            (start..end).step_by(ROWS_TOGETHER).map(move |r| (r, ROWS_TOGETHER.min(end - r)))
        })
        .collect()
}

/// The query rows `q` (`[rows, D]`) into `out`, part by part over the threads: row `r` over the
/// first `visible(r)` rows of its keys and values `kv(r)`. The rows of a part share their keys and
/// values, which are read once for all of them; each row's arithmetic is the same in any part.
fn attend_parts<'k>(
    q: &[f32],
    d: usize,
    scale: f32,
    out: &mut [f32],
    parts: &[(usize, usize)],
    kv: impl Fn(usize) -> (&'k [f32], &'k [f32]) + Sync,
    visible: impl Fn(usize) -> usize + Sync,
) {
    let mut pieces = Vec::with_capacity(parts.len());
    let mut rest = out;
    for &(_, n) in parts {
        let (piece, tail) = std::mem::take(&mut rest).split_at_mut(n * d);
        pieces.push(piece);
        rest = tail;
    }
    for_each(pieces, |i, out| {
        let (first, n) = parts[i];
        let seen: Vec<usize> = (first..first + n).map(&visible).collect();
        attend_rows(&q[first * d..(first + n) * d], kv(first), &seen, d, scale, out);
    });
}

/// Query rows `q` (`[n, D]`, at most [`ROWS_TOGETHER`]) over the first `visible[r]` rows of
/// `keys` and `values` (`[_, D]`, float32) into `out` (`[n, D]`): per row, `scale` times each dot
/// product, their exponentials less the maximum (MLX's `exp`), the sum of `exp · value` over the
/// rows in order, divided by the sum of the exponentials.
fn attend_rows(q: &[f32], kv: (&[f32], &[f32]), visible: &[usize], d: usize, scale: f32, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::nn::cpu_qmm::avx2_fma() {
        // SAFETY: the processor has AVX2 and FMA.
        return unsafe { attend_rows_fma(q, kv, visible, d, scale, out) };
    }
    attend_rows_as::<false>(q, kv, visible, d, scale, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_rows_fma(q: &[f32], kv: (&[f32], &[f32]), visible: &[usize], d: usize, scale: f32, out: &mut [f32]) {
    attend_rows_as::<true>(q, kv, visible, d, scale, out)
}

/// [`attend_rows`] with fused multiply-adds (`FMA`) or a product and a sum.
#[inline(always)]
fn attend_rows_as<const FMA: bool>(
    q: &[f32],
    kv: (&[f32], &[f32]),
    visible: &[usize],
    d: usize,
    scale: f32,
    out: &mut [f32],
) {
    match d {
        64 => by_rows::<64, FMA>(q, kv, visible, scale, out),
        128 => by_rows::<128, FMA>(q, kv, visible, scale, out),
        256 => by_rows::<256, FMA>(q, kv, visible, scale, out),
        _ => {
            for ((q, out), &seen) in q.chunks_exact(d).zip(out.chunks_exact_mut(d)).zip(visible) {
                any_size::<FMA>(q, kv, seen, d, scale, out);
            }
        }
    }
}

#[inline(always)]
fn by_rows<const D: usize, const FMA: bool>(
    q: &[f32],
    kv: (&[f32], &[f32]),
    visible: &[usize],
    scale: f32,
    out: &mut [f32],
) {
    match visible.len() {
        1 => rows_of::<D, 1, FMA>(q, kv, visible, scale, out),
        2 => rows_of::<D, 2, FMA>(q, kv, visible, scale, out),
        3 => rows_of::<D, 3, FMA>(q, kv, visible, scale, out),
        _ => rows_of::<D, 4, FMA>(q, kv, visible, scale, out),
    }
}

/// `M` rows of size `D`: the scores of all rows up to the longest's visible rows (a shorter row's
/// extra exponentials set to zero, adding nothing to its sum), then the weighted sums, 16 values
/// of every row at a time, so that each value is loaded once for the `M` rows.
#[inline(always)]
fn rows_of<const D: usize, const M: usize, const FMA: bool>(
    q: &[f32],
    (keys, values): (&[f32], &[f32]),
    visible: &[usize],
    scale: f32,
    out: &mut [f32],
) {
    let n = visible.iter().copied().max().unwrap_or(0);
    let (keys, values) = (&keys[..n * D], &values[..n * D]);
    if M == 1 {
        let mut scores = Vec::with_capacity(n);
        scores_of::<D, FMA>(q, keys, scale, &mut scores);
        let total = exponentials(&mut scores);
        weighted_sum::<D, FMA>(&scores, values, out);
        out.iter_mut().for_each(|o| *o /= total);
        return;
    }
    // Row `m`'s scores, then exponentials, at `scores[pos][m]`.
    let mut scores: Vec<[f32; M]> = Vec::with_capacity(n);
    #[cfg(target_arch = "x86_64")]
    if FMA {
        // SAFETY: FMA is set only under `attend_rows_fma`, on a processor with AVX2 and FMA.
        unsafe { avx2::scores::<D, M>(q, keys, scale, &mut scores) };
    }
    if scores.is_empty() {
        let rows: [&[f32]; M] = std::array::from_fn(|m| &q[m * D..(m + 1) * D]);
        for k in keys.chunks_exact(D) {
            scores.push(std::array::from_fn(|m| scale * dot::<FMA>(rows[m], k)));
        }
    }
    let mut totals = [0f32; M];
    let mut row = Vec::with_capacity(n);
    for (m, total) in totals.iter_mut().enumerate() {
        let seen = visible[m];
        row.clear();
        row.extend(scores[..seen].iter().map(|s| s[m]));
        *total = exponentials(&mut row);
        for (s, &e) in scores.iter_mut().zip(&row) {
            s[m] = e;
        }
        scores[seen..].iter_mut().for_each(|s| s[m] = 0.0);
    }
    #[cfg(target_arch = "x86_64")]
    if FMA {
        // SAFETY: as above.
        unsafe { avx2::weighted_sums::<D, M>(&scores, values, out) };
    }
    if !FMA || cfg!(not(target_arch = "x86_64")) {
        for (m, out) in out.chunks_exact_mut(D).enumerate() {
            row_sum::<FMA>(scores.iter().map(|p| p[m]), values, out);
        }
    }
    for (row, total) in out.chunks_exact_mut(D).zip(totals) {
        row.iter_mut().for_each(|o| *o /= total);
    }
}

/// One row of a head size without rows of its own: the same arithmetic, one key at a time.
#[inline(always)]
fn any_size<const FMA: bool>(
    q: &[f32],
    (keys, values): (&[f32], &[f32]),
    seen: usize,
    d: usize,
    scale: f32,
    out: &mut [f32],
) {
    let mut scores: Vec<f32> = keys[..seen * d].chunks_exact(d).map(|k| scale * dot::<FMA>(q, k)).collect();
    let total = exponentials(&mut scores);
    row_sum::<FMA>(scores.iter().copied(), values, out);
    out.iter_mut().for_each(|o| *o /= total);
}

/// `Σ p[pos] · values[pos]` over the rows of `values` (`[_, out.len()]`) into `out`, one value at a
/// time: [`weighted_sum`]'s arithmetic for any size.
#[inline(always)]
fn row_sum<const FMA: bool>(p: impl Iterator<Item = f32>, values: &[f32], out: &mut [f32]) {
    out.fill(0.0);
    for (p, v) in p.zip(values.chunks_exact(out.len())) {
        out.iter_mut().zip(v).for_each(|(o, &v)| *o = madd::<FMA>(p, v, *o));
    }
}

/// `s ← exp(s − max s)` with MLX's `exp`; returns their sum, taken in order.
#[inline(always)]
fn exponentials(scores: &mut [f32]) -> f32 {
    let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
    scores.iter_mut().for_each(|s| *s = mlx_exp(*s - max));
    scores.iter().fold(0f32, |t, &s| t + s)
}

/// `scale ·` the dot product of the query with every row of `keys` (`[_, D]`), appended to
/// `scores`: four rows at a time, each in eight lanes of its own (the same arithmetic as
/// [`super::cpu_fast::dot_as`], so a key's score does not depend on where its block starts).
#[inline(always)]
fn scores_of<const D: usize, const FMA: bool>(query: &[f32], keys: &[f32], scale: f32, scores: &mut Vec<f32>) {
    let q: &[f32; D] = query.try_into().expect("a query row of D values");
    let mut blocks = keys.chunks_exact(4 * D);
    for block in &mut blocks {
        let mut lanes = [[0f32; 8]; 4];
        for c in 0..D / 8 {
            for (k, lane) in lanes.iter_mut().enumerate() {
                for i in 0..8 {
                    lane[i] = madd::<FMA>(q[c * 8 + i], block[k * D + c * 8 + i], lane[i]);
                }
            }
        }
        scores.extend(lanes.iter().map(|l| scale * l.iter().fold(0f32, |t, &v| t + v)));
    }
    scores.extend(blocks.remainder().chunks_exact(D).map(|k| scale * dot::<FMA>(q, k)));
}

/// `Σ p[i] · values[i]` over the rows of `values` (`[_, D]`) into `out`, the sum held in
/// registers across the rows.
#[inline(always)]
fn weighted_sum<const D: usize, const FMA: bool>(p: &[f32], values: &[f32], out: &mut [f32]) {
    let mut sum = [0f32; D];
    for (&p, v) in p.iter().zip(values.chunks_exact(D)) {
        let v: &[f32; D] = v.try_into().expect("rows of D values");
        for i in 0..D {
            sum[i] = madd::<FMA>(p, v[i], sum[i]);
        }
    }
    out.copy_from_slice(&sum);
}

/// The multi-row kernels in AVX2 and FMA instructions, lane for lane the arithmetic of
/// [`super::cpu_fast::dot_as`] and [`weighted_sum`] (the compiler vectorised the rows instead of the lanes).
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// `scale ·` each row of `q` (`[M, D]`) dotted with each row of `keys`, per key `[M]`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn scores<const D: usize, const M: usize>(
        q: &[f32],
        keys: &[f32],
        scale: f32,
        out: &mut Vec<[f32; M]>,
    ) {
        assert!(q.len() >= M * D && keys.len().is_multiple_of(D));
        let q = q.as_ptr();
        for k in keys.chunks_exact(D) {
            let k = k.as_ptr();
            let mut lanes = [_mm256_setzero_ps(); M];
            for c in 0..D / 8 {
                let kc = _mm256_loadu_ps(k.add(c * 8));
                for (m, lane) in lanes.iter_mut().enumerate() {
                    *lane = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(m * D + c * 8)), kc, *lane);
                }
            }
            out.push(std::array::from_fn(|m| {
                let mut l = [0f32; 8];
                _mm256_storeu_ps(l.as_mut_ptr(), lanes[m]);
                scale * l.iter().fold(0f32, |t, &v| t + v)
            }));
        }
    }

    /// `out[m] = Σ p[pos][m] · values[pos]` (`values` `[_, D]`), 16 values of every row at a time.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn weighted_sums<const D: usize, const M: usize>(
        p: &[[f32; M]],
        values: &[f32],
        out: &mut [f32],
    ) {
        assert!(values.len() >= p.len() * D && out.len() >= M * D && D.is_multiple_of(16));
        let v = values.as_ptr();
        for c0 in (0..D).step_by(16) {
            let mut sums = [[_mm256_setzero_ps(); 2]; M];
            for (pos, p) in p.iter().enumerate() {
                let row = v.add(pos * D + c0);
                let (v0, v1) = (_mm256_loadu_ps(row), _mm256_loadu_ps(row.add(8)));
                for (sum, &p) in sums.iter_mut().zip(p) {
                    let p = _mm256_set1_ps(p);
                    sum[0] = _mm256_fmadd_ps(p, v0, sum[0]);
                    sum[1] = _mm256_fmadd_ps(p, v1, sum[1]);
                }
            }
            for (m, sum) in sums.iter().enumerate() {
                let at = out.as_mut_ptr().add(m * D + c0);
                _mm256_storeu_ps(at, sum[0]);
                _mm256_storeu_ps(at.add(8), sum[1]);
            }
        }
    }
}
