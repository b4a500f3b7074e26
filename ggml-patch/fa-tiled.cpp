// ---- superfluid: ggml_compute_forward_flash_attn_ext_tiled, trimmed ----
// Replaces the function of the same name in ggml/src/ggml-cpu/ops.cpp of
// llama-cpp-sys-2 0.1.161 (llama.cpp b11434) at CMake configure time
// (ggml-patch/superfluid.cmake). Derived from ggml, MIT License,
// Copyright (c) 2023-2026 The ggml authors; the changes are superfluid's.
//
// ggml computes every (64 query rows x 64 cells) pair of a tile that is not
// wholly masked in full. In a cache shared by several sequences most such
// pairs are mostly masked: a query tile that straddles two prompts, a prompt
// whose cells start mid-tile, a short shared prefix. This version computes,
// per pair, only the rows that see any cell of it and the cells (in steps of
// 16) that any row sees. Exact: what it leaves out are scores the mask sets to
// -inf, whose weight is exactly 0; the softmax sums run over the same
// 16-float blocks in the same order, so the result is bit for bit ggml's
// (where the cache's K and V are finite: ggml multiplies a masked inf by its
// zero weight into NaN, which a skipped cell never becomes; llama.cpp zeroes
// the cache, so only an f16 overflow would put one there).
// SUPERFLUID_FA_TRIM=0 in the environment computes every pair whole again.

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__ARM_FEATURE_SVE) || defined(__riscv_v_intrinsic)
// The softmax's vector length is not a constant here: cells are not trimmed.
#define SF_FA_CELL_STEP 64
#else
// A multiple of every fixed SIMD width ggml_vec_soft_max_f32 sums in (4, 8, 16).
#define SF_FA_CELL_STEP 16
#endif

// A row's open cells are one 64-bit word, and the cell step divides the tile.
static_assert(ggml_fa_tile_config::KV <= 64 && ggml_fa_tile_config::KV % SF_FA_CELL_STEP == 0,
              "superfluid's tiled attention assumes KV tiles of at most 64 cells, in whole steps");

static std::atomic<uint64_t> sf_fa_full{0};
static std::atomic<uint64_t> sf_fa_computed{0};

static bool superfluid_fa_trim_on() {
    static const bool on = [] {
        const char * v = std::getenv("SUPERFLUID_FA_TRIM");
        return v == nullptr || std::strcmp(v, "0") != 0;
    }();
    return on;
}

static void superfluid_fa_count(int rows, int cells) {
    sf_fa_full.fetch_add((uint64_t) ggml_fa_tile_config::Q * ggml_fa_tile_config::KV, std::memory_order_relaxed);
    sf_fa_computed.fetch_add((uint64_t) rows * cells, std::memory_order_relaxed);
}

// Bit i set when cell i of a mask row (n <= 64 cells) is not masked: its f16
// bits are not -inf's (0xFC00).
static inline uint64_t sf_open_cells(const ggml_fp16_t * m, int n) {
#if defined(__AVX512BW__)
    if (n == 64) {
        const __m512i inf = _mm512_set1_epi16((short) 0xFC00);
        const uint64_t lo = _mm512_cmpneq_epi16_mask(_mm512_loadu_si512((const void *) m), inf);
        const uint64_t hi = _mm512_cmpneq_epi16_mask(_mm512_loadu_si512((const void *) (m + 32)), inf);
        return lo | (hi << 32);
    }
#elif defined(__AVX2__)
    if (n == 64) {
        const __m256i inf = _mm256_set1_epi16((short) 0xFC00);
        uint64_t masked = 0;
        for (int half = 0; half < 2; half++) {
            const __m256i a = _mm256_cmpeq_epi16(_mm256_loadu_si256((const __m256i *) (m + 32 * half)), inf);
            const __m256i b = _mm256_cmpeq_epi16(_mm256_loadu_si256((const __m256i *) (m + 32 * half + 16)), inf);
            // packs interleaves the 128-bit lanes: put the 8-byte groups back in cell order.
            const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi16(a, b), 0xD8);
            masked |= (uint64_t) (uint32_t) _mm256_movemask_epi8(packed) << (32 * half);
        }
        return ~masked;
    }
