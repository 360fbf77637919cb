// aiayn's block-quantised matrix multiply for the CPU (built on first use by aiayn/fast/q4_build.py
// with torch.utils.cpp_extension.load_inline; see aiayn/fast/q4.py for the formats and docs/q4.md).
//
// A weight W (N, K) is stored row by row in blocks of B = 16 or 32 input positions:
//   w[n, k] = scale[n, b] * (q[n, k] - offset) + min[n, b]      (b = k / B; min optional)
// with q unsigned: 4-bit ("nibbles", two per byte) or 8-bit. The rows are padded to Kp, a multiple
// of 64 (zero scales and mins). Nibbles are packed per 64 positions: byte j of a 32-byte chunk holds
// position j (low nibble) and position 32 + j (high nibble), so that one chunk unpacks to 64 bytes
// in position order.
//
// y = x W^T is computed the way llama.cpp does on the CPU: each row of x is quantised per block of
// B to int8 (dx = max|x| / 127, xq = round(x / dx)), the products of q and xq are summed exactly in
// int32 (AVX-512 VNNI: vpdpbusd, 64 multiply-adds per instruction), and each block's integer sum is
// scaled by scale * dx in float32. The min term uses the exact float sum of x over the block:
//   y[m, n] = sum_b scale[n,b] dx[m,b] sum_{k in b} (q[n,k] - offset) xq[m,k] + sum_b min[n,b] sum_{k in b} x[m,k]
// so |y - x W^T| <= sum_b (dx[m,b] / 2) sum_{k in b} |w[n,k] - min[n,b]| + float32 rounding.
// Without AVX-512 VNNI the same arithmetic runs as plain C++ loops.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#include <immintrin.h>
#define AIAYN_VNNI 1
#else
#define AIAYN_VNNI 0
#endif

namespace {

constexpr int64_t kChunk = 64;  // input positions per inner step: one 512-bit vector of bytes
constexpr int64_t kLanes = 16;  // int32 / float32 lanes of a 512-bit vector (4 positions each)

// The activations of one call, quantised: row m's data at m * stride.
struct Activations {
  int64_t rows = 0, kp = 0, block = 0;
  std::vector<int8_t> xq;       // (rows, kp) int8
  std::vector<float> lane_dx;   // (rows, kp / 4): the activation scale of each 4-position lane
  std::vector<int32_t> init;    // (rows, kp / 4): -offset * (sum of the lane's 4 xq), or empty
  std::vector<float> block_sum; // (rows, kp / block): exact float sum of x over each block
};

void quantize_row(const float* x, int64_t k, int64_t kp, int64_t block, int64_t offset, bool sums,
                  int8_t* xq, float* lane_dx, int32_t* init, float* block_sum) {
  for (int64_t b0 = 0; b0 < kp; b0 += block) {
    float amax = 0.f, total = 0.f;
    const int64_t end = std::min(b0 + block, k);
    for (int64_t i = b0; i < end; ++i) {
      amax = std::max(amax, std::fabs(x[i]));
      total += x[i];
    }
    const float dx = amax / 127.f;
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    for (int64_t i = b0; i < b0 + block; ++i) {
      const float v = i < k ? std::nearbyint(x[i] * inv) : 0.f;
      xq[i] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, v)));
    }
    for (int64_t l = b0 / 4; l < (b0 + block) / 4; ++l) lane_dx[l] = dx;
    if (sums) block_sum[b0 / block] = total;
  }
  if (init != nullptr) {
    for (int64_t l = 0; l < kp / 4; ++l) {
      const int32_t s = xq[4 * l] + xq[4 * l + 1] + xq[4 * l + 2] + xq[4 * l + 3];
      init[l] = static_cast<int32_t>(-offset * s);
    }
  }
}

