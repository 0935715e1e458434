// dart::bf16_weight_linear: y = x @ W^T + b with fp32 activations and accumulation and the weight held in
// bf16 (half the bytes), for the few rows of a decoding step. AVX2 + FMA only, so it runs on every x86
// CPU of the pool.
//
// Why: a decoding step reads every weight once and is bound by memory bandwidth. On a CPU without bf16
// arithmetic (AVX2 only) the fp32 step reads 538 MB for SmolLM2-135M; here it reads 270 MB and widens
// each bf16 weight to fp32 in registers (a shift), so the step costs about half.
//
// Layout: the weight [N, K] is packed once (`bf16_weight_pack`) into panels of 16 output columns,
// [N/16][K][16], so a micro-kernel streams one panel and keeps 16 columns x up to 6 rows in registers.
//
// Every output element sums its K products in the same order whatever the number of rows (the K range
// is cut into the same 4 quarters, each summed in k order, then added in order), so a row's result does
// not depend on the rows beside it: a tree's verification gives each node exactly the logits a one-row
// step would.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <array>
#include <vector>

namespace {

constexpr int64_t kCols = 16;  // output columns per panel: two 8-float registers
constexpr int kQuarters = 4;   // the fixed K split, the same whatever the number of rows
// k steps ahead (6 KB of a panel, past its end into the thread's next panel): 32 left the loads waiting
// on memory; 192 read SmolLM2's step 13% (1 row) to 25% (3-8 rows) faster (AVX2, 2 threads, 12-07).
constexpr int64_t kPrefetchAhead = 192;

inline __m256 widen(const uint16_t* bits) {  // 8 bf16 -> 8 fp32: the bf16 bits are the fp32's high half
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bits));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline std::array<int64_t, kQuarters + 1> quarters(int64_t K) {
  std::array<int64_t, kQuarters + 1> cut{};
  for (int q = 0; q <= kQuarters; ++q) cut[q] = K * q / kQuarters;
  return cut;
}

// Rows [0, MB) of x times one panel over k in [k0, k1): the partial sums go to `part` (accumulate=false)
// or are added to it. Accumulators are named variables: GCC spills an array of them on every k.
#define DART_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
template <int MB>
inline void panel_rows(const float* x, int64_t ldx, const uint16_t* panel, int64_t k0, int64_t k1, float* part,
                       bool accumulate) {
#define DECL(r) __m256 c##r##0 = _mm256_setzero_ps(), c##r##1 = _mm256_setzero_ps();
  DART_ROWS(DECL)
#undef DECL
  for (int64_t k = k0; k < k1; ++k) {
    // The hardware prefetcher alone leaves several rows' FMAs waiting on memory: 16.5 -> 12.8 ms for
    // SmolLM2's linears at 5 rows (2 threads, AVX2); a line holds two k, hence every other k.
    if ((k & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kPrefetchAhead) * kCols), _MM_HINT_T0);
    const __m256 lo = widen(panel + k * kCols), hi = widen(panel + k * kCols + 8);
#define FMA(r)                                                \
  if constexpr (MB > r) {                                     \
    const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);   \
    c##r##0 = _mm256_fmadd_ps(a, lo, c##r##0);                \
    c##r##1 = _mm256_fmadd_ps(a, hi, c##r##1);                \
  }
    DART_ROWS(FMA)
#undef FMA
  }
#define STORE(r)                                                                              \
  if constexpr (MB > r) {                                                                     \
    float* p = part + r * kCols;                                                              \
    if (accumulate) {                                                                         \
      c##r##0 = _mm256_add_ps(_mm256_loadu_ps(p), c##r##0);                                   \
      c##r##1 = _mm256_add_ps(_mm256_loadu_ps(p + 8), c##r##1);                               \
    }                                                                                         \
    _mm256_storeu_ps(p, c##r##0);                                                             \
    _mm256_storeu_ps(p + 8, c##r##1);                                                         \
  }
  DART_ROWS(STORE)
#undef STORE
}
#undef DART_ROWS

// One row, quarter after quarter: the panel is read in one sequential stream (four interleaved quarter
// streams defeated the prefetcher on large matrices: the lm_head read at 11 GB/s, 22 this way), in the
// same order of sums as the rows above. Two FMA chains still outrun one core's share of memory.
inline void panel_one_row(const float* x, const uint16_t* panel, const std::array<int64_t, kQuarters + 1>& cut,
                          float* part) {
  __m256 sum_lo = _mm256_setzero_ps(), sum_hi = _mm256_setzero_ps();
  for (int q = 0; q < kQuarters; ++q) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int64_t k = cut[q]; k < cut[q + 1]; ++k) {
      if ((k & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kPrefetchAhead) * kCols), _MM_HINT_T0);
      const __m256 a = _mm256_broadcast_ss(x + k);
      lo = _mm256_fmadd_ps(a, widen(panel + k * kCols), lo);
      hi = _mm256_fmadd_ps(a, widen(panel + k * kCols + 8), hi);
    }
    sum_lo = q == 0 ? lo : _mm256_add_ps(sum_lo, lo);
    sum_hi = q == 0 ? hi : _mm256_add_ps(sum_hi, hi);
  }
  _mm256_storeu_ps(part, sum_lo);
  _mm256_storeu_ps(part + 8, sum_hi);
}

