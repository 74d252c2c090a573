//! The integer form of the product, for half-precision rows: every block of 32 input values is
//! quantised to 8 bits with one float32 scale (`d = max|x| / 127`), as llama.cpp quantises its
//! activations, and each block's dot product with the 4- or 8-bit weights is a sum of integer
//! products — 32 multiply-adds per AVX2 instruction (`maddubs`) where the float form does 8.
//!
//! The result is exactly the dequantised weights times `x̂`, `x` rounded to those steps (up to
//! float32 summation): each group contributes `scale · Σ q·x̂ + bias · Σ x̂`. Using the rounded
//! `x̂` in the biases' term too keeps the two halves of `w = scale · q + bias` cancelling as they
//! do in `w`; the exact `Σx` there made the error several times larger. The rounding is at most
//! half a step of `max|x| / 127` per value, the size of the rounding a bfloat16 input already
//! carries (8 significant bits), which is why the float form stays the one for float32 inputs.

use super::Scalar;

/// Input values per activation block (and per integer dot product).
pub const BLOCK: usize = 32;

/// The rows of `x` quantised: per block, a scale and 32 values, in the order the packed weights
/// unpack to (4 bits: the even positions of the block, then the odd ones; 8 bits: as they are).
pub struct QuantizedRows {
    values: Vec<i8>,
    scales: Vec<f32>,
    /// Per group, the sum of the rounded inputs `Σ x̂`: what the group's bias multiplies (and, for
    /// 8 bits, 128 × the scale: the values are made signed by subtracting 128).
    sums: Vec<f32>,
    k: usize,
    group: usize,
}

impl QuantizedRows {
    /// Quantises the rows (`[m, k]`, `k` a multiple of `group`, a multiple of [`BLOCK`]) for
    /// weights of `bits` in groups of `group`.
    pub fn new(x: &[f32], k: usize, bits: usize, group: usize) -> Self {
        let mut values = vec![0i8; x.len()];
        let mut scales = Vec::with_capacity(x.len() / BLOCK);
        for (xs, out) in x.chunks_exact(BLOCK).zip(values.chunks_exact_mut(BLOCK)) {
            let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
            let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
            // A NaN or infinite input makes its block's products NaN, as the float form would.
            let finite = amax.is_finite() && xs.iter().all(|v| !v.is_nan());
            scales.push(if finite { amax / 127.0 } else { f32::NAN });
            for (i, v) in xs.iter().enumerate() {
                let slot = if bits == 4 { (i % 2) * (BLOCK / 2) + i / 2 } else { i };
                out[slot] = round_half_away(v * inv) as i8;
            }
        }
        let per_group = group / BLOCK;
        let block_sums: Vec<f32> = values
            .chunks_exact(BLOCK)
            .zip(&scales)
            .map(|(q, d)| d * q.iter().map(|&v| v as i32).sum::<i32>() as f32)
            .collect();
        let sums = block_sums.chunks_exact(per_group).map(|g| g.iter().sum()).collect();
        QuantizedRows { values, scales, sums, k, group }
    }

    /// Row `r`'s values, block scales and group sums.
    fn row(&self, r: usize) -> (&[i8], &[f32], &[f32]) {
        let (blocks, groups) = (self.k / BLOCK, self.k / self.group);
        let sums = &self.sums[r * groups..(r + 1) * groups];
        (&self.values[r * self.k..(r + 1) * self.k], &self.scales[r * blocks..(r + 1) * blocks], sums)
    }
}

/// `x` (finite, `|x| ≤ 127`) rounded to the nearest integer, halves away from zero, as
/// `f32::round` (a call into libm on x86-64 without SSE4.1) rounds it.
#[inline]
fn round_half_away(x: f32) -> i32 {
    let whole = x as i32;
    let fraction = x - whole as f32;
    whole + (fraction >= 0.5) as i32 - (fraction <= -0.5) as i32
}

/// A packed matrix: `[n, k]` values of `bits` bits (`k · bits / 32` words a row) and per-group
/// scales and biases (`[n, k / group]`). Its rows are the output columns of the product.
pub struct Matrix<'a, S> {
    pub words: &'a [u32],
    pub scales: &'a [S],
    pub biases: &'a [S],
    pub bits: usize,
    pub group: usize,
    pub k: usize,
}

/// Output columns one pass of the AVX2 kernels computes (independent chains, one read of `x`).
const LANES: usize = 4;

