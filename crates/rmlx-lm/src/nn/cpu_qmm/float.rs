//! The float form of the product, for float32 rows: every packed weight unpacked to a float32
//! and multiplied with `x` as it is, exact to float32 summation.
//!
//! A row's dot product is `Σ_g scale_g · Σ_{i∈g} q_i x_i + Σ_g bias_g · Σ_{i∈g} x_i`: the
//! groups' integer-times-float sums are scaled into vector totals, the biases' part is a short
//! dot product with each group's sum of `x`, computed once per row of `x` ([`FloatRows`]). With
//! AVX-512 and 4 bits the kernel instead makes each group's 16 possible weights
//! `scale · q + bias` once and looks every value up among them (`vpermps`), so it has no
//! separate scale or bias step.
//!
//! With SIMD, a block of 32 four-bit values is one 16-byte load: every byte widened to a lane,
//! the low nibbles are the block's values at even positions and the high nibbles those at odd
//! positions, so [`FloatRows`] keeps `x` reordered per block (the even positions, then the odd
//! ones) and the kernel multiplies without shuffling. AVX-512 takes a block in two multiply-adds
//! of 16 lanes, AVX2 in four of 8; eight-bit values are widened in order. [`Columns::dots`]
//! chooses the kernel once for a run of output features and loops over them inside it.

/// Input values per block of the SIMD kernels: a 4-bit block is 16 bytes.
const BLOCK: usize = 32;

/// How far ahead of the block being read the SIMD kernels ask for the packed weights (this row's
/// later blocks, or the next rows'): measured on the 2-core development machine (AVX-512),
/// decoding the default model went from ~83 to ~96 tokens a second with 1,024 bytes (medians of
/// four alternating runs; 512 and 2,048 alike), the weights being read from beyond the core's own
/// cache.
const PREFETCH: usize = 1024;

/// Asks for the cache line `PREFETCH` bytes after `bytes[at]` when `at` starts a line (a prefetch
/// never faults, so past the matrix's end it is only wasted).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch(bytes: *const u8, at: usize) {
    if at.is_multiple_of(64) {
        // SAFETY: a prefetch reads nothing the program sees; the address is only a hint.
        unsafe {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            _mm_prefetch::<_MM_HINT_T0>(bytes.wrapping_add(at + PREFETCH) as *const i8);
        }
    }
}

/// The widest vector instructions the processor has for this form, detected at run time.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Simd {
    /// Plain Rust, for any processor (and groups that are not a multiple of [`BLOCK`]).
    Portable,
    /// AVX2 and FMA: 8 lanes.
    Avx2,
    /// AVX-512 (foundation): 16 lanes.
    Avx512,
}

impl Simd {
    /// The best level this processor runs.
    pub fn detect() -> Simd {
        static LEVEL: std::sync::OnceLock<Simd> = std::sync::OnceLock::new();
        *LEVEL.get_or_init(|| [Simd::Avx512, Simd::Avx2].into_iter().find(|s| s.available()).unwrap_or(Simd::Portable))
    }

    /// Whether this processor runs the level.
    pub fn available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = super::avx2_fma();
            match self {
                Simd::Portable => true,
                Simd::Avx2 => avx2,
                Simd::Avx512 => avx2 && std::is_x86_feature_detected!("avx512f"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        return self == Simd::Portable;
    }
}

/// Rows of `x` (`[m, k]`) made ready for products with matrices of one layout: the values in the
/// order the kernel reads them, and each group's sum (what its bias multiplies).
pub(crate) struct FloatRows {
    values: Vec<f32>,
    sums: Vec<f32>,
    k: usize,
    bits: usize,
    group: usize,
    simd: Simd,
}

impl FloatRows {
    /// `x` for weights of `bits` in groups of `group`, read at `simd` (or plainly, where the group
    /// does not fill whole blocks).
    pub fn new(x: &[f32], k: usize, bits: usize, group: usize, simd: Simd) -> Self {
        // The kernels read whole rows of whole groups: `values` must hold them all.
        assert!(group > 0 && k.is_multiple_of(group) && x.len().is_multiple_of(k.max(1)));
        let simd = if group.is_multiple_of(BLOCK) { simd } else { Simd::Portable };
        let sums = x.chunks(group).map(|g| g.iter().sum()).collect();
        let values = if simd != Simd::Portable && bits == 4 {
            x.chunks_exact(BLOCK)
                .flat_map(|b| (0..BLOCK).map(move |i| b[if i < BLOCK / 2 { 2 * i } else { 2 * i - BLOCK + 1 }]))
                .collect()
        } else {
            x.to_vec()
        };
        FloatRows { values, sums, k, bits, group, simd }
    }