// The one or two rows left after blocks of 6 (7, 8, 13, 14 rows) find the panel in cache, where one
// row's 2 FMA chains (two rows': 4) would wait on their latency: 7 rows cost 1.5x 6 (SmolLM2's step
// linears, AVX2, 2 threads). So these run several quarters at once, 8 chains, each quarter still summed
// in k order and the quarters added in order: 7 rows 10-15% faster, 8 rows 5-8% (a 7-node verification
// 6%).
#define DART_QUARTER(q, ...)                                                                   \
  {                                                                                            \
    const int64_t k = cut[q] + i;                                                              \
    const __m256 lo = widen(panel + k * kCols), hi = widen(panel + k * kCols + 8);            \
    const __m256 b0 = _mm256_broadcast_ss(x + k);                                              \
    s##q##0l = _mm256_fmadd_ps(b0, lo, s##q##0l), s##q##0h = _mm256_fmadd_ps(b0, hi, s##q##0h); \
    __VA_ARGS__                                                                                \
  }
#define DART_SECOND_ROW(q)                                                                     \
  const __m256 b1 = _mm256_broadcast_ss(x + ldx + k);                                          \
  s##q##1l = _mm256_fmadd_ps(b1, lo, s##q##1l), s##q##1h = _mm256_fmadd_ps(b1, hi, s##q##1h);

// One row, all four quarters at once.
inline void cached_one_row(const float* x, const uint16_t* panel, const std::array<int64_t, kQuarters + 1>& cut,
                           float* part) {
  __m256 s00l = _mm256_setzero_ps(), s00h = s00l, s10l = s00l, s10h = s00l, s20l = s00l, s20h = s00l, s30l = s00l,
         s30h = s00l;
  int64_t n = cut[1] - cut[0];
  for (int q = 1; q < kQuarters; ++q) n = std::min(n, cut[q + 1] - cut[q]);
  for (int64_t i = 0; i < n; ++i) {
    DART_QUARTER(0) DART_QUARTER(1) DART_QUARTER(2) DART_QUARTER(3)
  }
  for (int64_t i = n; i < cut[1] - cut[0]; ++i) DART_QUARTER(0)
  for (int64_t i = n; i < cut[2] - cut[1]; ++i) DART_QUARTER(1)
  for (int64_t i = n; i < cut[3] - cut[2]; ++i) DART_QUARTER(2)
  for (int64_t i = n; i < cut[4] - cut[3]; ++i) DART_QUARTER(3)
  _mm256_storeu_ps(part, _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(s00l, s10l), s20l), s30l));
  _mm256_storeu_ps(part + 8, _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(s00h, s10h), s20h), s30h));
}