#endif
    uint64_t open = 0;
    for (int i = 0; i < n; i++) {
        open |= (uint64_t) (m[i] != 0xFC00) << i;
    }
    return open;
}

static inline int sf_first_bit(uint64_t bits) {
#if defined(__GNUC__) || defined(__clang__)
    return __builtin_ctzll(bits);
#else
    int i = 0;
    while (!((bits >> i) & 1)) {
        i++;
    }
    return i;
#endif
}

static inline int sf_last_bit(uint64_t bits) {
#if defined(__GNUC__) || defined(__clang__)
    return 63 - __builtin_clzll(bits);
#else
    int i = 63;
    while (!((bits >> i) & 1)) {
        i--;
    }
    return i;
#endif
}

// Whether the tiled kernel trims (1) or computes every pair whole (0); its
// presence in the binary is what tells a build that has this change.
extern "C" int superfluid_ggml_fa_trim(void) {
    return superfluid_fa_trim_on() ? 1 : 0;
}

// Score entries (rows x cells) of the tile pairs the tiled kernel did not
// skip: `full` as ggml computes them, `computed` as this version did.
extern "C" void superfluid_ggml_fa_stats(uint64_t * full, uint64_t * computed) {
    *full = sf_fa_full.load(std::memory_order_relaxed);
    *computed = sf_fa_computed.load(std::memory_order_relaxed);
}

