// Attention over a paged KV cache, read in place through the block table (built on first use by
// aiayn/fast/paged_attention_build.py; chosen by aiayn/fast/paged_attention.py). In the spirit of
// vLLM's PagedAttention CPU kernel: the keys and values of a row are never copied into one
// contiguous tensor; each query reads them block by block from the pool.
//
// Shapes (shape letters of aiayn/nn/paged_kv_cache.py):
//   q      (b, h, t_q, d_h) float32, any strides
//   k, v   (n_blocks, B, h_kv, d_h) float32, contiguous: the layer's pool
//   table  (b, n) int64: row i's logical slot s is slot s % B of block table[i, s / B]
//   mask   (b or 1, 1, t_q or 1, >= t_k) bool, any strides, True = may attend; or none (every key)
//   t_k    the logical slots read, [0, t_k), t_k <= n * B
// out (b, h, t_q, d_h) float32, laid out (b, t_q, h, d_h) (what the output projection reads next).
//
// out[i, j, q] = sum_s softmax_s(scale * q[i, j, q] . k[s] | mask[i, q, s]) v[s], over the keys of
// row i's kv head j / (h / h_kv) (grouped-query attention: each key/value head serves h / h_kv
// query heads); a query that may attend no key outputs zeros (aiayn.nn.attention's convention).
// The softmax is the float32 one of scaled_dot_product_attention: max-subtracted, then normalised.
//
// Work is split over rows x key/value heads (at::parallel_for, torch's thread count): a task reads
// each of its keys and values once for all the query heads of its group and all its queries.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#include <sleef.h>  // torch's vector math (libtorch_cpu exports it): the softmax's exp
#define AIAYN_AVX512 1
#else
#define AIAYN_AVX512 0
#endif

namespace {

// One call's operands, shared by its tasks (a task: row i, key/value head j).
struct Problem {
  const float* q;      // (b, t_q, h, d)
  const float* k;      // (n_blocks, block, h_kv, d)
  const float* v;
  const int64_t* table;  // (b, n)
  const bool* mask;    // nullptr: every key; else mask[i * m_row + tq * m_query + s * m_key]
  float* out;          // (b, t_q, h, d)
  int64_t t_q, h, h_kv, d, n, block, t_k, m_row, m_query, m_key;
  float scale;
  int64_t group() const { return h / h_kv; }
  // Key or value s of row i, head j: the pool's slot s % block of block table[i, s / block].
  const float* at(const float* pool, int64_t i, int64_t j, int64_t s) const {
    return pool + ((table[i * n + s / block] * block + s % block) * h_kv + j) * d;
  }
  bool visible(int64_t i, int64_t tq, int64_t s) const {
    return mask == nullptr || mask[i * m_row + tq * m_query + s * m_key];
  }
  const float* query(int64_t i, int64_t tq, int64_t head) const { return q + ((i * t_q + tq) * h + head) * d; }
  float* output(int64_t i, int64_t tq, int64_t head) const { return out + ((i * t_q + tq) * h + head) * d; }
};

// Query x of a task (x = tq * group + g) is query head j * group + g of token tq.

// The softmax weights of one query's scores (t_k, -inf at masked keys) in place: exp(score - max),
// not yet normalised; returns their sum (0 when no key is visible: the weights are then all 0).
float exp_weights_generic(float* sc, int64_t t_k) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t s = 0; s < t_k; ++s) m = std::max(m, sc[s]);
  if (std::isinf(m)) {
    std::fill(sc, sc + t_k, 0.f);
    return 0.f;
  }
  float sum = 0.f;
  for (int64_t s = 0; s < t_k; ++s) {
    sc[s] = std::exp(sc[s] - m);  // exp(-inf) = 0 at masked keys
    sum += sc[s];
  }
  return sum;
}

// Plain C++ loops, any head width: scores (t_q * group, t_k), then the weighted sum of the values.
void task_generic(const Problem& p, int64_t i, int64_t j, std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t group = p.group(), queries = group * p.t_q, t_k = p.t_k, d = p.d;
  for (int64_t s = 0; s < t_k; ++s) {
    const float* k = p.at(p.k, i, j, s);
    for (int64_t tq = 0; tq < p.t_q; ++tq) {
      const bool visible = p.visible(i, tq, s);
      for (int64_t g = 0; g < group; ++g) {
        const float* qq = p.query(i, tq, j * group + g);
        float dot = 0.f;
        for (int64_t c = 0; c < d; ++c) dot += qq[c] * k[c];
        scores[(tq * group + g) * t_k + s] = visible ? p.scale * dot : -std::numeric_limits<float>::infinity();
      }
    }
  }
  std::fill(acc.begin(), acc.begin() + queries * d, 0.f);
  for (int64_t x = 0; x < queries; ++x) {
    float* w = scores.data() + x * t_k;
    const float total = exp_weights_generic(w, t_k);
    float* a = acc.data() + x * d;
    for (int64_t s = 0; s < t_k; ++s) {
      if (w[s] == 0.f) continue;
      const float* v = p.at(p.v, i, j, s);
      for (int64_t c = 0; c < d; ++c) a[c] += w[s] * v[c];
    }
    const float inv = total > 0.f ? 1.f / total : 0.f;  // normalised: the sum of the weights divides
    float* o = p.output(i, x / group, j * group + x % group);
    for (int64_t c = 0; c < d; ++c) o[c] = a[c] * inv;
  }
}

