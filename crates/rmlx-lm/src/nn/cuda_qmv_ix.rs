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
//!
//! **The split form** ([`SPLIT_SOURCE`]) serves the products with too few rows for that (under
//! [`MIN_TILES`] tiles: a layer's q/k/v, output and down projections, which are not gated): the
//! warps of a block split each row's inputs, each lane keeps its own units of `x` in registers in
//! the same fixed point, and each lane's next tile of weights, scales and biases arrives in a ring
//! in shared memory through `cp.async` while it computes the current one. On qwen3-8b 4-bit this
//! takes q/k/v from 12.3 to 8.4 µs and the down projection from 16.5 to 14.0 (BENCHMARKS.md).

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

/// The fewest tiles the integer form takes `computed_rows` rows of `x` for: [`MIN_TILES`], and
/// four times as many at 4 rows (a verification pass's), where a warp's one output row reads a
/// tile's weights: on an H100 (`rmlx bench-kernels --rows 3` and `--rows 4`, 4-bit), the head
/// (151,936 × 4,096, 37,984 tiles) went from 960 to 1,453–1,502 GB/s against the float form and
/// gate/up (12,288 × 4,096, 3,072) from 781–797 to 802–920, but q/o (4,096 × 4,096, 1,024) fell
/// from 605–613 to 459–537.
pub(super) fn min_tiles(computed_rows: i32) -> i32 {
    if computed_rows > 2 {
        4 * MIN_TILES
    } else {
        MIN_TILES
    }
}

/// The most shared memory `x` may take a block (of 48 KiB, with the rest of the kernel's).
const SHARED_LIMIT: i32 = 40 * 1024;

/// Output rows a warp for `matrices` weight matrices (2 for a gated product) and `computed_rows`
/// rows of `x`.
pub(super) fn rows_per_warp(matrices: i32, computed_rows: i32) -> i32 {
    (ROWS_PER_WARP / matrices / computed_rows).max(1)
}

/// Whether the integer form can compute a product of `bits`-bit weights (0: dense) and
/// `computed_rows` rows of `x` of `dtype` with `input` features: 16-bit `x` of 1, 2 or 4 rows
/// (4: a speculative verification pass of 2 or 3 drafts) that fits the block's shared memory. (It
/// takes the product where it also has [`MIN_TILES`] tiles.)
pub(super) fn serves(dtype: Dtype, bits: i32, computed_rows: i32, input: i32) -> bool {
    let vals = match bits {
        4 => 32,
        8 => 16,
        _ => return false,
    };
    let shared = computed_rows * (2 * input + 8 * (input / vals));
    matches!(dtype, Dtype::Bfloat16 | Dtype::Float16)
        && computed_rows <= 4
        && input % vals == 0
        && shared <= SHARED_LIMIT
}

/// The blocks of a launch over `tiles` tiles: `per_sm` a multiprocessor, or one a tile where fewer.
pub(super) fn grid(tiles: i32, per_sm: i32) -> rmlx::Result<i32> {
    static MULTIPROCESSORS: std::sync::OnceLock<i32> = std::sync::OnceLock::new();
    let sms = match MULTIPROCESSORS.get() {
        Some(&n) => n,
        None => {
            let n = rmlx::cuda::multiprocessors()?;
            *MULTIPROCESSORS.get_or_init(|| n)
        }
    };
    Ok(tiles.min(sms * per_sm).max(1))
}

/// Whether the split form ([`SPLIT_SOURCE`]) can compute a product of `bits`-bit weights,
/// `computed_rows` rows of 16-bit `x` of `dtype` with `input` features and epilogue `epilogue`
/// (not a gated one), its ring holding a row of a tile (inputs up to about 54,000 at 4
/// bits, 27,000 at 8).
pub(super) fn split_serves(dtype: Dtype, bits: i32, computed_rows: i32, input: i32, epilogue: i32) -> bool {
    matches!(dtype, Dtype::Bfloat16 | Dtype::Float16)
        && matches!(bits, 4 | 8)
        && computed_rows <= 2
        && epilogue < 2
        && input % (128 / bits) == 0
        && split_row_bytes(bits, input) <= SPLIT_RING_BYTES
}

