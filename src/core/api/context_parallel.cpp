// Context-parallel attention: each rank holds a shard of a sequence and computes its queries'
// attention over every shard's keys. A step of the call pairs this rank r with rank
// r - offset and one piece of that rank's keys and values: rank r receives the piece (and
// sends its own piece to rank r + offset) while the step before computes, computes each
// piece of its queries against it with the split forward, and merges the outputs into its
// own by their log-sum-exp, in place. Pieces hold at most `piece_bytes` of keys, so the
// buffers in flight and the copies each call makes stay small beside a shard. Steps whose pairs the
// mask leaves empty on every rank are not taken, so their pieces never move. The backward walks the
// same steps: each piece's key and value gradients go back to the rank that holds it.

#include "attnkit/context_parallel.h"

#include <algorithm>
#include <deque>
#include <limits>
#include <optional>
#include <sstream>
#include <utility>

#include "core/api/argument_checks.h"
#include "core/base/checks.h"
#include "core/base/lse_merge.h"
#include "core/plan/kernel_spec.h"
#include "core/scores/row_variants.h"
#include "core/scores/score_variants.h"

namespace attnkit {

namespace {

const char* const kContextParallelFn = "[context_parallel_attention]";

const char* layout_name(ShardLayout layout) {
  return layout == ShardLayout::kZigzag ? "zigzag" : "contiguous";
}

}  // namespace

SequenceShards::SequenceShards(int64_t length, int ranks, ShardLayout layout)
    : length_(length), ranks_(ranks), layout_(layout) {
  TORCH_CHECK(ranks >= 1, "[SequenceShards] ranks must be >= 1, got ", ranks);
  const int64_t chunks = layout == ShardLayout::kZigzag ? 2 * ranks : ranks;
  TORCH_CHECK(length >= chunks && length % chunks == 0, "[SequenceShards] a sequence of ", length,
              " tokens must divide into ", chunks, " equal chunks (", layout_name(layout), " over ",
              ranks, " ranks): pad it to a multiple of ", chunks);
}

std::vector<SequenceChunk> SequenceShards::chunks(int rank) const {
  TORCH_CHECK(rank >= 0 && rank < ranks_, "[SequenceShards] rank must be in [0, ", ranks_,
              "), got ", rank);
  if (layout_ == ShardLayout::kContiguous)
    return {{rank * shard_length(), shard_length(), 0}};
  const int64_t chunk = length_ / (2 * ranks_);
  return {{rank * chunk, chunk, 0}, {(2 * ranks_ - 1 - rank) * chunk, chunk, chunk}};
}

torch::Tensor SequenceShards::positions(int rank) const {
  std::vector<torch::Tensor> pieces;
  for (const auto& chunk : chunks(rank))
    pieces.push_back(torch::arange(chunk.start, chunk.start + chunk.length, torch::kInt64));
  return torch::cat(pieces);
}

torch::Tensor SequenceShards::shard(const torch::Tensor& whole, int rank, int64_t dim) const {
  TORCH_CHECK(
      whole.defined() && dim >= -whole.dim() && dim < whole.dim() && whole.size(dim) == length_,
      "[SequenceShards::shard] expected a tensor with ", length_, " tokens along dimension ", dim,
      ", got ", whole.defined() ? detail::shape_string(whole) : std::string("an undefined tensor"));
  std::vector<torch::Tensor> pieces;
  for (const auto& chunk : chunks(rank))
    pieces.push_back(whole.narrow(dim, chunk.start, chunk.length));
  return torch::cat(pieces, dim);
}

torch::Tensor SequenceShards::unshard(const std::vector<torch::Tensor>& shards, int64_t dim) const {
  TORCH_CHECK(static_cast<int>(shards.size()) == ranks_, "[SequenceShards::unshard] expected ",
              ranks_, " shards (one per rank), got ", shards.size());
  // (start in the sequence, piece) for every chunk of every rank, then in sequence order.
  std::vector<std::pair<int64_t, torch::Tensor>> pieces;
  for (int r = 0; r < ranks_; ++r) {
    const auto& shard = shards[r];
    TORCH_CHECK(shard.defined() && dim >= -shard.dim() && dim < shard.dim() &&
                    shard.size(dim) == shard_length(),
                "[SequenceShards::unshard] shard ", r, " must hold ", shard_length(),
                " tokens along dimension ", dim, ", got ",
                shard.defined() ? detail::shape_string(shard) : std::string("undefined"));
    for (const auto& chunk : chunks(r))
      pieces.emplace_back(chunk.start, shard.narrow(dim, chunk.local_start, chunk.length));
  }
  std::sort(pieces.begin(), pieces.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<torch::Tensor> ordered;
  for (auto& piece : pieces)
    ordered.push_back(std::move(piece.second));
  return torch::cat(ordered, dim);
}

namespace functional {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// One pair of a step: a piece of this rank's queries against the step's keys, under the whole
// mask's region there (none where the region is full).
struct PiecePair {
  size_t query_piece;  // index into the plan's query_pieces
  Mask mask;
};

struct Step {
  int offset;          // pairs rank r with the keys of rank r - offset
  SequenceChunk keys;  // the piece: where it sits in the sequence and in its rank's shard
  std::vector<PiecePair> pairs;
};

// Everything a call decided before its first transfer; the backward reuses it.
struct Plan : torch::CustomClassHolder {
  ShardExchange* exchange = nullptr;
  int rank = 0, ranks = 1;
  std::vector<SequenceChunk> query_pieces;  // this rank's
  std::vector<Step> steps;                  // offset 0 first, then the steps some rank needs
  AttentionOptions pair_options;            // the call's options without a mask
  // The score function's tensors that want gradients (a relative-position table, a graph's).
  std::vector<torch::Tensor> score_tensors;
};

// The options of one pair's call: its region of the mask, and the score function reading the
// pieces' positions in the whole sequence.
AttentionOptions options_of(const Plan& plan, const PiecePair& pair, const SequenceChunk& keys) {
  auto options = plan.pair_options;
  options.mask(pair.mask).score_mod(detail::score_mod_at_positions(
      plan.pair_options.score_mod(), plan.query_pieces[pair.query_piece].start, keys.start));
  return options;
}

// What the whole mask's region over a pair of chunks is, over every batch entry and head:
// empty, full, or partial (also when its structure does not say).
TileKind pair_kind(const Mask& region, int64_t batch, int64_t heads, int64_t queries,
                   int64_t keys) {
  if (region.is_none())
    return TileKind::kFull;
  bool empty = true, full = true;
  for (int64_t b = 0; b < batch; ++b) {
    const auto kind = region.structural_kind(Tile{b, 0, heads, 0, queries, 0, keys});
    if (!kind.has_value() || *kind == TileKind::kPartial)
      return TileKind::kPartial;
    empty = empty && *kind == TileKind::kEmpty;
    full = full && *kind == TileKind::kFull;
  }
  return empty ? TileKind::kEmpty : full ? TileKind::kFull : TileKind::kPartial;
}

// `chunks` cut into pieces of at most `tokens`, in order.
std::vector<SequenceChunk> pieces_of(const std::vector<SequenceChunk>& chunks, int64_t tokens) {
  std::vector<SequenceChunk> pieces;
  for (const auto& chunk : chunks) {
    for (int64_t begin = 0; begin < chunk.length; begin += tokens) {
      pieces.push_back(
          {chunk.start + begin, std::min(tokens, chunk.length - begin), chunk.local_start + begin});
    }
  }
  return pieces;
}

int wrap(int rank, int ranks) {
  return ((rank % ranks) + ranks) % ranks;
}

c10::intrusive_ptr<Plan> make_plan(const torch::Tensor& query, const torch::Tensor& key,
                                   const torch::Tensor& value, ShardExchange& exchange,
                                   const AttentionOptions& given,
                                   const ContextParallelOptions& parallel) {
  const auto layout = parallel.layout();
  TORCH_CHECK(parallel.piece_bytes() >= 1, kContextParallelFn, " piece_bytes must be >= 1, got ",
              parallel.piece_bytes());
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, kContextParallelFn,
              " query, key and value must be 4-D (b, h, s, hd) shards, got ",
              detail::shape_string(query), ", ", detail::shape_string(key), " and ",
              detail::shape_string(value));
  TORCH_CHECK(key.size(2) == query.size(2), kContextParallelFn,
              " query and key must hold the same shard of the sequence, got ", query.size(2),
              " queries and ", key.size(2), " keys");
  const int ranks = exchange.world_size(), rank = exchange.rank();
  TORCH_CHECK(ranks >= 1 && rank >= 0 && rank < ranks, kContextParallelFn, " exchange: rank ", rank,
              " of a world of ", ranks);
  const int64_t shard = query.size(2), n = shard * ranks;
  const int64_t chunks = layout == ShardLayout::kZigzag ? 2 : 1;
  TORCH_CHECK(shard % chunks == 0 && shard >= chunks, kContextParallelFn, " a ",
              layout_name(layout), " shard holds ", chunks, " equal chunks, got a shard of ", shard,
              " tokens: pad the sequence to a multiple of ", chunks * ranks);
  const SequenceShards shards(n, ranks, layout);

  auto options = given;
  Mask mask = options.mask();
  if (options.block_mask().defined()) {
    TORCH_CHECK(mask.is_none(), kContextParallelFn,
                " pass the mask either as mask(...) or inside block_mask(...), not both");
    mask = Mask::from_block_mask(options.block_mask());
  }
  options.mask({}).block_mask({});
  TORCH_CHECK(!options.training() || options.dropout_p() == 0.0, kContextParallelFn,
              " dropout is not offered (a split call's backward cannot redraw it); got "
              "dropout_p ",
              options.dropout_p(), " in training");
  TORCH_CHECK(!options.sinks().defined(), kContextParallelFn, " attention sinks are not offered");
  std::string why;
  const auto variant = detail::score_variant_of(options.score_mod(), &why);
  TORCH_CHECK(variant, kContextParallelFn, " score_mod: ", why,
              "; a context-parallel call takes the named score functions and ScoreGraphs");
  // The whole sequence's mask must fit the whole problem: refused here, before any transfer.
  mask.check(kContextParallelFn, query.size(0), query.size(1), n, n, query.device());
  // Each pair's call checks the rest (devices, dtypes, heads) before the first transfer too.
  check_attention_arguments(query, key, value, options, kContextParallelFn);
  TORCH_CHECK(query.device().is_cpu(), kContextParallelFn,
              " the split kernels that compute each pair run on the CPU, got ", query.device());

  auto plan = c10::make_intrusive<Plan>();
  plan->exchange = &exchange;
  plan->rank = rank;
  plan->ranks = ranks;
  // Queries and keys both go in pieces: a pair's call copies its pieces (their rows are
  // strided in a shard), so the pieces bound those copies and the buffers in flight.
  const int64_t token_bytes = key.size(0) * key.size(1) * key.size(3) * key.element_size();
  const int64_t piece_tokens =
      std::max<int64_t>(1, parallel.piece_bytes() / std::max<int64_t>(1, token_bytes));
  std::vector<std::vector<SequenceChunk>> pieces;  // every rank's, alike in each shard
  for (int r = 0; r < ranks; ++r)
    pieces.push_back(pieces_of(shards.chunks(r), piece_tokens));
  plan->query_pieces = pieces[static_cast<size_t>(rank)];
  plan->pair_options = options;
  for (const auto& tensor : variant->tensors()) {
    if (tensor.requires_grad())
      plan->score_tensors.push_back(tensor);
  }
  // Every rank judges every rank's pairs, so that all agree on the steps without talking.
  const int64_t batch = query.size(0), heads = query.size(1);
  for (int offset = 0; offset < ranks; ++offset) {
    for (size_t p = 0; p < pieces[0].size(); ++p) {
      Step step{offset, pieces[static_cast<size_t>(wrap(rank - offset, ranks))][p], {}};
      bool needed = false;
      for (int r = 0; r < ranks; ++r) {
        const auto& keys = pieces[static_cast<size_t>(wrap(r - offset, ranks))][p];
        const auto& mine = pieces[static_cast<size_t>(r)];
        for (size_t i = 0; i < mine.size(); ++i) {
          auto region = mask.is_none() ? mask : mask.region(mine[i].start, keys.start, n, n);
          const auto kind = pair_kind(region, batch, heads, mine[i].length, keys.length);
          if (kind == TileKind::kEmpty)
            continue;
          needed = true;
          if (r == rank)
            step.pairs.push_back({i, kind == TileKind::kFull ? Mask() : region});
        }
      }
      // A step that moves a piece is taken by every rank when one needs it; this rank's own
      // pieces move nothing.
      if (needed && (offset != 0 || !step.pairs.empty()))
        plan->steps.push_back(std::move(step));
    }
  }
  return plan;
}

// Every rank's shard must be shaped and typed as every other's: each rank sends its sizes to
// every other rank (R - 1 small transfers), so that all fail alike, naming the first rank that
// differs, before the first transfer of tensors.
void check_same_shapes(const Plan& plan, const torch::Tensor& query, const torch::Tensor& key,
                       const torch::Tensor& value) {
  std::vector<int64_t> sizes;
  for (const auto* t : {&query, &key, &value}) {
    for (const auto size : t->sizes())
      sizes.push_back(size);
  }
  sizes.push_back(static_cast<int64_t>(query.scalar_type()));
  const auto mine = torch::tensor(sizes, torch::kInt64);
  std::vector<torch::Tensor> every(static_cast<size_t>(plan.ranks));
  every[static_cast<size_t>(plan.rank)] = mine;
  for (int offset = 1; offset < plan.ranks; ++offset) {
    const int from = wrap(plan.rank - offset, plan.ranks);
    std::vector<torch::Tensor> theirs{torch::empty_like(mine)};
    plan.exchange->start_send_receive({mine}, wrap(plan.rank + offset, plan.ranks), theirs, from)();
    every[static_cast<size_t>(from)] = theirs[0];
  }
  const auto text = [](const torch::Tensor& t) {
    std::ostringstream out;
    for (int64_t i = 0; i < t.numel(); ++i)
      out << (i == 0 ? "[" : ", ") << t[i].item<int64_t>();
    return out.str() + "]";
  };
  for (int r = 1; r < plan.ranks; ++r) {
    TORCH_CHECK(every[static_cast<size_t>(r)].equal(every[0]), kContextParallelFn,
                " every rank's query, key and value must be shaped and typed alike; rank 0 has ",
                text(every[0]), ", rank ", r, " has ", text(every[static_cast<size_t>(r)]),
                " (the sizes of query, key and value, then the dtype's number)");
  }
}

// A transfer under way: what it receives, and the wait.
struct Transfer {
  std::vector<torch::Tensor> received;
  std::function<void()> wait;
};

// Starts step `step`'s exchange of `tensors`: towards higher ranks, this rank's piece goes to
// rank r + offset and rank r - offset's comes here; the other way, gradients go home.
Transfer start_step(const Plan& plan, const Step& step, const std::vector<torch::Tensor>& tensors,
                    bool towards_higher) {
  Transfer transfer;
  for (const auto& t : tensors)
    transfer.received.push_back(torch::empty_like(t, at::MemoryFormat::Contiguous));
  const int shift = towards_higher ? step.offset : -step.offset;
  transfer.wait =
      plan.exchange->start_send_receive(tensors, wrap(plan.rank + shift, plan.ranks),
                                        transfer.received, wrap(plan.rank - shift, plan.ranks));
  return transfer;
}

torch::Tensor chunk_of(const torch::Tensor& t, const SequenceChunk& chunk) {
  return t.narrow(2, chunk.local_start, chunk.length);
}

// Walks the plan's steps with each step's piece of keys and values: views of this rank's own
// at offset 0; else the other rank's, received while the step before computes.
template <typename Compute>
void walk_steps(const Plan& plan, const torch::Tensor& key, const torch::Tensor& value,
                const Compute& compute) {
  const auto& steps = plan.steps;
  // The first step from `i` on that moves a piece (steps.size() for none).
  const auto moving_from = [&](size_t i) {
    while (i < steps.size() && steps[i].offset == 0)
      ++i;
    return i;
  };
  const auto start = [&](size_t i) {
    // This rank's piece where the other rank's lies in its shard: the same place.
    const auto& keys = steps[i].keys;
    return start_step(plan, steps[i],
                      {chunk_of(key, keys).contiguous(), chunk_of(value, keys).contiguous()},
                      /*towards_higher=*/true);
  };
  // Two pieces in flight: a rank whose piece computes faster than its partner's (the
  // pieces of one step are unequal work) finds the next but one already sent.
  constexpr size_t kInFlight = 2;
  std::deque<Transfer> in_flight;
  size_t next_index = moving_from(0);
  const auto top_up = [&] {
    while (in_flight.size() < kInFlight && next_index < steps.size()) {
      in_flight.push_back(start(next_index));
      next_index = moving_from(next_index + 1);
    }
  };
  top_up();
  for (const auto& step : steps) {
    if (step.offset == 0) {
      compute(step, chunk_of(key, step.keys), chunk_of(value, step.keys));
      continue;
    }
    in_flight.front().wait();
    const auto current = std::move(in_flight.front().received);
    in_flight.pop_front();
    top_up();
    compute(step, current[0], current[1]);
  }
}

AttentionWithLse forward_over_steps(const Plan& plan, const torch::Tensor& query,
                                    const torch::Tensor& key, const torch::Tensor& value) {
  constexpr double kInfinity = std::numeric_limits<double>::infinity();
  const auto dtype = detail::compute_dtype(query);
  auto out = torch::zeros({query.size(0), query.size(1), query.size(2), value.size(3)},
                          query.options().dtype(dtype));
  auto log_weight = torch::full({query.size(0), query.size(1), query.size(2)}, -kInfinity,
                                query.options().dtype(dtype));
  // 16-bit shards are computed in float32 (as a single call computes them) and their pieces
  // travel in 16 bits: each pair's output then merges unrounded.
  const auto query_computed = query.to(dtype);
  walk_steps(plan, key, value,
             [&](const Step& step, const torch::Tensor& k, const torch::Tensor& v) {
               const auto k_computed = k.to(dtype), v_computed = v.to(dtype);
               for (const auto& pair : step.pairs) {
                 const auto& piece = plan.query_pieces[pair.query_piece];
                 auto piece_out = chunk_of(out, piece);
                 auto piece_weight = log_weight.narrow(2, piece.local_start, piece.length);
                 merge_into(piece_out, piece_weight,
                            attention_forward(chunk_of(query_computed, piece), k_computed,
                                              v_computed, options_of(plan, pair, step.keys)));
               }
             });
  // In the compute dtype, which backward reads. A row that saw no key: lse +inf, as a single
  // call's, and zeros.
  return {out, log_weight.masked_fill(log_weight.isneginf(), kInfinity)};
}

std::vector<torch::Tensor> backward_over_steps(const Plan& plan, const torch::Tensor& query,
                                               const torch::Tensor& key, const torch::Tensor& value,
                                               const AttentionWithLse& forward,
                                               const torch::Tensor& grad_out) {
  const auto dtype = detail::compute_dtype(query);
  auto grad_query = torch::zeros(query.sizes(), query.options().dtype(dtype));
  auto grad_key = torch::zeros(key.sizes(), key.options().dtype(dtype));
  auto grad_value = torch::zeros(value.sizes(), value.options().dtype(dtype));
  const auto query_computed = query.to(dtype), grad_out_computed = grad_out.to(dtype);
  std::vector<torch::Tensor> grad_score_tensors;  // summed over the pairs
  for (const auto& tensor : plan.score_tensors)
    grad_score_tensors.push_back(torch::zeros_like(tensor));
  // The gradients of this rank's pieces of keys and values on their way home from the ranks
  // that took them, with where each piece lies in this rank's shard (where the other's lies in
  // its). Added here with a step's delay, so that a slower partner does not hold this rank up.
  std::deque<std::pair<Transfer, SequenceChunk>> returning;
  const auto take_home = [&](size_t keep) {
    while (returning.size() > keep) {
      auto& [transfer, piece] = returning.front();
      transfer.wait();
      chunk_of(grad_key, piece) += transfer.received[0];
      chunk_of(grad_value, piece) += transfer.received[1];
      returning.pop_front();
    }
  };
  walk_steps(
      plan, key, value, [&](const Step& step, const torch::Tensor& k, const torch::Tensor& v) {
        // The piece's gradients: into this rank's own at offset 0, else sent home after.
        const bool own = step.offset == 0;
        auto piece_grad_key =
            own ? chunk_of(grad_key, step.keys) : torch::zeros(k.sizes(), k.options().dtype(dtype));
        auto piece_grad_value = own ? chunk_of(grad_value, step.keys)
                                    : torch::zeros(v.sizes(), v.options().dtype(dtype));
        const auto k_computed = k.to(dtype), v_computed = v.to(dtype);
        for (const auto& pair : step.pairs) {
          const auto& chunk = plan.query_pieces[pair.query_piece];
          const auto grads = attention_backward(
              chunk_of(query_computed, chunk), k_computed, v_computed,
              {chunk_of(forward.out, chunk),
               forward.lse.narrow(2, chunk.local_start, chunk.length)},
              chunk_of(grad_out_computed, chunk), options_of(plan, pair, step.keys));
          chunk_of(grad_query, chunk) += grads.query.to(dtype);
          piece_grad_key += grads.key.to(dtype);
          piece_grad_value += grads.value.to(dtype);
          for (size_t t = 0; t < grad_score_tensors.size(); ++t)
            grad_score_tensors[t] += grads.score_tensors[t];
        }
        if (!own) {
          take_home(1);
          returning.emplace_back(start_step(plan, step, {piece_grad_key, piece_grad_value},
                                            /*towards_higher=*/false),
                                 step.keys);
        }
      });
  take_home(0);
  std::vector<torch::Tensor> grads{grad_query.to(query.scalar_type()),
                                   grad_key.to(key.scalar_type()),
                                   grad_value.to(value.scalar_type())};
  grads.insert(grads.end(), grad_score_tensors.begin(), grad_score_tensors.end());
  return grads;
}

struct ContextParallelFunction : public torch::autograd::Function<ContextParallelFunction> {
  static torch::Tensor forward(AutogradContext* ctx, c10::intrusive_ptr<Plan> plan,
                               const torch::Tensor& query, const torch::Tensor& key,
                               const torch::Tensor& value, at::TensorList /*score_tensors*/) {
    // The score tensors are inputs so that autograd asks for their gradients; the plan holds
    // them.
    const auto result = forward_over_steps(*plan, query, key, value);
    ctx->save_for_backward({query, key, value, result.out, result.lse});
    ctx->saved_data["plan"] = c10::IValue::make_capsule(plan);
    return result.out.to(query.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto capsule = ctx->saved_data["plan"].toCapsule();
    const auto& plan = *static_cast<const Plan*>(capsule.get());
    const auto computed = backward_over_steps(plan, saved[0], saved[1], saved[2],
                                              {saved[3], saved[4]}, grads[0].contiguous());
    variable_list grads_in{torch::Tensor()};
    grads_in.insert(grads_in.end(), computed.begin(), computed.end());
    return grads_in;
  }
};

}  // namespace

torch::Tensor context_parallel_attention(const torch::Tensor& query, const torch::Tensor& key,
                                         const torch::Tensor& value, ShardExchange& exchange,
                                         const AttentionOptions& options,
                                         const ContextParallelOptions& parallel) {
  const auto plan = make_plan(query, key, value, exchange, options, parallel);
  check_same_shapes(*plan, query, key, value);
  return ContextParallelFunction::apply(plan, query, key, value,
                                        at::TensorList(plan->score_tensors));
}

}  // namespace functional

namespace {

thread_local const ContextParallelScope* current_scope = nullptr;

}  // namespace

ContextParallelScope::ContextParallelScope(ShardExchange& exchange, int64_t sequence_length,
                                           const ContextParallelOptions& options)
    : exchange_(exchange),
      options_(options),
      shards_(sequence_length, exchange.world_size(), options.layout()),
      outer_(current_scope) {
  TORCH_CHECK(options.piece_bytes() >= 1, "[ContextParallelScope] piece_bytes must be >= 1, got ",
              options.piece_bytes());
  current_scope = this;
}

ContextParallelScope::~ContextParallelScope() {
  current_scope = outer_;
}

const ContextParallelScope* ContextParallelScope::current() {
  return current_scope;
}

torch::Tensor ContextParallelScope::positions(const torch::Device& device) const {
  return shards_.positions(exchange_.rank()).to(device);
}

}  // namespace attnkit