#if AIAYN_AVX512
// r[l] = the sum of v[l]'s 16 lanes, l < 16: a transposing tree of shuffles and adds.
inline __m512 sum_lanes_16(const __m512* v) {
  __m512 x[8], y[4];
  for (int l = 0; l < 8; ++l) {  // per 128-bit lane L: [a0 + a2, b0 + b2, a1 + a3, b1 + b3]
    x[l] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * l], v[2 * l + 1]), _mm512_unpackhi_ps(v[2 * l], v[2 * l + 1]));
  }
  for (int l = 0; l < 4; ++l) {  // per 128-bit lane L: keys 4l..4l+3's sums over that lane
    y[l] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * l], x[2 * l + 1], 0x44), _mm512_shuffle_ps(x[2 * l], x[2 * l + 1], 0xEE));
  }
  const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(y[2], y[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// AVX-512, head width d = 16 * C: scores 16 keys at a time (16 dot products, their lanes summed by
// one transposing tree), the softmax's exp by Sleef (torch's own vector exp, 1-ulp), values
// accumulated in C registers per query.
template <int C>
void task_avx512(const Problem& p, int64_t i, int64_t j, std::vector<float>& scores) {
  const int64_t group = p.group(), queries = group * p.t_q, t_k = p.t_k;
  const float minus_inf = -std::numeric_limits<float>::infinity();
  const float* keys[16];
  for (int64_t s0 = 0; s0 < t_k; s0 += 16) {
    const int64_t count = std::min<int64_t>(16, t_k - s0);
    for (int64_t l = 0; l < 16; ++l) keys[l] = p.at(p.k, i, j, s0 + (l < count ? l : 0));  // past the end: any key
    for (int64_t tq = 0; tq < p.t_q; ++tq) {
      __mmask16 visible = 0;
      for (int64_t l = 0; l < count; ++l) visible |= static_cast<__mmask16>(p.visible(i, tq, s0 + l)) << l;
      for (int64_t g = 0; g < group; ++g) {
        const float* qq = p.query(i, tq, j * group + g);
        __m512 qv[C];
        for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(qq + 16 * c);
        __m512 dots[16];
        for (int l = 0; l < 16; ++l) {
          __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(keys[l]));
          for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(keys[l] + 16 * c), a);
          dots[l] = a;
        }
        const __m512 sc = _mm512_mul_ps(sum_lanes_16(dots), _mm512_set1_ps(p.scale));
        _mm512_mask_storeu_ps(scores.data() + (tq * group + g) * t_k + s0, static_cast<__mmask16>((1u << count) - 1),
                              _mm512_mask_blend_ps(visible, _mm512_set1_ps(minus_inf), sc));
      }
    }
  }
  for (int64_t x = 0; x < queries; ++x) {
    float* w = scores.data() + x * t_k;
    __m512 top = _mm512_set1_ps(minus_inf);
    int64_t s = 0;
    for (; s + 16 <= t_k; s += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(w + s));
    float m = _mm512_reduce_max_ps(top);
    for (; s < t_k; ++s) m = std::max(m, w[s]);
    float* o = p.output(i, x / group, j * group + x % group);
    if (std::isinf(m)) {  // no visible key: a zero output
      std::fill(o, o + 16 * C, 0.f);
      continue;
    }
    const __m512 mv = _mm512_set1_ps(m);
    __m512 sums = _mm512_setzero_ps();
    for (s = 0; s < t_k; s += 16) {  // exp(score - max): 0 at masked keys (-inf)
      const __mmask16 live = static_cast<__mmask16>(t_k - s >= 16 ? 0xFFFF : (1u << (t_k - s)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(live, Sleef_expf16_u10(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, w + s), mv)));
      _mm512_mask_storeu_ps(w + s, live, e);
      sums = _mm512_add_ps(sums, e);
    }
    const float total = _mm512_reduce_add_ps(sums);
    __m512 acc[C];
    for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
    for (s = 0; s < t_k; ++s) {
      if (w[s] == 0.f) continue;
      const float* v = p.at(p.v, i, j, s);
      const __m512 ws = _mm512_set1_ps(w[s]);
      for (int c = 0; c < C; ++c) acc[c] = _mm512_fmadd_ps(ws, _mm512_loadu_ps(v + 16 * c), acc[c]);
    }
    const __m512 inv = _mm512_set1_ps(1.f / total);  // normalised: the sum of the weights divides
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(acc[c], inv));
  }
}
#endif