/// The kernel body (the parameters and constants of [`super::cuda_qmv`]'s, `BITS` 4 or 8, `M` 1,
/// 2 or 4, `R` rows a warp, no split): the first step's weights are in flight while the block
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
    // Only weights are read before this (see `rmlx::cuda::OVERLAP`).
    rmlx_wait_previous();
    rmlx_release_next();
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
#pragma unroll
                    for (int m = 0; m < M; ++m) {
                        int h = 0, l = 0;
                        rmlx_unit_sums<BITS>(cur.w[r], xv[m], h, l);
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
                        rmlx_finish<T, EPI, BIAS>(acc[m][r], acc[m][GATED ? R + r : r], inv_rms, bias, bias2, res, y, m, row0 + r, N);
                    }
                }
            }
        }
    }
"#;

/// `dp4a` of unsigned weight bytes and signed input bytes, and the sums of one unit: `w` 16 bytes
/// of a weight row (eight 4-bit or four 8-bit values a word), `x` its `VALS` inputs as the pieces
/// the module docs lay out, `h += Σ q·hi` and `l += Σ q·lo`. Both forms call it.
pub(super) const HEADER: &str = r#"
__device__ __forceinline__ int rmlx_dp4a(unsigned a, unsigned b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
template <int BITS>
__device__ __forceinline__ void rmlx_unit_sums(uint4 w, const uint4* x, int& h, int& l) {
    const unsigned ua[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int word = 0; word < 4; ++word) {
        if constexpr (BITS == 4) {
            const unsigned even = ua[word] & 0x0F0F0F0Fu;
            const unsigned odd = (ua[word] >> 4) & 0x0F0F0F0Fu;
            h = rmlx_dp4a(even, x[word].x, h);
            h = rmlx_dp4a(odd, x[word].y, h);
            l = rmlx_dp4a(even, x[word].z, l);
            l = rmlx_dp4a(odd, x[word].w, l);
        } else {
            const uint4 p = x[word / 2];
            h = rmlx_dp4a(ua[word], word % 2 ? p.y : p.x, h);
            l = rmlx_dp4a(ua[word], word % 2 ? p.w : p.z, l);
        }
    }
}
"#;

/// The split integer form, for quantised products of 16-bit activations with too few output rows
/// for [`SOURCE`]'s tiles (a layer's q/k/v, output and down projections): the `KW` warps of a
/// block split each row's inputs, a lane owning the same unit of `VALS` inputs (or [`split_steps`]
/// of them) for every row. Each lane writes its units of `x` as 16-bit fixed point once, in
/// registers (the pieces [`SOURCE`] keeps in shared memory, the norm's weight applied and the
/// unit's squares summed), then the block takes tiles of `R` output rows
/// (`tile = blockIdx.x, blockIdx.x + gridDim.x, …`). Each lane copies its own weights, scales and
/// biases of the next `DEPTH - 1` tiles into a ring in shared memory (`cp.async`, no registers
/// held while they arrive; a lane reads only what it copied, so the ring needs no barrier). A
/// lane's `M · R` sums meet in log₂(`M · R`) halving shuffles and one exchange a remaining level,
/// the warps' sums in shared memory, added in warp order.
pub(super) const SPLIT_SOURCE: &str = r#"
    constexpr int PER_WORD = 32 / BITS;
    constexpr int VALS = 4 * PER_WORD;
    constexpr int UNITS = K / VALS;
    constexpr int STEPS = (UNITS + 31) / 32;
    constexpr int SPW = (STEPS + KW - 1) / KW;
    constexpr int THREADS = KW * 32;
    constexpr long long ROW_BYTES = static_cast<long long>(K) * BITS / 8;
    constexpr int GROUPS = K / GS;
    constexpr unsigned long long SCALES = static_cast<unsigned long long>(N) * GROUPS;
    constexpr int TILES = (N + R - 1) / R;
    constexpr int C = M * R;
    constexpr int U = VALS / 8;
    constexpr int RAW = VALS * static_cast<int>(sizeof(T)) / 16;
    constexpr int PER_RAW = 16 / static_cast<int>(sizeof(T));
    constexpr float MAGIC = 12582912.0f;
    static_assert(EPI < 2, "the split form computes plain products and residuals");
    static_assert(C <= 32 && (C & (C - 1)) == 0, "a lane's sums: a power of two up to 32");
    __shared__ uint4 ring_w[DEPTH][SPW][R][THREADS];
    __shared__ unsigned ring_s[DEPTH][SPW][R][THREADS];
    __shared__ unsigned ring_b[DEPTH][SPW][R][THREADS];
    __shared__ float partial[2][KW][C];
    __shared__ float squares[KW * M];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    // The aligned 4-byte word holding element `i` of `base` (scales or biases, of N · GROUPS
    // elements; a slice's may start at an odd element), and how many of its bytes are the array's:
    // 2 where `i` is the first half of the array's last word.
    auto word_of = [](const T* base, long long i, int& bytes) {
        const unsigned long long at = reinterpret_cast<unsigned long long>(base + i);
        const unsigned long long end = reinterpret_cast<unsigned long long>(base + SCALES);
        const unsigned long long word = at & ~3ull;
        bytes = word + 4 <= end ? 4 : 2;
        return reinterpret_cast<const T*>(word);
    };
    // Tile `tile`'s 16 bytes of each row for this lane's units into ring slot `slot`, with the
    // words holding their scales and biases (zeros past the last tile or unit).
    auto fetch = [&](int slot, int tile) {
#pragma unroll
        for (int s = 0; s < SPW; ++s) {
            const int unit = (warp * SPW + s) * 32 + lane;
            const bool live = tile < TILES && unit < UNITS;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const long long row = min(tile * R + r, N - 1);
                const long long i = live ? row * GROUPS + unit * VALS / GS : 0;
                int scale_bytes, bias_bytes;
                const T* scale_word = word_of(scales, i, scale_bytes);
                const T* bias_word = word_of(biases, i, bias_bytes);
                const char* src = reinterpret_cast<const char*>(w) + row * ROW_BYTES + static_cast<long long>(unit) * 16;
                rmlx_cp_async(&ring_w[slot][s][r][threadIdx.x], live ? src : reinterpret_cast<const char*>(w), live ? 16 : 0);
                rmlx_cp_async4(&ring_s[slot][s][r][threadIdx.x], scale_word, live ? scale_bytes : 0);
                rmlx_cp_async4(&ring_b[slot][s][r][threadIdx.x], bias_word, live ? bias_bytes : 0);
            }
        }
        asm volatile("cp.async.commit_group;");
    };
    // Element `i` of `base` from its word copied by `fetch`: the upper half where its address is.
    auto half_of = [](unsigned word, const T* base, long long i) {
        T t;
        const int upper = (reinterpret_cast<unsigned long long>(base + i) >> 1) & 1;
        t.bits = static_cast<unsigned short>(word >> (16 * upper));
        return static_cast<float>(t);
    };
