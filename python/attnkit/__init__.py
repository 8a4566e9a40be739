"""attnkit from Python: FlexAttention's API on attnkit's kernels (docs/python.md).

    import attnkit
    out = attnkit.flex_attention(q, k, v, score_mod=..., block_mask=...)

runs attnkit's chunked kernel through the PyTorch operator ``torch.ops.attnkit.flex_attention``:
memory linear in the sequence length, forward and backward, on the CPU (where PyTorch's
compiled flex_attention has no backward) and on CUDA.
"""

import math
import os
import re
import warnings
from pathlib import Path
from typing import NamedTuple, Optional

import torch

from . import _score_graph
from ._block_mask import BlockMask, create_block_mask, partial_tiles
from ._score_graph import ScoreModError, compiling

__all__ = ["flex_attention", "attention", "create_block_mask", "BlockMask", "ScoreModError",
           "AuxRequest", "AuxOutput", "library_path", "cpu_16bit_matmul"]

try:  # PyTorch's own (2.9 on), so that a script's AuxRequest and ours are one class
    from torch.nn.attention.flex_attention import AuxOutput, AuxRequest
    _TORCH_HAS_AUX = True
except ImportError:
    _TORCH_HAS_AUX = False

    class AuxRequest(NamedTuple):
        """Which auxiliary outputs flex_attention returns (FlexAttention's, for older torch)."""
        lse: bool = False
        max_scores: bool = False

    class AuxOutput(NamedTuple):
        """flex_attention's auxiliary outputs: a tensor where requested, else None."""
        lse: Optional[torch.Tensor] = None
        max_scores: Optional[torch.Tensor] = None


def library_path():
    """The operators' library: $ATTNKIT_OPS_LIBRARY, else the one inside this package."""
    configured = os.environ.get("ATTNKIT_OPS_LIBRARY")
    if configured:
        return Path(configured)
    return Path(__file__).resolve().parent / "lib" / "libattnkit_ops.so"


def _release(version):
    """A torch version's release numbers: 2.15.0+cu132 -> (2, 15, 0), 1.13.0a0 -> (1, 13, 0)."""
    return tuple(int(part) for part in re.match(r"\d+(?:\.\d+)*", version).group().split("."))


def _torch_built_for():
    """The torch version the library was compiled against (attnkit/_built_for.py, which
    setup.py and CMake write beside it), or None for a library from elsewhere."""
    if os.environ.get("ATTNKIT_OPS_LIBRARY"):
        return None
    try:
        from ._built_for import TORCH_VERSION
    except ImportError:
        return None
    return TORCH_VERSION


def _mismatch_error(path, detail):
    return ImportError(
        f"attnkit: {path} does not load into this PyTorch {torch.__version__} ({detail}); "
        "the library must be built against the LibTorch of the same PyTorch")


def _load():
    path = library_path()
    built_for = _torch_built_for()
    if built_for is not None and _release(built_for) != _release(torch.__version__):
        # A library of another release may load and then crash: refuse it before loading.
        raise _mismatch_error(path, f"it was built against PyTorch {built_for}")
    if not path.is_file():
        raise ImportError(
            f"attnkit: the operators' library {path} is missing: build it (cmake --build, "
            "target attnkit_ops) and import the package from the build's python/ folder, or "
            "install it (docs/python.md), or set ATTNKIT_OPS_LIBRARY to its path")
    try:
        torch.ops.load_library(str(path))
    except OSError as error:
        raise _mismatch_error(path, error) from error


_load()


