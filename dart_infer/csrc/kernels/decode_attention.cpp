// dart::decode_attention: softmax(q k^T * scale + mask) v for the few query rows of a decoding step (one
// token, or a verified tree) over a long cache. AVX2 + FMA only, float32.
//
// Why: torch's CPU SDPA splits its work by query blocks and heads, so a step's few rows leave one of two
// threads idle on SmolLM2's 3 key/value heads, and its per-block GEMM calls cost more than the arithmetic:
// 0.19 ms a layer for 1 row and 0.66 ms for 15 rows over 1,415 cached keys (AVX2, 2 threads), 5.8 and
// 20 ms a step over 30 layers.
//
// Here the cache is cut into chunks of a fixed number of keys; each (key/value head, chunk) pair is one
// task (so both threads stay busy on any head count) that computes, for every query row, the chunk's
// score maximum, exp-sum and weighted value sum; a second pass merges the chunks in order. Rows go in
// blocks of 3 (the query heads a key/value head serves in a GQA step of SmolLM2: nothing padded), scored
// against 4 keys at a time, and weight the values 3 rows at a time; while the first block scores a chunk,
// its values and the next chunk's keys are fetched into L2 (the cache is read from memory once a step).
// Against blocks of 4 rows x 2 keys, interleaved in one process (AVX2 emulated, 2 threads, SmolLM2 at
// 1,450 cached tokens): a 7-node verification 24.8 -> 22.4 ms, an AR step 13.9 -> 13.6.
//
// A row's result depends only on its own query and mask: every dot product, exp-sum and value sum runs in
// the same order whatever the number of rows beside it (rows are padded to whole blocks, key blocks by
// repeating the last key), so a tree's node gets exactly what a one-row step would.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <utility>

#include "simd_math.hpp"

namespace {

using dart_simd::exp_nonpositive;
using dart_simd::hsum;

constexpr int64_t kChunk = 128;  // keys per task: the chunk's keys and values (64 KB at D = 64) stay in L2
constexpr int64_t kRowBlock = 3;  // query rows sharing every key load (a step of SmolLM2's 3 query heads per
                                  // key/value head is one block a token, so nothing is padded)
constexpr int64_t kKeyBlock = 4;  // keys sharing every query load: 3 x 4 dot products in 12 registers
constexpr int64_t kTaskRows = 9;  // query rows per task (three blocks share the chunk while it is in L1/L2)

// Eight lane sums at once (output i = hsum(v_i)), in the same order of additions as `hsum`.
inline __m256 hsum8x8(__m256 v0, __m256 v1, __m256 v2, __m256 v3, __m256 v4, __m256 v5, __m256 v6, __m256 v7) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v0, v1), _mm256_hadd_ps(v2, v3));  // lanes: v0..v3 lo | hi
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v4, v5), _mm256_hadd_ps(v6, v7));
  const __m256 lo = _mm256_permute2f128_ps(a, b, 0x20), hi = _mm256_permute2f128_ps(a, b, 0x31);
  return _mm256_add_ps(lo, hi);
}

// Four lane sums (output i = hsum(v_i)), the same order again.
inline __m128 hsum4x8(__m256 v0, __m256 v1, __m256 v2, __m256 v3) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v0, v1), _mm256_hadd_ps(v2, v3));
  return _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
}

struct Problem {
  const float* q;       // [heads][rows_padded][D], contiguous
  const float* k;       // head h, key j at k + h * k_head + j * k_row
  const float* v;
  const float* mask;    // additive [mask_rows][T] (query row r reads row r % mask_rows), or null
  int64_t k_head, k_row, v_head, v_row;
  int64_t heads, rows, rows_padded, mask_rows, T, D;
  float scale;
};