#pragma unroll
    for (int d = 0; d < DEPTH - 1; ++d) fetch(d, blockIdx.x + d * gridDim.x);
    // Only weights, scales and biases are read before this (see `rmlx::cuda::OVERLAP`).
    rmlx_wait_previous();
    rmlx_release_next();
    // This lane's units of x as fixed point, while the first tiles arrive: a pass for the unit's
    // largest value, sum and squares, then one writing hi and lo eight values at a time.
    uint4 xv[M][SPW][U];
    float xd[M][SPW], xs[M][SPW], sq[M];
#pragma unroll
    for (int m = 0; m < M; ++m) {
        sq[m] = 0.0f;
#pragma unroll
        for (int s = 0; s < SPW; ++s) {
            const int unit = (warp * SPW + s) * 32 + lane;
            uint4 raw[RAW], nraw[RAW];
#pragma unroll
            for (int i = 0; i < RAW; ++i) {
                raw[i] = make_uint4(0u, 0u, 0u, 0u);
                nraw[i] = raw[i];
            }
            if (unit < UNITS) {
#pragma unroll
                for (int i = 0; i < RAW; ++i) {
                    raw[i] = __ldg(reinterpret_cast<const uint4*>(x + static_cast<long long>(min(m, rows - 1)) * K + unit * VALS) + i);
                    if constexpr (NORM) nraw[i] = __ldg(reinterpret_cast<const uint4*>(nw + unit * VALS) + i);
                }
            }
            auto value = [&](int j) {
                const float f = static_cast<float>(reinterpret_cast<const T*>(&raw[j / PER_RAW])[j % PER_RAW]);
                return NORM ? f * static_cast<float>(reinterpret_cast<const T*>(&nraw[j / PER_RAW])[j % PER_RAW]) : f;
            };
            float amax = 0.0f, sum = 0.0f;
#pragma unroll
            for (int j = 0; j < VALS; ++j) {
                const float f = static_cast<float>(reinterpret_cast<const T*>(&raw[j / PER_RAW])[j % PER_RAW]);
                sq[m] = fmaf(f, f, sq[m]);
                const float v = value(j);
                amax = fmaxf(amax, fabsf(v));
                sum += v;
            }
            // hi = round(x / d), lo = round(254 · x / d) − 254 · hi, from the float bits of
            // 1.5 · 2^23 plus each (their low bytes; the constant's low byte is zero).
            const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            const float inv254 = inv * 254.0f;
            auto pack = [](unsigned a, unsigned b, unsigned c, unsigned d) {
                return __byte_perm(__byte_perm(a, b, 0x0040), __byte_perm(c, d, 0x0040), 0x5410);
            };
#pragma unroll
            for (int word = 0; word < 4; ++word) {
                constexpr int PER = BITS == 4 ? 8 : 4;
                unsigned hi[PER], lo[PER];
#pragma unroll
                for (int j = 0; j < PER; ++j) {
                    const float v = value(PER * word + j);
                    hi[j] = __float_as_uint(fmaf(v, inv, MAGIC));
                    lo[j] = __float_as_uint(fmaf(v, inv254, MAGIC)) - 254u * hi[j];
                }
                if constexpr (BITS == 4) {
                    xv[m][s][word] = make_uint4(pack(hi[0], hi[2], hi[4], hi[6]), pack(hi[1], hi[3], hi[5], hi[7]),
                                                pack(lo[0], lo[2], lo[4], lo[6]), pack(lo[1], lo[3], lo[5], lo[7]));
                } else if (word % 2 == 0) {
                    xv[m][s][word / 2].x = pack(hi[0], hi[1], hi[2], hi[3]);
                    xv[m][s][word / 2].z = pack(lo[0], lo[1], lo[2], lo[3]);
                } else {
                    xv[m][s][word / 2].y = pack(hi[0], hi[1], hi[2], hi[3]);
                    xv[m][s][word / 2].w = pack(lo[0], lo[1], lo[2], lo[3]);
                }
            }
            xd[m][s] = amax / (127.0f * 254.0f);
            xs[m][s] = sum;
        }
    }
    // Each row's inverse root mean square, the warps' sums of squares added in warp order.
    float inv_rms[M];