def _check_tensor(name, tensor, like=None):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"attnkit.flex_attention: {name} must be a torch.Tensor, got "
                        f"{type(tensor).__name__}")
    if tensor.dim() != 4:
        raise ValueError(f"attnkit.flex_attention: {name} must be 4-D (B, H, S, D), got shape "
                         f"{tuple(tensor.shape)}")
    if tensor.shape[-1] > 0 and tensor.stride(-1) != 1:
        raise ValueError(f"attnkit.flex_attention: {name} must be contiguous in its last "
                         f"dimension (stride 1), got strides {tuple(tensor.stride())}; call "
                         ".contiguous() first")
    if not tensor.is_floating_point():
        raise TypeError(f"attnkit.flex_attention: {name} must be floating point, got "
                        f"{tensor.dtype}")
    if like is not None and (tensor.dtype != like.dtype or tensor.device != like.device):
        raise ValueError(f"attnkit.flex_attention: {name} is {tensor.dtype} on {tensor.device}, "
                         f"query {like.dtype} on {like.device}: they must match")


_cpu_float16 = None


def _cpu_multiplies_float16():
    global _cpu_float16
    if _cpu_float16 is None:
        try:
            one = torch.ones(1, 1, dtype=torch.float16)
            torch.mm(one, one)
            _cpu_float16 = True
        except RuntimeError:
            _cpu_float16 = False
    return _cpu_float16


def _check_problem(query, key, value, enable_gqa):
    _check_tensor("query", query)
    _check_tensor("key", key, query)
    _check_tensor("value", value, query)
    if query.dtype == torch.float16 and query.device.type == "cpu" and \
            not _cpu_multiplies_float16():
        raise TypeError(f"attnkit.flex_attention: query is float16 on the CPU, which this "
                        f"PyTorch {torch.__version__} cannot multiply (no CPU float16 "
                        "products): use bfloat16 or float32, or a GPU")
    if key.shape[0] != value.shape[0] or key.shape[0] not in (query.shape[0], 1):
        raise ValueError("attnkit.flex_attention: key and value must have the query's batch size "
                         "or 1 (one key/value batch entry serves every query's), got query "
                         f"{query.shape[0]}, key {key.shape[0]} and value {value.shape[0]}")
    if key.shape[1:3] != value.shape[1:3]:
        raise ValueError("attnkit.flex_attention: key and value must have the same heads and "
                         f"length, got {tuple(key.shape)} and {tuple(value.shape)}")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError("attnkit.flex_attention: query and key must have one head dimension, "
                         f"got {query.shape[-1]} and {key.shape[-1]}")
    hq, hkv = query.shape[1], key.shape[1]
    if not enable_gqa and hq != hkv:
        raise ValueError(f"attnkit.flex_attention: query has {hq} heads and key {hkv}: pass "
                         "enable_gqa=True for grouped-query attention")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"attnkit.flex_attention: the key/value heads ({hkv}) must divide the "
                         f"query heads ({hq})")


def _call(query, key, value, score_mod, block_mask, scale, enable_gqa, dropout_p,
          block_sizes=(128, 128), max_scores=False, mask=("", [])):
    """(out, lse, max_scores) of the operator: max_scores (B, Hq, L) where asked, else a (0)
    tensor. mask: a Mask's value form and its tensors (attnkit.attention's own masks), with
    block_mask's lists where both are given."""
    _check_problem(query, key, value, enable_gqa)
    if key.shape[0] != query.shape[0]:
        # Batch broadcast: a view with batch stride 0, which the kernels read in place; its
        # gradient is summed over the query's batch by autograd.
        key = key.expand(query.shape[0], -1, -1, -1)
        value = value.expand(query.shape[0], -1, -1, -1)
    graph, captured = ("", []) if score_mod is None else _score_graph.traced(score_mod)
    if block_mask is None or query.numel() == 0:
        # No batch entry or no query: no row to mask, and an empty batch has no block to list.
        lists = (None, None, None, None, None)
        q_block, kv_block = block_sizes
    else:
        q_block, kv_block, lists = partial_tiles(block_mask, query, key)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    elif isinstance(scale, torch.Tensor) and scale.requires_grad:
        # The operator takes scale as a number: its gradient would be lost without a word.
        raise TypeError("attnkit.flex_attention: scale is a tensor that requires grad; attnkit "
                        "takes scale as a number, without a gradient: pass a float, or fold a "
                        "learned scale into the query (query * scale) or into a score_mod")
    seed = -1
    if dropout_p > 0.0:
        seed = int(torch.randint(0, 2 ** 62, (1,), dtype=torch.int64).item())
    try:
        return torch.ops.attnkit.flex_attention(query, key, value, *lists, *mask, q_block,
                                                kv_block, graph, list(captured), float(scale),
                                                float(dropout_p), seed, max_scores)
    except RuntimeError as error:
        if "[ScoreGraph::parse]" in str(error):
            raise ScoreModError(f"score_mod uses what attnkit cannot run: {error}") from None
        raise