Activations quantize_activations(const float* x, int64_t rows, int64_t k, int64_t kp, int64_t block,
                                 int64_t offset, bool sums) {
  Activations a;
  a.rows = rows, a.kp = kp, a.block = block;
  a.xq.resize(rows * kp);
  a.lane_dx.resize(rows * kp / 4);
  if (offset != 0) a.init.resize(rows * kp / 4);
  if (sums) a.block_sum.resize(rows * kp / block);
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      quantize_row(x + r * k, k, kp, block, offset, sums, a.xq.data() + r * kp,
                   a.lane_dx.data() + r * kp / 4, offset != 0 ? a.init.data() + r * kp / 4 : nullptr,
                   sums ? a.block_sum.data() + r * kp / block : nullptr);
    }
  });
  return a;
}

float min_term(const float* mins, const float* block_sum, int64_t nb) {
  float s = 0.f;
  for (int64_t b = 0; b < nb; ++b) s += mins[b] * block_sum[b];
  return s;
}

#if AIAYN_VNNI
// 64 weights of one row as unsigned bytes in position order.
template <bool kNibbles>
inline __m512i load_weights(const uint8_t* q, int64_t chunk) {
  if constexpr (kNibbles) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * chunk));
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(raw, mask);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  } else {
    return _mm512_loadu_si512(q + 64 * chunk);
  }
}

// The 64 / B block scales of one chunk, one per lane (4 positions).
template <int kBlock>
inline __m512 lane_scales(const float* scale, int64_t chunk) {
  if constexpr (kBlock == 32) {
    const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m128 two = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(scale + 2 * chunk)));
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(two));
  } else {
    const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_loadu_ps(scale + 4 * chunk)));
  }
}

// y[m, n] for the kTile rows m0.. of the activations and one weight row n.
template <bool kNibbles, int kBlock, bool kMin, bool kOffset, int kTile>
inline void dot_rows(const Activations& a, int64_t m0, const uint8_t* q, const float* scale,
                     const float* mins, float* y, int64_t y_stride) {
  const int64_t chunks = a.kp / kChunk;
  __m512 acc0[kTile], acc1[kTile];
  for (int t = 0; t < kTile; ++t) acc0[t] = acc1[t] = _mm512_setzero_ps();
  const int8_t* xq[kTile];
  const float* dx[kTile];
  const int32_t* init[kTile];
  for (int t = 0; t < kTile; ++t) {
    xq[t] = a.xq.data() + (m0 + t) * a.kp;
    dx[t] = a.lane_dx.data() + (m0 + t) * a.kp / 4;
    init[t] = kOffset ? a.init.data() + (m0 + t) * a.kp / 4 : nullptr;
  }
  auto step = [&](int64_t c, __m512* acc) {
    const __m512i w = load_weights<kNibbles>(q, c);
    const __m512 sc = lane_scales<kBlock>(scale, c);
    for (int t = 0; t < kTile; ++t) {
      const __m512i start = kOffset ? _mm512_loadu_si512(init[t] + kLanes * c) : _mm512_setzero_si512();
      const __m512i sum = _mm512_dpbusd_epi32(start, w, _mm512_loadu_si512(xq[t] + kChunk * c));
      const __m512 f = _mm512_mul_ps(sc, _mm512_loadu_ps(dx[t] + kLanes * c));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), f, acc[t]);
    }
  };
  int64_t c = 0;
  for (; c + 1 < chunks; c += 2) {
    step(c, acc0);
    step(c + 1, acc1);
  }
  if (c < chunks) step(c, acc0);
  const int64_t nb = a.kp / kBlock;
  for (int t = 0; t < kTile; ++t) {
    float v = _mm512_reduce_add_ps(_mm512_add_ps(acc0[t], acc1[t]));
    if constexpr (kMin) v += min_term(mins, a.block_sum.data() + (m0 + t) * nb, nb);
    y[(m0 + t) * y_stride] = v;
  }
}
#endif