#pragma unroll
    for (int m = 0; m < M; ++m) {
        inv_rms[m] = 1.0f;
        if constexpr (NORM) {
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) sq[m] += __shfl_xor_sync(0xffffffffu, sq[m], o);
            if (lane == 0) squares[warp * M + m] = sq[m];
        }
    }
    if constexpr (NORM) {
        __syncthreads();
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float total = 0.0f;
#pragma unroll
            for (int v = 0; v < KW; ++v) total += squares[v * M + m];
            inv_rms[m] = rsqrtf(total / K + __int_as_float(EPS));
        }
    }
    int buffer = 0;
    int slot = 0;
    for (int tile = blockIdx.x; tile < TILES; tile += gridDim.x) {
        // The slot read last time takes the tile DEPTH - 1 ahead; then this tile's copies are in.
        fetch((slot + DEPTH - 1) % DEPTH, tile + (DEPTH - 1) * gridDim.x);
        asm volatile("cp.async.wait_group %0;" ::"n"(DEPTH - 1));
        float acc[C];
#pragma unroll
        for (int c = 0; c < C; ++c) acc[c] = 0.0f;
#pragma unroll
        for (int s = 0; s < SPW; ++s) {
            const int unit = (warp * SPW + s) * 32 + lane;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const uint4 wv = ring_w[slot][s][r][threadIdx.x];
                const long long i = static_cast<long long>(min(tile * R + r, N - 1)) * GROUPS + unit * VALS / GS;
                const float scale = half_of(ring_s[slot][s][r][threadIdx.x], scales, i);
                const float bias_ = half_of(ring_b[slot][s][r][threadIdx.x], biases, i);
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    int h = 0, l = 0;
                    rmlx_unit_sums<BITS>(wv, xv[m][s], h, l);
                    const float qx = xd[m][s] * static_cast<float>(254 * h + l);
                    acc[m * R + r] = fmaf(scale, qx, fmaf(bias_, xs[m][s], acc[m * R + r]));
                }
            }
        }
        slot = (slot + 1) % DEPTH;
        // Halving: at each of the first log2(C) levels a lane keeps half of its sums (the upper
        // half where its bit is set) and adds its partner's; the later levels add the one left.
        int index = 0;
        int count = C;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            if (count > 1) {
                const int half = count / 2;
                const bool upper = (lane & o) != 0;
#pragma unroll
                for (int i = 0; i < C / 2; ++i) {
                    if (i < half) {
                        const float send = upper ? acc[i] : acc[i + half];
                        const float keep = upper ? acc[i + half] : acc[i];
                        acc[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
                    }
                }
                index += upper ? half : 0;
                count = half;
            } else {
                acc[0] += __shfl_xor_sync(0xffffffffu, acc[0], o);
            }
        }
        if ((lane & (32 / C - 1)) == 0) partial[buffer][warp][index] = acc[0];
        __syncthreads();
        if (threadIdx.x < C) {
            float v = 0.0f;
#pragma unroll
            for (int p = 0; p < KW; ++p) v += partial[buffer][p][threadIdx.x];
            const int m = threadIdx.x / R;
            const int row = tile * R + threadIdx.x % R;
            if (m < rows && row < N) {
                rmlx_finish<T, EPI, BIAS>(v, v, inv_rms[m], bias, bias2, res, y, m, row, N);
            }
        }
        buffer ^= 1;
    }
    asm volatile("cp.async.wait_all;");