def cpu_16bit_matmul(dtype):
    """How attnkit's CPU kernels multiply ``dtype`` (torch.bfloat16 or torch.float16): the
    matrix units they run on ("AMX-BF16", "AVX-512 BF16", "AMX-FP16", "AVX-512 FP16"), or
    "float32: " and why the call is computed in float32 instead (docs/backends.md)."""
    return torch.ops.attnkit.cpu_16bit_matmul(dtype)


# kernel_options keys of PyTorch's FlexKernelOptions that mean nothing on attnkit's kernels
# (GPU launch and scheduling hints, guarantees the CPU kernels do not use), taken and ignored.
_IGNORED_KERNEL_OPTIONS = frozenset([
    "num_warps", "num_stages", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2",
    "ROWS_GUARANTEED_SAFE", "BLOCKS_ARE_CONTIGUOUS", "WRITE_DQ", "FORCE_USE_FLEX_ATTENTION",
    "USE_TMA", "kpack", "matrix_instr_nonkdim", "waves_per_eu", "BACKEND"])
# Keys that change what attnkit computes: the tile sizes without a block mask, and PRESCALE_QK.
_HONOURED_KERNEL_OPTIONS = frozenset(["BLOCK_M", "BLOCK_N", "PRESCALE_QK"])
_BACKENDS = ("AUTO", "TRITON", "FLASH", "TRITON_DECODE")
_warned_kernel_options = set()


def _kernel_options(kernel_options):
    """kernel_options as a dict of the keys attnkit honours, after FlexAttention's checks."""
    if kernel_options is None:
        return {}
    if not isinstance(kernel_options, dict):
        raise TypeError("attnkit.flex_attention: kernel_options must be a dict (FlexKernelOptions)"
                        f", got {type(kernel_options).__name__}")
    for internal in ("OUTPUT_LOGSUMEXP", "OUTPUT_MAX"):
        if internal in kernel_options:
            raise ValueError(f"attnkit.flex_attention: kernel_options must not hold {internal} "
                             "(it is set from return_aux), as in PyTorch")
    if "BACKEND" in kernel_options:
        if kernel_options["BACKEND"] not in _BACKENDS:
            raise ValueError("attnkit.flex_attention: kernel_options BACKEND must be one of "
                             f"{_BACKENDS}, got {kernel_options['BACKEND']!r}")
        if kernel_options.get("FORCE_USE_FLEX_ATTENTION", False):
            raise ValueError("attnkit.flex_attention: kernel_options BACKEND cannot be combined "
                             "with FORCE_USE_FLEX_ATTENTION, as in PyTorch")
    honoured = {}
    for name, value in kernel_options.items():
        stem = name[4:] if isinstance(name, str) and name[:4] in ("fwd_", "bwd_") else name
        if stem in _HONOURED_KERNEL_OPTIONS and name[:4] != "bwd_":
            honoured[stem] = value
        elif stem not in _IGNORED_KERNEL_OPTIONS and stem not in _HONOURED_KERNEL_OPTIONS and \
                name not in _warned_kernel_options:
            # PyTorch takes an unknown key without a word; attnkit takes it too, and says so once.
            _warned_kernel_options.add(name)
            warnings.warn(f"attnkit.flex_attention: kernel_options {name!r} is no key of "
                          "FlexKernelOptions; it is ignored (docs/python.md lists the keys)",
                          UserWarning, stacklevel=3)
    for name in ("BLOCK_M", "BLOCK_N"):
        size = honoured.get(name)
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or
                                 size < 1 or size & (size - 1)):
            raise ValueError(f"attnkit.flex_attention: kernel_options {name} must be a power of "
                             f"2, got {size!r}")
    return honoured


