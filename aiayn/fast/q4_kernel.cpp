// aiayn's block-quantised matrix multiply for the CPU (built on first use by aiayn/fast/q4_build.py
// with torch.utils.cpp_extension.load_inline; see aiayn/fast/q4.py for the format and docs/q4.md).
//
// A weight W (n, k) is stored in blocks of B = 16 or 32 inputs of a row:
//   w[r, c] = scale[r, b] * (q[r, c] - offset) + min[r, b]      (b = c / B; min optional)
// with q unsigned, 4-bit ("nibbles") or 8-bit. Rows are interleaved by 16 so that one 64-byte
// vector holds 16 rows x 4 consecutive inputs, the operand of one AVX-512 VNNI instruction:
//   q bytes:   (n / 16 groups, k / B blocks, U units, 16 rows, 4 inputs), U = B / 4; unit u holds
//              inputs 4u..4u+3 of the block;
//   q nibbles: (n / 16, k / B, U = B / 8, 16, 4); the low nibbles of unit u are inputs 4u..4u+3,
//              the high nibbles inputs 4(u + B/8)..4(u + B/8)+3;
//   scale, min: (n / 16, k / B, 16) float32, or float16 (where every value is one exactly).
// n is padded to a multiple of 16 (zero scales and mins).
//
// y = x W^T is computed the way llama.cpp does on the CPU: each row of x is quantised per block to
// int8 (dx = max|x| / 127, xq = round(x / dx), x^ = dx xq), sum_c (q - offset) xq is summed exactly
// in int32 (vpdpbusd: 16 rows x 4 inputs per instruction, the 4 activations broadcast), and each
// block's integer sum is scaled by scale * dx in float32; the min term takes the same rounded x
// (dx * sum xq, llama.cpp's Q8_1 "s"):
//   y[m, r] = sum_b dx[m,b] (scale[r,b] sum_{c in b} (q[r,c] - offset) xq[m,c] + min[r,b] sum_{c in b} xq[m,c])
//           = sum_c w[r,c] x^[m,c]                                      (exactly, but float32 rounding)
// so |y - x W^T| <= sum_b (dx[m,b] / 2) sum_{c in b} |w[r,c]| + float32 rounding. (The min term with
// the exact float sum of x instead would leave sum_c scale (q - offset) (x^ - x): integers q that are
// all >= 0 with a negative min add the rounding errors of a block up instead of letting the signed
// weights cancel them; SmolLM2 Q4_1's perplexity was 1.8% above float32 with it, 0.1% without.)
// Without AVX-512 VNNI the same arithmetic, rounded the same way, runs as plain C++ loops.

#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
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

constexpr int64_t kGroup = 16;  // rows interleaved together: the 16 int32 lanes of a vector
constexpr int64_t kUnit = 64;   // bytes of one unit: 16 rows x 4 inputs

// The activations of one call, quantised per block: row m's values at m * k, its blocks at m * nb.
struct Activations {
  int64_t rows = 0, k = 0, block = 0, nb = 0;
  std::vector<int8_t> xq;       // (rows, k)
  std::vector<float> dx;        // (rows, nb) the step of each block
  std::vector<int32_t> qsum;    // (rows, nb) sum of xq over each block (for the offset)
  std::vector<float> xsum;      // (rows, nb) dx * qsum: the rounded x summed over each block (for the mins)
};

Activations quantize_activations(const float* x, int64_t rows, int64_t k, int64_t block) {
  Activations a;
  a.rows = rows, a.k = k, a.block = block, a.nb = k / block;
  a.xq.resize(rows * k);
  a.dx.resize(rows * a.nb);
  a.qsum.resize(rows * a.nb);
  a.xsum.resize(rows * a.nb);
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t b = 0; b < a.nb; ++b) {
        const float* xb = x + r * k + b * block;
        float amax = 0.f;
        for (int64_t i = 0; i < block; ++i) {
          amax = std::max(amax, std::fabs(xb[i]));
        }
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        int32_t qs = 0;
        int8_t* q = a.xq.data() + r * k + b * block;
        for (int64_t i = 0; i < block; ++i) {
          q[i] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, std::nearbyint(xb[i] * inv))));
          qs += q[i];
        }
        a.dx[r * a.nb + b] = amax / 127.f;
        a.qsum[r * a.nb + b] = qs;
        a.xsum[r * a.nb + b] = a.dx[r * a.nb + b] * static_cast<float>(qs);
      }
    }
  });
  return a;
}

// 16 scales (or mins) as float32: stored float32, or float16 widened exactly.
template <typename S>
inline float scalar(const S* p) { return static_cast<float>(*p); }

