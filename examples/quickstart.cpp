// The README's example: a MultiHeadAttention forward and backward, then cached decoding.
// [doc:quickstart]
#include <attnkit/attnkit.h>

#include <iostream>

int main() {
  torch::manual_seed(123);
  attnkit::MultiHeadAttention mha(/*d_in=*/64, /*d_out=*/64, /*context_length=*/128,
                                  /*dropout=*/0.1, /*num_heads=*/4);
  auto x = torch::randn({2, 10, 64});  // (batch, tokens, d_in)
  mha(x).sum().backward();             // a trainable torch::nn module: (2, 10, 64)

  mha->eval();                                          // KV caches are for inference
  auto cache = mha->make_kv_cache(/*batch=*/2);         // one allocation, 128 positions
  auto prompt_out = mha->forward_with_cache(x, cache);  // prefill: (2, 10, 64)
  auto next_out = mha->forward_with_cache(torch::randn({2, 1, 64}), cache);  // (2, 1, 64)
  std::cout << "cache holds " << cache.size()
            << " positions; same as uncached: " << torch::allclose(prompt_out, mha(x), 1e-5, 1e-6)
            << "\n";
}
// [doc:end]
