//! The product of many rows (a prompt) with a packed matrix: the matrix dequantised six output
//! features at a time into a small float32 panel, which every block of sixteen rows then
//! multiplies in a register tile of sixteen rows by six features (AVX2 and FMA where the
//! processor has them).
//!
//! Each weight is unpacked once per product and never stored whole: a prompt of `m` rows
//! spends `m` multiply-adds per unpacked value, where dequantising the matrix for a BLAS product
//! wrote and read back the float32 matrix, and the BLAS threads' idle spinning took a core's
//! share of a prompt. The rows are packed once per product in blocks of sixteen, feature-major
//! (`[k, 16]`), so that the tile reads two vectors of rows per input feature and broadcasts each
//! panel weight; a panel holds whole unpacked weight rows, written in order.
//!
//! The values are exactly the float32 dequantisation `scale · q + bias`; the sums run in float32
//! along the input features, in another order than a BLAS product's.

use super::{Floats, Packed, Scalar};

/// Rows per register tile and per packed block of the input: two AVX registers.
const ROWS: usize = 16;

/// Output features per panel: 6 × 2 accumulators, 2 row registers and a broadcast fill 15 of
/// AVX2's 16 registers.
const FEATURES: usize = 6;

/// Output features per parallel task (whole panels).
const TASK_FEATURES: usize = 8 * FEATURES;

impl Packed<'_> {
    /// `[n, m]`: every output feature for every row of `x` (`[m, k]`), the features split over
    /// the threads.
    pub(crate) fn gemm(&self, x: &[f32]) -> Vec<f32> {
        let (k, m) = (self.k, x.len() / self.k.max(1));
        let mut y = vec![0f32; self.n * m];
        if y.is_empty() {
            return y;
        }
        let blocks = pack_rows(x, k, m);
        let simd = super::avx2_fma();
        super::super::cpu_pool::for_each_part(&mut y, TASK_FEATURES * m, |task, out| {
            let mut panel = vec![0f32; FEATURES * k];
            let first = task * TASK_FEATURES;
            for (p, part) in out.chunks_mut(FEATURES * m).enumerate() {
                let count = part.len() / m;
                self.unpack_panel(simd, first + p * FEATURES, count, &mut panel);
                for (b, block) in blocks.chunks_exact(k * ROWS).enumerate() {
                    let tile = tile(simd, block, &panel, k);
                    let (r0, rows) = (b * ROWS, (m - b * ROWS).min(ROWS));
                    for (j, col) in part.chunks_exact_mut(m).enumerate() {
                        col[r0..r0 + rows].copy_from_slice(&tile[j][..rows]);
                    }
                }
            }
        });
        y
    }

    /// Output features `first..first + count` dequantised into `panel` (`[FEATURES, k]`, the
    /// features beyond `count` zero).
    fn unpack_panel(&self, simd: bool, first: usize, count: usize, panel: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if simd {
            // SAFETY: `avx2_fma` found the features.
            return unsafe { self.unpack_panel_avx2(first, count, panel) };
        }
        let _ = simd;
        self.unpack_panel_portable(first, count, panel)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn unpack_panel_avx2(&self, first: usize, count: usize, panel: &mut [f32]) {
        self.unpack_panel_portable(first, count, panel)
    }

    #[inline(always)]
    fn unpack_panel_portable(&self, first: usize, count: usize, panel: &mut [f32]) {
        for (j, row) in panel.chunks_exact_mut(self.k).enumerate() {
            if j >= count {
                row.fill(0.0);
                continue;
            }
            match (&self.scales, &self.biases, self.bits) {
                (Floats::F32(s), Floats::F32(b), 4) => self.unpack_row::<_, 4, 8>(s, b, first + j, row),
                (Floats::F32(s), Floats::F32(b), _) => self.unpack_row::<_, 8, 4>(s, b, first + j, row),
                (Floats::Bf16(s), Floats::Bf16(b), 4) => self.unpack_row::<_, 4, 8>(s, b, first + j, row),
                (Floats::Bf16(s), Floats::Bf16(b), _) => self.unpack_row::<_, 8, 4>(s, b, first + j, row),
                (Floats::F16(s), Floats::F16(b), 4) => self.unpack_row::<_, 4, 8>(s, b, first + j, row),
                (Floats::F16(s), Floats::F16(b), _) => self.unpack_row::<_, 8, 4>(s, b, first + j, row),
                _ => unreachable!("`Packed::of` checks that scales and biases share a dtype"),
            }
        }
    }

    /// Output feature `c`'s weights, `scale · q + bias`, into `row` (`[k]`).
    #[inline(always)]
    fn unpack_row<S: Scalar, const BITS: u32, const PER_WORD: usize>(
        &self,
        scales: &[S],
        biases: &[S],
        c: usize,
        row: &mut [f32],
    ) {
        let (k, group) = (self.k, self.group);
        let (groups, words) = (k / group, k / PER_WORD);
        let mask = (1u32 << BITS) - 1;
        let w = &self.words[c * words..(c + 1) * words];
        for (g, (out, gw)) in row.chunks_exact_mut(group).zip(w.chunks_exact(group / PER_WORD)).enumerate() {
            let (scale, bias) = (scales[c * groups + g].f(), biases[c * groups + g].f());
            for (word, vs) in gw.iter().zip(out.chunks_exact_mut(PER_WORD)) {
                for (i, v) in vs.iter_mut().enumerate() {
                    *v = scale * ((word >> (BITS * i as u32)) & mask) as f32 + bias;
                }
            }
        }
    }
}