    /// Rows of `x`.
    fn m(&self) -> usize {
        self.values.len() / self.k.max(1)
    }
}

/// Consecutive output features' packed weights (`k · bits / 32` words each) with their scales and
/// biases (`k / group` each) widened to float32.
pub(crate) struct Columns<'a> {
    pub w: &'a [u32],
    pub scales: &'a [f32],
    pub biases: &'a [f32],
}

impl Columns<'_> {
    /// Every feature's dot product with every row of `x`, into `out` (`[features, m]`).
    pub fn dots(&self, x: &FloatRows, out: &mut [f32]) {
        let (groups, words) = (x.k / x.group, x.k * x.bits / 32);
        let columns = out.len() / x.m().max(1);
        assert!(
            out.len() == columns * x.m()
                && self.w.len() == columns * words
                && self.scales.len() == columns * groups
                && self.biases.len() == columns * groups
        );
        #[cfg(target_arch = "x86_64")]
        match x.simd {
            // SAFETY: `FloatRows::new` takes the level from `Simd::detect` or a caller that
            // checked `available`; the lengths are checked above.
            Simd::Avx512 => return unsafe { self.dots_avx512(x, out) },
            Simd::Avx2 => return unsafe { self.dots_avx2(x, out) },
            Simd::Portable => {}
        }
        self.each(x, out, |row, xs, sums| row.dot_portable(x.bits, x.group, xs, sums))
    }

    /// `dot` of every feature with every row of `x`: the loop the kernels are inlined into.
    #[inline(always)]
    fn each(&self, x: &FloatRows, out: &mut [f32], dot: impl Fn(&Row<'_>, &[f32], &[f32]) -> f32) {
        let (k, m, groups, words) = (x.k, x.m(), x.k / x.group, x.k * x.bits / 32);
        for (c, col) in out.chunks_exact_mut(m).enumerate() {
            let row = Row {
                w: &self.w[c * words..(c + 1) * words],
                scales: &self.scales[c * groups..(c + 1) * groups],
                biases: &self.biases[c * groups..(c + 1) * groups],
            };
            for (r, v) in col.iter_mut().enumerate() {
                *v = dot(&row, &x.values[r * k..(r + 1) * k], &x.sums[r * groups..(r + 1) * groups]);
            }
        }
    }

    /// [`each`](Self::each) with `dots` taking [`ROWS_TOGETHER`] rows of `x` at once (their values
    /// and group sums), the rows past the last whole set one at a time through `dots` too (the
    /// others' places filled with the last row: a row's result does not depend on the others).
    #[inline(always)]
    fn each_rows(
        &self,
        x: &FloatRows,
        out: &mut [f32],
        dots: impl Fn(&Row<'_>, [&[f32]; ROWS_TOGETHER], [&[f32]; ROWS_TOGETHER]) -> [f32; ROWS_TOGETHER],
    ) {
        let (k, m, groups, words) = (x.k, x.m(), x.k / x.group, x.k * x.bits / 32);
        let values = |r: usize| &x.values[r * k..(r + 1) * k];
        let sums = |r: usize| &x.sums[r * groups..(r + 1) * groups];
        for (c, col) in out.chunks_exact_mut(m).enumerate() {
            let row = Row {
                w: &self.w[c * words..(c + 1) * words],
                scales: &self.scales[c * groups..(c + 1) * groups],
                biases: &self.biases[c * groups..(c + 1) * groups],
            };
            for first in (0..m).step_by(ROWS_TOGETHER) {
                let rows: [usize; ROWS_TOGETHER] = std::array::from_fn(|i| (first + i).min(m - 1));
                let got = dots(&row, rows.map(values), rows.map(sums));
                for (i, v) in got.iter().enumerate().take(m - first) {
                    col[first + i] = *v;
                }
            }
        }
    }

    /// The AVX-512 kernel for the layout, the common groups' block counts fixed.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn dots_avx512(&self, x: &FloatRows, out: &mut [f32]) {
        let group = x.group;
        match (x.bits, group / BLOCK) {
            (4, 1) => self.each(x, out, |row, xs, _| row.dot_avx512_table::<1>(group, xs)),
            (4, 2) => self.each(x, out, |row, xs, _| row.dot_avx512_table::<2>(group, xs)),
            (4, 4) => self.each(x, out, |row, xs, _| row.dot_avx512_table::<4>(group, xs)),
            (4, _) => self.each(x, out, |row, xs, _| row.dot_avx512_table::<0>(group, xs)),
            (_, 1) => self.each(x, out, |row, xs, sums| row.dot_avx512_bytes::<1>(group, xs, sums)),
            (_, 2) => self.each(x, out, |row, xs, sums| row.dot_avx512_bytes::<2>(group, xs, sums)),
            (_, 4) => self.each(x, out, |row, xs, sums| row.dot_avx512_bytes::<4>(group, xs, sums)),
            _ => self.each(x, out, |row, xs, sums| row.dot_avx512_bytes::<0>(group, xs, sums)),
        }
    }

    /// The AVX2 kernel for the layout, the common groups' block counts fixed; several rows of `x`
    /// go through it [`ROWS_TOGETHER`] at a time ([`Row::dots_avx2`]).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dots_avx2(&self, x: &FloatRows, out: &mut [f32]) {
        let group = x.group;
        if x.m() >= ROWS_TOGETHER {
            return match (x.bits, group / BLOCK) {
                (4, 1) => self.each_rows(x, out, |row, xs, sums| row.dots_avx2::<4, 1, ROWS_TOGETHER>(group, xs, sums)),
                (4, 2) => self.each_rows(x, out, |row, xs, sums| row.dots_avx2::<4, 2, ROWS_TOGETHER>(group, xs, sums)),
                (4, 4) => self.each_rows(x, out, |row, xs, sums| row.dots_avx2::<4, 4, ROWS_TOGETHER>(group, xs, sums)),
                (4, _) => self.each_rows(x, out, |row, xs, sums| row.dots_avx2::<4, 0, ROWS_TOGETHER>(group, xs, sums)),
                (_, 1) => self.each_rows(x, out, |row, xs, sums| row.dots_avx2::<8, 1, ROWS_TOGETHER>(group, xs, sums)),
                (_, 2) => self.each_rows(x, out, |row, xs, sums| row.dots_avx2::<8, 2, ROWS_TOGETHER>(group, xs, sums)),
                (_, 4) => self.each_rows(x, out, |row, xs, sums| row.dots_avx2::<8, 4, ROWS_TOGETHER>(group, xs, sums)),
                _ => self.each_rows(x, out, |row, xs, sums| row.dots_avx2::<8, 0, ROWS_TOGETHER>(group, xs, sums)),
            };
        }
        match (x.bits, group / BLOCK) {
            (4, 1) => self.each(x, out, |row, xs, sums| row.dot_avx2::<4, 1>(group, xs, sums)),
            (4, 2) => self.each(x, out, |row, xs, sums| row.dot_avx2::<4, 2>(group, xs, sums)),
            (4, 4) => self.each(x, out, |row, xs, sums| row.dot_avx2::<4, 4>(group, xs, sums)),
            (4, _) => self.each(x, out, |row, xs, sums| row.dot_avx2::<4, 0>(group, xs, sums)),
            (_, 1) => self.each(x, out, |row, xs, sums| row.dot_avx2::<8, 1>(group, xs, sums)),
            (_, 2) => self.each(x, out, |row, xs, sums| row.dot_avx2::<8, 2>(group, xs, sums)),
            (_, 4) => self.each(x, out, |row, xs, sums| row.dot_avx2::<8, 4>(group, xs, sums)),
            _ => self.each(x, out, |row, xs, sums| row.dot_avx2::<8, 0>(group, xs, sums)),
        }
    }
}