#if AIAYN_VNNI
template <typename S>
inline __m512 load16(const S* p) {
  if constexpr (std::is_same_v<S, float>) {
    return _mm512_loadu_ps(p);
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
}

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// y[m, 16 g .. 16 g + 15] for the kTile activation rows m0.. and row group g.
template <typename S, bool kNibbles, int kBlock, bool kMin, int kTile>
inline void group_rows(const Activations& a, int64_t m0, const uint8_t* q, const S* scale,
                       const S* mins, int64_t offset, float* y, int64_t y_stride, __mmask16 store) {
  constexpr int kQuads = kBlock / 4, kUnits = kNibbles ? kQuads / 2 : kQuads;
  const int64_t nb = a.nb;
  __m512 acc[kTile];
  for (int t = 0; t < kTile; ++t) acc[t] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    __m512i lo[kTile], hi[kTile];
    for (int t = 0; t < kTile; ++t) {
      lo[t] = _mm512_set1_epi32(static_cast<int32_t>(-offset * a.qsum[(m0 + t) * nb + b]));
      hi[t] = _mm512_setzero_si512();
    }
    const uint8_t* qb = q + b * kUnits * kUnit;
    for (int u = 0; u < kUnits; ++u) {
      const __m512i raw = _mm512_loadu_si512(qb + u * kUnit);
      if constexpr (kNibbles) {
        const __m512i wl = _mm512_and_si512(raw, low4);
        const __m512i wh = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
        for (int t = 0; t < kTile; ++t) {
          const int8_t* xb = a.xq.data() + (m0 + t) * a.k + b * kBlock;
          lo[t] = _mm512_dpbusd_epi32(lo[t], wl, bcast4(xb + 4 * u));
          hi[t] = _mm512_dpbusd_epi32(hi[t], wh, bcast4(xb + 4 * (u + kUnits)));
        }
      } else {
        for (int t = 0; t < kTile; ++t) {
          const int8_t* xb = a.xq.data() + (m0 + t) * a.k + b * kBlock;
          if (u % 2 == 0) lo[t] = _mm512_dpbusd_epi32(lo[t], raw, bcast4(xb + 4 * u));
          else hi[t] = _mm512_dpbusd_epi32(hi[t], raw, bcast4(xb + 4 * u));
        }
      }
    }
    const __m512 sc = load16(scale + b * kGroup);
    for (int t = 0; t < kTile; ++t) {
      const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(lo[t], hi[t]));
      acc[t] = _mm512_fmadd_ps(sum, _mm512_mul_ps(sc, _mm512_set1_ps(a.dx[(m0 + t) * nb + b])), acc[t]);
      if constexpr (kMin) {
        acc[t] = _mm512_fmadd_ps(load16(mins + b * kGroup), _mm512_set1_ps(a.xsum[(m0 + t) * nb + b]), acc[t]);
      }
    }
  }
  for (int t = 0; t < kTile; ++t) _mm512_mask_storeu_ps(y + (m0 + t) * y_stride, store, acc[t]);
}
#endif

// The same sums in plain C++ (CPUs without AVX-512 VNNI).
template <typename S, bool kNibbles, int kBlock, bool kMin>
void group_rows_scalar(const Activations& a, int64_t m, const uint8_t* q, const S* scale,
                       const S* mins, int64_t offset, float* y, int64_t live) {
  constexpr int kQuads = kBlock / 4, kUnits = kNibbles ? kQuads / 2 : kQuads;
  for (int64_t r = 0; r < live; ++r) {
    float v = 0.f;
    for (int64_t b = 0; b < a.nb; ++b) {
      const int8_t* xb = a.xq.data() + m * a.k + b * kBlock;
      const uint8_t* qb = q + b * kUnits * kUnit;
      int32_t s = 0;
      for (int u = 0; u < kUnits; ++u) {
        for (int i = 0; i < 4; ++i) {
          const uint8_t byte = qb[u * kUnit + 4 * r + i];
          if constexpr (kNibbles) {
            s += ((byte & 0x0F) - static_cast<int32_t>(offset)) * xb[4 * u + i];
            s += ((byte >> 4) - static_cast<int32_t>(offset)) * xb[4 * (u + kUnits) + i];
          } else {
            s += (byte - static_cast<int32_t>(offset)) * xb[4 * u + i];
          }
        }
      }
      // Fused multiply-adds in the vector path's order, so both paths round alike.
      v = std::fma(static_cast<float>(s), scalar(scale + b * kGroup + r) * a.dx[m * a.nb + b], v);
      if constexpr (kMin) v = std::fma(scalar(mins + b * kGroup + r), a.xsum[m * a.nb + b], v);
    }
    y[r] = v;
  }
}