static void ggml_compute_forward_flash_attn_ext_tiled(
        const ggml_compute_params * params,
        ggml_tensor * dst,
        int ir0, int ir1) {
    const ggml_tensor * q     = dst->src[0];
    const ggml_tensor * k     = dst->src[1];
    const ggml_tensor * v     = dst->src[2];
    const ggml_tensor * mask  = dst->src[3];
    const ggml_tensor * sinks = dst->src[4];

    GGML_TENSOR_LOCALS(int64_t, neq, q,   ne)
    GGML_TENSOR_LOCALS(size_t,  nbq, q,   nb)
    GGML_TENSOR_LOCALS(int64_t, nek, k,   ne)
    GGML_TENSOR_LOCALS(size_t,  nbk, k,   nb)
    GGML_TENSOR_LOCALS(int64_t, nev, v,   ne)
    GGML_TENSOR_LOCALS(size_t,  nbv, v,   nb)
    GGML_TENSOR_LOCALS(int64_t, ne,  dst, ne)
    GGML_TENSOR_LOCALS(size_t,  nb,  dst, nb)

    const int64_t DK = nek0;
    const int64_t DV = nev0;
    const int64_t N  = neq1;

    GGML_ASSERT(ne0 == DV);
    GGML_ASSERT(ne2 == N);

    // input tensor rows must be contiguous
    GGML_ASSERT(nbq0 == ggml_type_size(q->type));
    GGML_ASSERT(nbk0 == ggml_type_size(k->type));
    GGML_ASSERT(nbv0 == ggml_type_size(v->type));

    GGML_ASSERT(neq0 == DK);
    GGML_ASSERT(nek0 == DK);
    GGML_ASSERT(nev0 == DV);

    GGML_ASSERT(neq1 == N);

    // dst cannot be transposed or permuted
    GGML_ASSERT(nb0 == sizeof(float));
    GGML_ASSERT(nb0 <= nb1);
    GGML_ASSERT(nb1 <= nb2);
    GGML_ASSERT(nb2 <= nb3);

    GGML_ASSERT(k->type == v->type);
    const ggml_type kv_type = k->type;


    // broadcast factors
    const int64_t rk2 = neq2/nek2;
    const int64_t rk3 = neq3/nek3;

    const int64_t rv2 = neq2/nev2;
    const int64_t rv3 = neq3/nev3;

    float scale         = 1.0f;
    float max_bias      = 0.0f;
    float logit_softcap = 0.0f;

    memcpy(&scale,         (float *) dst->op_params + 0, sizeof(float));
    memcpy(&max_bias,      (float *) dst->op_params + 1, sizeof(float));
    memcpy(&logit_softcap, (float *) dst->op_params + 2, sizeof(float));

    if (logit_softcap != 0) {
        scale /= logit_softcap;
    }

    const uint32_t n_head      = neq2;
    const uint32_t n_head_log2 = 1u << (uint32_t) floor(log2(n_head));

    const float m0 = powf(2.0f, -(max_bias       ) / n_head_log2);
    const float m1 = powf(2.0f, -(max_bias / 2.0f) / n_head_log2);

    int ith = params->ith;

    static constexpr int Q_TILE_SZ  = ggml_fa_tile_config::Q;
    static constexpr int KV_TILE_SZ = ggml_fa_tile_config::KV;

    int ir = ir0;
    while (ir < ir1) {
        // q indices for the start of this tile
        const int iq3 = ir/(neq2*neq1);
        const int iq2 = (ir - iq3*neq2*neq1)/neq1;
        const int iq1 = (ir - iq3*neq2*neq1 - iq2*neq1);

        // Number of valid rows in this tile:
        // - limited by tile size (Q_TILE_SZ)
        // - limited by chunk boundary (ir1 - ir)
        // - limited by head boundary (neq1 - iq1) to avoid crossing into next head
        const int tile_rows = MIN(Q_TILE_SZ, MIN((int)(ir1 - ir), (int)(neq1 - iq1)));
        GGML_ASSERT(tile_rows > 0);

        const uint32_t h = iq2; // head index
        const float slope = (max_bias > 0.0f) ? h < n_head_log2 ? powf(m0, h + 1) : powf(m1, 2*(h - n_head_log2) + 1) : 1.0f;

        float S[Q_TILE_SZ];
        float M[Q_TILE_SZ];

        for (int i = 0 ; i < Q_TILE_SZ; ++i) {
            S[i] = 0.;
            M[i] = -INFINITY;
        }

        // Per-thread scratch layout:
        // Q_q:    Q_TILE_SZ * DK (converted Q tile — F32 for GEMM, KV type for scalar)
        // KQ:     Q_TILE_SZ * KV_TILE_SZ (attention scores in float)
        // mask:   Q_TILE_SZ * KV_TILE_SZ (mask in float)
        // VKQ32:  Q_TILE_SZ * DV (FP32 output accumulator)
        // V32:    KV_TILE_SZ * DV (F32 buffer for V tile)
        // K_f32:  KV_TILE_SZ * DK (F32 buffer for K tile — GEMM path)
        float * base  = (float *) params->wdata + ith*(Q_TILE_SZ*DK + 2*Q_TILE_SZ*KV_TILE_SZ + Q_TILE_SZ*DV + KV_TILE_SZ*DV + KV_TILE_SZ*DK + CACHE_LINE_SIZE_F32);

        void  * Q_q    = base;
        float * KQ     = (float *)((char *)base + Q_TILE_SZ * DK * sizeof(float));
        float * mask32 = KQ + Q_TILE_SZ * KV_TILE_SZ;
        float * VKQ32  = mask32 + Q_TILE_SZ * KV_TILE_SZ;
        float * V32    = VKQ32 + Q_TILE_SZ * DV;
        float * K_f32  = V32 + KV_TILE_SZ * DV;

        memset(VKQ32, 0, Q_TILE_SZ * DV * sizeof(float));
        memset(mask32, 0, Q_TILE_SZ * KV_TILE_SZ * sizeof(float));

        // k indices
        const int ik3 = iq3 / rk3;
        const int ik2 = iq2 / rk2;

        // v indices
        const int iv3 = iq3 / rv3;
        const int iv2 = iq2 / rv2;

        {
            float * Q_f32 = (float *)Q_q;
            for (int tq = 0; tq < tile_rows; tq++) {
                const float * pq = (const float *) ((char *) q->data + ((iq1 + tq)*nbq1 + iq2*nbq2 + iq3*nbq3));
                memcpy(Q_f32 + tq * DK, pq, DK * sizeof(float));
            }
            for (int tq = tile_rows; tq < Q_TILE_SZ; tq++) {
                memset(Q_f32 + tq * DK, 0, DK * sizeof(float));
            }
        }

        memset(K_f32, 0, DK * KV_TILE_SZ * sizeof(float));
        memset(V32,   0, KV_TILE_SZ * DV * sizeof(float));

        for (int64_t ic = 0; ic < nek1; ic += KV_TILE_SZ) {
            const int kv_tile = (int)std::min((int64_t)KV_TILE_SZ, nek1 - ic);

            // superfluid: the rows [r0, r1) and cells [c0, c1) of the tile
            // that any unmasked score touches; the tile is skipped when there
            // are none. Which cells a row sees is read from the mask's f16
            // bits (-inf is 0xFC00 and nothing else, and slope > 0 keeps it
            // -inf), and only the part computed is converted. Untrimmed (no
            // mask, or SUPERFLUID_FA_TRIM=0): every row and cell, as ggml
            // computes them.
            int r0 = 0, r1 = Q_TILE_SZ, c0 = 0, c1 = KV_TILE_SZ;
            if (mask) {
                int lo_r = Q_TILE_SZ, hi_r = 0, lo_c = KV_TILE_SZ, hi_c = 0;
                for (int tq = 0; tq < tile_rows; tq++) {
                    const ggml_fp16_t * mp_row = (const ggml_fp16_t *)((const char *) mask->data + (iq1 + tq)*mask->nb[1] + (iq2%mask->ne[2])*mask->nb[2] + (iq3%mask->ne[3])*mask->nb[3]);
                    const uint64_t open = sf_open_cells(mp_row + ic, kv_tile);
                    if (open != 0) {
                        lo_r = std::min(lo_r, tq);
                        hi_r = tq + 1;
                        lo_c = std::min(lo_c, sf_first_bit(open));
                        hi_c = std::max(hi_c, sf_last_bit(open) + 1);
                    }
                }

                if (hi_r == 0) {
                    continue;
                }
                if (superfluid_fa_trim_on()) {
                    r0 = lo_r;
                    r1 = hi_r;
                    c0 = lo_c / SF_FA_CELL_STEP * SF_FA_CELL_STEP;
                    c1 = std::min((int) KV_TILE_SZ, (hi_c + SF_FA_CELL_STEP - 1) / SF_FA_CELL_STEP * SF_FA_CELL_STEP);
                }
                // The mask of the rows and cells computed, as floats; -inf
                // past the end of the cache.
                for (int tq = r0; tq < std::min(r1, tile_rows); tq++) {
                    const ggml_fp16_t * mp_row = (const ggml_fp16_t *)((const char *) mask->data + (iq1 + tq)*mask->nb[1] + (iq2%mask->ne[2])*mask->nb[2] + (iq3%mask->ne[3])*mask->nb[3]);
                    for (int tk = c0; tk < c1; tk++) {
                        mask32[tq * KV_TILE_SZ + tk] = tk < kv_tile ? slope * GGML_CPU_FP16_TO_FP32(mp_row[ic + tk]) : -INFINITY;
                    }
                }
            }
            const int nr = r1 - r0;                        // rows computed
            const int nc = c1 - c0;                        // cells computed: the row stride of KQ, K_f32's row length
            const int nk = std::max(0, std::min(c1, kv_tile) - c0); // of them, cells that exist
            superfluid_fa_count(nr, nc);

            // Pack K tile transposed: K_f32[dk][kv] so KV_TILE is contiguous (SIMD dim),
            // cells [c0, c1) only; cells past the end of the cache are zero
            for (int tk = 0; tk < nk; tk++) {
                const char * k_data = (const char *)k->data + (ic + c0 + tk)*nbk1 + ik2*nbk2 + ik3*nbk3;
                if (kv_type == GGML_TYPE_F16) {
                    const ggml_fp16_t * k_f16 = (const ggml_fp16_t *)k_data;
                    for (int64_t dk = 0; dk < DK; dk++) {
                        K_f32[dk * nc + tk] = GGML_CPU_FP16_TO_FP32(k_f16[dk]);
                    }
                } else {
                    const float * k_f32_src = (const float *)k_data;
                    for (int64_t dk = 0; dk < DK; dk++) {
                        K_f32[dk * nc + tk] = k_f32_src[dk];
                    }
                }
            }
            for (int tk = nk; tk < nc; tk++) {
                for (int64_t dk = 0; dk < DK; dk++) {
                    K_f32[dk * nc + tk] = 0.0f;
                }
            }
            float * KQ_r = KQ + r0 * nc;                   // row tq of the tile at KQ + tq*nc
            memset(KQ_r, 0, nr * nc * sizeof(float));
            simd_gemm(KQ_r, (const float *)Q_q + r0 * DK, K_f32, nr, DK, nc);
            ggml_vec_scale_f32(nr * nc, KQ_r, scale);

            if (logit_softcap != 0.0f) {
                ggml_vec_tanh_f32(nr * nc, KQ_r, KQ_r);
                ggml_vec_scale_f32(nr * nc, KQ_r, logit_softcap);
            }

            // Set padded KQ entries to -inf so softmax gives them zero weight
            for (int tq = r0; tq < r1; tq++) {
                for (int tk = nk; tk < nc; tk++) {
                    KQ[tq * nc + tk] = -INFINITY;
                }
            }

            if (mask) {
                for (int tq = r0; tq < std::min(r1, tile_rows); tq++) {
                    ggml_vec_add_f32(nc, KQ + tq * nc, KQ + tq * nc, mask32 + tq * KV_TILE_SZ + c0);
                }
            }

            bool skip[Q_TILE_SZ] = {};

            for (int tq = r0; tq < r1; tq++) {
                float * kq_row = KQ + tq * nc;

                float tile_max;
                ggml_vec_max_f32(nc, &tile_max, kq_row);

                if (tile_max == -INFINITY) {
                    skip[tq] = true;
                    continue;
                }

                const float Mold = M[tq];
                const float Mnew = fmaxf(Mold, tile_max);

                if (Mnew > Mold) {
                    const float ms = expf(Mold - Mnew);
                    ggml_vec_scale_f32(DV, VKQ32 + tq * DV, ms);
                    S[tq] *= ms;
                }
                M[tq] = Mnew;


                S[tq] += ggml_vec_soft_max_f32(nc, kq_row, kq_row, Mnew);
            }

            // V accumulation: VKQ32 += softmax(KQ) * V
            // Pack V tile to contiguous F32, cells [c0, c1), zero past the end of the cache
            for (int tk = 0; tk < nk; tk++) {
                const char * v_data = (const char *)v->data + (ic + c0 + tk)*nbv1 + iv2*nbv2 + iv3*nbv3;
                if (kv_type == GGML_TYPE_F16) {
                    ggml_cpu_fp16_to_fp32((const ggml_fp16_t *)v_data, V32 + tk * DV, DV);
                } else {
                    memcpy(V32 + tk * DV, v_data, DV * sizeof(float));
                }
            }
            if (nk < nc) {
                memset(V32 + nk * DV, 0, (nc - nk) * DV * sizeof(float));
            }
            for (int tq = r0; tq < r1; tq++) {
                if (skip[tq]) {
                    memset(KQ + tq * nc, 0, nc * sizeof(float));
                }
            }
            simd_gemm(VKQ32 + r0 * DV, KQ_r, V32, nr, nc, DV);
        }

        // sinks (apply only to valid rows in the tile)
        if (sinks) {
            const float s = ((float *)((char *) sinks->data))[h];

            for (int tq = 0; tq < tile_rows; tq++) {
                float ms = 1.0f;
                float vs = 1.0f;

                if (s > M[tq]) {
                    ms = expf(M[tq] - s);
                    ggml_vec_scale_f32(DV, VKQ32 + tq * DV, ms);
                } else {
                    vs = expf(s - M[tq]);
                }

                S[tq] = S[tq] * ms + vs;
            }
        }

        for (int tq = 0; tq < tile_rows; tq++) {
            // V /= S
            const float S_inv = S[tq] == 0.0f ? 0.0f : 1.0f / S[tq];
            ggml_vec_scale_f32(DV, VKQ32 + tq * DV, S_inv);

            // dst indices
            const int i1 = iq1 + tq;
            const int i2 = iq2;
            const int i3 = iq3;

            // permute(0, 2, 1, 3)
            memcpy((char *) dst->data + (i3*ne2*ne1 + i2 + i1*ne1)*nb1, VKQ32 + tq * DV, nb1);
        }

        ir += tile_rows;
    }
}

// ---- end of superfluid's replacement ----
