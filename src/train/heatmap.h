#pragma once

// PNG heatmaps of attention weights, one panel per layer and head, with token labels on
// both axes (rows: queries, columns: keys).

#include <string>
#include <vector>

#include <torch/torch.h>

namespace attnkit::train {

/// Writes `maps` (one (heads, n, n) tensor per layer, weights in [0, 1]) to a PNG at `path`.
/// `labels` names the n tokens. Fails with a c10::Error naming the path if it cannot write.
void write_attention_heatmap(const std::string& path, const std::vector<torch::Tensor>& maps,
                             const std::vector<std::string>& labels, const std::string& title);

}  // namespace attnkit::train