// Scores of rows [r0, r0 + 3) against keys [j0, j1) of head h into s[3][kChunk]: each dot product as 8
// lane sums over the head dimension, then `hsum`'s order, wherever its key falls in a block.
template <int NV>
void chunk_scores(const Problem& P, int64_t h, int64_t r0, int64_t j0, int64_t j1, float* s, bool prefetch) {
  const int nv = NV ? NV : static_cast<int>(P.D / 8);
  const float* q = P.q + (h * P.rows_padded + r0) * P.D;
  const float* keys = P.k + h * P.k_head;
  for (int64_t j = j0; j < j1; j += kKeyBlock) {
    const float* ka = keys + j * P.k_row;  // a tail block repeats its last key, the copies unused
    const float* kb = j + 1 < j1 ? ka + P.k_row : ka;
    const float* kc = j + 2 < j1 ? kb + P.k_row : kb;
    const float* kd = j + 3 < j1 ? kc + P.k_row : kc;
    if (prefetch) {  // this chunk's values (read next) and the next chunk's keys, into L2 while computing
      for (int64_t t = j; t < std::min(j + kKeyBlock, j1); ++t) {
        const char* vt = reinterpret_cast<const char*>(P.v + h * P.v_head + t * P.v_row);
        const char* kt = reinterpret_cast<const char*>(keys + (t + kChunk) * P.k_row);
        for (int64_t b = 0; b < P.D * 4; b += 64) {
          _mm_prefetch(vt + b, _MM_HINT_T1);
          if (t + kChunk < P.T) _mm_prefetch(kt + b, _MM_HINT_T1);
        }
      }
    }
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, b0 = a0, b1 = a0, b2 = a0;
    __m256 c0 = a0, c1 = a0, c2 = a0, d0 = a0, d1 = a0, d2 = a0;
    for (int c = 0; c < nv; ++c) {
      const __m256 q0 = _mm256_loadu_ps(q + 8 * c), q1 = _mm256_loadu_ps(q + P.D + 8 * c);
      const __m256 q2 = _mm256_loadu_ps(q + 2 * P.D + 8 * c);
      __m256 kv = _mm256_loadu_ps(ka + 8 * c);
      a0 = _mm256_fmadd_ps(q0, kv, a0), a1 = _mm256_fmadd_ps(q1, kv, a1), a2 = _mm256_fmadd_ps(q2, kv, a2);
      kv = _mm256_loadu_ps(kb + 8 * c);
      b0 = _mm256_fmadd_ps(q0, kv, b0), b1 = _mm256_fmadd_ps(q1, kv, b1), b2 = _mm256_fmadd_ps(q2, kv, b2);
      kv = _mm256_loadu_ps(kc + 8 * c);
      c0 = _mm256_fmadd_ps(q0, kv, c0), c1 = _mm256_fmadd_ps(q1, kv, c1), c2 = _mm256_fmadd_ps(q2, kv, c2);
      kv = _mm256_loadu_ps(kd + 8 * c);
      d0 = _mm256_fmadd_ps(q0, kv, d0), d1 = _mm256_fmadd_ps(q1, kv, d1), d2 = _mm256_fmadd_ps(q2, kv, d2);
    }
    alignas(32) float dots[12];  // row 0: keys a-d, row 1: a-d, row 2: a-d
    _mm256_store_ps(dots, hsum8x8(a0, b0, c0, d0, a1, b1, c1, d1));
    _mm_store_ps(dots + 8, hsum4x8(a2, b2, c2, d2));
    const int64_t n = std::min<int64_t>(kKeyBlock, j1 - j);
    for (int r = 0; r < kRowBlock; ++r) {
      for (int64_t t = 0; t < n; ++t) s[r * kChunk + (j - j0) + t] = dots[r * kKeyBlock + t];
    }
  }
}

// s[j] = s[j] * scale + mask[j] for j < n and -inf for n <= j < n rounded up to 8; returns the maximum.
// Whole blocks of 8 only, so a key's value is computed the same way wherever it falls in its chunk.
inline float scale_mask_max(float* s, const float* mask, int64_t n, float scale) {
  const __m256 vs = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 top = ninf;
  alignas(32) float padded[8];
  for (int64_t j = 0; j < n; j += 8) {
    const int64_t width = std::min<int64_t>(8, n - j);
    __m256 x, m = _mm256_setzero_ps();
    if (width == 8) {
      x = _mm256_loadu_ps(s + j);
      if (mask) m = _mm256_loadu_ps(mask + j);
    } else {
      for (int t = 0; t < 8; ++t) padded[t] = t < width ? s[j + t] : 0.f;
      x = _mm256_load_ps(padded);
      if (mask) {
        for (int t = 0; t < 8; ++t) padded[t] = t < width ? mask[j + t] : 0.f;
        m = _mm256_load_ps(padded);
      }
    }
    x = _mm256_add_ps(_mm256_mul_ps(x, vs), m);
    const __m256 real = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(width)), lane));
    x = _mm256_blendv_ps(ninf, x, real);
    _mm256_storeu_ps(s + j, x);  // s has room for whole blocks
    top = _mm256_max_ps(top, x);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  float best = lanes[0];
  for (int i = 1; i < 8; ++i) best = std::max(best, lanes[i]);
  return best;
}

