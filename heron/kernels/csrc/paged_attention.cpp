// Paged attention for the CPU: each query reads its sequence's keys and values in place through the block
// table (no gather into a new tensor), with a block-wise online softmax in float32. Covers any number of
// queries per sequence (decode, speculative verification, prefill chunks over a cached prefix), GQA and
// sliding windows. Work is split over (sequence, KV head) pairs, so each key/value row is read and converted
// once for all the query heads that share it; cost grows with the positions each query attends.
// The pool holds the queries' dtype, or float8 (an fp8 KV cache): stored keys are k / k_scale and values
// v / v_scale, so k_scale is folded into the scaled query and v_scale into the output's normalization.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "float_rows.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using namespace heron;

// T: q's and the output's dtype; C: the pool's (T, or float8). scale: the softmax scale times k_scale, applied to
// the query; v_scale: applied with the softmax's 1 / sum.
template <typename T, typename C>
void attend(const T* q, int64_t q_stride, const C* cache, const int32_t* block_table, const int32_t* seq_lens,
            const int32_t* query_begin, const int32_t* query_end, T* out, int64_t num_seqs, int64_t num_heads,
            int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks, int64_t table_width,
            float scale, int64_t window, float v_scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_heads * head_dim;   // out: [T, H, D]; q's rows may be strided
  const int64_t slot_stride = num_kv_heads * head_dim;  // cache: [2, NB, BS, KVH, D]
  const int64_t block_stride = block_size * slot_stride;
  const int64_t value_offset = num_blocks * block_stride;
  const int64_t D = head_dim, BS = block_size;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * D), acc(group * D), keys(BS * D), values(BS * D);
    std::vector<float> scores(BS), running_max(group), denom(group);
    for (int64_t work = begin; work < end; ++work) {
      const int64_t b = work / num_kv_heads, kvh = work % num_kv_heads;
      const int64_t q_begin = query_begin[b], q_end = query_end[b];
      const int64_t seq_len = seq_lens[b], num_q = q_end - q_begin;
      const int32_t* table = block_table + b * table_width;
      for (int64_t t = q_begin; t < q_end; ++t) {
        const int64_t pos = seq_len - num_q + (t - q_begin);
        const int64_t first = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
        load_row(q + t * q_stride + kvh * group * D, qf.data(), group * D);
        for (auto& x : qf) x *= scale;
        std::fill(acc.begin(), acc.end(), 0.0f);
        std::fill(running_max.begin(), running_max.end(), neg_inf);
        std::fill(denom.begin(), denom.end(), 0.0f);
        for (int64_t j0 = first; j0 <= pos;) {
          const int64_t offset = j0 % BS;
          const int64_t n = std::min(BS - offset, pos - j0 + 1);  // positions of this block to read
          const int64_t row0 = static_cast<int64_t>(table[j0 / BS]) * block_stride + offset * slot_stride + kvh * D;
          for (int64_t r = 0; r < n; ++r) {
            load_row(cache + row0 + r * slot_stride, keys.data() + r * D, D);
            load_row(cache + value_offset + row0 + r * slot_stride, values.data() + r * D, D);
          }
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = qf.data() + g * D;
            for (int64_t r = 0; r < n; ++r) {
              const float* k = keys.data() + r * D;
              float s = 0.0f;
#pragma omp simd reduction(+ : s)
              for (int64_t d = 0; d < D; ++d) s += qg[d] * k[d];
              scores[r] = s;
            }
            float block_max = neg_inf;
#pragma omp simd reduction(max : block_max)
            for (int64_t r = 0; r < n; ++r) block_max = std::max(block_max, scores[r]);
            const float new_max = std::max(running_max[g], block_max);
            const float correction = std::exp(running_max[g] - new_max);  // 0 on the first block
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t r = 0; r < n; ++r) {
              scores[r] = exp_approx(scores[r] - new_max);
              sum += scores[r];
            }
            float* a = acc.data() + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] *= correction;
            for (int64_t r = 0; r < n; ++r) {
              const float p = scores[r];
              const float* v = values.data() + r * D;
#pragma omp simd
              for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
            }
            denom[g] = denom[g] * correction + sum;
            running_max[g] = new_max;
          }
          j0 += n;
        }
        T* o = out + t * token_stride + kvh * group * D;
        for (int64_t g = 0; g < group; ++g) {
          const float inv = v_scale / denom[g];
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) acc[g * D + d] *= inv;
          store_row(acc.data() + g * D, o + g * D, D);
        }
      }
    }
  });
}

}  // namespace

// q: [T, H, D] (rows may be strided); kv_cache: [2, NB, BS, KVH, D] (q's dtype, or float8 holding k / k_scale
// and v / v_scale); block_table: [B, W] int32; seq_lens: [B] int32;
// query_begin, query_end: [B] int32, sequence b's queries are rows [begin, end) of q (an empty range skips it:
// its rows of the result are left for another path). Returns [T, H, D].
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_table,
                              torch::Tensor seq_lens, torch::Tensor query_begin, torch::Tensor query_end,
                              double scale, int64_t window, double k_scale, double v_scale) {
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && kv_cache.is_contiguous() &&
              block_table.is_contiguous(), "contiguous heads of q, a contiguous pool and block table");
  const auto pool = kv_cache.scalar_type();
  TORCH_CHECK(pool == q.scalar_type() || pool == at::kFloat8_e4m3fn || pool == at::kFloat8_e5m2,
              "the KV cache must hold q's dtype or float8");
  auto out = torch::empty(q.sizes(), q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    const auto run = [&](const auto* cache) {
      attend(q.data_ptr<scalar_t>(), q.stride(0), cache, block_table.data_ptr<int32_t>(),
             seq_lens.data_ptr<int32_t>(), query_begin.data_ptr<int32_t>(), query_end.data_ptr<int32_t>(),
             out.data_ptr<scalar_t>(), seq_lens.size(0), q.size(1), kv_cache.size(3), q.size(2), kv_cache.size(2),
             kv_cache.size(1), block_table.size(1), static_cast<float>(scale * k_scale), window,
             static_cast<float>(v_scale));
    };
    if (pool == at::kFloat8_e4m3fn) {
      run(kv_cache.data_ptr<c10::Float8_e4m3fn>());
    } else if (pool == at::kFloat8_e5m2) {
      run(kv_cache.data_ptr<c10::Float8_e5m2>());
    } else {
      run(kv_cache.data_ptr<scalar_t>());
    }
  });
  return out;
}