impl<S: Scalar> Matrix<'_, S> {
    /// `out[i]` = the product of row `r` of `x` (rounded) with column `first + i`: `Σ_g scale_g ·
    /// Σ_{i∈g} q_i x̂_i + bias_g · Σ_{i∈g} x̂_i`. `simd`: the processor has AVX2 and FMA.
    pub fn dots(&self, simd: bool, x: &QuantizedRows, r: usize, first: usize, out: &mut [f32]) {
        let (xq, xd, xsum) = x.row(r);
        debug_assert_eq!(x.group, self.group);
        let mut c = first;
        #[cfg(target_arch = "x86_64")]
        if simd {
            for chunk in out.chunks_exact_mut(LANES) {
                // SAFETY: the caller found AVX2 and FMA; `lanes` checks the bounds.
                let dots = unsafe {
                    match self.bits {
                        4 => self.lanes::<4>(c, xq, xd, xsum),
                        _ => self.lanes::<8>(c, xq, xd, xsum),
                    }
                };
                chunk.copy_from_slice(&dots);
                c += LANES;
            }
            let done = out.len() / LANES * LANES;
            for v in &mut out[done..] {
                *v = self.dot(c, xq, xd, xsum);
                c += 1;
            }
            return;
        }
        let _ = simd;
        for v in out {
            *v = self.dot(c, xq, xd, xsum);
            c += 1;
        }
    }

    /// Column `c`, portably.
    fn dot(&self, c: usize, xq: &[i8], xd: &[f32], xsum: &[f32]) -> f32 {
        let (groups, per_group) = (self.k / self.group, self.group / BLOCK);
        let words_per_block = BLOCK * self.bits / 32;
        let words = &self.words[c * self.k * self.bits / 32..][..self.k * self.bits / 32];
        let mut total = 0f32;
        for (g, &sum) in xsum.iter().enumerate().take(groups) {
            let (scale, bias) = (self.scales[c * groups + g].f(), self.biases[c * groups + g].f());
            let mut acc = 0f32;
            for b in g * per_group..(g + 1) * per_group {
                let bytes = words[b * words_per_block..][..words_per_block].iter().flat_map(|w| w.to_le_bytes());
                let xs = &xq[b * BLOCK..(b + 1) * BLOCK];
                let sum: i32 = if self.bits == 4 {
                    bytes
                        .enumerate()
                        .map(|(j, q)| (q & 15) as i32 * xs[j] as i32 + (q >> 4) as i32 * xs[BLOCK / 2 + j] as i32)
                        .sum()
                } else {
                    bytes.zip(xs).map(|(q, &x)| (q as i32 - 128) * x as i32).sum()
                };
                acc += sum as f32 * xd[b];
            }
            let shift = if self.bits == 8 { 128.0 * scale } else { 0.0 };
            total += acc * scale + (shift + bias) * sum;
        }
        total
    }

    /// Columns `c..c + LANES` with AVX2: per block of 32, one integer dot product per column
    /// (`maddubs` of the unsigned 4-bit values, or of the 8-bit ones made signed, with `x`).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn lanes<const BITS: usize>(&self, c: usize, xq: &[i8], xd: &[f32], xsum: &[f32]) -> [f32; LANES] {
        use std::arch::x86_64::*;
        let (groups, per_group) = (self.k / self.group, self.group / BLOCK);
        let row_words = self.k * BITS / 32;
        assert!(
            BITS == self.bits
                && (c + LANES) * row_words <= self.words.len()
                && (c + LANES) * groups <= self.scales.len().min(self.biases.len())
                && xq.len() >= self.k
                && xd.len() * BLOCK >= self.k
                && xsum.len() >= groups
        );
        let (low, ones, shift) = (_mm_set1_epi8(15), _mm256_set1_epi16(1), _mm256_set1_epi8(-128));
        let base = self.words.as_ptr().add(c * row_words) as *const u8;
        let (scales, biases) = (self.scales.as_ptr().add(c * groups), self.biases.as_ptr().add(c * groups));
        let (mut a0, mut a1, mut a2, mut a3) =
            (_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps());
        let mut bias_total = [0f32; LANES];
        // One column's integer sums of a block (at `at`) with `x` (a macro: a closure would not
        // inherit the enabled features, and its intrinsics would not be inlined).
        macro_rules! block {
            ($at:expr, $x:expr) => {
                if BITS == 4 {
                    let packed = _mm_loadu_si128($at as *const __m128i);
                    let even = _mm_and_si128(packed, low);
                    let odd = _mm_and_si128(_mm_srli_epi16(packed, 4), low);
                    _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set_m128i(odd, even), $x), ones)
                } else {
                    let w = _mm256_xor_si256(_mm256_loadu_si256($at as *const __m256i), shift);
                    // Signed × signed through unsigned × signed: |w| · (x with w's sign).
                    let pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8($x, w));
                    _mm256_madd_epi16(pairs, ones)
                }
            };
        }
        let stride = row_words * 4;
        for (g, &sum) in xsum.iter().enumerate().take(groups) {
            let mut scale = [0f32; LANES];
            for j in 0..LANES {
                // SAFETY: group `g` of rows `c..c + LANES` is in bounds (asserted above).
                scale[j] = (*scales.add(j * groups + g)).f();
                let shift = if BITS == 8 { 128.0 * scale[j] } else { 0.0 };
                bias_total[j] += (shift + (*biases.add(j * groups + g)).f()) * sum;
            }
            for b in g * per_group..(g + 1) * per_group {
                // SAFETY (all loads): block `b` of rows `c..c + LANES` and of `x` are in bounds
                // (asserted above).
                let x = _mm256_loadu_si256(xq.as_ptr().add(b * BLOCK) as *const __m256i);
                let d = *xd.get_unchecked(b);
                let at = base.add(b * BLOCK * BITS / 8);
                let (s0, s1) = (block!(at, x), block!(at.add(stride), x));
                let (s2, s3) = (block!(at.add(2 * stride), x), block!(at.add(3 * stride), x));
                a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_set1_ps(d * scale[0]), a0);
                a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_set1_ps(d * scale[1]), a1);
                a2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s2), _mm256_set1_ps(d * scale[2]), a2);
                a3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s3), _mm256_set1_ps(d * scale[3]), a3);
            }
        }
        let acc = [a0, a1, a2, a3];
        let mut out = [0f32; LANES];
        for j in 0..LANES {
            out[j] = horizontal_sum(acc[j]) + bias_total[j];
        }
        out
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn horizontal_sum(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
}
