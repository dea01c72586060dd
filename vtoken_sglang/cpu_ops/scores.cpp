// vToken's decode scores on the CPU in one op: the contract of ``layers_scores_headsum`` (scoring/reference.py).
// For request b with live row slots[b, :live[b]] and its newest query q[l, b] of each scored layer l, per query head
// h (KV head h / group): p = softmax_j(scale * <q[l, b, h], K_l[slots[b, j], h / group]>), soft-capped first when
// logit_cap > 0; out[b, j] = sum over layers and heads of p (float32, 0 past live[b]).
// Requests are independent (each writes its own output row), so they run in parallel when the batch is large.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kAhead = 8;  // keys fetched ahead of the one being scored

// kD: the head dim when it is one of the common ones (fixed at compile time, so the per-key loops unroll), else 0
template <typename scalar_t, typename index_t, int kD>
void score_rows(const at::Tensor& q, const std::vector<at::Tensor>& keys, const index_t* slots, const int64_t* live,
                int64_t B, int64_t W, double scale, double cap, float* out) {
  const int64_t L = q.size(0), Hq = q.size(2), D = kD > 0 ? kD : q.size(3), Hkv = keys[0].size(1), group = Hq / Hkv;
  const int64_t q_layer = q.stride(0), q_row = q.stride(1), q_head = q.stride(2);
  std::vector<const scalar_t*> k_ptr(L);
  std::vector<int64_t> k_slot(L), k_head(L);
  for (int64_t l = 0; l < L; ++l) {
    k_ptr[l] = keys[l].data_ptr<scalar_t>();
    k_slot[l] = keys[l].stride(0);
    k_head[l] = keys[l].stride(1);
  }
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const int64_t slot_bytes = Hkv * keys[0].stride(1) * static_cast<int64_t>(sizeof(scalar_t));
  const int64_t work = std::max<int64_t>(L * Hq * W * D, 1);
  const int64_t grain = std::max<int64_t>(1, (1 << 20) / work);  // small batches stay on the calling thread
  at::parallel_for(0, B, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(Hq * D), kf(D), logits(Hq * W);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = std::min<int64_t>(live[b], W);
      float* o = out + b * W;
      if (n <= 0) continue;
      const index_t* row = slots + b * W;
      for (int64_t l = 0; l < L; ++l) {
        for (int64_t h = 0; h < Hq; ++h) {
          const scalar_t* qh = q_ptr + l * q_layer + b * q_row + h * q_head;
          for (int64_t d = 0; d < D; ++d) qf[h * D + d] = static_cast<float>(qh[d]) * static_cast<float>(scale);
        }
        // each live key's slot is read once for all heads; the slots are scattered over the pool, so those a few
        // keys ahead are fetched meanwhile
        for (int64_t j = 0; j < n; ++j) {
          if (j + kAhead < n) {
            const scalar_t* ahead = k_ptr[l] + static_cast<int64_t>(row[j + kAhead]) * k_slot[l];
            const auto* next = reinterpret_cast<const char*>(ahead);
            for (int64_t byte = 0; byte < slot_bytes; byte += 64) __builtin_prefetch(next + byte);
          }
          const scalar_t* k_row = k_ptr[l] + static_cast<int64_t>(row[j]) * k_slot[l];
          for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
            const scalar_t* k = k_row + kvh * k_head[l];
            for (int64_t d = 0; d < D; ++d) kf[d] = static_cast<float>(k[d]);
            for (int64_t g = 0; g < group; ++g) {
              const int64_t h = kvh * group + g;
              const float* qg = qf.data() + h * D;
              float dot = 0.f;
#pragma omp simd reduction(+ : dot)
              for (int64_t d = 0; d < D; ++d) dot += qg[d] * kf[d];
              logits[h * W + j] = dot;
            }
          }
        }
        for (int64_t h = 0; h < Hq; ++h) {
          float* x = logits.data() + h * W;
          float top = -INFINITY;
          for (int64_t j = 0; j < n; ++j) {
            if (cap > 0) x[j] = static_cast<float>(cap) * std::tanh(x[j] / static_cast<float>(cap));
            top = std::max(top, x[j]);
          }
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t j = 0; j < n; ++j) {
            x[j] = std::exp(x[j] - top);
            sum += x[j];
          }
          const float inv = 1.f / sum;
          for (int64_t j = 0; j < n; ++j) o[j] += x[j] * inv;
        }
      }
    }
  });
}

template <typename scalar_t, typename index_t>
void score_rows_by_dim(const at::Tensor& q, const std::vector<at::Tensor>& keys, const index_t* slots,
                       const int64_t* live, int64_t B, int64_t W, double scale, double cap, float* out) {
  switch (q.size(3)) {
    case 32:
      return score_rows<scalar_t, index_t, 32>(q, keys, slots, live, B, W, scale, cap, out);
    case 64:
      return score_rows<scalar_t, index_t, 64>(q, keys, slots, live, B, W, scale, cap, out);
    case 128:
      return score_rows<scalar_t, index_t, 128>(q, keys, slots, live, B, W, scale, cap, out);
    default:
      return score_rows<scalar_t, index_t, 0>(q, keys, slots, live, B, W, scale, cap, out);
  }
}

at::Tensor decode_scores_headsum(const at::Tensor& q, at::TensorList k_buffers, const at::Tensor& slots,
                                 const at::Tensor& live_len, double scale, double logit_cap) {
  TORCH_CHECK(q.dim() == 4 && q.stride(3) == 1, "q: [layers, batch, heads, head_dim], last dim contiguous");
  TORCH_CHECK(static_cast<int64_t>(k_buffers.size()) == q.size(0), "one key buffer per scored layer");
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == q.size(1), "slots: [batch, width]");
  std::vector<at::Tensor> keys;
  for (const auto& k : k_buffers) {
    TORCH_CHECK(k.dim() == 3 && k.stride(2) == 1 && k.scalar_type() == q.scalar_type() && k.size(2) == q.size(3),
                "key buffers: [slots, kv_heads, head_dim] of q's dtype");
    keys.push_back(k);
  }
  TORCH_CHECK(q.size(2) % keys[0].size(1) == 0, "query heads must be a multiple of KV heads");
  const auto s = slots.contiguous();
  const auto live = live_len.to(at::kLong).contiguous();
  const int64_t B = s.size(0), W = s.size(1);
  auto out = at::zeros({B, W}, q.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "vtoken_decode_scores", [&] {
    if (s.scalar_type() == at::kInt) {
      score_rows_by_dim<scalar_t, int32_t>(q, keys, s.data_ptr<int32_t>(), live.data_ptr<int64_t>(), B, W, scale,
                                           logit_cap, out.data_ptr<float>());
    } else {
      TORCH_CHECK(s.scalar_type() == at::kLong, "slots: int32 or int64");
      score_rows_by_dim<scalar_t, int64_t>(q, keys, s.data_ptr<int64_t>(), live.data_ptr<int64_t>(), B, W, scale,
                                           logit_cap, out.data_ptr<float>());
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vtoken_cpu, m) {
  m.def("decode_scores_headsum(Tensor q, Tensor[] k_buffers, Tensor slots, Tensor live_len, float scale, "
        "float logit_cap) -> Tensor");
}

TORCH_LIBRARY_IMPL(vtoken_cpu, CPU, m) { m.impl("decode_scores_headsum", &decode_scores_headsum); }