// out[r][0 : 8W) = sum_j p[r][j] * v[j][0 : 8W) for the block's 3 rows, j in order: every value load
// serves three rows (12 sums in registers at W = 4).
template <int W>
inline void weighted_values(const float* p, const float* v, int64_t v_row, int64_t n, float* out, int64_t out_row) {
  __m256 acc[kRowBlock][W];
  for (int r = 0; r < kRowBlock; ++r) {
    for (int c = 0; c < W; ++c) acc[r][c] = _mm256_setzero_ps();
  }
  for (int64_t j = 0; j < n; ++j) {
    const float* vj = v + j * v_row;
    __m256 vv[W];
    for (int c = 0; c < W; ++c) vv[c] = _mm256_loadu_ps(vj + 8 * c);
    for (int r = 0; r < kRowBlock; ++r) {
      const __m256 w = _mm256_broadcast_ss(p + r * kChunk + j);
      for (int c = 0; c < W; ++c) acc[r][c] = _mm256_fmadd_ps(w, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < kRowBlock; ++r) {
    for (int c = 0; c < W; ++c) _mm256_storeu_ps(out + r * out_row + 8 * c, acc[r][c]);
  }
}

// Per row of a block: s[j] <- e^(s[j] - max) in place; returns {max, sum}.
inline std::pair<float, float> softmax_terms(float* sr, const float* mask, int64_t n, float scale) {
  const float top = scale_mask_max(sr, mask, n, scale);
  const float shift = std::isinf(top) ? 0.f : top;  // a chunk masked out entirely weighs nothing
  // Whole blocks (the lanes past n hold -inf: e^-inf = 0), so the sum's order does not depend on n.
  __m256 total = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sr + j), _mm256_set1_ps(shift)));
    _mm256_storeu_ps(sr + j, e);
    total = _mm256_add_ps(total, e);
  }
  const float sum = hsum(total);
  return {top, sum};
}

// One task: head h, keys [j0, j1). Per query row (padded ones too): the chunk's max score, exp-sum and
// weighted value sum (D floats), written to part[row] = {max, sum, values...}.
template <int NV>
void chunk_task(const Problem& P, int64_t h, int64_t j0, int64_t j1, int64_t r_begin, int64_t r_end, float* part) {
  alignas(32) float s[kRowBlock * kChunk];
  const int nv = NV ? NV : static_cast<int>(P.D / 8);
  const int64_t n = j1 - j0, stride = P.D + 2;
  const float* vh = P.v + h * P.v_head + j0 * P.v_row;
  for (int64_t r0 = r_begin; r0 < r_end; r0 += kRowBlock) {
    chunk_scores<NV>(P, h, r0, j0, j1, s, r0 == r_begin);
    for (int64_t i = 0; i < kRowBlock; ++i) {
      const float* m = P.mask ? P.mask + ((r0 + i) % P.mask_rows) * P.T + j0 : nullptr;
      const auto [top, sum] = softmax_terms(s + i * kChunk, m, n, P.scale);
      part[(r0 + i) * stride] = top, part[(r0 + i) * stride + 1] = sum;
    }
    float* out = part + r0 * stride + 2;
    for (int c0 = 0; c0 < nv;) {  // 4 registers of the head dimension at a time
      if (nv - c0 >= 4) {
        weighted_values<4>(s, vh + 8 * c0, P.v_row, n, out + 8 * c0, stride), c0 += 4;
      } else {  // head sizes that are not a multiple of 32
        weighted_values<1>(s, vh + 8 * c0, P.v_row, n, out + 8 * c0, stride), c0 += 1;
      }
    }
  }
}