def _check_sinks(sinks, query):
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"attnkit: sinks must be a torch.Tensor, got {type(sinks).__name__}")
    if tuple(sinks.shape) != (query.shape[1],) or not sinks.is_floating_point():
        raise ValueError(f"attnkit: sinks must be a floating tensor ({query.shape[1]},), one "
                         f"logit per query head, got {sinks.dtype} {tuple(sinks.shape)}")
    if sinks.device != query.device:
        raise ValueError(f"attnkit: sinks is on {sinks.device}, the query on {query.device}")


def _with_sinks(out, lse, sinks):
    """(out, lse) of attention with a sink per head: a key whose score is sinks[h] and whose
    value is zero (GPT-OSS). The sink takes exp(sink - lse_s) of each row's weight, so
    out_s = out * exp(lse - lse_s) with lse_s = logaddexp(lse, sink); gradients reach the
    kernels through out and the lse."""
    lse = lse.masked_fill(lse == math.inf, -math.inf)  # (B, H, L): -inf for no key
    lse_with_sink = torch.logaddexp(lse, sinks.to(lse.dtype).view(1, -1, 1).expand_as(lse))
    kept = torch.exp(lse - lse_with_sink).unsqueeze(-1)  # (B, H, L, 1)
    return (out.to(kept.dtype) * kept).to(out.dtype), lse_with_sink


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None,
                   enable_gqa=False, return_lse=False, kernel_options=None, *, return_aux=None,
                   sinks=None):
    """FlexAttention's ``flex_attention`` on attnkit's kernels, forward and backward.

    query (B, Hq, L, E), key (B or 1, Hkv, S, E), value (B or 1, Hkv, S, Ev) ->
    (B, Hq, L, Ev). return_aux=AuxRequest(lse=True) returns (out, AuxOutput) with the
    log-sum-exp (B, Hq, L) in float32 (-inf for a query that sees no key), differentiable,
    and with max_scores=True each query's largest score (the fused tile kernel keeps it);
    return_lse=True (deprecated where PyTorch deprecates it) returns (out, lse).
    score_mod(score, b, h, q_idx, kv_idx) is traced at each call (torch.fx) and runs in
    the kernels; block_mask is PyTorch's BlockMask (create_block_mask) or attnkit's, whose
    mask_mod is evaluated on its partial tiles only. kernel_options: docs/python.md.
    sinks (Hq,) (attnkit's, keyword only): a learnable logit per query head that takes a
    share of each row's weight and gives nothing (GPT-OSS); the lse then includes it.
    """
    if return_aux is not None:
        if not (hasattr(return_aux, "lse") and hasattr(return_aux, "max_scores")):
            raise TypeError("attnkit.flex_attention: return_aux must be an AuxRequest(lse=..., "
                            f"max_scores=...), got {type(return_aux).__name__}")
        if return_lse:
            raise ValueError("attnkit.flex_attention: give return_lse or return_aux, not both "
                             "(return_lse is deprecated: use return_aux=AuxRequest(lse=True))")
    elif return_lse and _TORCH_HAS_AUX:
        warnings.warn("attnkit.flex_attention: return_lse is deprecated, as in PyTorch; use "
                      "return_aux=AuxRequest(lse=True)", FutureWarning, stacklevel=2)
    options = _kernel_options(kernel_options)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1]) if isinstance(query, torch.Tensor) else None
    if options.get("PRESCALE_QK", False) and isinstance(query, torch.Tensor):
        # FlexAttention's numerics for it: the query is scaled (rounded in its dtype) first.
        query, scale = query * scale, 1.0
    if sinks is not None and isinstance(query, torch.Tensor):
        _check_sinks(sinks, query)
    # dropout_p a literal: a float default would be a symbolic input under torch.compile's
    # dynamic shapes, then fixed by the operator, and Dynamo would trace the frame twice.
    wants_max = return_aux is not None and bool(return_aux.max_scores)
    out, lse, max_scores = _call(query, key, value, score_mod, block_mask, scale, enable_gqa, 0.0,
                                 block_sizes=(options.get("BLOCK_M", 128),
                                              options.get("BLOCK_N", 128)),
                                 max_scores=wants_max)
    if sinks is not None:
        out, lse = _with_sinks(out, lse, sinks)
    if return_aux is not None:
        wanted = return_aux.lse
        return out, AuxOutput(
            lse=lse.masked_fill(lse == math.inf, -math.inf) if wanted else None,
            max_scores=max_scores if wants_max else None)
    if return_lse:
        return out, lse.masked_fill(lse == math.inf, -math.inf)
    return out


