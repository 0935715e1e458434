// dart::prefill_attention: causal softmax(q k^T * scale) v over a whole prompt (nothing cached before it),
// float32, AVX2 + FMA only.
//
// Why: the prompt is most of a long request's time on a CPU without bf16 arithmetic (issue 40: 58% of DART's
// time at ~1,300-token prompts), and torch's CPU flash attention runs its causal fp32 blocks at ~110
// GFLOP/s on 2 AVX2 cores while the prompt's GEMMs reach ~180.
//
// Flash attention with register-tiled micro-kernels: a task is (query head, block of kQBlock query rows); it
// walks the key blocks up to its diagonal, computing the block's scores as 6 x 16 tiles (the keys packed
// transposed once per key/value head, so a tile is broadcast-FMA like a GEMM's), an online softmax per
// row, and the value sums as 6 x 16 tiles again. Query heads sharing a key/value head read the same
// packed keys (grouped-query attention without copies).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "simd_math.hpp"

namespace {

using dart_simd::exp_nonpositive;

constexpr int64_t kQBlock = 48;  // query rows per task: 8 tiles of 6
constexpr int64_t kKBlock = 128;  // keys per online-softmax step
constexpr int kTile = 6;         // rows per micro-tile (12 accumulators + 2 loads + 1 broadcast)
constexpr int64_t kCols = 16;    // columns per micro-tile: two registers
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#define DART_TILE_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)

// s[r][0:16] = sum_d q[r][d] * kt[d][0:16] for rows r < MR (q rows ldq apart, kt rows ldk apart).
template <int MR>
inline void score_tile(const float* q, int64_t ldq, const float* kt, int64_t ldk, int64_t D, float* s,
                       int64_t lds) {
#define DECL(r) __m256 c##r##0 = _mm256_setzero_ps(), c##r##1 = _mm256_setzero_ps();
  DART_TILE_ROWS(DECL)
#undef DECL
  for (int64_t d = 0; d < D; ++d) {
    const __m256 k0 = _mm256_loadu_ps(kt + d * ldk), k1 = _mm256_loadu_ps(kt + d * ldk + 8);
#define FMA(r)                                                  \
  if constexpr (MR > r) {                                       \
    const __m256 a = _mm256_broadcast_ss(q + r * ldq + d);      \
    c##r##0 = _mm256_fmadd_ps(a, k0, c##r##0);                  \
    c##r##1 = _mm256_fmadd_ps(a, k1, c##r##1);                  \
  }
    DART_TILE_ROWS(FMA)
#undef FMA
  }
#define STORE(r)                                   \
  if constexpr (MR > r) {                          \
    _mm256_storeu_ps(s + r * lds, c##r##0);        \
    _mm256_storeu_ps(s + r * lds + 8, c##r##1);    \
  }
  DART_TILE_ROWS(STORE)
#undef STORE
}

// o[r][0:8W] += sum_j p[r][j] * v[j][0:8W] for rows r < MR, j < n (W = 2, or 1 for a head size's last 8).
template <int MR, int W>
inline void value_tile(const float* p, int64_t ldp, const float* v, int64_t ldv, int64_t n, float* o, int64_t ldo) {
#define DECL(r)                                                                               \
  __m256 c##r##0 = MR > r ? _mm256_loadu_ps(o + r * ldo) : _mm256_setzero_ps();               \
  __m256 c##r##1 = MR > r && W > 1 ? _mm256_loadu_ps(o + r * ldo + 8) : _mm256_setzero_ps();
  DART_TILE_ROWS(DECL)
#undef DECL
  for (int64_t j = 0; j < n; ++j) {
    const __m256 v0 = _mm256_loadu_ps(v + j * ldv), v1 = W > 1 ? _mm256_loadu_ps(v + j * ldv + 8) : v0;
#define FMA(r)                                                  \
  if constexpr (MR > r) {                                       \
    const __m256 a = _mm256_broadcast_ss(p + r * ldp + j);      \
    c##r##0 = _mm256_fmadd_ps(a, v0, c##r##0);                  \
    if constexpr (W > 1) c##r##1 = _mm256_fmadd_ps(a, v1, c##r##1); \
  }
    DART_TILE_ROWS(FMA)
#undef FMA
  }
#define STORE(r)                                                      \
  if constexpr (MR > r) {                                             \
    _mm256_storeu_ps(o + r * ldo, c##r##0);                           \
    if constexpr (W > 1) _mm256_storeu_ps(o + r * ldo + 8, c##r##1);  \
  }
  DART_TILE_ROWS(STORE)
#undef STORE
}
#undef DART_TILE_ROWS

template <typename Tile>
inline void by_tiles(int64_t rows, Tile&& tile) {  // tile(first row, row count as a constant)
  int64_t r = 0;
  for (; r + kTile <= rows; r += kTile) tile(r, std::integral_constant<int, kTile>{});
  switch (rows - r) {
    case 5: tile(r, std::integral_constant<int, 5>{}); break;
    case 4: tile(r, std::integral_constant<int, 4>{}); break;
    case 3: tile(r, std::integral_constant<int, 3>{}); break;
    case 2: tile(r, std::integral_constant<int, 2>{}); break;
    case 1: tile(r, std::integral_constant<int, 1>{}); break;
    default: break;
  }
}

struct Problem {
  const float* q;   // query head h, row t at q + h * q_head + t * q_row
  const float* kt;  // packed keys: [kv_heads][D][T16]
  const float* v;   // value head g, key j at v + g * v_head + j * v_row
  float* out;       // [T][H][D]
  int64_t q_head, q_row, v_head, v_row;
  int64_t heads, groups, T, T16, D;
  float scale;
};

// Query head h, rows [t0, t1): every row's softmax over keys [0, t] and its value sum into out.
void task(const Problem& P, int64_t h, int64_t t0, int64_t t1) {
  alignas(32) float s[kQBlock * kKBlock];   // scores, then e^(score - max)
  alignas(32) float o[kQBlock * 256];       // value sums (D <= 256)
  float top[kQBlock], sum[kQBlock];
  const int64_t rows = t1 - t0, g = h / P.groups, D = P.D;
  const float* q = P.q + h * P.q_head + t0 * P.q_row;
  const float* kt = P.kt + g * D * P.T16;
  const float* vg = P.v + g * P.v_head;
  std::fill(o, o + rows * D, 0.f);
  std::fill(top, top + rows, kNegInf);
  std::fill(sum, sum + rows, 0.f);
  const __m256 vscale = _mm256_set1_ps(P.scale), ninf = _mm256_set1_ps(kNegInf);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t j0 = 0; j0 < t1; j0 += kKBlock) {
    const int64_t n = std::min(kKBlock, t1 - j0), n16 = (n + kCols - 1) / kCols * kCols;
    for (int64_t c = 0; c < n16; c += kCols) {
      by_tiles(rows, [&](int64_t r, auto mr) {
        score_tile<decltype(mr)::value>(q + r * P.q_row, P.q_row, kt + j0 + c, P.T16, D, s + r * kKBlock + c, kKBlock);
      });
    }
    for (int64_t r = 0; r < rows; ++r) {  // scale, causal mask, online softmax
      float* sr = s + r * kKBlock;
      const int64_t visible = std::min(n, t0 + r + 1 - j0);  // keys j0 .. t0 + r
      if (visible <= 0) {  // the whole block lies after this row
        std::fill(sr, sr + n16, 0.f);
        continue;
      }
      // The block's largest raw score (scale > 0 keeps it the largest scaled one); keys after the diagonal
      // become -inf, and only the diagonal block has any.
      __m256 best = ninf;
      if (visible >= n16) {
        for (int64_t j = 0; j < n16; j += 8) best = _mm256_max_ps(best, _mm256_loadu_ps(sr + j));
      } else {
        for (int64_t j = 0; j < n16; j += 8) {
          const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(visible - j)), lane));
          const __m256 x = _mm256_blendv_ps(ninf, _mm256_loadu_ps(sr + j), keep);
          _mm256_storeu_ps(sr + j, x);
          best = _mm256_max_ps(best, x);
        }
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, best);
      const float block_top = *std::max_element(lanes, lanes + 8) * P.scale;
      const float new_top = std::max(top[r], block_top);
      const float alpha = top[r] == kNegInf ? 0.f : std::exp(top[r] - new_top);
      __m256 total = _mm256_setzero_ps();
      const __m256 shift = _mm256_set1_ps(new_top);
      for (int64_t j = 0; j < n16; j += 8) {  // e^(score * scale - max), the scaling fused in
        const __m256 e = exp_nonpositive(_mm256_fmsub_ps(_mm256_loadu_ps(sr + j), vscale, shift));
        _mm256_storeu_ps(sr + j, e);
        total = _mm256_add_ps(total, e);
      }
      sum[r] = sum[r] * alpha + dart_simd::hsum(total);
      top[r] = new_top;
      if (alpha != 1.f) {
        float* orow = o + r * D;
        const __m256 va = _mm256_set1_ps(alpha);
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(orow + d, _mm256_mul_ps(_mm256_loadu_ps(orow + d), va));
      }
    }
    for (int64_t c = 0; c < D; c += kCols) {
      const float* vc = vg + j0 * P.v_row + c;
      by_tiles(rows, [&](int64_t r, auto mr) {
        if (D - c >= kCols) {
          value_tile<decltype(mr)::value, 2>(s + r * kKBlock, kKBlock, vc, P.v_row, n, o + r * D + c, D);
        } else {  // a head size that is not a multiple of 16: its last 8 columns
          value_tile<decltype(mr)::value, 1>(s + r * kKBlock, kKBlock, vc, P.v_row, n, o + r * D + c, D);
        }
      });
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = P.out + ((t0 + r) * P.heads + h) * D;
    const __m256 inv = _mm256_set1_ps(1.f / sum[r]);
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_loadu_ps(o + r * D + d), inv));
  }
}

