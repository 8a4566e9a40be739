// The examples of docs/inference.md and docs/attention_family.md: KV caches, a language model
// that attnkit::generate can drive, and the attention family's caches.

#include <attnkit/attnkit.h>

#include <cmath>
#include <iostream>

namespace {

void cache_lifecycle() {
  auto prompt = torch::rand({2, 5, 768});
  auto token = torch::rand({2, 1, 768});
  // [doc:cache]
  attnkit::MultiHeadAttention mha(attnkit::MultiHeadAttentionOptions(768, 768, 1024, 0.0, 12));
  mha->eval();                                        // the cache is for inference only
  auto cache = mha->make_kv_cache(/*batch=*/2);       // capacity: context_length (1024)
  auto out = mha->forward_with_cache(prompt, cache);  // prefill: (2, n, 768)
  auto next = mha->forward_with_cache(token, cache);  // one decode step: (2, 1, 768)
  cache.size();                                       // positions held: n + 1
  cache.nbytes();  // 2 * 2 * 12 * 1024 * 64 * 4 bytes = 12 MiB, allocated once
  cache.reset();   // a new sequence; the memory is kept
  // [doc:end]
  TORCH_CHECK(out.size(1) == 5 && next.size(1) == 1 && cache.size() == 0);
}

// [doc:language-model]
// A one-layer byte model: what attnkit::generate needs is the four methods of
// attnkit::CausalLanguageModel, each attention layer reading and appending to its own cache.
struct TinyModelImpl : torch::nn::Module, attnkit::CausalLanguageModel {
  static constexpr int64_t kVocab = 256, kWidth = 32, kContext = 64;
  TinyModelImpl()
      : embedding(register_module("embedding", torch::nn::Embedding(kVocab, kWidth))),
        position(register_module("position", torch::nn::Embedding(kContext, kWidth))),
        attention(register_module("attention",
                                  attnkit::MultiHeadAttention(kWidth, kWidth, kContext, 0.0, 4))),
        head(register_module("head", torch::nn::Linear(kWidth, kVocab))) {}

  torch::Tensor embed(const torch::Tensor& tokens, int64_t start) {  // (b, n) -> (b, n, d)
    return embedding(tokens) + position(torch::arange(start, start + tokens.size(1)));
  }
  torch::Tensor logits(const torch::Tensor& tokens) override {
    return head(attention(embed(tokens, 0)));
  }
  torch::Tensor logits_with_cache(const torch::Tensor& tokens,
                                  std::vector<attnkit::KVCache>& caches) override {
    const auto x = embed(tokens, caches.front().size());
    return head(attention->forward_with_cache(x, caches.front()));
  }
  // Optional: prompts of different lengths in one batch. Row r's tokens sit at its own
  // positions lengths()[r] + i (the padding's clamped into the table; its logits are unused).
  torch::Tensor ragged_logits_with_cache(const torch::Tensor& tokens, const torch::Tensor& lengths,
                                         std::vector<attnkit::KVCache>& caches) override {
    const auto positions = (caches.front().lengths().unsqueeze(1) + torch::arange(tokens.size(1)))
                               .clamp_max(kContext - 1);
    const auto x = embedding(tokens) + position(positions);  // (b, n, d)
    return head(attention->forward_with_cache(x, caches.front(), lengths));
  }
  std::vector<attnkit::KVCache> make_kv_caches(int64_t batch, int64_t capacity) override {
    std::vector<attnkit::KVCache> caches;  // one per attention layer (KVCache moves only)
    caches.push_back(attention->make_kv_cache(batch, capacity));
    return caches;
  }
  // Optional: serving (attnkit::Scheduler). Row r's tokens at its sequence's next positions.
  std::vector<attnkit::PagedKVCache> make_paged_kv_caches(int64_t num_pages,
                                                          int64_t page_size) override {
    std::vector<attnkit::PagedKVCache> pools;  // one per attention layer
    pools.push_back(attention->make_paged_kv_cache(num_pages, page_size));
    return pools;
  }
  torch::Tensor paged_logits(const torch::Tensor& tokens, std::vector<attnkit::PagedKVCache>& pools,
                             const std::vector<int64_t>& sequences) override {
    std::vector<int64_t> starts;
    for (const auto sequence : sequences)
      starts.push_back(pools.front().length(sequence));
    const auto positions = torch::tensor(starts).unsqueeze(1) + torch::arange(tokens.size(1));
    const auto x = embedding(tokens) + position(positions);  // (b, n, d)
    return head(attention->forward_with_cache(x, pools.front(), sequences));
  }
  int64_t context_length() const override { return kContext; }

