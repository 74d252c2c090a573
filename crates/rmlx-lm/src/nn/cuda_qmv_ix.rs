//! The integer form of [`super::cuda_qmv`]'s quantised product for 16-bit activations: `x` as
//! 16-bit fixed point, and the weights' 4- or 8-bit values multiplied by it four at a time with
//! `dp4a` (four 8-bit products and their sum in one instruction).
//!
//! The float form spends three instructions a 4-bit value (a shift, a mask-and-or, a
//! multiply-add). Here a 32-bit word of eight 4-bit values gives two words of four bytes in three
//! instructions (`w & 0x0F0F0F0F` the even values, `(w >> 4) & 0x0F0F0F0F` the odd ones), each
//! multiplied by four inputs (and again by their low parts) in one `dp4a`: under a fifth of the
//! instructions a value.
//!
//! **Fixed point.** Each block first prepares `x` in shared memory: each unit that one lane reads
//! in one step (`VALS` inputs: 32 at 4 bits, 16 at 8; the norm's weight applied where one is
//! fused) as `d · (hi + lo / 254)` with `d = max |x| / 127`, `hi = round(x / d)` and
//! `lo = round((x / d − hi) · 254)`, both in `[-127, 127]`: an error of at most `max |x| / 64,516`
//! a value (bfloat16 itself rounds a value of `max |x|` by up to `max |x| / 512`). A row's sums are
//! exact in 32-bit integers: `Σ q·x = d / 254 · (254 · Σ q·hi + Σ q·lo)`. With each unit go its
//! `d / 254` and `Σ x` (for the groups' biases); with a fused norm the block sums the squares of
//! `x` on the way (in a fixed order: the same bits every run). Float32 activations keep the float
//! form, exact to float32's rounding.
//!
//! **Layout.** An 8-input piece is 16 bytes: `hi` of its even inputs, of its odd ones, then the
//! same of `lo` at 4 bits (the order `w & 0x0F0F0F0F` and `(w >> 4) & 0x0F0F0F0F` leave the values
//! in); `hi` of inputs 0–3, 4–7, then `lo` at 8 bits. Piece `p` of a unit of `U = VALS / 8` pieces
//! is stored at `p · K / VALS + unit`, so that the 32 lanes of a step read 32 consecutive pieces
//! (no shared-memory bank twice).
//!
//! Each block prepares all of `x` once, then loops over tiles of output rows (a warp owns
//! [`ROWS_PER_WARP`] weight rows of a tile and the warps do not split a row's inputs), so that
//! the preparing is shared by many rows; the grid is what the GPU runs at once.

use rmlx::Dtype;

/// Weight rows a warp for one row of `x` (halved for a gated product's output rows, which read
/// two each, and for two rows of `x`).
const ROWS_PER_WARP: i32 = 4;

/// Blocks a multiprocessor runs at once (the kernel's registers are bounded for them): the grid
/// is this many times the GPU's multiprocessors, or the tiles where fewer.
pub(super) const BLOCKS_PER_SM: i32 = 6;

/// The fewest tiles (of 4 warps' rows) a product takes the integer form for. Preparing `x` costs
/// a block as much as about three tiles' arithmetic, and a product of few tiles leaves few warps
/// to a multiprocessor: on an H200, qwen3-8b's gate/up (1,536 tiles) and head (9,496) are faster
/// this way, its q/k/v (384 tiles) no faster, its o and down projections (256) slower
/// (BENCHMARKS.md). The rule is the product's shape alone, so that a model's results do not depend
/// on the GPU.
pub(super) const MIN_TILES: i32 = 512;

/// The most shared memory `x` may take a block (of 48 KiB, with the rest of the kernel's).
const SHARED_LIMIT: i32 = 40 * 1024;

/// Output rows a warp for `matrices` weight matrices (2 for a gated product) and `computed_rows`
/// rows of `x`.
pub(super) fn rows_per_warp(matrices: i32, computed_rows: i32) -> i32 {
    (ROWS_PER_WARP / matrices / computed_rows).max(1)
}