// The same sums in plain C++ (CPUs without AVX-512 VNNI), one activation row at a time.
template <bool kNibbles, int kBlock, bool kMin>
void dot_rows_scalar(const Activations& a, int64_t m, const uint8_t* q, const float* scale,
                     const float* mins, int64_t offset, float* y) {
  const int8_t* xq = a.xq.data() + m * a.kp;
  const float* dx = a.lane_dx.data() + m * a.kp / 4;
  const int64_t nb = a.kp / kBlock;
  float v = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    int32_t s = 0;
    for (int64_t i = b * kBlock; i < (b + 1) * kBlock; ++i) {
      int32_t qi;
      if constexpr (kNibbles) {
        const int64_t chunk = i / kChunk, j = i % kChunk;
        const uint8_t byte = q[32 * chunk + (j % 32)];
        qi = j < 32 ? (byte & 0x0F) : (byte >> 4);
      } else {
        qi = q[i];
      }
      s += (qi - static_cast<int32_t>(offset)) * xq[i];
    }
    v += static_cast<float>(s) * (scale[b] * dx[b * kBlock / 4]);
  }
  if constexpr (kMin) v += min_term(mins, a.block_sum.data() + m * nb, nb);
  *y = v;
}

template <bool kNibbles, int kBlock, bool kMin, bool kOffset>
void matmul_rows(const Activations& a, const uint8_t* q, const float* scale, const float* mins,
                 int64_t offset, int64_t n, float* y) {
  const int64_t row_bytes = kNibbles ? a.kp / 2 : a.kp, nb = a.kp / kBlock;
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, a.rows));
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t r = n0; r < n1; ++r) {
      const uint8_t* qr = q + r * row_bytes;
      const float* sr = scale + r * nb;
      const float* mr = kMin ? mins + r * nb : nullptr;
#if AIAYN_VNNI
      int64_t m = 0;
      for (; m + 4 <= a.rows; m += 4) dot_rows<kNibbles, kBlock, kMin, kOffset, 4>(a, m, qr, sr, mr, y + r, n);
      switch (a.rows - m) {
        case 3: dot_rows<kNibbles, kBlock, kMin, kOffset, 3>(a, m, qr, sr, mr, y + r, n); break;
        case 2: dot_rows<kNibbles, kBlock, kMin, kOffset, 2>(a, m, qr, sr, mr, y + r, n); break;
        case 1: dot_rows<kNibbles, kBlock, kMin, kOffset, 1>(a, m, qr, sr, mr, y + r, n); break;
        default: break;
      }
      (void)offset;
#else
      for (int64_t m = 0; m < a.rows; ++m) dot_rows_scalar<kNibbles, kBlock, kMin>(a, m, qr, sr, mr, offset, y + m * n + r);
#endif
    }
  });
}

template <bool kNibbles, int kBlock>
void dispatch_min_offset(const Activations& a, const uint8_t* q, const float* scale, const float* mins,
                         int64_t offset, int64_t n, float* y) {
  if (mins != nullptr) {
    if (offset != 0) matmul_rows<kNibbles, kBlock, true, true>(a, q, scale, mins, offset, n, y);
    else matmul_rows<kNibbles, kBlock, true, false>(a, q, scale, mins, offset, n, y);
  } else {
    if (offset != 0) matmul_rows<kNibbles, kBlock, false, true>(a, q, scale, mins, offset, n, y);
    else matmul_rows<kNibbles, kBlock, false, false>(a, q, scale, mins, offset, n, y);
  }
}

void check_weights(const at::Tensor& q, const at::Tensor& scale, const c10::optional<at::Tensor>& mins,
                   int64_t block, bool nibbles, int64_t k) {
  TORCH_CHECK(block == 16 || block == 32, "q4: block must be 16 or 32, got ", block);
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte && q.is_contiguous(), "q4: weights must be contiguous (n, bytes) uint8");
  const int64_t kp = (k + kChunk - 1) / kChunk * kChunk;
  TORCH_CHECK(q.size(1) == (nibbles ? kp / 2 : kp), "q4: weight rows hold ", q.size(1), " bytes, expected ", nibbles ? kp / 2 : kp, " for k=", k);
  TORCH_CHECK(scale.dim() == 2 && scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.size(0) == q.size(0) && scale.size(1) == kp / block,
              "q4: scales must be contiguous float32 (n, kp / block)");
  if (mins.has_value()) {
    TORCH_CHECK(mins->sizes() == scale.sizes() && mins->scalar_type() == at::kFloat && mins->is_contiguous(), "q4: mins must match scales");
  }
}

