"""The chapter-3 attention classes in Python: the reference attnkit is checked against.

SelfAttention_v1/v2, CausalAttention, MultiHeadAttentionWrapper and MultiHeadAttention
follow the book; MultiHeadAttention takes `causal` (default True) as attnkit's does, and
MultiHeadAttentionCombinedQKV uses seed 001's per-head [q | k | v] layout of its `qkv`
projection. Both multi-head classes carry the KV cache of the book's chapter-4 bonus
material: `forward(x, use_cache=True)` appends the keys and values of x to the module's
cache (concatenation, as the bonus code does) and attends from the cached position on;
`reset_cache()` starts over. Both take `sliding_window_size` (query p sees keys j with
0 <= p - j < W). The bonus material's GroupedQueryAttention (multi-query with one group) and
MultiHeadLatentAttention follow, with the same cache interface. The two multi-head classes
and GroupedQueryAttention also take today's models' `rope` (a dict: context_length, theta_base,
layout "split_half" or "interleaved", freq_config) and `qk_norm` (RMSNorm over head_dim of
queries and keys, `q_norm.weight` / `k_norm.weight`, before RoPE); new keys are rotated at
their positions before they enter the cache. Used by make_golden.py, check_python_interop.py,
llama_reference.py and bench_generate.py.
"""
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rope_reference import angles  # noqa: E402


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


def _attend(queries, keys, values, mask, causal, dropout, start=0, window=None):
    """queries (b, h, n, hd) at positions [start, start + n), keys and values (b, h, start + n, hd)
    -> (b, n, h * hd); the book's masked, scaled softmax. With a window W, query position p also
    skips keys j with p - j >= W (sliding-window attention)."""
    b, h, num_tokens, hd = queries.shape
    attn_scores = queries @ keys.transpose(2, 3)
    if causal:
        num_keys = keys.shape[2]
        blocked = mask.bool()[start:start + num_tokens, :num_keys]
        if window is not None:
            positions = torch.arange(start, start + num_tokens).unsqueeze(1)
            blocked = blocked | (positions - torch.arange(num_keys).unsqueeze(0) >= window)
        attn_scores.masked_fill_(blocked, -torch.inf)
    attn_weights = torch.softmax(attn_scores / hd ** 0.5, dim=-1)
    attn_weights = dropout(attn_weights)
    # (b, h, n, hd) -> (b, n, h, hd) -> (b, n, h * hd)
    return (attn_weights @ values).transpose(1, 2).contiguous().view(b, num_tokens, h * hd)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension (torch.nn.RMSNorm, which
    PyTorch 1.13 lacks)."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Rope:
    """Rotary position embedding of heads (b, h, n, hd) from float64 tables (rope_reference.py's
    angles) cast to the heads' dtype. Split-half pairs feature i with i + hd/2, interleaved
    2i with 2i + 1."""

    def __init__(self, config, head_dim):
        table = angles(config.get("freq_config"), torch.arange(config["context_length"]),
                       head_dim, config.get("theta_base", 10000.0))  # (context, hd/2)
        self.cos, self.sin = torch.cos(table), torch.sin(table)
        self.split_half = config.get("layout", "split_half") == "split_half"

    def __call__(self, x, start):
        """x's token i at position start + i."""
        n, half = x.shape[2], x.shape[3] // 2
        assert start + n <= self.cos.shape[0], "positions pass the RoPE tables"
        c, s = (t[start:start + n].to(x.dtype) for t in (self.cos, self.sin))  # (n, hd/2)
        if self.split_half:
            first, second = x[..., :half], x[..., half:]
        else:
            first, second = x[..., 0::2], x[..., 1::2]
        turned = (first * c - second * s, second * c + first * s)
        if self.split_half:
            return torch.cat(turned, dim=-1)
        return torch.stack(turned, dim=-1).flatten(-2)  # (..., hd/2, 2) -> (..., hd)