/// Rows of `x` the AVX2 kernel takes at once: each block of weights unpacked once for all of them.
pub const ROWS_TOGETHER: usize = 2;

/// One output feature's packed weights with its scales and biases.
struct Row<'a> {
    w: &'a [u32],
    scales: &'a [f32],
    biases: &'a [f32],
}

impl Row<'_> {
    /// `Σ_g bias_g · xsum_g`.
    fn biases_term(&self, xsum: &[f32]) -> f32 {
        // Four partial sums: one made each addition wait for the one before.
        let mut acc = [0f32; 4];
        let mut chunks = self.biases.chunks_exact(4).zip(xsum.chunks_exact(4));
        for (b, s) in &mut chunks {
            for j in 0..4 {
                acc[j] += b[j] * s[j];
            }
        }
        let tail = self.biases.len() / 4 * 4;
        let rest: f32 = self.biases[tail..].iter().zip(&xsum[tail..]).map(|(b, s)| b * s).sum();
        (acc[0] + acc[1]) + (acc[2] + acc[3]) + rest
    }

    /// `Σ_g scale_g · part(g)` over the groups, the groups going round four totals so that no
    /// group's multiply-add waits for the one before.
    #[inline(always)]
    fn scaled_sum<V: Copy>(
        &self,
        zero: V,
        fma: impl Fn(f32, V, V) -> V,
        add: impl Fn(V, V) -> V,
        part: impl Fn(usize) -> V,
    ) -> V {
        let (s, groups) = (self.scales, self.scales.len());
        let (mut t0, mut t1, mut t2, mut t3) = (zero, zero, zero, zero);
        let mut g = 0;
        while g + 4 <= groups {
            t0 = fma(s[g], part(g), t0);
            t1 = fma(s[g + 1], part(g + 1), t1);
            t2 = fma(s[g + 2], part(g + 2), t2);
            t3 = fma(s[g + 3], part(g + 3), t3);
            g += 4;
        }
        while g < groups {
            t0 = fma(s[g], part(g), t0);
            g += 1;
        }
        add(add(t0, t1), add(t2, t3))
    }

    /// Eight bits with AVX-512. `BLOCKS`: blocks a group, or 0 for any (`group / BLOCK`).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn dot_avx512_bytes<const BLOCKS: usize>(&self, group: usize, x: &[f32], xsum: &[f32]) -> f32 {
        use std::arch::x86_64::*;
        let (bytes, xp) = (self.w.as_ptr() as *const u8, x.as_ptr());
        let blocks_per_group = if BLOCKS > 0 { BLOCKS } else { group / BLOCK };
        let widen = |at: *const u8| _mm512_cvtepu8_epi32(_mm_loadu_si128(at as *const __m128i));
        // One group's `Σ q·x` in 16 lanes: two multiply-adds a block.
        let part = |g: usize| {
            let mut part = _mm512_setzero_ps();
            for b in g * blocks_per_group..(g + 1) * blocks_per_group {
                prefetch(bytes, BLOCK * b);
                let xb = xp.add(BLOCK * b);
                let (lo, hi) = (widen(bytes.add(BLOCK * b)), widen(bytes.add(BLOCK * b + 16)));
                part = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_loadu_ps(xb), part);
                part = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_loadu_ps(xb.add(16)), part);
            }
            part
        };
        let fma = |s: f32, v, t| _mm512_fmadd_ps(_mm512_set1_ps(s), v, t);
        let total = self.scaled_sum(_mm512_setzero_ps(), fma, |a, b| _mm512_add_ps(a, b), part);
        _mm512_reduce_add_ps(total) + self.biases_term(xsum)
    }

    /// Four bits with AVX-512: each group's 16 possible weights `scale · q + bias` made once as a
    /// vector, and every value looked up in it by its nibble (`vpermps` reads an index's low four
    /// bits), so that a block is a widening, a shift, two look-ups and two multiply-adds.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn dot_avx512_table<const BLOCKS: usize>(&self, group: usize, x: &[f32]) -> f32 {
        use std::arch::x86_64::*;
        let (bytes, xp) = (self.w.as_ptr() as *const u8, x.as_ptr());
        let blocks_per_group = if BLOCKS > 0 { BLOCKS } else { group / BLOCK };
        let steps = _mm512_setr_ps(0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.);
        let (mut a, mut b) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        for (g, (&scale, &bias)) in self.scales.iter().zip(self.biases).enumerate() {
            let table = _mm512_fmadd_ps(steps, _mm512_set1_ps(scale), _mm512_set1_ps(bias));
            for blk in g * blocks_per_group..(g + 1) * blocks_per_group {
                prefetch(bytes, 16 * blk);
                let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(bytes.add(16 * blk) as *const __m128i));
                let xb = xp.add(BLOCK * blk);
                a = _mm512_fmadd_ps(_mm512_permutexvar_ps(v, table), _mm512_loadu_ps(xb), a);
                b = _mm512_fmadd_ps(
                    _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table),
                    _mm512_loadu_ps(xb.add(16)),
                    b,
                );
            }
        }
        _mm512_reduce_add_ps(_mm512_add_ps(a, b))
    }

    /// AVX2. `BLOCKS`: blocks a group, or 0 for any (`group / BLOCK`): [`dots_avx2`](Self::dots_avx2)
    /// of the one row `x`.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn dot_avx2<const BITS: usize, const BLOCKS: usize>(&self, group: usize, x: &[f32], xsum: &[f32]) -> f32 {
        self.dots_avx2::<BITS, BLOCKS, 1>(group, [x], [xsum])[0]
    }

    /// `R` rows of `x` (one, or [`ROWS_TOGETHER`]) with AVX2: each block's values widened once,
    /// then multiplied into each row's two sums (four multiply-adds a block); per group the sums
    /// added and scaled; each row's result the same bits whatever `R`.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn dots_avx2<const BITS: usize, const BLOCKS: usize, const R: usize>(
        &self,
        group: usize,
        xs: [&[f32]; R],
        xsums: [&[f32]; R],
    ) -> [f32; R] {
        use std::arch::x86_64::*;
        let bytes = self.w.as_ptr() as *const u8;
        let xps = xs.map(|x| x.as_ptr());
        let blocks_per_group = if BLOCKS > 0 { BLOCKS } else { group / BLOCK };
        let nibble = _mm256_set1_epi32(15);
        let widen = |at: *const u8| _mm256_cvtepu8_epi32(_mm_loadl_epi64(at as *const __m128i));
        let part = |g: usize| {
            let (mut a, mut b) = ([_mm256_setzero_ps(); R], [_mm256_setzero_ps(); R]);
            for blk in g * blocks_per_group..(g + 1) * blocks_per_group {
                prefetch(bytes, blk * BLOCK * BITS / 8);
                // Vectors of the block's values, in the order of `FloatRows`' inputs.
                let v: [__m256i; 4] = if BITS == 4 {
                    let (v0, v1) = (widen(bytes.add(16 * blk)), widen(bytes.add(16 * blk + 8)));
                    [
                        _mm256_and_si256(v0, nibble),
                        _mm256_and_si256(v1, nibble),
                        _mm256_srli_epi32(v0, 4),
                        _mm256_srli_epi32(v1, 4),
                    ]
                } else {
                    let at = bytes.add(BLOCK * blk);
                    [widen(at), widen(at.add(8)), widen(at.add(16)), widen(at.add(24))]
                };
                let w = v.map(|v| _mm256_cvtepi32_ps(v));
                for r in 0..R {
                    let xb = xps[r].add(BLOCK * blk);
                    a[r] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xb), a[r]);
                    b[r] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xb.add(8)), b[r]);
                    a[r] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb.add(16)), a[r]);
                    b[r] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb.add(24)), b[r]);
                }
            }
            std::array::from_fn::<__m256, R, _>(|r| _mm256_add_ps(a[r], b[r]))
        };
        let fma = |s: f32, v: [__m256; R], t: [__m256; R]| {
            std::array::from_fn(|r| _mm256_fmadd_ps(_mm256_set1_ps(s), v[r], t[r]))
        };
        let add = |p: [__m256; R], q: [__m256; R]| std::array::from_fn(|r| _mm256_add_ps(p[r], q[r]));
        let total = self.scaled_sum([_mm256_setzero_ps(); R], fma, add, part);
        std::array::from_fn(|r| {
            let mut lanes = [0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), total[r]);
            lanes.iter().sum::<f32>() + self.biases_term(xsums[r])
        })
    }

    /// Written for the compiler to vectorise: eight (or four) lanes, one per value of a word.
    fn dot_portable(&self, bits: usize, group: usize, x: &[f32], xsum: &[f32]) -> f32 {
        match bits {
            4 => self.dot_bits::<4, 8>(group, x, xsum),
            _ => self.dot_bits::<8, 4>(group, x, xsum),
        }
    }

    #[inline(always)]
    fn dot_bits<const BITS: u32, const PER_WORD: usize>(&self, group: usize, x: &[f32], xsum: &[f32]) -> f32 {
        let mask = (1u32 << BITS) - 1;
        let words_per_group = group / PER_WORD;
        let mut total = [0f32; PER_WORD];
        for (g, words) in self.w.chunks_exact(words_per_group).enumerate() {
            let mut acc = [0f32; PER_WORD];
            let xg = &x[g * group..(g + 1) * group];
            for (word, xs) in words.iter().zip(xg.chunks_exact(PER_WORD)) {
                for j in 0..PER_WORD {
                    acc[j] += ((word >> (BITS * j as u32)) & mask) as f32 * xs[j];
                }
            }
            for j in 0..PER_WORD {
                total[j] += self.scales[g] * acc[j];
            }
        }
        total.iter().sum::<f32>() + self.biases_term(xsum)
    }
}