template <int NV>
void run(const Problem& P, float* out) {
  const int64_t chunks = (P.T + kChunk - 1) / kChunk, stride = P.D + 2;
  at::Tensor scratch = at::empty({P.heads * chunks * P.rows_padded * stride}, at::kFloat);
  float* parts = scratch.data_ptr<float>();
  // Tasks: (head, chunk, up to kTaskRows rows), so a short cache still gives both threads work.
  const int64_t row_groups = (P.rows_padded + kTaskRows - 1) / kTaskRows;
  at::parallel_for(0, P.heads * chunks * row_groups, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const int64_t hc = t / row_groups, g = t % row_groups, h = hc / chunks, c = hc % chunks;
      chunk_task<NV>(P, h, c * kChunk, std::min(P.T, (c + 1) * kChunk), g * kTaskRows,
                     std::min(P.rows_padded, (g + 1) * kTaskRows), parts + hc * P.rows_padded * stride);
    }
  });
  // Merge the chunks in order: rescale each to the row's overall maximum.
  at::parallel_for(0, P.heads * P.rows, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const int64_t h = t / P.rows, r = t % P.rows;
      const float* base = parts + h * chunks * P.rows_padded * stride + r * stride;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < chunks; ++c) top = std::max(top, base[c * P.rows_padded * stride]);
      float sum = 0.f;
      float acc[256] = {};
      for (int64_t c = 0; c < chunks; ++c) {
        const float* part = base + c * P.rows_padded * stride;
        const float w = part[0] == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(part[0] - top);
        sum += part[1] * w;
        for (int64_t d = 0; d < P.D; ++d) acc[d] += part[2 + d] * w;
      }
      float* o = out + (h * P.rows + r) * P.D;
      for (int64_t d = 0; d < P.D; ++d) o[d] = acc[d] / sum;
    }
  });
}

// query [B=1, H, R, D]; key/value [1, H, T, D] (the last dim contiguous; tokens and heads may be strided,
// as a cache with spare room is); mask: additive float [M, T] shared by all heads, query row r reading
// mask row r % M (the packed GQA layout: each head's R rows are groups of M), or none.
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const std::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && key.scalar_type() == at::kFloat &&
                  value.scalar_type() == at::kFloat, "decode_attention: float32 only");
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4 && query.size(0) == 1 && key.size(0) == 1 &&
                  value.size(0) == 1, "decode_attention: batch-1 [1, H, L, D] tensors only");
  const int64_t H = query.size(1), R = query.size(2), D = query.size(3), T = key.size(2);
  TORCH_CHECK(key.size(1) == H && value.size(1) == H && key.size(3) == D && value.size(3) == D && value.size(2) == T,
              "decode_attention: query, key and value shapes disagree");
  TORCH_CHECK(D % 8 == 0 && D <= 256, "decode_attention: head size must be a multiple of 8 up to 256, got ", D);
  TORCH_CHECK(key.stride(3) == 1 && value.stride(3) == 1, "decode_attention: key/value rows must be contiguous");
  TORCH_CHECK(T > 0, "decode_attention: empty cache");
  at::Tensor m;
  if (mask.has_value() && mask->defined()) {
    m = mask->contiguous();
    TORCH_CHECK(m.scalar_type() == at::kFloat && m.dim() == 2 && m.size(1) == T && R % m.size(0) == 0,
                "decode_attention: the mask must be float [M, T] with M dividing the query rows");
  }
  const int64_t padded = (R + kRowBlock - 1) / kRowBlock * kRowBlock;
  at::Tensor q = at::zeros({H, padded, D}, query.options());
  q.narrow(1, 0, R).copy_(query[0]);
  at::Tensor out = at::empty({1, H, R, D}, query.options());
  Problem P{q.data_ptr<float>(), key.data_ptr<float>(), value.data_ptr<float>(),
            m.defined() ? m.data_ptr<float>() : nullptr,
            key.stride(1), key.stride(2), value.stride(1), value.stride(2),
            H, R, padded, m.defined() ? m.size(0) : 1, T, D, static_cast<float>(scale)};
  switch (D / 8) {
    case 8: run<8>(P, out.data_ptr<float>()); break;
    case 16: run<16>(P, out.data_ptr<float>()); break;
    default: run<0>(P, out.data_ptr<float>()); break;  // other head sizes: loops bounded at run time
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dart, m) {
  m.def("decode_attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(dart, CPU, m) { m.impl("decode_attention", &decode_attention); }
