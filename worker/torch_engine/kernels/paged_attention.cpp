// Attention over the KV block pool in place, on the CPU: each query reads its sequence's blocks where they lie,
// through its block table, with an online softmax (no gather of the context into a batch).
//
// Work comes as items. An item is a run of queries that attend the first `shared` blocks of one table together
// (a prompt tile: all of its blocks; a group of decode rows: the leading blocks they share, read once for all of
// them), then each query its own blocks after those. Queries see positions up to their own (`last`), so a
// prompt tile is causal. Items run in parallel on ATen's intra-op threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

// Eight float lanes; GCC lowers them to the machine's vector registers (AVX2 here, NEON on Arm).
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));  // the same, at any float address

inline v8 load8(const float* p) { return *reinterpret_cast<const v8u*>(p); }
inline void store8(float* p, v8 x) { *reinterpret_cast<v8u*>(p) = x; }

typedef int32_t v8i __attribute__((vector_size(32)));

// exp on eight lanes at once (Cephes' expf: 2^n times a degree-6 polynomial; relative error about 1e-7), for
// x <= 0 (scores less their maximum), clamped where exp underflows.
inline v8 exp8(v8 x) {
  const v8 lo = v8{} - 87.3f;
  x = x < lo ? lo : x;
  const v8 t = x * 1.44269504088896341f + 0.5f;
  v8i n = __builtin_convertvector(t, v8i);  // truncates: floor(t) for t >= 0, one more for t < 0
  v8 nf = __builtin_convertvector(n, v8);
  const v8i over = nf > t;
  n += over;  // over is -1 where true
  nf = __builtin_convertvector(n, v8);
  const v8 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  v8 y = r * 1.9875691500e-4f + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.f;
  const v8i bits = (n + 127) << 23;
  return y * reinterpret_cast<const v8&>(bits);
}

// scores[j] = q . keys[j * stride] for j < n <= 8: eight independent dot products at once (one accumulator per
// key, so no chain of dependent adds), summed across lanes together at the end.
inline void scores8(const float* q, const float* keys, int64_t stride, int64_t n, int64_t d, float* scores) {
#if defined(__AVX2__) && defined(__FMA__)
  if (n == 8) {
    __m256 acc[8];
    for (int k = 0; k < 8; ++k) acc[k] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
      const __m256 qv = _mm256_loadu_ps(q + i);
      for (int k = 0; k < 8; ++k) acc[k] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys + k * stride + i), acc[k]);
    }
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
    _mm256_storeu_ps(scores, _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20),
                                           _mm256_permute2f128_ps(t0, t1, 0x31)));
    return;
  }
#endif
  v8 acc[8] = {};
  for (int64_t i = 0; i < d; i += 8) {
    const v8 qv = load8(q + i);
    for (int64_t k = 0; k < n; ++k) acc[k] += qv * load8(keys + k * stride + i);
  }
  for (int64_t k = 0; k < n; ++k)
    scores[k] = ((acc[k][0] + acc[k][1]) + (acc[k][2] + acc[k][3])) + ((acc[k][4] + acc[k][5]) + (acc[k][6] + acc[k][7]));
}

struct Shape {
  int64_t hq, hkv, group, dim, block_size;
};

// The running softmax of one query vector over the blocks read so far.
struct QueryState {
  const float* q;  // [dim], scaled
  float* acc;      // [dim], unnormalised output
  float max = -std::numeric_limits<float>::infinity();
  float sum = 0.f;
};

// One block of one kv head: where its keys and values are (float, each position `stride` floats after the last).
struct BlockView {
  const float* keys;
  const float* values;
  int64_t stride;
};