def attention(query, key, value, *, causal=False, query_offset=0, window=None, key_lengths=None,
              document_ids=None, softcap=None, alibi_slopes=None, bias=None, scale=None,
              dropout_p=0.0, training=True, enable_gqa=True, block_size=128, sinks=None):
    """attnkit's own masks and score functions, without making a block mask yourself.

    Masks (combined with &): causal (query i sees keys j <= query_offset + i), window (with
    causal: only the last `window` keys), key_lengths (B) integers in [0, S] (row r sees
    keys < its length), document_ids (L) or (B, L) integers (a query sees its own document
    only; self-attention). Scores: softcap (cap * tanh(s / cap)), alibi_slopes (H) (adds slope[h] *
    (kv_idx - q_idx)), bias (H, 2 D + 1) a learnable relative-position bias (adds
    bias[h, clamp(kv_idx - q_idx, -D, D) + D]), sinks (H) a learnable logit per head that
    takes a share of each row's weight and gives nothing. dropout_p applies when training.
    Without a gradient to keep, document_ids runs one PyTorch SDPA call per document where
    that was measured faster than a block mask (docs/backends.md, "Documents from Python").
    """
    L, S = query.shape[2], key.shape[2]
    if window is not None and not causal:
        raise ValueError("attnkit.attention: window needs causal=True")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool)):
        raise TypeError(f"attnkit.attention: window must be an int, got {window!r}")
    if window is not None and window < 1:
        raise ValueError(f"attnkit.attention: window must be >= 1, got {window}")
    if query_offset < 0:
        raise ValueError(f"attnkit.attention: query_offset must be >= 0, got {query_offset}")
    if query_offset > 2 ** 63 - 1 - max(L, 1):
        # Query i's key position, query_offset + i, is an int64 (past it, the sum wrapped and
        # every query saw no key).
        raise ValueError(f"attnkit.attention: query_offset must be at most 2**63 - 1 - {max(L, 1)} "
                         f"(the last query's key position must fit in int64), got {query_offset}")
    if window is not None and window >= query_offset + L:
        # As long as the last query's position or longer: every earlier key, no window (2**63
        # wrapped in int64 and gave another mask; 2**64 failed converting).
        window = None
    # The masks as they are, in Mask's value form (src/core/masks/mask_form.h): the kernels
    # read their structure, and nothing is evaluated per (query, key) pair here.
    parts, mask_tensors = [], []
    if causal:
        parts.append(f"causal({int(query_offset)}" +
                     (f", window={int(window)})" if window is not None else ")"))
    if key_lengths is not None:
        if key_lengths.shape != (query.shape[0],):
            raise ValueError(f"attnkit.attention: key_lengths must be ({query.shape[0]},), got "
                             f"{tuple(key_lengths.shape)}")
        _check_integers("key_lengths", key_lengths)
        if key_lengths.numel() > 0 and not bool(((key_lengths >= 0) & (key_lengths <= S)).all()):
            raise ValueError(f"attnkit.attention: key_lengths must be in [0, {S}] (the number "
                             f"of keys), got {key_lengths.tolist()}")
        parts.append(f"key_padding(#{len(mask_tensors)})")
        mask_tensors.append(key_lengths.to(device=query.device, dtype=torch.int64))
    if document_ids is not None:
        if L != S or document_ids.shape[-1] != L:
            raise ValueError("attnkit.attention: document_ids needs self-attention and one id per "
                             f"token: queries {L}, keys {S}, ids {tuple(document_ids.shape)}")
        if document_ids.dim() not in (1, 2) or \
                (document_ids.dim() == 2 and document_ids.shape[0] != query.shape[0]):
            raise ValueError(f"attnkit.attention: document_ids must be ({L},) or "
                             f"({query.shape[0]}, {L}), got {tuple(document_ids.shape)}")
        _check_integers("document_ids", document_ids)
        parts.append(f"documents(#{len(mask_tensors)})")
        mask_tensors.append(document_ids.to(device=query.device, dtype=torch.int64))
    if sinks is not None:
        _check_sinks(sinks, query)
        if training and dropout_p > 0.0:
            raise ValueError("attnkit.attention: sinks with dropout_p > 0 are not supported (the "
                             "sink's share is taken from the lse, which dropout does not see)")
    if document_ids is not None and key_lengths is None and window is None and \
            query_offset == 0 and softcap is None and alibi_slopes is None and bias is None and \
            sinks is None and not (training and dropout_p > 0.0):
        out = _attention_by_document(query, key, value, document_ids, causal, scale)
        if out is not None:
            return out
    if not isinstance(block_size, int) or isinstance(block_size, bool):
        raise TypeError(f"attnkit.attention: block_size must be an int, got {block_size!r}")
    if block_size < 1:
        raise ValueError(f"attnkit.attention: block_size must be >= 1, got {block_size}")
    # A block longer than the sequence holds no more tokens: at most the longer length,
    # rounded up to even (block_size=2**30 on 32 tokens grew to 24 GB).
    block_size = min(block_size, max(2, (max(L, S) + 1) // 2 * 2))
    # An empty batch or query has no row to mask.
    mask = (" & ".join(parts), mask_tensors) if query.numel() > 0 else ("", [])
    if alibi_slopes is not None and tuple(alibi_slopes.shape) != (query.shape[1],):
        raise ValueError(f"attnkit.attention: alibi_slopes must be ({query.shape[1]},), one slope "
                         f"per query head, got {tuple(alibi_slopes.shape)}")
    score_mod = _combined_score_mod(softcap, alibi_slopes, bias)
    out, lse, _ = _call(query, key, value, score_mod, None, scale, enable_gqa,
                        dropout_p if training else 0.0, block_sizes=(block_size, block_size),
                        mask=mask)
    return out if sinks is None else _with_sinks(out, lse, sinks)[0]


def _check_integers(name, tensor):
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise TypeError(f"attnkit.attention: {name} must be an integer tensor, got {tensor.dtype}")


# Where one SDPA call per document beats the block mask's route (docs/backends.md): documents
# of this many tokens on average or more, and at least this many (query, key) pairs that the
# block mask's mask_mod would evaluate per call (a call costs about 20 us, a pair 2.6 ns).
_SHORTEST_MEAN_DOCUMENT = 4
_PAIRS_PER_DOCUMENT_CALL = 1024
# ... and causal documents in a batch of rows that share one block mask at most this long.
_LONGEST_CAUSAL_DOCUMENT = 256


def _attention_by_document(query, key, value, document_ids, causal, scale):
    """Documents on PyTorch's SDPA, one call per document (what the C++ sdpa_varlen kernel
    does): exact, nothing across documents computed, and no block mask to make, whose mask_mod
    over every (query, key) pair costs about as much as the kernel (docs/backends.md). Taken
    where that was measured faster: the CPU, float32 or float64, no gradient to keep, heads
    not grouped, each document one run of tokens, documents not too many for their length,
    causal ones not long where rows share the block mask.
    None where the call is not one of those; the block mask's route runs it then."""
    F = torch.nn.functional
    wants_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (query, key, value))
    if not hasattr(F, "scaled_dot_product_attention") or wants_grad or compiling() or \
            query.device.type != "cpu" or query.dtype not in (torch.float32, torch.float64) or \
            query.shape[1] != key.shape[1] or query.numel() == 0 or key.numel() == 0 or \
            (scale is not None and _release(torch.__version__) < (2, 1)):
        return None
    # PyTorch's CPU SDPA drops a NaN query's row on short sequences (12 tokens; docs/masks.md):
    # attnkit's kernels keep it. A sum is NaN where an entry is, at one pass over each.
    if bool(torch.isnan(query.sum())) or bool(torch.isnan(key.sum())):
        return None
    _check_problem(query, key, value, True)
    ids = document_ids.to("cpu")
    mask_rows = ids.shape[0] if ids.dim() == 2 else 1  # the block mask's B
    ids = ids if ids.dim() == 2 else ids.unsqueeze(0).expand(query.shape[0], -1)  # (B, L)
    # Each row's documents as runs of equal ids: a run's end where the id changes.
    changes = ids[:, 1:] != ids[:, :-1]  # (B, L - 1)
    runs = int(changes.sum()) + ids.shape[0]
    tokens = ids.shape[1]
    if ids.shape[0] * tokens < _SHORTEST_MEAN_DOCUMENT * runs or \
            mask_rows * tokens * tokens < _PAIRS_PER_DOCUMENT_CALL * runs:
        return None  # many short documents: their calls cost more than the block mask
    if causal and ids.shape[0] * tokens > _LONGEST_CAUSAL_DOCUMENT * runs and \
            ids.shape[0] > mask_rows:
        # Long causal documents in a batch: the tiles skip each document's upper half, one
        # block mask serves every row, and SDPA's CPU kernel gains less from causality.
        return None
    row_ends = [(torch.nonzero(changes[b]).flatten() + 1).tolist() + [tokens]
                for b in range(ids.shape[0])]
    if any(len(ends) != torch.unique(row).numel() for ends, row in zip(row_ends, ids)):
        return None  # a document in more than one run: the block mask's route
    out = query.new_empty(*query.shape[:3], value.shape[-1])
    extra = {} if scale is None else {"scale": float(scale)}
    for b, ends in enumerate(row_ends):
        for start, end in zip([0] + ends[:-1], ends):
            out[b, :, start:end] = F.scaled_dot_product_attention(
                query[b:b + 1, :, start:end], key[b:b + 1, :, start:end],
                value[b:b + 1, :, start:end], is_causal=causal, **extra)[0]
    return out


def _combined_score_mod(softcap, alibi_slopes, bias):
    if softcap is None and alibi_slopes is None and bias is None:
        return None
    if softcap is not None and softcap <= 0:
        raise ValueError(f"attnkit.attention: softcap must be > 0, got {softcap}")
    reach = None
    if bias is not None:
        if bias.dim() != 2 or bias.shape[1] % 2 != 1:
            raise ValueError("attnkit.attention: bias must be (heads, 2 D + 1), got "
                             f"{tuple(bias.shape)}")
        reach = bias.shape[1] // 2
    shared = bias is not None and bias.shape[0] == 1

    def score_mod(score, b, h, q, kv):
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        if alibi_slopes is not None:
            score = score + alibi_slopes[h] * (kv - q)
        if bias is not None:
            score = score + bias[h * 0 if shared else h, torch.clamp(kv - q, -reach, reach) + reach]
        return score
    return score_mod