"#;

/// Asynchronous copies to shared memory: `bytes` of 16 (or of 4) from `src`, the rest zeros.
pub(super) const SPLIT_HEADER: &str = r#"
__device__ __forceinline__ void rmlx_cp_async(void* dst, const void* src, int bytes) {
    const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void rmlx_cp_async4(void* dst, const void* src, int bytes) {
    const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(d), "l"(src), "r"(bytes));
}
"#;

/// Warps a multiprocessor the split form's grid is made for (blocks of [`split_warps`] warps;
/// its kernel's registers are bounded for them). Measured on qwen3-8b 4-bit (BENCHMARKS.md): 16
/// left the down projection's 12-warp blocks one a multiprocessor, 32 bound the registers to 64
/// and slowed q/k/v.
const SPLIT_WARPS_PER_SM: i32 = 24;

/// Tiles in flight in a block's ring: the tile computed and the next one. Deeper rings (3, 4)
/// were slower: their shared memory leaves fewer blocks a multiprocessor.
const SPLIT_DEPTH: i32 = 2;

/// The shared memory a block's ring may take (of 48 KiB, with the kernel's other arrays).
const SPLIT_RING_BYTES: i32 = 40 * 1024;

/// Blocks a multiprocessor of the split form with `warps` warps a block.
pub(super) fn split_blocks_per_sm(warps: i32) -> i32 {
    (SPLIT_WARPS_PER_SM / warps).max(1)
}

/// Output rows a tile of the split form: 4 for one row of `x`, 2 for two (a lane keeps 4 sums),
/// halved while three tiles' copies would not fit [`SPLIT_RING_BYTES`] (a down projection's
/// 12-warp blocks take one row a tile).
pub(super) fn split_rows(bits: i32, input: i32, computed_rows: i32) -> i32 {
    let mut rows = (4 / computed_rows).max(1);
    while rows > 1 && 3 * rows * split_row_bytes(bits, input) > SPLIT_RING_BYTES {
        rows /= 2;
    }
    rows
}

/// The ring's depth (`DEPTH`) for tiles of `rows` rows: [`SPLIT_DEPTH`], or fewer where they do
/// not fit [`SPLIT_RING_BYTES`].
pub(super) fn split_depth(bits: i32, input: i32, rows: i32) -> i32 {
    (SPLIT_RING_BYTES / (rows * split_row_bytes(bits, input))).clamp(1, SPLIT_DEPTH)
}

/// A block's ring bytes for one row of a tile: 16 bytes of weights and a 4-byte word of scales
/// and of biases for each unit its lanes own.
fn split_row_bytes(bits: i32, input: i32) -> i32 {
    32 * split_warps(bits, input) * split_steps(bits, input) * 24
}

/// Steps of 32 lanes' units a warp of the split form takes: one where a block of up to
/// [`SPLIT_MAX_WARPS`] warps covers the inputs, more for longer rows.
fn split_steps(bits: i32, input: i32) -> i32 {
    let steps = (split_units(bits, input) + 31) / 32;
    (steps + SPLIT_MAX_WARPS - 1) / SPLIT_MAX_WARPS
}

/// Warps a block of the split form: one a step of 32 units, [`split_steps`] steps each.
pub(super) fn split_warps(bits: i32, input: i32) -> i32 {
    let steps = (split_units(bits, input) + 31) / 32;
    let per_warp = split_steps(bits, input);
    (steps + per_warp - 1) / per_warp
}

/// The most warps a block of the split form.
const SPLIT_MAX_WARPS: i32 = 16;

/// Units of `x` a row has: 16 bytes of weights each.
fn split_units(bits: i32, input: i32) -> i32 {
    input / (128 / bits)
}
