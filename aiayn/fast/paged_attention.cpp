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

namespace {

constexpr int64_t kLanes = 16;  // independent partial sums of a dot product: one 512-bit vector

// q . k over d floats: kLanes partial sums the compiler keeps in one vector register, then added.
inline float dot(const float* q, const float* k, int64_t d) {
  float lanes[kLanes] = {0.f};
  int64_t c = 0;
  for (; c + kLanes <= d; c += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += q[c + l] * k[c + l];
  }
  float sum = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) sum += lanes[l];
  for (; c < d; ++c) sum += q[c] * k[c];
  return sum;
}

// out += w * v over d floats.
inline void axpy(float* out, float w, const float* v, int64_t d) {
  for (int64_t c = 0; c < d; ++c) out[c] += w * v[c];
}

at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& table_in, int64_t t_k, const c10::optional<at::Tensor>& mask,
                           double scale) {
  TORCH_CHECK(q_in.dim() == 4 && q_in.scalar_type() == at::kFloat, "paged_attention: q must be float32 (b, h, t_q, d_h)");
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.scalar_type() == at::kFloat && k_pool.is_contiguous() &&
                  v_pool.sizes() == k_pool.sizes() && v_pool.scalar_type() == at::kFloat && v_pool.is_contiguous(),
              "paged_attention: k and v must be contiguous float32 pools (n_blocks, block_size, h_kv, d_h) of one shape");
  TORCH_CHECK(table_in.dim() == 2 && table_in.scalar_type() == at::kLong, "paged_attention: the block table must be int64 (b, n)");
  const int64_t b = q_in.size(0), h = q_in.size(1), t_q = q_in.size(2), d = q_in.size(3);
  const int64_t n_blocks = k_pool.size(0), block = k_pool.size(1), h_kv = k_pool.size(2);
  TORCH_CHECK(k_pool.size(3) == d, "paged_attention: q and the pool differ in head width: ", d, " and ", k_pool.size(3));
  TORCH_CHECK(h_kv > 0 && h % h_kv == 0, "paged_attention: ", h, " query heads are not a multiple of ", h_kv, " key/value heads");
  TORCH_CHECK(table_in.size(0) == b, "paged_attention: the block table has ", table_in.size(0), " rows for a batch of ", b);
  const int64_t n = table_in.size(1);
  TORCH_CHECK(t_k >= 0 && t_k <= n * block, "paged_attention: ", t_k, " keys do not fit ", n, " blocks of ", block);
  const at::Tensor table = table_in.contiguous();
  const int64_t* tp = table.data_ptr<int64_t>();
  for (int64_t i = 0; i < b * n; ++i) {
    TORCH_CHECK(tp[i] >= 0 && tp[i] < n_blocks, "paged_attention: block ", tp[i], " is out of range for a pool of ", n_blocks);
  }
  // The mask's strides (0 along a broadcast dimension): rows, queries, keys.
  const bool* mp = nullptr;
  int64_t m_row = 0, m_query = 0, m_key = 0;
  if (mask.has_value()) {
    const at::Tensor& m = *mask;
    TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 4 && m.size(1) == 1 && (m.size(0) == b || m.size(0) == 1) &&
                    (m.size(2) == t_q || m.size(2) == 1) && m.size(3) >= t_k,
                "paged_attention: the mask must be bool (b or 1, 1, t_q or 1, t_k), got ", m.sizes());
    mp = m.data_ptr<bool>();
    m_row = m.size(0) == 1 ? 0 : m.stride(0);
    m_query = m.size(2) == 1 ? 0 : m.stride(2);
    m_key = m.stride(3);
  }
  const at::Tensor q = q_in.transpose(1, 2).contiguous();  // (b, t_q, h, d_h): one query's heads side by side
  at::Tensor out = at::empty({b, t_q, h, d}, q.options());  // written in full below
  const float* qp = q.data_ptr<float>();
  const float* kp = k_pool.data_ptr<float>();
  const float* vp = v_pool.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t group = h / h_kv, queries = group * t_q;  // the queries one task serves
  const float s = static_cast<float>(scale);

  at::parallel_for(0, b * h_kv, 1, [&](int64_t task0, int64_t task1) {
    std::vector<float> scores(queries * t_k);  // (t_q, group, t_k) of one task
    std::vector<float> acc(queries * d);       // (t_q, group, d_h) its outputs
    std::vector<float> total(queries);
    for (int64_t task = task0; task < task1; ++task) {
      const int64_t i = task / h_kv, j = task % h_kv;
      const int64_t* row_table = tp + i * n;
      // scores[(tq * group + g) * t_k + key] = scale * q . k, or -inf where masked
      for (int64_t key = 0; key < t_k; ++key) {
        const float* k = kp + ((row_table[key / block] * block + key % block) * h_kv + j) * d;
        for (int64_t tq = 0; tq < t_q; ++tq) {
          const bool visible = mp == nullptr || mp[i * m_row + tq * m_query + key * m_key];
          const float* qq = qp + ((i * t_q + tq) * h + j * group) * d;  // the group's first query head
          float* sc = scores.data() + tq * group * t_k + key;
          for (int64_t g = 0; g < group; ++g) {
            sc[g * t_k] = visible ? s * dot(qq + g * d, k, d) : -std::numeric_limits<float>::infinity();
          }
        }
      }
      // softmax over each query's keys: exp(score - max), normalised after the products with v
      for (int64_t x = 0; x < queries; ++x) {
        float* sc = scores.data() + x * t_k;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t key = 0; key < t_k; ++key) m = std::max(m, sc[key]);
        float sum = 0.f;
        if (std::isinf(m)) {  // no visible key: zero weights (and a zero output)
          std::fill(sc, sc + t_k, 0.f);
        } else {
          for (int64_t key = 0; key < t_k; ++key) {
            sc[key] = std::exp(sc[key] - m);  // exp(-inf) = 0 at masked keys
            sum += sc[key];
          }
        }
        total[x] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t key = 0; key < t_k; ++key) {
        const float* v = vp + ((row_table[key / block] * block + key % block) * h_kv + j) * d;
        for (int64_t x = 0; x < queries; ++x) {
          const float w = scores[x * t_k + key];
          if (w != 0.f) axpy(acc.data() + x * d, w, v, d);
        }
      }
      for (int64_t tq = 0; tq < t_q; ++tq) {  // normalised: the sum of the weights divides
        for (int64_t g = 0; g < group; ++g) {
          const int64_t x = tq * group + g;
          const float* a = acc.data() + x * d;
          const float inv = total[x] > 0.f ? 1.f / total[x] : 0.f;
          float* o = op + ((i * t_q + tq) * h + j * group + g) * d;
          for (int64_t c = 0; c < d; ++c) o[c] = a[c] * inv;
        }
      }
    }
  });
  return out.transpose(1, 2);  // (b, h, t_q, d_h), a view of the (b, t_q, h, d_h) layout
}

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
}

TORCH_LIBRARY_IMPL(aiayn_paged, CPU, m) { m.impl("attention", &paged_attention); }