// Fold a block into a query's state, for its first `valid` positions.
inline void fold_block(QueryState& st, const BlockView& blk, int64_t valid, const Shape& s, float* scores) {
  const int64_t d = s.dim;
  for (int64_t j = 0; j < valid; j += 8)
    scores8(st.q, blk.keys + j * blk.stride, blk.stride, std::min<int64_t>(8, valid - j), d, scores + j);
  float block_max = scores[0];
  for (int64_t j = 1; j < valid; ++j) block_max = std::max(block_max, scores[j]);
  const float new_max = std::max(st.max, block_max);
  const float alpha = std::exp(st.max - new_max);  // 0 on the first block (max was -inf)
  for (int64_t j = 0; j < valid; j += 8) store8(scores + j, exp8(load8(scores + j) - new_max));
  float sum = 0.f;
  for (int64_t j = 0; j < valid; ++j) sum += scores[j];
  // The output, 64 lanes at a time held in registers across the block's positions (independent adds).
  for (int64_t i0 = 0; i0 < d; i0 += 64) {
    const int64_t lanes = std::min<int64_t>(8, (d - i0) / 8);
    v8 acc[8];
    for (int64_t k = 0; k < lanes; ++k) acc[k] = load8(st.acc + i0 + 8 * k) * alpha;
    for (int64_t j = 0; j < valid; ++j) {
      const float p = scores[j];
      const float* v = blk.values + j * blk.stride + i0;
      for (int64_t k = 0; k < lanes; ++k) acc[k] += p * load8(v + 8 * k);
    }
    for (int64_t k = 0; k < lanes; ++k) store8(st.acc + i0 + 8 * k, acc[k]);
  }
  st.sum = st.sum * alpha + sum;
  st.max = new_max;
}

// Reads blocks out of the pool as BlockViews: float pools where they lie, others converted into a buffer first.
template <typename scalar_t>
struct BlockReader {
  const scalar_t* k_pool;
  const scalar_t* v_pool;
  Shape s;
  std::vector<float> k, v;

  BlockReader(const scalar_t* kp, const scalar_t* vp, const Shape& shape) : k_pool(kp), v_pool(vp), s(shape) {
    if constexpr (!std::is_same_v<scalar_t, float>) {
      k.resize(s.block_size * s.hkv * s.dim);
      v.resize(k.size());
    }
  }

  // Block `block`, all heads; then `head(h)` views one of them.
  void read(int64_t block) {
    const int64_t n = s.block_size * s.hkv * s.dim, at = block * n;
    if constexpr (std::is_same_v<scalar_t, float>) {
      keys = k_pool + at;
      values = v_pool + at;
    } else {
      for (int64_t i = 0; i < n; ++i) k[i] = static_cast<float>(k_pool[at + i]);
      for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(v_pool[at + i]);
      keys = k.data();
      values = v.data();
    }
  }

  BlockView head(int64_t h) const { return BlockView{keys + h * s.dim, values + h * s.dim, s.hkv * s.dim}; }

  const float* keys = nullptr;
  const float* values = nullptr;
};

