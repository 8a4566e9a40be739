// attnkit-walkthrough: the chapter-3 notebooks' computations, step by step, in C++.
// Every number printed here is one the notebooks print (and the tests check).

#include <cmath>
#include <cstdio>
#include <functional>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "attnkit/attnkit.h"
#include "command_line.h"
#include "train/line.h"

namespace F = attnkit::functional;

using attnkit::train::Line;

namespace {

// Python-style tensor text, `tensor([[0.2961, 0.5166], ...])`, so lines match the notebooks.
// `pad_sign`: a column of mixed signs lines up when non-negative values get a leading space.
void format_values(std::ostream& out, const torch::Tensor& t, int indent, bool pad_sign) {
  if (t.dim() == 0) {
    const double value = t.item<double>();
    out << (pad_sign && value >= 0 ? " " : "") << std::fixed << std::setprecision(4) << value;
    return;
  }
  out << "[";
  for (int64_t i = 0; i < t.size(0); ++i) {
    if (i > 0) {
      out << ",";
      if (t.dim() > 1) {
        // One line break per row, a blank line between matrices, as Python prints.
        out << std::string(t.dim() - 1, '\n') << std::string(indent + 1, ' ');
      } else {
        out << " ";
      }
    }
    format_values(out, t[i], indent + 1, pad_sign);
  }
  out << "]";
}

std::string python_repr(const torch::Tensor& t) {
  std::ostringstream out;
  out << "tensor(";
  const auto values = t.detach().to(torch::kCPU, torch::kFloat64);
  format_values(out, values, /*indent=*/7, /*pad_sign=*/values.lt(0).any().item<bool>());
  out << ")";
  return out.str();
}

// The module's own line, without its submodules (what `<<` would add).
std::string pretty_printed(const torch::nn::Module& module) {
  std::ostringstream text;
  module.pretty_print(text);
  return text.str();
}

void heading(const std::string& title) {
  Line(std::cout) << "\n== " << title << " ==\n";
}

void show(const std::string& name, const torch::Tensor& t) {
  Line(std::cout) << name << " =\n" << python_repr(t) << "\n";
}

torch::Tensor journey_inputs() {
  return torch::tensor({{0.43, 0.15, 0.89},   // Your     (x^1)
                        {0.55, 0.87, 0.66},   // journey  (x^2)
                        {0.57, 0.85, 0.64},   // starts   (x^3)
                        {0.22, 0.58, 0.33},   // with     (x^4)
                        {0.77, 0.25, 0.10},   // one      (x^5)
                        {0.05, 0.80, 0.55}},  // step     (x^6)
                       torch::kFloat32);
}

void simplified_attention() {
  heading("1. Simplified self-attention (no trainable weights)");
  const auto inputs = journey_inputs();
  show("inputs  (6 tokens x 3 dims: Your journey starts with one step)", inputs);
  const auto attn_scores_2 = F::attention_scores(inputs[1], inputs);
  show("attn_scores_2 = inputs @ x^2  (query: 'journey')", attn_scores_2);
  show("naive weights = scores / scores.sum()", F::normalize_by_sum(attn_scores_2));
  const auto attn_weights_2 = F::softmax_weights(attn_scores_2);
  show("softmax weights", attn_weights_2);
  show("context_vec_2 = weights @ inputs", F::context_vectors(attn_weights_2, inputs));
  show("all context vectors = softmax(inputs inputs^T) inputs", F::simple_self_attention(inputs));

  const auto hello =
      torch::tensor({{0.34, 0.22, 0.54}, {0.53, 0.34, 0.98}, {0.29, 0.54, 0.93}}, torch::kFloat32);
  show("'Hello shiny sun': context vector of 'shiny'", F::simple_self_attention(hello)[1]);
  Line(std::cout) << "  (the page rounds its weights first and prints [0.3992, 0.3858, 0.8610])\n";
}

void trainable_weights() {
  heading("2. Self-attention with trainable weights (torch::manual_seed(123))");
  torch::manual_seed(123);
  attnkit::SelfAttentionV1 sa_v1(/*d_in=*/3, /*d_out=*/2);
  torch::NoGradGuard no_grad;
  show("W_query", sa_v1->W_query);
  show("W_key", sa_v1->W_key);
  show("W_value", sa_v1->W_value);
  const auto inputs = journey_inputs();
  const auto x_2 = inputs[1];
  const auto query_2 = x_2.matmul(sa_v1->W_query);
  show("query_2", query_2);
  show("key_2", x_2.matmul(sa_v1->W_key));
  show("value_2", x_2.matmul(sa_v1->W_value));
  const auto keys = inputs.matmul(sa_v1->W_key);
  const auto values = inputs.matmul(sa_v1->W_value);
  show("attn_score_22 = query_2 . key_2", query_2.dot(keys[1]));
  const auto attn_scores_2 = F::attention_scores(query_2, keys);
  show("attn_scores_2 = query_2 @ keys^T", attn_scores_2);
  show("attn_scores = queries @ keys^T", F::attention_scores(inputs.matmul(sa_v1->W_query), keys));
  const auto d_k = keys.size(-1);
  const auto attn_weights_2 = F::softmax_weights(attn_scores_2 / std::sqrt(double(d_k)));
  show("attn_weights_2 = softmax(attn_scores_2 / sqrt(d_k = 2))", attn_weights_2);
  show("context_vec_2 = attn_weights_2 @ values", F::context_vectors(attn_weights_2, values));
}

void why_scale() {
  heading("3. Why divide by sqrt(d_k)");
  const auto scores = torch::tensor({0.1, -0.2, 0.3, -0.2, 0.5}, torch::kFloat32);
  show("softmax([0.1, -0.2, 0.3, -0.2, 0.5])", F::softmax_weights(scores));
  show("softmax(8 x the same)  (peaky)", F::softmax_weights(scores * 8));
  torch::manual_seed(0);
  for (const int64_t dim : {5, 100}) {
    const auto q = torch::randn({10000, 1, dim});
    const auto k = torch::randn({10000, 1, dim});
    const auto dots = F::attention_scores(q, k).flatten();
    Line(std::cout) << std::fixed << std::setprecision(4) << "variance of q.k, dim " << dim << ": "
                    << dots.var(false).item<double>() << " before, "
                    << (dots / std::sqrt(double(dim))).var(false).item<double>()
                    << " after dividing by sqrt(dim)\n";
  }
}

void self_attention_classes() {
  heading("4. SelfAttentionV1 (seed 123) and SelfAttentionV2 (seed 789)");
  torch::NoGradGuard no_grad;
  const auto inputs = journey_inputs();
  torch::manual_seed(123);
  attnkit::SelfAttentionV1 sa_v1(3, 2);
  Line(std::cout) << *sa_v1 << "\n";
  show("sa_v1(inputs)", sa_v1(inputs));
  torch::manual_seed(789);
  attnkit::SelfAttentionV2 sa_v2(3, 2);
  Line(std::cout) << pretty_printed(*sa_v2) << "\n";
  show("sa_v2(inputs)", sa_v2(inputs));
  sa_v1->copy_weights_from(*sa_v2);
  show("sa_v1(inputs) after sa_v1->copy_weights_from(*sa_v2)", sa_v1(inputs));
}

void causal_attention() {
  heading("5. Causal attention: hiding future tokens");
  torch::NoGradGuard no_grad;
  const auto inputs = journey_inputs();
  torch::manual_seed(789);
  attnkit::SelfAttentionV2 sa_v2(3, 2);
  const auto attn_scores = F::attention_scores(sa_v2->W_query(inputs), sa_v2->W_key(inputs));
  const auto attn_weights = F::softmax_weights(attn_scores / std::sqrt(2.0));
  show("attn_weights (no mask)", attn_weights);
  show("way 1: tril mask, then rows renormalised",
       F::causal_weights_by_renormalizing(attn_weights));
  show("way 2: -inf above the diagonal, then softmax",
       F::causal_weights_by_masking(attn_scores, 2));
  show("causal_mask(6, 6)  (true = hidden)", F::causal_mask(6, 6).to(torch::kFloat32));

  torch::manual_seed(123);
  show("dropout(p=0.5) on ones(6, 6), seed 123, training",
       F::dropout_weights(torch::ones({6, 6}), 0.5, /*training=*/true));

  const auto batch = torch::stack({inputs, inputs});  // (2, 6, 3)
  torch::manual_seed(123);
  attnkit::CausalAttention ca(/*d_in=*/3, /*d_out=*/2, /*context_length=*/6, /*dropout=*/0.0);
  Line(std::cout) << *ca << "\n";
  const auto context_vecs = ca(batch);
  show("ca(batch)[0]", context_vecs[0]);
  Line(std::cout) << "context_vecs.shape: " << context_vecs.sizes() << "\n";
}

void multi_head() {
  heading("6. Multi-head attention (seed 123, batch of two copies)");
  torch::NoGradGuard no_grad;
  const auto inputs = journey_inputs();
  const auto batch = torch::stack({inputs, inputs});
  torch::manual_seed(123);
  attnkit::MultiHeadAttentionWrapper wrapper(3, 2, 6, 0.0, /*num_heads=*/2);
  Line(std::cout) << pretty_printed(*wrapper) << "\n";
  const auto wrapped = wrapper(batch);
  show("wrapper(batch)[0]  (d_out * num_heads = 4 columns)", wrapped[0]);
  Line(std::cout) << "context_vecs.shape: " << wrapped.sizes() << "\n";

  torch::manual_seed(123);
  attnkit::MultiHeadAttention mha(3, 2, 6, 0.0, /*num_heads=*/2);
  Line(std::cout) << pretty_printed(*mha) << "\n";
  const auto context_vecs = mha(batch);
  show("mha(batch)[0]", context_vecs[0]);
  Line(std::cout) << "context_vecs.shape: " << context_vecs.sizes() << "\n";

  attnkit::MultiHeadAttentionCombinedQKV combined(3, 2, 6, 0.0, 2);
  combined->copy_weights_from(*mha);
  const auto difference = (combined(batch) - context_vecs).abs().max().item<double>();
  Line(std::cout) << "MultiHeadAttentionCombinedQKV with mha's weights: max difference "
                  << std::scientific << std::setprecision(1) << difference << "\n";
}

struct Section {
  const char* name;
  const char* what;
  void (*run)();
};

const std::vector<Section>& sections() {
  static const std::vector<Section> all{
      {"simple", "simplified self-attention, Hello shiny sun", simplified_attention},
      {"trainable", "trainable weights step by step at seed 123", trainable_weights},
      {"scaling", "why scores are divided by sqrt(d_k)", why_scale},
      {"classes", "SelfAttentionV1 / V2 and the weight copy", self_attention_classes},
      {"causal", "causal masks, dropout, CausalAttention", causal_attention},
      {"multihead", "the wrapper, MultiHeadAttention, combined QKV", multi_head},
  };
  return all;
}

}  // namespace