class _QueryKeyMixin:
    """The rope and qk_norm options: queries and keys normed, then rotated."""

    def _init_query_key(self, rope, qk_norm, head_dim):
        self.rope = Rope(rope, head_dim) if rope else None
        if qk_norm:
            self.q_norm, self.k_norm = RMSNorm(head_dim), RMSNorm(head_dim)
        self.qk_norm = qk_norm

    def _query_key(self, queries, keys, start):
        if self.qk_norm:
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        if self.rope is not None:
            queries, keys = self.rope(queries, start), self.rope(keys, start)
        return queries, keys


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


class MultiHeadAttention(_QueryKeyMixin, _KVCacheMixin, nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False, causal=True,
                 sliding_window_size=None, rope=None, qk_norm=False):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        self.d_out, self.num_heads, self.causal = d_out, num_heads, causal
        self.window = sliding_window_size
        self.head_dim = d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))
        self._init_query_key(rope, qk_norm, self.head_dim)
        self.reset_cache()

    def forward(self, x, use_cache=False):
        b, num_tokens, d_in = x.shape

        def split(t):  # (b, n, d_out) -> (b, n, h, hd) -> (b, h, n, hd)
            return t.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)

        start = self.ptr_current_pos if use_cache else 0
        queries, keys = self._query_key(split(self.W_query(x)), split(self.W_key(x)), start)
        values = split(self.W_value(x))
        if use_cache:
            keys, values, start = self._cached(keys, values)
        context = _attend(queries, keys, values, self.mask, self.causal, self.dropout, start,
                          self.window)
        return self.out_proj(context)


class MultiHeadAttentionCombinedQKV(_QueryKeyMixin, _KVCacheMixin, nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False, causal=True,
                 sliding_window_size=None, rope=None, qk_norm=False):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        self.num_heads, self.causal = num_heads, causal
        self.window = sliding_window_size
        self.head_dim = d_out // num_heads
        self.qkv = nn.Linear(d_in, 3 * d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))
        self._init_query_key(rope, qk_norm, self.head_dim)
        self.reset_cache()

    def forward(self, x, use_cache=False):
        b, num_tokens, d_in = x.shape
        # (b, n, 3 * d_out) -> (b, n, h, 3 * hd) -> (b, h, n, 3 * hd)
        qkv = self.qkv(x).view(b, num_tokens, self.num_heads, 3 * self.head_dim).permute(0, 2, 1, 3)
        queries, keys, values = qkv.chunk(3, dim=-1)
        start = self.ptr_current_pos if use_cache else 0
        queries, keys = self._query_key(queries, keys, start)
        if use_cache:
            keys, values, start = self._cached(keys, values)
        return self.out_proj(_attend(queries, keys, values, self.mask, self.causal, self.dropout,
                                     start, self.window))


class GroupedQueryAttention(_QueryKeyMixin, _KVCacheMixin, nn.Module):
    """The bonus material's GQA: num_kv_groups key/value heads shared by num_heads query heads
    (query head h reads group h // (num_heads // num_kv_groups)); always causal. The cache holds
    the num_kv_groups heads."""

    def __init__(self, d_in, d_out, dropout, num_heads, num_kv_groups, qkv_bias=False,
                 sliding_window_size=None, rope=None, qk_norm=False):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        assert num_heads % num_kv_groups == 0, "num_heads must be divisible by num_kv_groups"
        self.num_heads, self.num_kv_groups = num_heads, num_kv_groups
        self.head_dim = d_out // num_heads
        self.group_size = num_heads // num_kv_groups
        self.window = sliding_window_size
        self.W_key = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=qkv_bias)
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out, bias=False)
        self.dropout = nn.Dropout(dropout)
        self._init_query_key(rope, qk_norm, self.head_dim)
        self.reset_cache()

    def forward(self, x, use_cache=False):
        b, num_tokens, d_in = x.shape

        def split(t, heads):  # (b, n, heads * hd) -> (b, n, heads, hd) -> (b, heads, n, hd)
            return t.view(b, num_tokens, heads, self.head_dim).transpose(1, 2)

        start = self.ptr_current_pos if use_cache else 0
        queries, keys = self._query_key(split(self.W_query(x), self.num_heads),
                                        split(self.W_key(x), self.num_kv_groups), start)
        values = split(self.W_value(x), self.num_kv_groups)
        if use_cache:
            keys, values, start = self._cached(keys, values)
        # (b, g, m, hd) -> (b, h, m, hd): each group once per query head that reads it
        keys = keys.repeat_interleave(self.group_size, dim=1)
        values = values.repeat_interleave(self.group_size, dim=1)
        num_keys = keys.shape[2]
        mask = torch.triu(torch.ones(num_keys, num_keys), diagonal=1)
        context = _attend(queries, keys, values, mask, True, self.dropout, start, self.window)
        return self.out_proj(context)