// Two rows, quarters (0, 1) and then (2, 3) at once; part = ((q0 + q1) + q2) + q3 per row.
inline void cached_two_rows(const float* x, int64_t ldx, const uint16_t* panel,
                            const std::array<int64_t, kQuarters + 1>& quarter_cut, float* part) {
  __m256 sum[4];  // row 0 lo, hi, row 1 lo, hi
  for (int pair = 0; pair < 2; ++pair) {
    const std::array<int64_t, 2> cut{quarter_cut[2 * pair], quarter_cut[2 * pair + 1]};
    const int64_t na = quarter_cut[2 * pair + 1] - cut[0], nb = quarter_cut[2 * pair + 2] - cut[1];
    __m256 s00l = _mm256_setzero_ps(), s00h = s00l, s01l = s00l, s01h = s00l, s10l = s00l, s10h = s00l,
           s11l = s00l, s11h = s00l;
    const int64_t n = std::min(na, nb);
    for (int64_t i = 0; i < n; ++i) {
      DART_QUARTER(0, DART_SECOND_ROW(0)) DART_QUARTER(1, DART_SECOND_ROW(1))
    }
    for (int64_t i = n; i < na; ++i) DART_QUARTER(0, DART_SECOND_ROW(0))
    for (int64_t i = n; i < nb; ++i) DART_QUARTER(1, DART_SECOND_ROW(1))
    const __m256 first[4] = {s00l, s00h, s01l, s01h}, second[4] = {s10l, s10h, s11l, s11h};
    for (int j = 0; j < 4; ++j) {
      sum[j] = pair == 0 ? _mm256_add_ps(first[j], second[j]) : _mm256_add_ps(_mm256_add_ps(sum[j], first[j]), second[j]);
    }
  }
  for (int j = 0; j < 4; ++j) _mm256_storeu_ps(part + (j / 2) * kCols + 8 * (j % 2), sum[j]);
}
#undef DART_SECOND_ROW
#undef DART_QUARTER

template <int MB>
void rows_block(const float* x, int64_t K, const uint16_t* panel, const std::array<int64_t, kQuarters + 1>& cut,
                float* part) {
  for (int q = 0; q < kQuarters; ++q) panel_rows<MB>(x, K, panel, cut[q], cut[q + 1], part, q > 0);
}

at::Tensor bf16_weight_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) % kCols == 0,
              "bf16_weight_pack: the weight must be [N, K] with N a multiple of 16, got ", weight.sizes());
  const int64_t N = weight.size(0), K = weight.size(1);
  return weight.to(at::kBFloat16).reshape({N / kCols, kCols, K}).transpose(1, 2).contiguous();
}

at::Tensor bf16_weight_linear(const at::Tensor& input, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.scalar_type() == at::kFloat, "bf16_weight_linear: float32 input only, got ", input.scalar_type());
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 3 && packed.size(2) == kCols &&
                  packed.is_contiguous(), "bf16_weight_linear: the weight must come from bf16_weight_pack");
  const int64_t K = input.size(-1), N = packed.size(0) * kCols;
  TORCH_CHECK(packed.size(1) == K, "bf16_weight_linear: input has ", K, " features, the weight ", packed.size(1));
  const at::Tensor x = input.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty({M, N}, input.options());
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "bf16_weight_linear: bias has ", bias->numel(), " values, expected ", N);
    b = bias->to(at::kFloat).contiguous();
  }
  if (M == 0) return out.reshape(shape);
  const float* xp = x.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const auto cut = quarters(K);
  at::parallel_for(0, N / kCols, 1, [&](int64_t first, int64_t last) {
    alignas(32) float part[6 * kCols];
    for (int64_t p = first; p < last; ++p) {
      const uint16_t* panel = wp + p * K * kCols;
      for (int64_t m = 0; m < M; m += 6) {
        const int64_t rows = std::min<int64_t>(6, M - m);
        const float* xm = xp + m * K;
        switch (rows) {
          case 6: rows_block<6>(xm, K, panel, cut, part); break;
          case 5: rows_block<5>(xm, K, panel, cut, part); break;
          case 4: rows_block<4>(xm, K, panel, cut, part); break;
          case 3: rows_block<3>(xm, K, panel, cut, part); break;
          case 2:
            if (m > 0) cached_two_rows(xm, K, panel, cut, part); else rows_block<2>(xm, K, panel, cut, part);
            break;
          default:
            if (m > 0) cached_one_row(xm, panel, cut, part); else panel_one_row(xm, panel, cut, part);
            break;
        }
        for (int64_t r = 0; r < rows; ++r) {
          float* dst = op + (m + r) * N + p * kCols;
          for (int64_t c = 0; c < kCols; ++c) dst[c] = part[r * kCols + c] + (bp ? bp[p * kCols + c] : 0.f);
        }
      }
    }
  });
  return out.reshape(shape);
}

}  // namespace

TORCH_LIBRARY(dart, m) {
  m.def("bf16_weight_pack(Tensor weight) -> Tensor");
  m.def("bf16_weight_linear(Tensor input, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(dart, CPU, m) {
  m.impl("bf16_weight_pack", &bf16_weight_pack);
  m.impl("bf16_weight_linear", &bf16_weight_linear);
}
