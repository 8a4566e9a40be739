#pragma once

// What the two tile kernels, chunked (chunked.cpp) and fused (fused_tiles*.cpp), share for one
// call: the problem their forward and backward both read, its dropout, and the state their
// autograd functions save for backward.

#include <cstdint>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "attnkit/block_mask.h"
#include "attnkit/mask.h"

namespace attnkit::detail {

/// Dropout of the attention weights, tile by tile: each tile's keep factors (0 or 1 / (1 - p))
/// come from a CPU generator seeded by the call's seed plus the tile's place, so that backward
/// redraws forward's masks however the tiles are batched and whichever worker draws them, and
/// both tile kernels draw the same masks. Drawn on the CPU: a generator of another device,
/// reseeded per tile, would be a clone of its default one, and LibTorch 1.13's
/// Generator::clone leaks the clone (LeakSanitizer).
struct TileDropout {
  double p = 0.0;
  int64_t seed = -1;  // < 0: no dropout

  bool on() const { return p > 0.0 && seed >= 0; }

  /// The place of the tile whose first query is q0 and first key k0, of head h of outer
  /// index o, in a call of `heads` heads, n queries and m keys.
  static int64_t place(int64_t o, int64_t h, int64_t q0, int64_t k0, int64_t heads, int64_t n,
                       int64_t m) {
    return ((o * heads + h) * n + q0) * m + k0;
  }

  /// Fills `keep` (a CPU tensor of any shape) with the factors of the tile at `place`.
  void draw(torch::Tensor keep, int64_t tile_place) const {
    auto generator = at::detail::createCPUGenerator(static_cast<uint64_t>(seed) +
                                                    static_cast<uint64_t>(tile_place));
    keep.bernoulli_(1.0 - p, generator);
    keep.mul_(1.0 / (1.0 - p));
  }

  /// A seed from LibTorch's global generator, so that torch::manual_seed fixes the masks.
  static int64_t draw_seed() {
    return torch::randint(0, int64_t{1} << 62, {1}, torch::kInt64).item<int64_t>();
  }
};

/// A tile kernel's settings for one call, shared by its forward and its backward. Each kernel
/// adds how it reads the score function (ChunkedProblem, FusedTileProblem).
struct TileProblem : torch::CustomClassHolder {
  Mask mask;
  BlockMask blocks;  // defined when the mask is not none
  double scale = 1.0;
  int64_t query_block = 128;  // the block mask's query block when there is one
  int64_t key_block = 1024;
  TileDropout dropout;
};

/// What a tile kernel's autograd function keeps for backward: its problem, the inputs, the
/// output and lse that backward reads, and the score function's tensors that want gradients.
struct SavedTiles {
  c10::intrusive_ptr<torch::CustomClassHolder> problem;  // a TileProblem
  torch::Tensor query, key, value, out, lse;
  std::vector<torch::Tensor> parameters;

  template <typename Problem>
  const Problem& problem_as() const {
    return *static_cast<const Problem*>(problem.get());
  }

  void save(torch::autograd::AutogradContext* ctx) const {
    std::vector<torch::Tensor> tensors{query, key, value, out, lse};
    tensors.insert(tensors.end(), parameters.begin(), parameters.end());
    ctx->save_for_backward(tensors);
    ctx->saved_data["problem"] = c10::IValue::make_capsule(problem);
  }

  static SavedTiles load(torch::autograd::AutogradContext* ctx) {
    const auto tensors = ctx->get_saved_variables();
    return {ctx->saved_data["problem"].toCapsule(),
            tensors[0],
            tensors[1],
            tensors[2],
            tensors[3],
            tensors[4],
            std::vector<torch::Tensor>(tensors.begin() + 5, tensors.end())};
  }
};

}  // namespace attnkit::detail