/// Whether the integer form can compute a product of `bits`-bit weights (0: dense) and
/// `computed_rows` rows of `x` of `dtype` with `input` features: 16-bit `x` of 1 or 2 rows that
/// fits the block's shared memory. (It takes the product where it also has [`MIN_TILES`] tiles.)
pub(super) fn serves(dtype: Dtype, bits: i32, computed_rows: i32, input: i32) -> bool {
    let vals = match bits {
        4 => 32,
        8 => 16,
        _ => return false,
    };
    let shared = computed_rows * (2 * input + 8 * (input / vals));
    matches!(dtype, Dtype::Bfloat16 | Dtype::Float16)
        && computed_rows <= 2
        && input % vals == 0
        && shared <= SHARED_LIMIT
}

/// The blocks of a launch over `tiles` tiles: [`BLOCKS_PER_SM`] a multiprocessor, or one a tile
/// where fewer.
pub(super) fn grid(tiles: i32) -> rmlx::Result<i32> {
    static MULTIPROCESSORS: std::sync::OnceLock<i32> = std::sync::OnceLock::new();
    let sms = match MULTIPROCESSORS.get() {
        Some(&n) => n,
        None => {
            let n = rmlx::cuda::multiprocessors()?;
            *MULTIPROCESSORS.get_or_init(|| n)
        }
    };
    Ok(tiles.min(sms * BLOCKS_PER_SM).max(1))
}

/// The kernel body (the parameters and constants of [`super::cuda_qmv`]'s, `BITS` 4 or 8, `M` 1
/// or 2, `R` rows a warp, no split): the first step's weights are in flight while the block
/// prepares `x`; then the block takes tiles of `4 R` output rows (a warp `R` of them) in turn,
/// `tile = blockIdx.x, blockIdx.x + gridDim.x, …`, each step loading the next one's weights before
/// computing its own.
pub(super) const SOURCE: &str = r#"
    constexpr int PER_WORD = 32 / BITS;
    constexpr int VALS = 4 * PER_WORD;
    constexpr int U = VALS / 8;
    constexpr int STEP = 32 * VALS;
    constexpr int STEPS = (K + STEP - 1) / STEP;
    constexpr long long ROW_BYTES = static_cast<long long>(K) * BITS / 8;
    constexpr int GROUPS = K / GS;
    constexpr bool GATED = EPI >= 2;
    constexpr int RR = GATED ? 2 * R : R;
    constexpr int WARPS = 4;
    constexpr int TILES = (N + WARPS * R - 1) / (WARPS * R);
    static_assert(KW == 1, "the integer form's warps do not split a row");
    __shared__ uint4 xpieces[M * K / 8];
    __shared__ float2 xunits[M * (K / VALS)];
    __shared__ float xsquares[WARPS * M + M];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const char* wsrc[2] = {reinterpret_cast<const char*>(w), reinterpret_cast<const char*>(w2)};
    const T* ssrc[2] = {scales, scales2};
    const T* bsrc[2] = {biases, biases2};
    struct Stage {
        uint4 w[RR];
        float s[RR];
        float b[RR];
    };
    // Step `step` of tile `tile`: this lane's 16 bytes of each of its rows, their scales and biases.
    auto load = [&](Stage& st, int tile, int step) {
        const int row0 = (tile * WARPS + warp) * R;
        const int k0 = step * STEP + lane * VALS;
        const bool live = tile < TILES && k0 < K;
#pragma unroll
        for (int r = 0; r < RR; ++r) {
            const long long row = min(row0 + r % R, N - 1);
            const int src = r / R;
            st.w[r] = make_uint4(0u, 0u, 0u, 0u);
            st.s[r] = 0.0f;
            st.b[r] = 0.0f;
            if (live) {
                st.w[r] = __ldg(reinterpret_cast<const uint4*>(wsrc[src] + row * ROW_BYTES + static_cast<long long>(k0) * BITS / 8));
                st.s[r] = static_cast<float>(ssrc[src][row * GROUPS + k0 / GS]);
                st.b[r] = static_cast<float>(bsrc[src][row * GROUPS + k0 / GS]);
            }
        }
    };
    Stage cur, nxt;
    load(cur, blockIdx.x, 0);
    // x in shared memory, as the module docs describe, while the first step's weights arrive.
    constexpr int PIECES = K / 8;
    constexpr int THREADS = WARPS * 32;
    float squares[M];
