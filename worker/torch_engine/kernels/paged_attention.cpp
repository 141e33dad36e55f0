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

// scores[k] = q . keys[k * stride] for k < 8: eight independent dot products at once (one accumulator per key,
// so no chain of dependent adds), summed across lanes together at the end. A block's size is a multiple of 8, so
// the eight keys are always there (scores past a query's last position are computed and ignored).
inline void scores8(const float* q, const float* keys, int64_t stride, int64_t d, float* scores) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[8];
  for (int k = 0; k < 8; ++k) acc[k] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int k = 0; k < 8; ++k) acc[k] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys + k * stride + i), acc[k]);
  }
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
  _mm256_storeu_ps(scores, _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31)));
#else
  v8 acc[8] = {};
  for (int64_t i = 0; i < d; i += 8) {
    const v8 qv = load8(q + i);
    for (int k = 0; k < 8; ++k) acc[k] += qv * load8(keys + k * stride + i);
  }
  for (int k = 0; k < 8; ++k)
    scores[k] = ((acc[k][0] + acc[k][1]) + (acc[k][2] + acc[k][3])) + ((acc[k][4] + acc[k][5]) + (acc[k][6] + acc[k][7]));
#endif
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

// acc[0, 8 * LANES) = acc * alpha + sum_j p[j] * values[j * stride], the accumulators held in registers across the
// positions (LANES is a constant, so the compiler keeps them there).
template <int LANES>
inline void accumulate(float* acc, float alpha, const float* p, const float* values, int64_t stride, int64_t valid) {
  v8 a[LANES];
  for (int k = 0; k < LANES; ++k) a[k] = load8(acc + 8 * k) * alpha;
  for (int64_t j = 0; j < valid; ++j) {
    const float pj = p[j];
    const float* v = values + j * stride;
    for (int k = 0; k < LANES; ++k) a[k] += pj * load8(v + 8 * k);
  }
  for (int k = 0; k < LANES; ++k) store8(acc + 8 * k, a[k]);
}

// Query vectors folded together: each stage runs for all of them before the next, so the processor overlaps
// their independent work (a single vector's stages form one long chain of dependent steps).
constexpr int FOLD = 4;

// Fold a block into `n` <= FOLD query states, state k for its first valid[k] positions (scores: FOLD * block).
inline void fold_block(QueryState* const* st, const int64_t* valid, int n, const BlockView& blk, const Shape& s,
                       float* scores) {
  const int64_t d = s.dim, bs = s.block_size;
  float alpha[FOLD], new_max[FOLD];
  for (int k = 0; k < n; ++k)
    for (int64_t j = 0; j < valid[k]; j += 8)
      scores8(st[k]->q, blk.keys + j * blk.stride, blk.stride, d, scores + k * bs + j);
  for (int k = 0; k < n; ++k) {
    const float* sc = scores + k * bs;
    float block_max = sc[0];
    for (int64_t j = 1; j < valid[k]; ++j) block_max = std::max(block_max, sc[j]);
    new_max[k] = std::max(st[k]->max, block_max);
    alpha[k] = std::exp(st[k]->max - new_max[k]);  // 0 on the first block (max was -inf)
  }
  for (int k = 0; k < n; ++k)
    for (int64_t j = 0; j < valid[k]; j += 8) store8(scores + k * bs + j, exp8(load8(scores + k * bs + j) - new_max[k]));
  for (int k = 0; k < n; ++k) {
    const float* sc = scores + k * bs;
    float sum = 0.f;
    for (int64_t j = 0; j < valid[k]; ++j) sum += sc[j];
    st[k]->sum = st[k]->sum * alpha[k] + sum;
    st[k]->max = new_max[k];
  }
  for (int k = 0; k < n; ++k) {
    int64_t i = 0;
    for (; i + 64 <= d; i += 64) accumulate<8>(st[k]->acc + i, alpha[k], scores + k * bs, blk.values + i, blk.stride, valid[k]);
    for (; i < d; i += 8) accumulate<1>(st[k]->acc + i, alpha[k], scores + k * bs, blk.values + i, blk.stride, valid[k]);
  }
}

// Collects the query vectors that read one block, folding them FOLD at a time.
struct FoldBatch {
  QueryState* states[FOLD];
  int64_t valid[FOLD];
  int n = 0;

  void add(QueryState* st, int64_t v, const BlockView& blk, const Shape& s, float* scores) {
    states[n] = st;
    valid[n++] = v;
    if (n == FOLD) flush(blk, s, scores);
  }
  void flush(const BlockView& blk, const Shape& s, float* scores) {
    if (n) fold_block(states, valid, n, blk, s, scores);
    n = 0;
  }
};

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
    std::vector<float> qbuf, acc, scores(FOLD * bs);
    FoldBatch batch;
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
            for (int64_t j = 0; j < g; ++j) batch.add(&states[qi * s.hq + h * g + j], valid, blk, s, scores.data());
          }
          batch.flush(blk, s, scores.data());
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
            for (int64_t j = 0; j < g; ++j) batch.add(&states[qi * s.hq + h * g + j], valid, blk, s, scores.data());
            batch.flush(blk, s, scores.data());
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
