#pragma once

/// The notebooks' teaching steps, one function each, as attnkit-walkthrough shows them:
/// attention scores, the naive and softmax normalisations, context vectors, simplified
/// self-attention, the two causal recipes and dropout on the weights. The trainable modules
/// do not call them; they call the one core (attnkit/attention.h).

#include <torch/torch.h>

namespace attnkit::functional {

/// Dot-product attention scores `queries @ keys^T` over the last two dimensions:
/// (..., n, d) x (..., m, d) -> (..., n, m). A 1-D query (d) against keys (m, d) gives (m).
/// Example: `attention_scores(inputs[1], inputs)` gives the notebooks' omega_2.
torch::Tensor attention_scores(const torch::Tensor& queries, const torch::Tensor& keys);

/// The naive normalisation the notebooks compare softmax with: `scores / scores.sum(-1)`.
/// Example: `normalize_by_sum(attention_scores(x[1], x))`.
torch::Tensor normalize_by_sum(const torch::Tensor& attn_scores);

/// Softmax over the last dimension: the attention weights of unscaled scores.
/// Example: `softmax_weights(torch::tensor({0.1, -0.2, 0.3}))`.
torch::Tensor softmax_weights(const torch::Tensor& attn_scores);

/// Weighted sum of value vectors: (..., n, m) x (..., m, d) -> (..., n, d); (m) x (m, d) -> (d).
/// Example: `context_vectors(attn_weights_2, inputs)`.
torch::Tensor context_vectors(const torch::Tensor& attn_weights, const torch::Tensor& values);

/// Simplified self-attention without trainable weights (queries = keys = values = x):
/// `softmax(x x^T) x`, unscaled, for x of shape (n, d) or (b, n, d).
/// Example: `simple_self_attention(inputs)[1]` is the notebooks' context vector z_2.
torch::Tensor simple_self_attention(const torch::Tensor& x);

/// First causal recipe of the notebooks: zero the weights above the diagonal of
/// already-normalised attention weights (..., n, n) and renormalise each row to sum 1.
/// Example: `causal_weights_by_renormalizing(torch::softmax(scores / std::sqrt(d_k), -1))`.
torch::Tensor causal_weights_by_renormalizing(const torch::Tensor& attn_weights);

/// Second causal recipe: fill the scores above the diagonal with -inf, then softmax of
/// `scores / sqrt(d_k)`. Gives the same weights as `causal_weights_by_renormalizing`.
/// Example: `causal_weights_by_masking(scores, /*d_k=*/2)`.
torch::Tensor causal_weights_by_masking(const torch::Tensor& attn_scores, int64_t d_k);

/// Dropout on attention weights, as `torch.nn.Dropout(p)`: in training mode each weight is
/// zeroed with probability p and the kept ones are scaled by 1 / (1 - p); otherwise identity.
/// Example: `torch::manual_seed(123); dropout_weights(torch::ones({6, 6}), 0.5, true)`.
torch::Tensor dropout_weights(const torch::Tensor& attn_weights, double p, bool training);

}  // namespace attnkit::functional