#pragma unroll
    for (int m = 0; m < M; ++m) squares[m] = 0.0f;
    // Every lane runs every round, for the shuffles among a unit's U neighbouring lanes.
#pragma unroll 4
    for (int base = 0; base < M * PIECES; base += THREADS) {
        const int at = base + threadIdx.x;
        const int m = at / PIECES;
        const int piece = at % PIECES;
        const bool live = at < M * PIECES && m < rows;
        float v[8];
        float amax = 0.0f, sum = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = 0.0f;
        if (live) {
            const uint4 raw = __ldg(reinterpret_cast<const uint4*>(x + static_cast<long long>(m) * K + 8 * piece));
            const T* e = reinterpret_cast<const T*>(&raw);
            uint4 nraw = raw;
            if constexpr (NORM) nraw = __ldg(reinterpret_cast<const uint4*>(nw + 8 * piece));
            const T* n = reinterpret_cast<const T*>(&nraw);
            float sq = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                float f = static_cast<float>(e[i]);
                sq = fmaf(f, f, sq);
                if constexpr (NORM) f *= static_cast<float>(n[i]);
                v[i] = f;
                amax = fmaxf(amax, fabsf(f));
                sum += f;
            }
#pragma unroll
            for (int r = 0; r < M; ++r) squares[r] += r == m ? sq : 0.0f;
        }
#pragma unroll
        for (int o = 1; o < U; o <<= 1) {
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
            sum += __shfl_xor_sync(0xffffffffu, sum, o);
        }
        if (live) {
            const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            // x / d rounded to the nearest integer by adding 1.5 · 2^23: its low byte is it.
            constexpr float MAGIC = 12582912.0f;
            unsigned hi[8], lo[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float s = v[i] * inv;
                const float t = s + MAGIC;
                hi[i] = __float_as_uint(t);
                lo[i] = __float_as_uint(fmaf(s - (t - MAGIC), 254.0f, MAGIC));
            }
            auto pack = [](unsigned a, unsigned b, unsigned c, unsigned d) {
                return __byte_perm(__byte_perm(a, b, 0x0040), __byte_perm(c, d, 0x0040), 0x5410);
            };
            const uint4 out = BITS == 4
                ? make_uint4(pack(hi[0], hi[2], hi[4], hi[6]), pack(hi[1], hi[3], hi[5], hi[7]),
                             pack(lo[0], lo[2], lo[4], lo[6]), pack(lo[1], lo[3], lo[5], lo[7]))
                : make_uint4(pack(hi[0], hi[1], hi[2], hi[3]), pack(hi[4], hi[5], hi[6], hi[7]),
                             pack(lo[0], lo[1], lo[2], lo[3]), pack(lo[4], lo[5], lo[6], lo[7]));
            const int unit = piece / U;
            xpieces[m * PIECES + (piece % U) * (K / VALS) + unit] = out;
            if (piece % U == 0) {
                xunits[m * (K / VALS) + unit] = make_float2(amax / (127.0f * 254.0f), sum);
            }
        }
    }
    if constexpr (NORM) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) squares[m] += __shfl_xor_sync(0xffffffffu, squares[m], o);
            if (lane == 0) xsquares[warp * M + m] = squares[m];
        }
        __syncthreads();
        // Each row's total in xsquares[WARPS * M + m], the warps' sums added in a fixed order.
        float total[M];