// query [1, H, T, D]; key/value [1, H_kv, T, D] (H a multiple of H_kv; the last dim contiguous, the others
// may be strided); row t attends to keys 0..t. Returns [1, T, H, D] (transformers' attention output layout).
at::Tensor prefill_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, double scale) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && key.scalar_type() == at::kFloat &&
                  value.scalar_type() == at::kFloat, "prefill_attention: float32 only");
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4 && query.size(0) == 1 && key.size(0) == 1 &&
                  value.size(0) == 1, "prefill_attention: batch-1 [1, H, T, D] tensors only");
  const int64_t H = query.size(1), T = query.size(2), D = query.size(3), KV = key.size(1);
  TORCH_CHECK(KV > 0 && H % KV == 0 && value.size(1) == KV, "prefill_attention: query heads must be a multiple of key/value heads");
  TORCH_CHECK(key.size(2) == T && value.size(2) == T && key.size(3) == D && value.size(3) == D,
              "prefill_attention: query, key and value must cover the same T positions with one head size");
  TORCH_CHECK(D % 8 == 0 && D <= 256, "prefill_attention: head size must be a multiple of 8 up to 256, got ", D);
  TORCH_CHECK(query.stride(3) == 1 && value.stride(3) == 1, "prefill_attention: query/value rows must be contiguous");
  TORCH_CHECK(scale > 0, "prefill_attention: the scale must be positive, got ", scale);  // the max is taken unscaled
  const int64_t T16 = (T + kCols - 1) / kCols * kCols;
  at::Tensor kt = at::zeros({KV, D, T16}, key.options());
  kt.narrow(2, 0, T).copy_(key[0].transpose(1, 2));
  at::Tensor out = at::empty({1, T, H, D}, query.options());
  const Problem P{query.data_ptr<float>(), kt.data_ptr<float>(), value.data_ptr<float>(), out.data_ptr<float>(),
                  query.stride(1), query.stride(2), value.stride(1), value.stride(2),
                  H, H / KV, T, T16, D, static_cast<float>(scale)};
  const int64_t blocks = (T + kQBlock - 1) / kQBlock;
  // Tasks in (head, block) order: each thread's contiguous share holds whole heads' worth of every block
  // length, so the causal triangle's uneven tasks balance.
  at::parallel_for(0, H * blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const int64_t h = t / blocks, b = t % blocks;
      task(P, h, b * kQBlock, std::min(T, (b + 1) * kQBlock));
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dart, m) {
  m.def("prefill_attention(Tensor query, Tensor key, Tensor value, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(dart, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
