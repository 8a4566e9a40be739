// The examples of docs/modules.md, docs/backends.md, docs/interop.md, docs/masks.md,
// docs/threads.md and docs/distributed.md.
// Each region between "[doc:NAME]" and "[doc:end]" is shown on a page, exactly as here.

#include <attnkit/attnkit.h>
#include <attnkit/threads.h>

#include <cstdio>
#include <filesystem>
#include <iostream>

namespace {

void one_line_each() {
  torch::manual_seed(123);
  auto inputs = torch::rand({6, 3});            // (n, d_in): the notebooks' six tokens
  auto batch = torch::stack({inputs, inputs});  // (2, 6, 3)
  // [doc:one-line-each]
  attnkit::SelfAttentionV1 sa_v1(3, 2);
  auto z1 = sa_v1(inputs);  // (6, 2)
  attnkit::SelfAttentionV2 sa_v2(3, 2, /*qkv_bias=*/false);
  auto z2 = sa_v2(inputs);  // (6, 2)
  attnkit::CausalAttention ca(3, 2, /*context_length=*/6, /*dropout=*/0.0);
  auto z3 = ca(batch);  // (2, 6, 2)
  attnkit::MultiHeadAttentionWrapper wrapper(3, 2, 6, 0.0, /*num_heads=*/2);
  auto z4 = wrapper(batch);  // (2, 6, 4)
  attnkit::MultiHeadAttention mha(3, 2, 6, 0.0, /*num_heads=*/2);
  auto z5 = mha(batch);  // (2, 6, 2)
  attnkit::MultiHeadAttentionCombinedQKV combined(3, 2, 6, 0.0, 2);
  auto z6 = combined(batch);  // (2, 6, 2)
  // [doc:end]
  TORCH_CHECK(z1.sizes() == z2.sizes() && z3.sizes() == z5.sizes() && z5.sizes() == z6.sizes() &&
              z4.size(-1) == 4);
}

void options_and_names() {
  // [doc:options]
  // The LibTorch-style options constructor; causal(false) is unmasked encoder attention.
  attnkit::MultiHeadAttention encoder(
      attnkit::MultiHeadAttentionOptions(/*d_in=*/768, /*d_out=*/768, /*context_length=*/1024,
                                         /*dropout=*/0.1, /*num_heads=*/12)
          .causal(false)
          .qkv_bias(true));
  for (const auto& parameter : encoder->named_parameters())
    std::cout << parameter.key() << " ";  // W_query.weight W_query.bias ... out_proj.bias
  std::cout << "\n";
  // [doc:end]
}

void weights_and_transfers() {
  torch::manual_seed(123);
  auto batch = torch::rand({2, 6, 3});
  // [doc:weights]
  attnkit::MultiHeadAttention mha(3, 2, /*context_length=*/6, /*dropout=*/0.0, /*num_heads=*/2);
  auto [context, weights] = mha->forward_with_weights(batch);  // (2, 6, 2), (2, 2, 6, 6)

  // The combined-QKV layout computes the same function once the weights are copied over.
  attnkit::MultiHeadAttentionCombinedQKV combined(3, 2, 6, 0.0, 2);
  combined->copy_weights_from(*mha);
  TORCH_CHECK(torch::allclose(combined(batch), mha(batch), 1e-6, 1e-6));
  // [doc:end]
  TORCH_CHECK(weights.sizes() == torch::IntArrayRef({2, 2, 6, 6}));
}

void errors() {
  // [doc:errors]
  attnkit::CausalAttention ca(3, 2, /*context_length=*/6, /*dropout=*/0.0);
  try {
    ca(torch::rand({2, 7, 3}));  // one token more than context_length
  } catch (const c10::Error& e) {
    std::cout << e.what_without_backtrace() << "\n";
    // [CausalAttention::forward] x: num_tokens = 7 exceeds context_length = 6 (shape [2, 7, 3])
  }
  // [doc:end]
}

void backends() {
  auto x = torch::rand({2, 16, 64});
  // [doc:backends]
  // The same parameters under every backend: a trained model switches without conversion.
  attnkit::MultiHeadAttention chunked(
      attnkit::MultiHeadAttentionOptions(64, 64, /*context_length=*/1024, 0.0, /*num_heads=*/4)
          .backend(attnkit::AttentionBackend::kChunked)  // kMath (default), kFused, kChunked
          .query_block_size(128)                         // query tokens per block
          .key_block_size(1024));                        // key tokens per block
  auto y = chunked(x);                                   // (2, 16, 64)

  // The attention core alone, on (b, h, n, head_dim) queries, keys and values.
  auto q = torch::rand({2, 4, 16, 16}), k = torch::rand({2, 4, 16, 16}),
       v = torch::rand({2, 4, 16, 16});
  auto context = attnkit::functional::attention(
      q, k, v, attnkit::functional::AttentionOptions().mask(attnkit::Mask::causal()));
  // (2, 4, 16, 16)
  // [doc:end]
  TORCH_CHECK(y.sizes() == x.sizes() && context.sizes() == q.sizes());
}

void state_dicts() {
  const auto path = (std::filesystem::temp_directory_path() / "attnkit_example_mha.pt").string();
  // [doc:state-dict]
  attnkit::MultiHeadAttention mha(768, 768, 1024, 0.1, 12);
  attnkit::save_state_dict(*mha, path);  // Python: model.load_state_dict(torch.load(path))

  attnkit::MultiHeadAttention restored(768, 768, 1024, 0.1, 12);
  attnkit::load_state_dict(*restored, path);  // also what Python's torch.save wrote
  // [doc:end]
  TORCH_CHECK(torch::equal(restored->W_query->weight, mha->W_query->weight));
  std::remove(path.c_str());
}

void safetensors_files() {
  const auto path =
      (std::filesystem::temp_directory_path() / "attnkit_example_gpt2.safetensors").string();
  attnkit::MultiHeadAttention trained(768, 768, 1024, 0.0, 12, /*qkv_bias=*/true);
  attnkit::StateDict gpt2;  // a GPT-2 attention layer's weights, as transformers names them
  const auto w = attnkit::state_dict(*trained);
  gpt2.insert("h.0.attn.c_attn.weight",  // Conv1D: (in, out), query, key and value fused
              torch::cat({w["W_query.weight"], w["W_key.weight"], w["W_value.weight"]}).t());
  gpt2.insert("h.0.attn.c_attn.bias",
              torch::cat({w["W_query.bias"], w["W_key.bias"], w["W_value.bias"]}));
  gpt2.insert("h.0.attn.c_proj.weight", w["out_proj.weight"].t());
  gpt2.insert("h.0.attn.c_proj.bias", w["out_proj.bias"]);
  gpt2.insert("h.0.attn.bias", torch::ones({1, 1, 1024, 1024}).tril());
  attnkit::save_safetensors(gpt2, path, {{"format", "pt"}});
  // [doc:safetensors]
  // GPT-2's names and layouts to attnkit's MultiHeadAttention, as data.
  const attnkit::NameMap gpt2_attention{
      /*prefix=*/"h.0.attn.",
      /*ignored=*/{"bias"},  // GPT-2's causal-mask buffer
                             /*rules=*/
      {{"c_attn\\.weight",
        {"W_query.weight", "W_key.weight", "W_value.weight"},
        /*transpose=*/true},
       {"c_attn\\.bias", {"W_query.bias", "W_key.bias", "W_value.bias"}},
       {"c_proj\\.weight", {"out_proj.weight"}, /*transpose=*/true},
       {"c_proj\\.bias", {"out_proj.bias"}}}};
  attnkit::MultiHeadAttention mha(768, 768, 1024, 0.0, 12, /*qkv_bias=*/true);
  attnkit::load_safetensors(*mha, path, gpt2_attention);  // strict: every weight, nothing left

  auto tensors = attnkit::load_safetensors(path);  // the file's tensors, memory-mapped
  auto format = attnkit::load_safetensors_metadata(path).at("format");  // "pt"
  attnkit::save_safetensors(attnkit::state_dict(*mha),
                            path);  // safetensors.torch.load_file reads it
  // [doc:end]
  TORCH_CHECK(torch::equal(mha->W_key->weight, trained->W_key->weight) && format == "pt" &&
              tensors.size() == 5);
  std::remove(path.c_str());
}

void rotary_and_qk_norm() {
  torch::NoGradGuard no_grad;
  // [doc:rope]
  // A Qwen3-style attention layer: 16 query heads sharing 8 key/value heads, QK-norm, RoPE.
  attnkit::GroupedQueryAttention attention(
      attnkit::GroupedQueryAttentionOptions(/*d_in=*/1024, /*d_out=*/2048, /*dropout=*/0.0,
                                            /*num_heads=*/16, /*num_kv_groups=*/8)
          .rope(attnkit::RopeOptions(/*context_length=*/4096).theta_base(1000000.0))
          .qk_norm(true));  // adds q_norm.weight and k_norm.weight, (128) each
  attention->eval();
  auto cache = attention->make_kv_cache(/*batch=*/1, /*capacity=*/64);
  auto prompt = attention->forward_with_cache(torch::randn({1, 5, 1024}), cache);  // positions 0-4
  auto next = attention->forward_with_cache(torch::randn({1, 1, 1024}), cache);    // position 5
  // [doc:end]
  TORCH_CHECK(prompt.size(1) == 5 && next.size(1) == 1 && cache.size() == 6);
}

void block_masks() {
  torch::NoGradGuard no_grad;
  const int64_t batch = 2, n = 256;
  const auto ids = torch::arange(n).div(100, "floor").expand({batch, n});  // documents of 100
  attnkit::MultiHeadAttention layer0(64, 64, n, 0.0, 4), layer1(64, 64, n, 0.0, 4);
  auto x = torch::randn({batch, n, 64});
  const auto y = x;
  // [doc:block-mask]
  // Judged once per step (one host transfer), then read by every layer, forward and backward.
  const auto bm =
      attnkit::create_block_mask(attnkit::Mask::documents(ids, /*causal=*/true), batch, /*H=*/1, n,
                                 n, attnkit::BlockMaskOptions().block_size(128));
  std::cout << bm.to_string() << "\n";  // shape, sparsity, a picture of the tiles
  for (auto* layer : {&layer0, &layer1})
    x = (*layer)->forward(x, {}, {}, attnkit::Mask::from_block_mask(bm));

  // The attention core alone takes it as an option.
  auto q = torch::randn({batch, 4, n, 16});  // (b, h, n, head_dim)
  auto context = attnkit::functional::attention(
      q, q, q, attnkit::functional::AttentionOptions().block_mask(bm));  // (b, h, n, head_dim)
  // [doc:end]
  auto expected = y;
  for (auto* layer : {&layer0, &layer1})
    expected = (*layer)->forward(expected, {}, {}, attnkit::Mask::documents(ids, true));
  TORCH_CHECK(torch::allclose(x, expected, 1e-5, 1e-5) && context.sizes() == q.sizes());
}

void threads() {
  // [doc:threads]
  attnkit::set_num_threads(2);                   // LibTorch's threads and the BLAS's
  std::cout << attnkit::blas_threads() << "\n";  // "OpenBLAS, 2 threads"
  // [doc:end]
}

// [doc:any-cached-layer]
// A block that takes any attention layer with a KV cache.
struct Block : torch::nn::Module {
  explicit Block(std::shared_ptr<attnkit::CachedAttentionLayer> layer) : attention(layer) {
    register_module("attention", attention->as_module());  // state-dict keys attention.*
  }
  std::shared_ptr<attnkit::CachedAttentionLayer> attention;
};
// [doc:end]

void any_cached_layer() {
  // [doc:any-cached-layer-use]
  Block gpt(attnkit::MultiHeadAttention(64, 64, /*context_length=*/256, 0.0, 4).ptr());
  Block llama(attnkit::GroupedQueryAttention(
                  attnkit::GroupedQueryAttentionOptions(64, 64, 0.0, 4, /*num_kv_groups=*/2)
                      .rope(attnkit::RopeOptions(256)))
                  .ptr());
  gpt.eval();
  llama.eval();
  auto x = torch::randn({1, 5, 64});
  for (auto* block : {&gpt, &llama}) {
    auto cache = block->attention->make_kv_cache(/*batch=*/1, /*capacity=*/256);
    std::cout << block->attention->forward_with_cache(x, cache).sizes() << "\n";  // [1, 5, 64]
  }
  // [doc:end]
  auto cache = llama.attention->make_kv_cache(1, 256);
  TORCH_CHECK(torch::allclose(llama.attention->forward_with_cache(x, cache),
                              llama.attention->forward(x), 1e-5, 1e-5));
  TORCH_CHECK(gpt.named_parameters().contains("attention.W_query.weight"));
}

}  // namespace