  torch::nn::Embedding embedding, position;
  attnkit::MultiHeadAttention attention;
  torch::nn::Linear head;
};
TORCH_MODULE(TinyModel);
// [doc:end]

void generation() {
  torch::manual_seed(1);
  TinyModel model;
  auto prompt_ids = torch::randint(0, 256, {2, 4});  // (b, n) int64
  // [doc:generate]
  model->eval();
  auto greedy = attnkit::generate(*model, prompt_ids, attnkit::GenerateOptions(20));
  auto sampled = attnkit::generate(*model, prompt_ids,
                                   attnkit::GenerateOptions(20).temperature(0.8).top_k(40).seed(1));
  // (2, 4 + 20) each; greedy decoding gives the same tokens without the caches:
  auto recomputed =
      attnkit::generate(*model, prompt_ids, attnkit::GenerateOptions(20).use_kv_cache(false));
  // [doc:end]
  TORCH_CHECK(torch::equal(greedy, recomputed) && sampled.size(1) == 24);

  // [doc:batched-generate]
  const auto ids = [](std::vector<int64_t> tokens) { return torch::tensor(tokens, torch::kInt64); };
  std::vector<attnkit::GenerationRequest> prompts{
      ids({72, 105}),                                                         // "Hi"
      attnkit::GenerationRequest(ids({84, 104, 101, 32})).max_new_tokens(8),  // "The "
      attnkit::GenerationRequest(ids({65})).stop_tokens({'\n'})};             // "A"
  auto rows = attnkit::generate(*model, prompts, attnkit::GenerateOptions(20));
  // rows[r]: prompt r, then its new tokens (up to 20, 8 for row 1, row 2 ends at '\n')
  // [doc:end]
  const auto alone =
      attnkit::generate(*model, prompts[0].prompt().unsqueeze(0), attnkit::GenerateOptions(20));
  TORCH_CHECK(rows[0].equal(alone[0]) && rows[1].size(0) == 4 + 8);
}

void family() {
  auto x = torch::rand({1, 8, 768});
  auto prompt = torch::rand({1, 300, 768});
  // [doc:family]
  // Llama-style: 12 query heads, 4 key/value heads, a 256-token window.
  attnkit::GroupedQueryAttention gqa(
      attnkit::GroupedQueryAttentionOptions(768, 768, /*dropout=*/0.0, /*num_heads=*/12,
                                            /*num_kv_groups=*/4)
          .sliding_window_size(256)
          .backend(attnkit::AttentionBackend::kChunked));
  auto y = gqa(x);  // (b, n, 768), trainable
  gqa->eval();
  auto cache = gqa->make_kv_cache(/*batch=*/1, /*capacity=*/4096);  // rolling: 256 positions
  auto out = gqa->forward_with_cache(prompt, cache);                // then one token at a time

  attnkit::MultiHeadLatentAttention mla(
      attnkit::MultiHeadLatentAttentionOptions(768, 768, 0.0, 12).latent_dim(96));
  auto latents = mla->make_kv_cache(1, 1024);  // (1, 1024, 96) floats
  // [doc:end]
  TORCH_CHECK(y.sizes() == x.sizes() && out.sizes() == prompt.sizes());
  TORCH_CHECK(latents.capacity() == 1024);
}

void gemma2_attention() {
  auto prompt = torch::rand({1, 12, 2304});
  // [doc:gemma2]
  // Gemma 2 2B's local layers: 8 query heads of 256 over 4 key/value heads, a 4,096-token
  // window, scores capped at 50 and scaled by query_pre_attn_scalar^-0.5.
  attnkit::GroupedQueryAttention local(
      attnkit::GroupedQueryAttentionOptions(2304, 8 * 256, /*dropout=*/0.0, /*num_heads=*/8,
                                            /*num_kv_groups=*/4)
          .output_dim(2304)
          .sliding_window_size(4096)
          .score_mod(attnkit::score_mods::softcap(50.0))
          .scale(1.0 / std::sqrt(256.0)));
  local->eval();
  auto cache = local->make_kv_cache(/*batch=*/1, /*capacity=*/0);  // rolling: 4,096 positions
  auto out = local->forward_with_cache(prompt, cache);  // decode steps run the decode kernel
  // [doc:end]
  TORCH_CHECK(out.sizes() == prompt.sizes() && cache.window_size() == 4096);
}

void paged_cache() {
  torch::NoGradGuard no_grad;
  const auto prefix_keys = torch::rand({4, 40, 64}), prefix_values = torch::rand({4, 40, 64});
  const auto token = torch::rand({4, 1, 64});
  const auto query = torch::rand({2, 8, 1, 64});
  // [doc:paged]
  // A pool of 64 pages of 16 positions, 4 key/value heads of 64, allocated once.
  attnkit::PagedKVCache cache(/*num_pages=*/64, /*page_size=*/16, /*num_heads=*/4,
                              /*head_dim=*/64);
  const auto system_prompt = cache.add_sequence();
  cache.append(system_prompt, prefix_keys, prefix_values);  // (4, 40, 64): 3 pages
  const auto a = cache.fork(system_prompt);  // two requests share the prompt's 3 pages
  const auto b = cache.fork(system_prompt);
  cache.release(system_prompt);   // the pages stay while a request holds them
  cache.append(a, token, token);  // a copies the shared, partly filled last page
  cache.append(b, token, token);  // b's alone now: written in place; 4 pages held
  // One decode step of both requests, 8 query heads on the 4 key heads, read in place.
  auto context = attnkit::paged_attention(query, cache.view({a, b}));  // (2, 8, 1, 64)
  cache.release(a);  // a finished: its own page returns to the pool
  // [doc:end]
  TORCH_CHECK(context.sizes() == query.sizes() && cache.free_pages() == 64 - 3);
}

void serving() {
  torch::manual_seed(2);
  TinyModel model;
  model->eval();
  const auto ids = [](std::vector<int64_t> tokens) { return torch::tensor(tokens, torch::kInt64); };
  // [doc:serving]
  // Pools of 64 pages of 8 positions; at most 4 requests at once, 16 tokens per step.
  attnkit::Scheduler scheduler(
      *model, attnkit::SchedulerOptions(64).page_size(8).max_running(4).max_tokens_per_step(16));
  const auto greedy = scheduler.submit(ids({72, 105}), attnkit::GenerateOptions(20));
  scheduler.submit(ids({84, 104, 101, 32}),
                   attnkit::GenerateOptions(30).temperature(0.8).top_k(40).seed(7));
  std::vector<attnkit::ServedRequest> served;
  // A system prompt prefilled once; requests on it share its pages and prefill only their own.
  const auto system = scheduler.add_prefix(ids({89, 111, 117, 32, 97, 114, 101, 58, 32}));
  for (int step = 0; !scheduler.idle(); ++step) {
    if (step == 3)  // requests join the running batch
      scheduler.submit(ids({65}), attnkit::GenerateOptions(20).stop_tokens({'\n'}), system);
    if (step == 4)
      scheduler.submit(ids({66, 67}), attnkit::GenerateOptions(10), system);
    for (auto& done : scheduler.step())  // the requests that ended in this step
      served.push_back(std::move(done));
  }
  scheduler.release_prefix(system);  // its pages return to the pool
  // served[i].tokens: the prompt (a prefix's tokens first), then its new tokens;
  // .seconds_to_first_token, .seconds
  // [doc:end]
  const auto alone =
      attnkit::generate(*model, ids({72, 105}).unsqueeze(0), attnkit::GenerateOptions(20))[0];
  TORCH_CHECK(served.size() == 4);
  for (const auto& done : served)
    TORCH_CHECK(done.id != greedy || done.tokens.equal(alone));
  for (const auto& pool : scheduler.pools())
    TORCH_CHECK(pool.free_pages() == 64);
}

}  // namespace

int main() {
  cache_lifecycle();
  generation();
  family();
  gemma2_attention();
  paged_cache();
  serving();
  std::cout << "generation examples ran\n";
}
