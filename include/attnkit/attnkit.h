#pragma once

/// Umbrella header: every public attnkit header.
/// Example: `#include <attnkit/attnkit.h>` then `attnkit::MultiHeadAttention mha(...);`

#include "attnkit/attention.h"
#include "attnkit/autocast.h"
#include "attnkit/block_mask.h"
#include "attnkit/book_steps.h"
#include "attnkit/cached_attention.h"
#include "attnkit/causal_attention.h"
#include "attnkit/decode.h"
#include "attnkit/functional.h"
#include "attnkit/generate.h"
#include "attnkit/grouped_query_attention.h"
#include "attnkit/kv_cache.h"
#include "attnkit/latent_attention.h"
#include "attnkit/mask.h"
#include "attnkit/multi_head_attention.h"
#include "attnkit/options.h"
#include "attnkit/python_state.h"
#include "attnkit/rms_norm.h"
#include "attnkit/rope.h"
#include "attnkit/safetensors.h"
#include "attnkit/score_graph.h"
#include "attnkit/self_attention.h"
#include "attnkit/serialize.h"
#include "attnkit/threads.h"
#include "attnkit/version.h"