#pragma unroll
        for (int m = 0; m < M; ++m) {
            total[m] = 0.0f;
#pragma unroll
            for (int v = 0; v < WARPS; ++v) total[m] += xsquares[v * M + m];
        }
        if (threadIdx.x < M) {
#pragma unroll
            for (int m = 0; m < M; ++m) {
                if (m == threadIdx.x) xsquares[WARPS * M + m] = total[m];
            }
        }
    }
    __syncthreads();
    for (int tile = blockIdx.x; tile < TILES; tile += gridDim.x) {
        const int row0 = (tile * WARPS + warp) * R;
        float acc[M][RR];
#pragma unroll
        for (int m = 0; m < M; ++m) {
#pragma unroll
            for (int r = 0; r < RR; ++r) acc[m][r] = 0.0f;
        }
#pragma unroll 2
        for (int step = 0; step < STEPS; ++step) {
            const bool last = step + 1 == STEPS;
            load(nxt, last ? tile + gridDim.x : tile, last ? 0 : step + 1);
            const int k0 = step * STEP + lane * VALS;
            if (k0 < K) {
                const int unit = k0 / VALS;
                uint4 xv[M][U];
                float2 um[M];
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    const int xr = min(m, rows - 1);
#pragma unroll
                    for (int p = 0; p < U; ++p) {
                        xv[m][p] = xpieces[xr * (K / 8) + p * (K / VALS) + unit];
                    }
                    um[m] = xunits[xr * (K / VALS) + unit];
                }
#pragma unroll
                for (int r = 0; r < RR; ++r) {
                    const unsigned ua[4] = {cur.w[r].x, cur.w[r].y, cur.w[r].z, cur.w[r].w};
                    unsigned even[4], odd[4];
#pragma unroll
                    for (int w = 0; w < 4; ++w) {
                        even[w] = BITS == 4 ? ua[w] & 0x0F0F0F0Fu : ua[w];
                        odd[w] = BITS == 4 ? (ua[w] >> 4) & 0x0F0F0F0Fu : 0u;
                    }
#pragma unroll
                    for (int m = 0; m < M; ++m) {
                        int h = 0, l = 0;
#pragma unroll
                        for (int w = 0; w < 4; ++w) {
                            if constexpr (BITS == 4) {
                                h = rmlx_dp4a(even[w], xv[m][w].x, h);
                                h = rmlx_dp4a(odd[w], xv[m][w].y, h);
                                l = rmlx_dp4a(even[w], xv[m][w].z, l);
                                l = rmlx_dp4a(odd[w], xv[m][w].w, l);
                            } else {
                                const uint4 p = xv[m][w / 2];
                                h = rmlx_dp4a(even[w], w % 2 ? p.y : p.x, h);
                                l = rmlx_dp4a(even[w], w % 2 ? p.w : p.z, l);
                            }
                        }
                        const float qx = um[m].x * static_cast<float>(254 * h + l);
                        acc[m][r] = fmaf(cur.s[r], qx, fmaf(cur.b[r], um[m].y, acc[m][r]));
                    }
                }
            }
            cur = nxt;
        }
#pragma unroll
        for (int m = 0; m < M; ++m) {
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
                for (int r = 0; r < RR; ++r) acc[m][r] += __shfl_xor_sync(0xffffffffu, acc[m][r], o);
            }
        }
        if (lane == 0) {
#pragma unroll
            for (int m = 0; m < M; ++m) {
                if (m >= rows) break;
                const float inv_rms = NORM ? rsqrtf(xsquares[WARPS * M + m] / K + __int_as_float(EPS)) : 1.0f;
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    if (row0 + r < N) {
                        rmlx_finish<T, EPI, BIAS>(acc[m][r], acc[m][GATED ? R + r : r], inv_rms, bias, res, y, m, row0 + r, N);
                    }
                }
            }
        }
    }
"#;

/// `dp4a` of unsigned weight bytes and signed input bytes.
pub(super) const HEADER: &str = r#"
__device__ __forceinline__ int rmlx_dp4a(unsigned a, unsigned b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
"#;