class MultiHeadLatentAttention(nn.Module):
    """The bonus material's MLA: keys and values up-projected from a shared latent of latent_dim
    per token (W_DKV down, W_UK / W_UV up); the cache holds the latent only. Always causal."""

    def __init__(self, d_in, d_out, dropout, num_heads, qkv_bias=False, latent_dim=None):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        self.num_heads, self.head_dim = num_heads, d_out // num_heads
        self.latent_dim = latent_dim if latent_dim is not None else max(16, d_out // 8)
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_DKV = nn.Linear(d_in, self.latent_dim, bias=qkv_bias)
        self.W_UK = nn.Linear(self.latent_dim, d_out, bias=qkv_bias)
        self.W_UV = nn.Linear(self.latent_dim, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.reset_cache()

    def reset_cache(self):
        self.cache_latent, self.ptr_current_pos = None, 0

    def forward(self, x, use_cache=False):
        b, num_tokens, d_in = x.shape
        latents, start = self.W_DKV(x), 0  # (b, n, latent_dim)
        if use_cache:
            start = self.ptr_current_pos
            if self.cache_latent is not None:
                latents = torch.cat([self.cache_latent, latents], dim=1)
            self.cache_latent = latents
            self.ptr_current_pos += num_tokens

        def split(t):  # (b, m, d_out) -> (b, m, h, hd) -> (b, h, m, hd)
            return t.view(b, t.shape[1], self.num_heads, self.head_dim).transpose(1, 2)

        num_keys = latents.shape[1]
        mask = torch.triu(torch.ones(num_keys, num_keys), diagonal=1)
        context = _attend(split(self.W_query(x)), split(self.W_UK(latents)),
                          split(self.W_UV(latents)), mask, True, self.dropout, start)
        return self.out_proj(context)


def build(module, config):
    """The reference module named `module` (attnkit's C++ class name) for a config dict."""
    c = config
    window = c.get("sliding_window_size") or None  # absent, None or 0 (C++ tests): no window
    query_key = dict(rope=c.get("rope"), qk_norm=c.get("qk_norm", False))  # absent: neither
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
                                  c["num_heads"], c["qkv_bias"], c["causal"],
                                  window, **query_key)
    if module == "MultiHeadAttentionCombinedQKV":
        return MultiHeadAttentionCombinedQKV(c["d_in"], c["d_out"], c["context_length"], c["dropout"],
                                             c["num_heads"], c["qkv_bias"], c["causal"],
                                             window, **query_key)
    if module == "GroupedQueryAttention":
        return GroupedQueryAttention(c["d_in"], c["d_out"], c["dropout"], c["num_heads"],
                                     c["num_kv_groups"], c["qkv_bias"], window, **query_key)
    if module == "MultiHeadLatentAttention":
        return MultiHeadLatentAttention(c["d_in"], c["d_out"], c["dropout"], c["num_heads"],
                                        c["qkv_bias"], c.get("latent_dim") or None)
    raise ValueError(f"unknown module {module!r}")
