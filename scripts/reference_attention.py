"""The chapter-3 attention classes in Python: the reference attnkit is checked against.

SelfAttention_v1/v2, CausalAttention, MultiHeadAttentionWrapper and MultiHeadAttention
follow the book; MultiHeadAttention takes `causal` (default True) as attnkit's does, and
MultiHeadAttentionCombinedQKV uses seed 001's per-head [q | k | v] layout of its `qkv`
projection. Both multi-head classes carry the KV cache of the book's chapter-4 bonus
material: `forward(x, use_cache=True)` appends the keys and values of x to the module's
cache (concatenation, as the bonus code does) and attends from the cached position on;
`reset_cache()` starts over. Used by make_golden.py, check_python_interop.py and
bench_generate.py.
"""
import torch
import torch.nn as nn


class SelfAttention_v1(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.W_query = nn.Parameter(torch.rand(d_in, d_out))
        self.W_key = nn.Parameter(torch.rand(d_in, d_out))
        self.W_value = nn.Parameter(torch.rand(d_in, d_out))

    def forward(self, x):
        keys = x @ self.W_key
        queries = x @ self.W_query
        values = x @ self.W_value
        attn_scores = queries @ keys.transpose(-2, -1)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        return attn_weights @ values


class SelfAttention_v2(nn.Module):
    def __init__(self, d_in, d_out, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def forward(self, x):
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)
        attn_scores = queries @ keys.transpose(-2, -1)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        return attn_weights @ values


class CausalAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x):
        b, num_tokens, d_in = x.shape
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)
        attn_scores = queries @ keys.transpose(1, 2)
        attn_scores.masked_fill_(self.mask.bool()[:num_tokens, :num_tokens], -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        return attn_weights @ values


class MultiHeadAttentionWrapper(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.heads = nn.ModuleList(
            [CausalAttention(d_in, d_out, context_length, dropout, qkv_bias) for _ in range(num_heads)])

    def forward(self, x):
        return torch.cat([head(x) for head in self.heads], dim=-1)


def _attend(queries, keys, values, mask, causal, dropout, start=0):
    """queries (b, h, n, hd) at positions [start, start + n), keys and values (b, h, start + n, hd)
    -> (b, n, h * hd); the book's masked, scaled softmax."""
    b, h, num_tokens, hd = queries.shape
    attn_scores = queries @ keys.transpose(2, 3)
    if causal:
        num_keys = keys.shape[2]
        attn_scores.masked_fill_(mask.bool()[start:start + num_tokens, :num_keys], -torch.inf)
    attn_weights = torch.softmax(attn_scores / hd ** 0.5, dim=-1)
    attn_weights = dropout(attn_weights)
    # (b, h, n, hd) -> (b, n, h, hd) -> (b, n, h * hd)
    return (attn_weights @ values).transpose(1, 2).contiguous().view(b, num_tokens, h * hd)


class _KVCacheMixin:
    """The bonus material's cache: keys and values (b, h, positions, hd) kept in the module."""

    def reset_cache(self):
        self.cache_k, self.cache_v, self.ptr_current_pos = None, None, 0

    def _cached(self, keys, values):
        """Appends keys and values (b, h, n, hd); returns all held and the first new position."""
        start = self.ptr_current_pos
        if self.cache_k is None:
            self.cache_k, self.cache_v = keys, values
        else:
            self.cache_k = torch.cat([self.cache_k, keys], dim=2)
            self.cache_v = torch.cat([self.cache_v, values], dim=2)
        self.ptr_current_pos += keys.shape[2]
        return self.cache_k, self.cache_v, start


class MultiHeadAttention(_KVCacheMixin, nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False, causal=True):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        self.d_out, self.num_heads, self.causal = d_out, num_heads, causal
        self.head_dim = d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))
        self.reset_cache()

    def forward(self, x, use_cache=False):
        b, num_tokens, d_in = x.shape

        def split(t):  # (b, n, d_out) -> (b, n, h, hd) -> (b, h, n, hd)
            return t.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)

        keys, values, start = split(self.W_key(x)), split(self.W_value(x)), 0
        if use_cache:
            keys, values, start = self._cached(keys, values)
        context = _attend(split(self.W_query(x)), keys, values, self.mask, self.causal, self.dropout,
                          start)
        return self.out_proj(context)


class MultiHeadAttentionCombinedQKV(_KVCacheMixin, nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False, causal=True):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        self.num_heads, self.causal = num_heads, causal
        self.head_dim = d_out // num_heads
        self.qkv = nn.Linear(d_in, 3 * d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))
        self.reset_cache()

    def forward(self, x, use_cache=False):
        b, num_tokens, d_in = x.shape
        # (b, n, 3 * d_out) -> (b, n, h, 3 * hd) -> (b, h, n, 3 * hd)
        qkv = self.qkv(x).view(b, num_tokens, self.num_heads, 3 * self.head_dim).permute(0, 2, 1, 3)
        queries, keys, values = qkv.chunk(3, dim=-1)
        start = 0
        if use_cache:
            keys, values, start = self._cached(keys, values)
        return self.out_proj(_attend(queries, keys, values, self.mask, self.causal, self.dropout,
                                     start))


def build(module, config):
    """The reference module named `module` (attnkit's C++ class name) for a config dict."""
    c = config
    if module == "SelfAttentionV1":
        return SelfAttention_v1(c["d_in"], c["d_out"])
    if module == "SelfAttentionV2":
        return SelfAttention_v2(c["d_in"], c["d_out"], c["qkv_bias"])
    if module == "CausalAttention":
        return CausalAttention(c["d_in"], c["d_out"], c["context_length"], c["dropout"], c["qkv_bias"])
    if module == "MultiHeadAttentionWrapper":
        return MultiHeadAttentionWrapper(c["d_in"], c["d_out"], c["context_length"], c["dropout"],
                                         c["num_heads"], c["qkv_bias"])
    if module == "MultiHeadAttention":
        return MultiHeadAttention(c["d_in"], c["d_out"], c["context_length"], c["dropout"],
                                  c["num_heads"], c["qkv_bias"], c["causal"])
    if module == "MultiHeadAttentionCombinedQKV":
        return MultiHeadAttentionCombinedQKV(c["d_in"], c["d_out"], c["context_length"], c["dropout"],
                                             c["num_heads"], c["qkv_bias"], c["causal"])
    raise ValueError(f"unknown module {module!r}")