template <typename S, bool kNibbles, int kBlock, bool kMin>
void matmul_groups(const Activations& a, const uint8_t* q, const S* scale, const S* mins,
                   int64_t offset, int64_t n, float* y) {
  const int64_t groups = (n + kGroup - 1) / kGroup;
  const int64_t group_bytes = a.nb * (kNibbles ? kBlock / 2 : kBlock) * kGroup;
  // Groups per task: about 32 activation rows x 16 weight rows of work at least (a split below
  // that costs more in thread start-up than it saves), so that two threads share even a 576-row matrix.
  const int64_t grain = std::max<int64_t>(1, 32 / std::max<int64_t>(1, a.rows));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* qg = q + g * group_bytes;
      const S* sg = scale + g * a.nb * kGroup;
      const S* mg = kMin ? mins + g * a.nb * kGroup : nullptr;
      const int64_t live = std::min<int64_t>(kGroup, n - g * kGroup);
#if AIAYN_VNNI
      const __mmask16 store = static_cast<__mmask16>((1u << live) - 1u);
      float* yg = y + g * kGroup;
      int64_t m = 0;
      for (; m + 4 <= a.rows; m += 4) group_rows<S, kNibbles, kBlock, kMin, 4>(a, m, qg, sg, mg, offset, yg, n, store);
      switch (a.rows - m) {
        case 3: group_rows<S, kNibbles, kBlock, kMin, 3>(a, m, qg, sg, mg, offset, yg, n, store); break;
        case 2: group_rows<S, kNibbles, kBlock, kMin, 2>(a, m, qg, sg, mg, offset, yg, n, store); break;
        case 1: group_rows<S, kNibbles, kBlock, kMin, 1>(a, m, qg, sg, mg, offset, yg, n, store); break;
        default: break;
      }
#else
      for (int64_t m = 0; m < a.rows; ++m) {
        group_rows_scalar<S, kNibbles, kBlock, kMin>(a, m, qg, sg, mg, offset, y + m * n + g * kGroup, live);
      }
#endif
    }
  });
}

void check_weights(const at::Tensor& q, const at::Tensor& scale, const c10::optional<at::Tensor>& mins,
                   int64_t block, bool nibbles, int64_t n, int64_t k) {
  TORCH_CHECK(block == 16 || block == 32, "q4: block must be 16 or 32, got ", block);
  TORCH_CHECK(k > 0 && k % block == 0, "q4: k=", k, " is not a multiple of the block ", block);
  const int64_t groups = (n + kGroup - 1) / kGroup, nb = k / block;
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous() && q.numel() == groups * nb * (nibbles ? block / 2 : block) * kGroup,
              "q4: the weights must be ", groups * nb * (nibbles ? block / 2 : block) * kGroup, " contiguous bytes for n=", n, ", k=", k);
  TORCH_CHECK((scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kHalf) && scale.is_contiguous() &&
                  scale.numel() == groups * nb * kGroup,
              "q4: the scales must be ", groups * nb * kGroup, " contiguous float32 or float16 values");
  if (mins.has_value()) {
    TORCH_CHECK(mins->scalar_type() == scale.scalar_type() && mins->is_contiguous() && mins->numel() == scale.numel(),
                "q4: the mins must match the scales");
  }
}

template <typename S>
void dispatch(const Activations& a, const at::Tensor& q, const at::Tensor& scale, const c10::optional<at::Tensor>& mins,
              int64_t offset, int64_t block, bool nibbles, int64_t n, float* yp) {
  const S* m = mins.has_value() ? mins->data_ptr<S>() : nullptr;
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const S* sp = scale.data_ptr<S>();
  const bool has_min = m != nullptr;
#define AIAYN_CALL(NIB, BLK, MIN) matmul_groups<S, NIB, BLK, MIN>(a, qp, sp, m, offset, n, yp)
  if (nibbles && block == 32) { if (has_min) AIAYN_CALL(true, 32, true); else AIAYN_CALL(true, 32, false); }
  else if (nibbles) { if (has_min) AIAYN_CALL(true, 16, true); else AIAYN_CALL(true, 16, false); }
  else if (block == 32) { if (has_min) AIAYN_CALL(false, 32, true); else AIAYN_CALL(false, 32, false); }
  else { if (has_min) AIAYN_CALL(false, 16, true); else AIAYN_CALL(false, 16, false); }
#undef AIAYN_CALL
}