/// The rows of `x` (`[m, k]`) in blocks of [`ROWS`], each `[k, ROWS]` (the rows beyond `m`
/// zero).
fn pack_rows(x: &[f32], k: usize, m: usize) -> Vec<f32> {
    let blocks = m.div_ceil(ROWS);
    let mut packed = vec![0f32; blocks * k * ROWS];
    for (r, row) in x.chunks_exact(k).enumerate() {
        let block = &mut packed[(r / ROWS) * k * ROWS..];
        for (p, v) in row.iter().enumerate() {
            block[p * ROWS + r % ROWS] = *v;
        }
    }
    packed
}

/// `tile[j][i]` = row `i` of `block` (`[k, ROWS]`) times feature `j` of `panel` (`[FEATURES, k]`).
fn tile(simd: bool, block: &[f32], panel: &[f32], k: usize) -> [[f32; ROWS]; FEATURES] {
    assert!(block.len() == k * ROWS && panel.len() == FEATURES * k);
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `avx2_fma` found the features; the lengths are checked above.
        return unsafe { tile_avx2(block, panel, k) };
    }
    let _ = simd;
    let mut tile = [[0f32; ROWS]; FEATURES];
    for (j, t) in tile.iter_mut().enumerate() {
        for (p, rows) in block.chunks_exact(ROWS).enumerate() {
            let w = panel[j * k + p];
            t.iter_mut().zip(rows).for_each(|(acc, x)| *acc += w * x);
        }
    }
    tile
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2(block: &[f32], panel: &[f32], k: usize) -> [[f32; ROWS]; FEATURES] {
    use std::arch::x86_64::*;
    let (x, w) = (block.as_ptr(), panel.as_ptr());
    let mut lo = [_mm256_setzero_ps(); FEATURES];
    let mut hi = [_mm256_setzero_ps(); FEATURES];
    for p in 0..k {
        let x0 = _mm256_loadu_ps(x.add(p * ROWS));
        let x1 = _mm256_loadu_ps(x.add(p * ROWS + 8));
        for j in 0..FEATURES {
            let v = _mm256_broadcast_ss(&*w.add(j * k + p));
            lo[j] = _mm256_fmadd_ps(v, x0, lo[j]);
            hi[j] = _mm256_fmadd_ps(v, x1, hi[j]);
        }
    }
    let mut tile = [[0f32; ROWS]; FEATURES];
    for j in 0..FEATURES {
        _mm256_storeu_ps(tile[j].as_mut_ptr(), lo[j]);
        _mm256_storeu_ps(tile[j].as_mut_ptr().add(8), hi[j]);
    }
    tile
}