int main(int argc, char** argv) {
  std::string section_help = "Print only this section:";
  for (const auto& s : sections()) {
    section_help += std::string("\n  ") + s.name + ": " + s.what;
  }
  attnkit::cli::CommandLine cli("attnkit-walkthrough",
                                "The chapter-3 attention computations of \"LLMs from scratch\", "
                                "step by step, with attnkit (LibTorch).");
  cli.value("", "s,section", section_help)
      .flag("", "h,help", "Show this help")
      .flag("", "version", "Print the attnkit version");
  try {
    cli.parse(argc, argv);
    if (cli.given("help")) {
      Line(std::cout) << cli.help() << "\n";
      return 0;
    }
    if (cli.given("version")) {
      Line(std::cout) << "attnkit-walkthrough " << ATTNKIT_VERSION << "\n";
      return 0;
    }
    const std::string only = cli.text("section");
    bool found = only.empty();
    for (const auto& s : sections()) {
      if (only.empty() || only == s.name) {
        s.run();
        found = true;
      }
    }
    if (!found) {
      Line error(std::cerr);
      error << "attnkit-walkthrough: unknown --section '" << only << "'; expected one of:";
      for (const auto& s : sections()) {
        error << " " << s.name;
      }
      error << "\n";
      return 2;
    }
  } catch (const attnkit::cli::UsageError& e) {
    Line(std::cerr) << "attnkit-walkthrough: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