at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                     const c10::optional<at::Tensor>& mins, int64_t offset, int64_t block, bool nibbles,
                     int64_t n, int64_t k) {
  check_weights(q, scale, mins, block, nibbles, n, k);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) == k,
              "q4: x must be contiguous float32 (m, ", k, ")");
  const int64_t rows = x.size(0);
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return y;
  const Activations a = quantize_activations(x.data_ptr<float>(), rows, k, block);
  if (scale.scalar_type() == at::kHalf) {
    dispatch<at::Half>(a, q, scale, mins, offset, block, nibbles, n, y.data_ptr<float>());
  } else {
    dispatch<float>(a, q, scale, mins, offset, block, nibbles, n, y.data_ptr<float>());
  }
  return y;
}

// W's rows (all n, or the given ones) as float32 (r, k): scale * (q - offset) + min, in that
// order (as the gguf package computes it).
template <typename S>
void dequantize_rows(const uint8_t* qp, const S* sp, const S* mp, int64_t offset, int64_t block, bool nibbles,
                     int64_t k, const int64_t* ip, int64_t count, float* wp) {
  const int64_t nb = k / block, units = nibbles ? block / 8 : block / 4;
  const int64_t group_bytes = nb * units * kUnit;
  at::parallel_for(0, count, 16, [&](int64_t i0, int64_t i1) {
    uint8_t values[32];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = ip != nullptr ? ip[i] : i, g = r / kGroup, lane = r % kGroup;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* qb = qp + g * group_bytes + b * units * kUnit;
        for (int64_t u = 0; u < units; ++u) {
          for (int64_t j = 0; j < 4; ++j) {
            const uint8_t byte = qb[u * kUnit + 4 * lane + j];
            if (nibbles) {
              values[4 * u + j] = byte & 0x0F;
              values[4 * (u + units) + j] = byte >> 4;
            } else {
              values[4 * u + j] = byte;
            }
          }
        }
        const int64_t at = (g * nb + b) * kGroup + lane;
        const float s = scalar(sp + at);
        float* out = wp + i * k + b * block;
        if (mp != nullptr) {
          const float m = scalar(mp + at);
          for (int64_t c = 0; c < block; ++c) out[c] = s * static_cast<float>(values[c] - offset) + m;
        } else {
          for (int64_t c = 0; c < block; ++c) out[c] = s * static_cast<float>(values[c] - offset);
        }
      }
    }
  });
}

at::Tensor q4_dequantize(const at::Tensor& q, const at::Tensor& scale, const c10::optional<at::Tensor>& mins,
                         int64_t offset, int64_t block, bool nibbles, int64_t n, int64_t k,
                         const c10::optional<at::Tensor>& rows) {
  check_weights(q, scale, mins, block, nibbles, n, k);
  at::Tensor index;
  if (rows.has_value()) {
    index = rows->contiguous();
    TORCH_CHECK(index.scalar_type() == at::kLong && index.dim() == 1, "q4: rows must be a 1-D long tensor");
  }
  const int64_t count = rows.has_value() ? index.numel() : n;
  const int64_t* ip = rows.has_value() ? index.data_ptr<int64_t>() : nullptr;
  for (int64_t i = 0; i < (ip != nullptr ? count : 0); ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < n, "q4: row ", ip[i], " is out of range for ", n, " rows");
  }
  at::Tensor w = at::empty({count, k}, q.options().dtype(at::kFloat));
  if (scale.scalar_type() == at::kHalf) {
    dequantize_rows<at::Half>(q.data_ptr<uint8_t>(), scale.data_ptr<at::Half>(),
                              mins.has_value() ? mins->data_ptr<at::Half>() : nullptr, offset, block, nibbles, k,
                              ip, count, w.data_ptr<float>());
  } else {
    dequantize_rows<float>(q.data_ptr<uint8_t>(), scale.data_ptr<float>(),
                           mins.has_value() ? mins->data_ptr<float>() : nullptr, offset, block, nibbles, k, ip,
                           count, w.data_ptr<float>());
  }
  return w;
}

bool q4_has_vnni() { return AIAYN_VNNI != 0; }

// at::parallel_for splits work over torch's threads only in code compiled with OpenMP: ATen's
// header runs it serially otherwise (one thread whatever torch.set_num_threads says). The build
// passes -fopenmp; a test checks that it took.
bool q4_parallel() {
#ifdef _OPENMP
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(aiayn_q4, m) {
  m.def("matmul(Tensor x, Tensor q, Tensor scale, Tensor? mins, int offset, int block, bool nibbles, int n, int k) -> Tensor");
  m.def("dequantize(Tensor q, Tensor scale, Tensor? mins, int offset, int block, bool nibbles, int n, int k, Tensor? rows) -> Tensor");
  m.def("has_vnni() -> bool", &q4_has_vnni);
  m.def("parallel() -> bool", &q4_parallel);
}

TORCH_LIBRARY_IMPL(aiayn_q4, CPU, m) {
  m.impl("matmul", &q4_matmul);
  m.impl("dequantize", &q4_dequantize);
}