at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& table_in, int64_t t_k, const c10::optional<at::Tensor>& mask,
                           double scale) {
  TORCH_CHECK(q_in.dim() == 4 && q_in.scalar_type() == at::kFloat, "paged_attention: q must be float32 (b, h, t_q, d_h)");
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.scalar_type() == at::kFloat && k_pool.is_contiguous() &&
                  v_pool.sizes() == k_pool.sizes() && v_pool.scalar_type() == at::kFloat && v_pool.is_contiguous(),
              "paged_attention: k and v must be contiguous float32 pools (n_blocks, block_size, h_kv, d_h) of one shape");
  TORCH_CHECK(table_in.dim() == 2 && table_in.scalar_type() == at::kLong, "paged_attention: the block table must be int64 (b, n)");
  Problem p{};
  const int64_t b = q_in.size(0);
  p.h = q_in.size(1), p.t_q = q_in.size(2), p.d = q_in.size(3);
  const int64_t n_blocks = k_pool.size(0);
  p.block = k_pool.size(1), p.h_kv = k_pool.size(2);
  TORCH_CHECK(k_pool.size(3) == p.d, "paged_attention: q and the pool differ in head width: ", p.d, " and ", k_pool.size(3));
  TORCH_CHECK(p.h_kv > 0 && p.h % p.h_kv == 0, "paged_attention: ", p.h, " query heads are not a multiple of ", p.h_kv,
              " key/value heads");
  TORCH_CHECK(table_in.size(0) == b, "paged_attention: the block table has ", table_in.size(0), " rows for a batch of ", b);
  p.n = table_in.size(1), p.t_k = t_k;
  TORCH_CHECK(t_k >= 0 && t_k <= p.n * p.block, "paged_attention: ", t_k, " keys do not fit ", p.n, " blocks of ", p.block);
  const at::Tensor table = table_in.contiguous();
  p.table = table.data_ptr<int64_t>();
  for (int64_t x = 0; x < b * p.n; ++x) {
    TORCH_CHECK(p.table[x] >= 0 && p.table[x] < n_blocks, "paged_attention: block ", p.table[x],
                " is out of range for a pool of ", n_blocks);
  }
  if (mask.has_value()) {  // its strides (0 along a broadcast dimension): rows, queries, keys
    const at::Tensor& m = *mask;
    TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 4 && m.size(1) == 1 && (m.size(0) == b || m.size(0) == 1) &&
                    (m.size(2) == p.t_q || m.size(2) == 1) && m.size(3) >= t_k,
                "paged_attention: the mask must be bool (b or 1, 1, t_q or 1, t_k), got ", m.sizes());
    p.mask = m.data_ptr<bool>();
    p.m_row = m.size(0) == 1 ? 0 : m.stride(0);
    p.m_query = m.size(2) == 1 ? 0 : m.stride(2);
    p.m_key = m.stride(3);
  }
  const at::Tensor q = q_in.transpose(1, 2).contiguous();  // (b, t_q, h, d_h): one token's heads side by side
  at::Tensor out = at::empty({b, p.t_q, p.h, p.d}, q.options());  // written in full by the tasks
  p.q = q.data_ptr<float>(), p.k = k_pool.data_ptr<float>(), p.v = v_pool.data_ptr<float>();
  p.out = out.data_ptr<float>();
  p.scale = static_cast<float>(scale);
  const int64_t queries = p.group() * p.t_q;

  at::parallel_for(0, b * p.h_kv, 1, [&](int64_t task0, int64_t task1) {
    std::vector<float> scores(queries * t_k);  // (t_q, group, t_k): one task's scores, then weights
    std::vector<float> acc;
    for (int64_t task = task0; task < task1; ++task) {
      const int64_t i = task / p.h_kv, j = task % p.h_kv;
#if AIAYN_AVX512
      if (p.d == 32) { task_avx512<2>(p, i, j, scores); continue; }
      if (p.d == 64) { task_avx512<4>(p, i, j, scores); continue; }
      if (p.d == 128) { task_avx512<8>(p, i, j, scores); continue; }
#endif
      acc.resize(queries * p.d);
      task_generic(p, i, j, scores, acc);
    }
  });
  return out.transpose(1, 2);  // (b, h, t_q, d_h), a view of the (b, t_q, h, d_h) layout
}

// Whether head widths 32, 64 and 128 take the AVX-512 path (else every width the plain loops).
bool paged_has_avx512() { return AIAYN_AVX512 != 0; }

// at::parallel_for splits work over torch's threads only in code compiled with OpenMP (see
// q4_kernel.cpp); the build passes -fopenmp and a test checks that it took.
bool paged_parallel() {
#ifdef _OPENMP
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(aiayn_paged, m) {
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor table, int t_k, Tensor? mask, float scale) -> Tensor");
  m.def("parallel() -> bool", &paged_parallel);
  m.def("has_avx512() -> bool", &paged_has_avx512);
}

TORCH_LIBRARY_IMPL(aiayn_paged, CPU, m) { m.impl("attention", &paged_attention); }