at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                     const c10::optional<at::Tensor>& mins, int64_t offset, int64_t block, bool nibbles,
                     int64_t k) {
  check_weights(q, scale, mins, block, nibbles, k);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) == k,
              "q4: x must be contiguous float32 (m, ", k, ")");
  const int64_t kp = (k + kChunk - 1) / kChunk * kChunk, rows = x.size(0), n = q.size(0);
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return y;
  const Activations a = quantize_activations(x.data_ptr<float>(), rows, k, kp, block, offset, mins.has_value());
  const float* m = mins.has_value() ? mins->data_ptr<float>() : nullptr;
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (nibbles) {
    if (block == 32) dispatch_min_offset<true, 32>(a, qp, sp, m, offset, n, yp);
    else dispatch_min_offset<true, 16>(a, qp, sp, m, offset, n, yp);
  } else {
    if (block == 32) dispatch_min_offset<false, 32>(a, qp, sp, m, offset, n, yp);
    else dispatch_min_offset<false, 16>(a, qp, sp, m, offset, n, yp);
  }
  return y;
}

// W as float32 (n, k): scale * (q - offset) + min, in that order (as the gguf package computes it).
at::Tensor q4_dequantize(const at::Tensor& q, const at::Tensor& scale, const c10::optional<at::Tensor>& mins,
                         int64_t offset, int64_t block, bool nibbles, int64_t k) {
  check_weights(q, scale, mins, block, nibbles, k);
  const int64_t kp = (k + kChunk - 1) / kChunk * kChunk, n = q.size(0), nb = kp / block;
  const int64_t row_bytes = nibbles ? kp / 2 : kp;
  at::Tensor w = at::empty({n, k}, scale.options());
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* mp = mins.has_value() ? mins->data_ptr<float>() : nullptr;
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    uint8_t values[kChunk];
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* qr = qp + r * row_bytes;
      for (int64_t c = 0; c * kChunk < k; ++c) {
        if (nibbles) {
          for (int64_t j = 0; j < 32; ++j) {
            values[j] = qr[32 * c + j] & 0x0F;
            values[32 + j] = qr[32 * c + j] >> 4;
          }
        } else {
          std::memcpy(values, qr + kChunk * c, kChunk);
        }
        for (int64_t b0 = 0; b0 < kChunk && c * kChunk + b0 < k; b0 += block) {
          const int64_t b = r * nb + (c * kChunk + b0) / block;
          const float s = sp[b], m = mp != nullptr ? mp[b] : 0.f;
          float* out = wp + r * k + c * kChunk + b0;
          if (mp != nullptr) {
            for (int64_t i = 0; i < block; ++i) out[i] = s * static_cast<float>(values[b0 + i] - offset) + m;
          } else {
            for (int64_t i = 0; i < block; ++i) out[i] = s * static_cast<float>(values[b0 + i] - offset);
          }
        }
      }
    }
  });
  return w;
}

bool q4_has_vnni() { return AIAYN_VNNI != 0; }

}  // namespace

TORCH_LIBRARY(aiayn_q4, m) {
  m.def("matmul(Tensor x, Tensor q, Tensor scale, Tensor? mins, int offset, int block, bool nibbles, int k) -> Tensor");
  m.def("dequantize(Tensor q, Tensor scale, Tensor? mins, int offset, int block, bool nibbles, int k) -> Tensor");
  m.def("has_vnni() -> bool", &q4_has_vnni);
}

TORCH_LIBRARY_IMPL(aiayn_q4, CPU, m) {
  m.impl("matmul", &q4_matmul);
  m.impl("dequantize", &q4_dequantize);
}