// The world of one process, for the example: a real run passes its process group's
// transfers (attnkit-train's c10d group is a ShardExchange).
class OneRank : public attnkit::ShardExchange {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  std::function<void()> start_send_receive(const std::vector<torch::Tensor>& send, int,
                                           std::vector<torch::Tensor>& receive, int) override {
    for (size_t i = 0; i < send.size(); ++i)
      receive[i].copy_(send[i]);
    return [] {};
  }
};

void context_parallel() {
  OneRank group;
  const int64_t n = 256;
  const auto x = torch::randn({2, n, 64});
  // [doc:context-parallel]
  attnkit::MultiHeadAttention mha(
      attnkit::MultiHeadAttentionOptions(64, 64, n, 0.0, 4).rope(attnkit::RopeOptions(n)));
  const attnkit::SequenceShards shards(n, group.world_size());  // zigzag
  torch::Tensor y;
  {
    attnkit::ContextParallelScope scope(group, n);
    y = mha(shards.shard(x, group.rank(), 1));  // this rank's tokens: (2, n / R, 64)
  }
  y.sum().backward();  // key and value gradients travel home through `group`
  // [doc:end]
  TORCH_CHECK(torch::allclose(shards.unshard({y}, 1), mha(x), 1e-5, 1e-6));
}

int main() {
  one_line_each();
  options_and_names();
  weights_and_transfers();
  errors();
  backends();
  state_dicts();
  safetensors_files();
  rotary_and_qk_norm();
  block_masks();
  threads();
  any_cached_layer();
  context_parallel();
}