template <typename scalar_t>
void run_items(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_pool, const at::Tensor& v_pool,
               const at::Tensor& tables, const at::Tensor& queries, const at::Tensor& items, double scale,
               const Shape& s) {
  const scalar_t* q_data = query.data_ptr<scalar_t>();
  scalar_t* o_data = out.data_ptr<scalar_t>();
  const int32_t* tab = tables.data_ptr<int32_t>();
  const int32_t* qs = queries.data_ptr<int32_t>();
  const int32_t* its = items.data_ptr<int32_t>();
  const int64_t table_width = tables.size(1), num_items = items.size(0);
  const int64_t bs = s.block_size, d = s.dim, g = s.group;

  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    BlockReader<scalar_t> reader(k_pool.data_ptr<scalar_t>(), v_pool.data_ptr<scalar_t>(), s);
    std::vector<float> qbuf, acc, scores(bs);
    std::vector<QueryState> states;
    for (int64_t item = begin; item < end; ++item) {
      const int32_t qb = its[item * 3], qe = its[item * 3 + 1], shared = its[item * 3 + 2];
      const int64_t nq = qe - qb, nv = nq * s.hq;  // query vectors, ordered (query, head)
      qbuf.assign(nv * d, 0.f);
      acc.assign(nv * d, 0.f);
      states.assign(nv, QueryState{});
      for (int64_t qi = 0; qi < nq; ++qi) {
        const scalar_t* src = q_data + int64_t(qs[(qb + qi) * 3]) * s.hq * d;
        for (int64_t i = 0; i < s.hq * d; ++i) qbuf[qi * s.hq * d + i] = static_cast<float>(src[i]) * float(scale);
      }
      for (int64_t vi = 0; vi < nv; ++vi) {
        states[vi].q = qbuf.data() + vi * d;
        states[vi].acc = acc.data() + vi * d;
      }
      const int32_t* first_table = tab + int64_t(qs[qb * 3 + 1]) * table_width;
      for (int64_t b = 0; b < shared; ++b) {  // read once, for every query of the item
        reader.read(first_table[b]);
        for (int64_t h = 0; h < s.hkv; ++h) {
          const BlockView blk = reader.head(h);
          for (int64_t qi = 0; qi < nq; ++qi) {
            const int64_t valid = std::min<int64_t>(bs, qs[(qb + qi) * 3 + 2] - b * bs + 1);
            if (valid <= 0) continue;
            for (int64_t j = 0; j < g; ++j) fold_block(states[qi * s.hq + h * g + j], blk, valid, s, scores.data());
          }
        }
      }
      for (int64_t qi = 0; qi < nq; ++qi) {  // then each query's own blocks
        const int32_t* table = tab + int64_t(qs[(qb + qi) * 3 + 1]) * table_width;
        const int64_t last = qs[(qb + qi) * 3 + 2];
        for (int64_t b = shared; b <= last / bs; ++b) {
          reader.read(table[b]);
          const int64_t valid = std::min<int64_t>(bs, last - b * bs + 1);
          for (int64_t h = 0; h < s.hkv; ++h) {
            const BlockView blk = reader.head(h);
            for (int64_t j = 0; j < g; ++j) fold_block(states[qi * s.hq + h * g + j], blk, valid, s, scores.data());
          }
        }
      }
      for (int64_t qi = 0; qi < nq; ++qi) {
        scalar_t* o = o_data + int64_t(qs[(qb + qi) * 3]) * s.hq * d;
        for (int64_t hv = 0; hv < s.hq; ++hv) {
          const QueryState& st = states[qi * s.hq + hv];
          const float inv = 1.f / st.sum;
          for (int64_t i = 0; i < d; ++i) o[hv * d + i] = static_cast<scalar_t>(st.acc[i] * inv);
        }
      }
    }
  });
}

// out, query: [T, Hq, D]; k_pool, v_pool: [slots, Hkv, D]; tables: [rows, width] int32 block ids;
// queries: [Q, 3] int32 (token, table row, last position); items: [I, 3] int32 (first query, end, shared blocks).
void paged_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& k_pool, const at::Tensor& v_pool,
                     const at::Tensor& tables, const at::Tensor& queries, const at::Tensor& items, double scale,
                     int64_t block_size) {
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous(),
              "paged_attention: query, out and the pools must be contiguous");
  TORCH_CHECK(tables.scalar_type() == at::kInt && queries.scalar_type() == at::kInt &&
                  items.scalar_type() == at::kInt && tables.is_contiguous() && queries.is_contiguous() &&
                  items.is_contiguous(),
              "paged_attention: tables, queries and items must be contiguous int32");
  TORCH_CHECK(query.scalar_type() == k_pool.scalar_type() && out.scalar_type() == query.scalar_type(),
              "paged_attention: query, out and the pools must share a dtype");
  const Shape s{query.size(1), k_pool.size(1), query.size(1) / k_pool.size(1), query.size(2), block_size};
  TORCH_CHECK(s.hq % s.hkv == 0 && k_pool.size(2) == s.dim, "paged_attention: head shapes do not match");
  TORCH_CHECK(s.dim % 8 == 0 && block_size % 8 == 0, "paged_attention: head_dim and block_size must be multiples of 8, not ", s.dim, " and ",
              block_size);
  switch (query.scalar_type()) {
    case at::kFloat: run_items<float>(out, query, k_pool, v_pool, tables, queries, items, scale, s); break;
    case at::kBFloat16: run_items<c10::BFloat16>(out, query, k_pool, v_pool, tables, queries, items, scale, s); break;
    case at::kHalf: run_items<c10::Half>(out, query, k_pool, v_pool, tables, queries, items, scale, s); break;
    default: TORCH_CHECK(false, "paged_attention: unsupported dtype ", query.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY(pdserve, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor query, Tensor k_pool, Tensor v_pool, Tensor tables, "
        "Tensor queries, Tensor items, float scale, int block_size) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("paged_attention", paged_attention); }
