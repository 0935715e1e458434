// dart::rms_norm, dart::silu_mul and dart::rotary: the float32 elementwise pieces of a Llama-style decoder
// layer in one pass each (AVX2 + FMA), for the models served with bf16 weights
// (dart_infer/target/fused_blocks.py).
//
// Why: eagerly, transformers' RMSNorm is eight small ops (cast, pow, mean, add, rsqrt, mul, cast, mul) and
// the gated MLP's activation two (silu, mul): at one token, 61 norms and 30 activations a step of
// SmolLM2-135M are ~1,000 dispatches; over a prompt, as many passes over its activations. Rotary embedding
// is fourteen (rotate_half's slices, neg and cat, then two muls and an add, for queries and keys): ~35 us
// a layer at one token.
//
// Each row is computed on its own, in one order whatever rows share the call.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "simd_math.hpp"

namespace {

using dart_simd::exp_nonpositive;
using dart_simd::hsum;

// x * sigmoid(x), from e = e^-|x| (never overflows): x / (1 + e) for x >= 0, x * e / (1 + e) below.
inline __m256 silu(__m256 x) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 e = exp_nonpositive(_mm256_or_ps(x, sign));  // -|x|
  const __m256 numerator = _mm256_blendv_ps(x, _mm256_mul_ps(x, e), x);  // the sign bit picks x * e
  return _mm256_div_ps(numerator, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rms_norm: float32 only");
  const int64_t H = input.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H, "rms_norm: weight must be [", H, "]");
  const at::Tensor x = input.reshape({-1, H}).contiguous(), w = weight.contiguous();
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t full = H / 8 * 8;
  at::parallel_for(0, x.size(0), 64, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const float* xr = xp + r * H;
      float* o = op + r * H;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t j = 0; j < full; j += 8) {
        const __m256 v = _mm256_loadu_ps(xr + j);
        acc = _mm256_fmadd_ps(v, v, acc);
      }
      float squares = hsum(acc);
      for (int64_t j = full; j < H; ++j) squares += xr[j] * xr[j];
      const float inv = 1.0f / std::sqrt(squares / static_cast<float>(H) + static_cast<float>(eps));
      const __m256 vi = _mm256_set1_ps(inv);
      for (int64_t j = 0; j < full; j += 8)
        _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_loadu_ps(wp + j), _mm256_mul_ps(_mm256_loadu_ps(xr + j), vi)));
      for (int64_t j = full; j < H; ++j) o[j] = wp[j] * (xr[j] * inv);
    }
  });
  return out.reshape(input.sizes());
}

// [..., 2I] (gate then up) -> [..., I]: silu(gate) * up.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat, "silu_mul: float32 only");
  const int64_t I2 = gate_up.size(-1), I = I2 / 2;
  TORCH_CHECK(I2 % 16 == 0, "silu_mul: the last dimension must be twice a multiple of 8, got ", I2);
  const at::Tensor x = gate_up.reshape({-1, I2}).contiguous();
  at::Tensor out = at::empty({x.size(0), I}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t blocks = I / 8;
  at::parallel_for(0, x.size(0) * blocks, 2048, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const int64_t r = t / blocks, j = (t % blocks) * 8;
      const float* g = xp + r * I2 + j;
      _mm256_storeu_ps(op + r * I + j, _mm256_mul_ps(silu(_mm256_loadu_ps(g)), _mm256_loadu_ps(g + I)));
    }
  });
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = I;
  return out.reshape(shape);
}

// x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]: transformers' apply_rotary_pos_emb, with its
// roundings (each product rounded, then the sum: never fused into an FMA), for x [B, H, T, D] (any strides,
// the last dimension contiguous) and cos/sin [B or 1, T, D]. Returns a contiguous [B, H, T, D].
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1, "rotary: query/key must be [B, H, T, D] with contiguous rows");
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && cos.dim() == 3 && cos.sizes() == sin.sizes() && cos.size(1) == T && cos.size(2) == D &&
                  (cos.size(0) == B || cos.size(0) == 1), "rotary: cos/sin must be [B or 1, T, D] for x ", x.sizes());
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  at::Tensor out = at::empty({B, H, T, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t vector_end = half % 8 == 0 ? half : 0;  // whole registers per half, else scalar
  const int64_t sb = x.stride(0), sh = x.stride(1), st = x.stride(2), per_sequence = c.size(0) > 1;
  at::parallel_for(0, B * H * T, 256, [&](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) {
      const int64_t b = row / (H * T), h = row / T % H, t = row % T;
      const float* xr = xp + b * sb + h * sh + t * st;
      const int64_t cs = (b * per_sequence * T + t) * D;
      float* o = op + row * D;
      for (int64_t i = 0; i < vector_end; i += 8) {
        const __m256 x1 = _mm256_loadu_ps(xr + i), x2 = _mm256_loadu_ps(xr + half + i);
        __m256 a = _mm256_mul_ps(x1, _mm256_loadu_ps(cp + cs + i));
        __m256 b2 = _mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), x2), _mm256_loadu_ps(sp + cs + i));
        __m256 a2 = _mm256_mul_ps(x2, _mm256_loadu_ps(cp + cs + half + i));
        __m256 b1 = _mm256_mul_ps(x1, _mm256_loadu_ps(sp + cs + half + i));
        asm("" : "+x"(a), "+x"(b2), "+x"(a2), "+x"(b1));  // keep the products rounded: no FMA contraction
        _mm256_storeu_ps(o + i, _mm256_add_ps(a, b2));
        _mm256_storeu_ps(o + half + i, _mm256_add_ps(a2, b1));
      }
      for (int64_t i = vector_end; i < half; ++i) {
        volatile float a = xr[i] * cp[cs + i], b2 = -xr[half + i] * sp[cs + i];
        volatile float a2 = xr[half + i] * cp[cs + half + i], b1 = xr[i] * sp[cs + half + i];
        o[i] = a + b2, o[half + i] = a2 + b1;
      }
    }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& query, const at::Tensor& key, const at::Tensor& cos,
                                          const at::Tensor& sin) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && key.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat, "rotary: float32 only");
  return {rotate(query, cos, sin), rotate(key, cos, sin)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dart, m) {
  m.def("rms_norm(Tensor input, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rotary(Tensor query, Tensor key, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(dart, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rotary", &rotary);
}
