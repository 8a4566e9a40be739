"""attnkit as an attention implementation of Hugging Face transformers (docs/python.md).

    import attnkit.transformers
    attnkit.transformers.register()
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="attnkit")

The model's masks (causal, padding, packed documents from position_ids, sliding windows) come
as block masks that transformers' own mask functions describe; softcaps, sinks, the scale and
the dropout come from the model's attention layers, as they pass them to any implementation.
Forward and backward run on attnkit's kernels, on the CPU too, where transformers'
flex_attention path has no backward and refuses sinks.
"""

import torch

from . import _call, _check_sinks, _with_sinks
from ._block_mask import BlockMask, create_block_mask

NAME = "attnkit"


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      softcap=None, s_aux=None, **kwargs):
    """transformers' attention interface: query (B, H, L, D), key and value (B, Hkv, S, D)
    -> ((B, L, H, D), None). attention_mask is the block mask that block_mask_for_model made,
    or None (no mask)."""
    if attention_mask is not None and not isinstance(attention_mask, BlockMask):
        raise TypeError("attnkit.transformers: attention_mask must be a BlockMask (the model's "
                        "masks are made by attnkit.transformers.block_mask_for_model once "
                        f"register() ran), got {type(attention_mask).__name__}")
    score_mod = None
    if softcap is not None:
        cap = float(softcap)

        def score_mod(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)
    dropout_p = float(dropout) if module.training else 0.0
    if s_aux is not None:
        _check_sinks(s_aux, query)
        if dropout_p > 0.0:
            raise ValueError("attnkit.transformers: sinks (s_aux) with attention dropout > 0 are "
                             "not supported; set the config's attention_dropout to 0")
    out, lse, _ = _call(query, key, value, score_mod, attention_mask, scaling, True, dropout_p)
    if s_aux is not None:
        out, _ = _with_sinks(out, lse, s_aux)
    return out.transpose(1, 2).contiguous(), None  # (B, H, L, D) -> (B, L, H, D)


def block_mask_for_model(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                         mask_function=None, attention_mask=None, device="cpu", **kwargs):
    """transformers' mask interface: the model's mask function (causal, sliding window,
    packed documents), its 2-D padding mask and offsets, as one block mask."""
    from transformers import masking_utils
    mask_function = mask_function or masking_utils.causal_mask_function
    if attention_mask is not None and not bool(attention_mask.all()):
        padding = masking_utils.prepare_padding_mask(attention_mask, kv_length, kv_offset)
        mask_function = masking_utils.and_masks(
            mask_function, masking_utils.padding_mask_function(padding))
    mask_function = masking_utils.add_offsets_to_mask_function(mask_function, q_offset,
                                                               kv_offset)

    def mask_mod(b, h, q_idx, kv_idx):
        # transformers' functions return a bool tensor, or a Python bool for "every entry".
        allowed = mask_function(b, h, q_idx, kv_idx)
        return allowed if isinstance(allowed, torch.Tensor) else torch.full_like(
            q_idx == kv_idx, bool(allowed))
    return create_block_mask(mask_mod, batch_size, None, q_length, kv_length, device=device)


def register():
    """Make attn_implementation="attnkit" available to transformers' models."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, block_mask_for_model)
