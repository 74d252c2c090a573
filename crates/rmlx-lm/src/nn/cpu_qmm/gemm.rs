//! The product of many rows (a prompt) with a packed matrix: the matrix dequantised sixteen
//! output features at a time into a small float32 panel, which every row then multiplies in
//! register tiles of six rows by sixteen features (AVX2 and FMA where the processor has them).
//!
//! Each weight is unpacked once per product and never stored whole: a prompt of `m` rows
//! spends `m` multiply-adds per unpacked value, where dequantising the matrix for a BLAS product
//! wrote and read back the float32 matrix, and the BLAS threads' idle spinning took a core's
//! share of a prompt. The values are exactly the float32 dequantisation `scale · q + bias`; the
//! sums run in float32 along the input features, in another order than a BLAS product's.

use super::{Packed, Scalar, Scalars};

/// Output features per panel: two AVX registers.
const NR: usize = 16;

/// Rows per register tile: 6 × 2 accumulators, 2 panel registers and a broadcast fill 15 of
/// AVX2's 16 registers.
const MR: usize = 6;

/// Output features per parallel task (whole panels).
const TASK_COLUMNS: usize = 4 * NR;

impl Packed<'_> {
    /// `[n, m]`: every output feature for every row of `x` (`[m, k]`), the columns split over
    /// the threads.
    pub(crate) fn gemm(&self, x: &[f32]) -> Vec<f32> {
        let m = x.len() / self.k.max(1);
        let mut y = vec![0f32; self.n * m];
        if y.is_empty() {
            return y;
        }
        let simd = super::avx2_fma();
        super::super::cpu_pool::for_each_part(&mut y, TASK_COLUMNS * m, |task, out| {
            let mut panel = vec![0f32; self.k * NR];
            let first = task * TASK_COLUMNS;
            for (p, part) in out.chunks_mut(NR * m).enumerate() {
                let c = first + p * NR;
                let count = part.len() / m;
                self.unpack_panel(c, count, &mut panel);
                tiles(simd, x, self.k, &panel, part, m);
            }
        });
        y
    }

    /// Output features `first..first + count` dequantised into `panel` (`[k, NR]`, features
    /// last; the features beyond `count` zero).
    fn unpack_panel(&self, first: usize, count: usize, panel: &mut [f32]) {
        match (&self.scales, &self.biases) {
            (Scalars::F32(s), Scalars::F32(b)) => self.unpack_panel_of(s, b, first, count, panel),
            (Scalars::Bf16(s), Scalars::Bf16(b)) => self.unpack_panel_of(s, b, first, count, panel),
            (Scalars::F16(s), Scalars::F16(b)) => self.unpack_panel_of(s, b, first, count, panel),
            _ => unreachable!("`Packed::of` checks that scales and biases share a dtype"),
        }
    }

    fn unpack_panel_of<S: Scalar>(&self, scales: &[S], biases: &[S], first: usize, count: usize, panel: &mut [f32]) {
        let (k, bits, group) = (self.k, self.bits, self.group);
        let (groups, words) = (k / group, k * bits / 32);
        let per_word = 32 / bits;
        let mask = (1u32 << bits) - 1;
        let mut row = vec![0f32; k];
        for j in 0..NR {
            if j >= count {
                panel.iter_mut().skip(j).step_by(NR).for_each(|v| *v = 0.0);
                continue;
            }
            let c = first + j;
            let w = &self.words[c * words..(c + 1) * words];
            for (g, out) in row.chunks_exact_mut(group).enumerate() {
                let (scale, bias) = (scales[c * groups + g].f(), biases[c * groups + g].f());
                let gw = &w[g * group / per_word..(g + 1) * group / per_word];
                for (word, vs) in gw.iter().zip(out.chunks_exact_mut(per_word)) {
                    for (i, v) in vs.iter_mut().enumerate() {
                        *v = scale * ((word >> (bits * i)) & mask) as f32 + bias;
                    }
                }
            }
            for (p, v) in row.iter().enumerate() {
                panel[p * NR + j] = *v;
            }
        }
    }
}

/// `out` (`[count, m]`, `count ≤ NR` features) = `x` (`[m, k]`) times `panel` (`[k, NR]`).
fn tiles(simd: bool, x: &[f32], k: usize, panel: &[f32], out: &mut [f32], m: usize) {
    let count = out.len() / m;
    let mut tile = [[0f32; NR]; MR];
    for r0 in (0..m).step_by(MR) {
        let rows = (m - r0).min(MR);
        let a = &x[r0 * k..(r0 + rows) * k];
        match rows {
            6 => tile_of::<6>(simd, a, k, panel, &mut tile),
            5 => tile_of::<5>(simd, a, k, panel, &mut tile),
            4 => tile_of::<4>(simd, a, k, panel, &mut tile),
            3 => tile_of::<3>(simd, a, k, panel, &mut tile),
            2 => tile_of::<2>(simd, a, k, panel, &mut tile),
            _ => tile_of::<1>(simd, a, k, panel, &mut tile),
        }
        for (j, col) in out.chunks_exact_mut(m).enumerate().take(count) {
            for (r, t) in tile.iter().enumerate().take(rows) {
                col[r0 + r] = t[j];
            }
        }
    }
}

/// The first `R` rows of `tile` = the `R` rows of `a` (`[R, k]`) times `panel`.
fn tile_of<const R: usize>(simd: bool, a: &[f32], k: usize, panel: &[f32], tile: &mut [[f32; NR]; MR]) {
    assert!(a.len() == R * k && panel.len() == k * NR && R <= MR);
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `avx2_fma` found the features; the lengths are checked above.
        unsafe { tile_avx2::<R>(a, k, panel, tile) };
        return;
    }
    let _ = simd;
    for (r, t) in tile.iter_mut().enumerate().take(R) {
        *t = [0f32; NR];
        for (p, b) in panel.chunks_exact(NR).enumerate() {
            let v = a[r * k + p];
            for (acc, w) in t.iter_mut().zip(b) {
                *acc += v * w;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2<const R: usize>(a: &[f32], k: usize, panel: &[f32], tile: &mut [[f32; NR]; MR]) {
    use std::arch::x86_64::*;
    let (a, b) = (a.as_ptr(), panel.as_ptr());
    let mut lo = [_mm256_setzero_ps(); R];
    let mut hi = [_mm256_setzero_ps(); R];
    for p in 0..k {
        let b0 = _mm256_loadu_ps(b.add(p * NR));
        let b1 = _mm256_loadu_ps(b.add(p * NR + 8));
        for r in 0..R {
            let v = _mm256_broadcast_ss(&*a.add(r * k + p));
            lo[r] = _mm256_fmadd_ps(v, b0, lo[r]);
            hi[r] = _mm256_fmadd_ps(v, b1, hi[r]);
        }
    }
    for r in 0..R {
        _mm256_storeu_ps(tile[r].as_mut_ptr(), lo[r]);
        _mm256_storeu_ps(tile[r].as_mut_ptr().add(8), hi[r]);
    }
}
