// Memory-efficient attention: queries and keys in blocks, an online softmax (running max
// and sum), blocks above the causal diagonal skipped, and a backward pass that recomputes
// each block's probabilities from the saved log-sum-exp. Memory is O(n * block) per head
// instead of the O(n^2) score matrix of the math path.

#include <cmath>
#include <limits>

#include "attnkit/functional.h"
#include "checks.h"

namespace attnkit::functional {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr double kInfinity = std::numeric_limits<double>::infinity();

// Everything forward and backward must agree on to visit the same blocks the same way.
struct BlockPlan {
  int64_t num_queries;
  int64_t num_keys;
  int64_t block;
  bool causal;
  double dropout_p;
  int64_t dropout_seed;  // < 0: no dropout

  // Keys a query block [q0, q1) can see: all, or (causal, top-left aligned) j <= i.
  int64_t key_end(int64_t q1) const { return causal ? std::min(num_keys, q1) : num_keys; }
};

// Scaled scores of one (query block, key block) pair, masked above the causal diagonal.
torch::Tensor block_scores(const torch::Tensor& q_block, const torch::Tensor& k_block, int64_t q0,
                           int64_t k0, double scale, const BlockPlan& plan) {
  auto scores = torch::matmul(q_block, k_block.transpose(-2, -1)) * scale;  // (..., bq, bk)
  const int64_t bq = q_block.size(-2), bk = k_block.size(-2);
  if (plan.causal && k0 + bk - 1 > q0) {  // the block reaches above the diagonal
    const auto rows = torch::arange(q0, q0 + bq, scores.options().dtype(torch::kInt64));
    const auto cols = torch::arange(k0, k0 + bk, scores.options().dtype(torch::kInt64));
    scores = scores.masked_fill(cols.unsqueeze(0) > rows.unsqueeze(1), -kInfinity);
  }
  return scores;
}

// The dropout keep-mask (scaled by 1 / (1 - p)) of one block, drawn from a generator
// seeded by the call's seed and the block's position, so backward redraws the same mask.
torch::Tensor dropout_scale(const torch::Tensor& like, int64_t q0, int64_t k0,
                            const BlockPlan& plan) {
  auto generator = at::detail::createCPUGenerator(static_cast<uint64_t>(plan.dropout_seed) +
                                                  static_cast<uint64_t>(q0 * plan.num_keys + k0));
  const auto keep = torch::empty(like.sizes(), torch::dtype(like.scalar_type()))
                        .bernoulli_(1.0 - plan.dropout_p, generator);
  return (keep / (1.0 - plan.dropout_p)).to(like.device());
}

struct ChunkedAttention : public torch::autograd::Function<ChunkedAttention> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, bool causal, double dropout_p,
                               int64_t dropout_seed, int64_t block) {
    const BlockPlan plan{q.size(-2), k.size(-2), block, causal, dropout_p, dropout_seed};
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
    auto out_shape = q.sizes().vec();
    out_shape.back() = v.size(-1);
    auto out = torch::empty(out_shape, q.options());
    auto lse_shape = q.sizes().vec();
    lse_shape.back() = 1;
    auto lse = torch::empty(lse_shape, q.options());  // (..., n, 1) log-sum-exp per row

    for (int64_t q0 = 0; q0 < plan.num_queries; q0 += block) {
      const int64_t bq = std::min(block, plan.num_queries - q0);
      const auto q_block = q.narrow(-2, q0, bq);
      auto running_max = torch::full_like(lse.narrow(-2, q0, bq), -kInfinity);
      auto running_sum = torch::zeros_like(running_max);
      auto acc = torch::zeros_like(out.narrow(-2, q0, bq));
      for (int64_t k0 = 0; k0 < plan.key_end(q0 + bq); k0 += block) {
        const int64_t bk = std::min(block, plan.num_keys - k0);
        const auto scores = block_scores(q_block, k.narrow(-2, k0, bk), q0, k0, scale, plan);
        const auto new_max = torch::maximum(running_max, scores.amax(-1, /*keepdim=*/true));
        const auto p = torch::exp(scores - new_max);
        const auto correction = torch::exp(running_max - new_max);
        running_sum = running_sum * correction + p.sum(-1, /*keepdim=*/true);
        const auto p_used = plan.dropout_seed >= 0 ? p * dropout_scale(p, q0, k0, plan) : p;
        acc = acc * correction + torch::matmul(p_used, v.narrow(-2, k0, bk));
        running_max = new_max;
      }
      out.narrow(-2, q0, bq).copy_(acc / running_sum);
      lse.narrow(-2, q0, bq).copy_(running_max + torch::log(running_sum));
    }
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["dropout_seed"] = dropout_seed;
    ctx->saved_data["block"] = block;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    const BlockPlan plan{q.size(-2),
                         k.size(-2),
                         ctx->saved_data["block"].toInt(),
                         ctx->saved_data["causal"].toBool(),
                         ctx->saved_data["dropout_p"].toDouble(),
                         ctx->saved_data["dropout_seed"].toInt()};
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
    const auto grad_out = grads[0].contiguous();
    // D_i = sum_j P_ij dP_ij = dO_i . O_i (holds with dropout too, since O = P_dropped V).
    const auto delta = (grad_out * out).sum(-1, /*keepdim=*/true);  // (..., n, 1)
    auto grad_q = torch::zeros_like(q);
    auto grad_k = torch::zeros_like(k);
    auto grad_v = torch::zeros_like(v);
    const int64_t block = plan.block;
    for (int64_t q0 = 0; q0 < plan.num_queries; q0 += block) {
      const int64_t bq = std::min(block, plan.num_queries - q0);
      const auto q_block = q.narrow(-2, q0, bq);
      const auto grad_out_block = grad_out.narrow(-2, q0, bq);
      const auto lse_block = lse.narrow(-2, q0, bq);
      const auto delta_block = delta.narrow(-2, q0, bq);
      auto grad_q_block = grad_q.narrow(-2, q0, bq);
      for (int64_t k0 = 0; k0 < plan.key_end(q0 + bq); k0 += block) {
        const int64_t bk = std::min(block, plan.num_keys - k0);
        const auto k_block = k.narrow(-2, k0, bk);
        const auto v_block = v.narrow(-2, k0, bk);
        const auto p = torch::exp(block_scores(q_block, k_block, q0, k0, scale, plan) - lse_block);
        torch::Tensor p_used = p, grad_p;
        const auto grad_p_used = torch::matmul(grad_out_block, v_block.transpose(-2, -1));
        if (plan.dropout_seed >= 0) {
          const auto keep = dropout_scale(p, q0, k0, plan);
          p_used = p * keep;
          grad_p = grad_p_used * keep;
        } else {
          grad_p = grad_p_used;
        }
        grad_v.narrow(-2, k0, bk).add_(torch::matmul(p_used.transpose(-2, -1), grad_out_block));
        const auto grad_scores = p * (grad_p - delta_block) * scale;
        grad_q_block.add_(torch::matmul(grad_scores, k_block));
        grad_k.narrow(-2, k0, bk).add_(torch::matmul(grad_scores.transpose(-2, -1), q_block));
      }
    }
    return {grad_q,          grad_k,          grad_v,         torch::Tensor(),
            torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor chunked_attention(const torch::Tensor& query, const torch::Tensor& key,
                                const torch::Tensor& value, const ChunkedOptions& options) {
  const char* fn = "[chunked_attention]";
  TORCH_CHECK(query.dim() >= 2 && key.dim() == query.dim() && value.dim() == query.dim(), fn,
              " query, key and value must have the same rank >= 2, got ",
              detail::shape_string(query), ", ", detail::shape_string(key), ", ",
              detail::shape_string(value));
  TORCH_CHECK(query.size(-1) == key.size(-1) && key.size(-2) == value.size(-2), fn,
              " expected query (..., n, hd), key (..., m, hd), value (..., m, hd_v); got ",
              detail::shape_string(query), ", ", detail::shape_string(key), ", ",
              detail::shape_string(value));
  TORCH_CHECK(key.size(-2) >= 1, fn, " key must hold at least one token");
  TORCH_CHECK(options.block_size() >= 1, fn, " block_size must be >= 1, got ",
              options.block_size());
  TORCH_CHECK(options.dropout_p() >= 0.0 && options.dropout_p() < 1.0, fn,
              " dropout_p must be in [0, 1), got ", options.dropout_p());
  const bool dropout = options.training() && options.dropout_p() > 0.0;
  // The seed comes from the global generator, so torch::manual_seed fixes the masks.
  const int64_t seed =
      dropout ? torch::randint(0, int64_t{1} << 62, {1}, torch::kInt64).item<int64_t>() : -1;
  return ChunkedAttention::apply(query, key, value, options.is_causal(), options.dropout_p(), seed,
                                 options.block_size());
}

}  // namespace attnkit::functional
