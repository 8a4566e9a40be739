"""The Python package attnkit and its operators against PyTorch (run by CTest with each leg's
Python: 1.13, 2.6, pip's newest; PYTHONPATH holds the build's python/ folder, or on the pip
leg the package is installed by pip install .).

- FlexAttention's own cases (score functions, masks, GQA, B or H of 1, float32 and bfloat16)
  against float64 eager flex_attention where PyTorch has it (2.5 on), else a dense float64
  reference, with FlexAttention's rule: attnkit's error at most 10x eager's in float32 and
  1.1x in 16-bit, outputs and the gradients of q, k, v and captured buffers.
- gradcheck in float64 per mask and score family; torch.library.opcheck where it exists (2.4 on).
- Bad input: each refused with an error that names the argument.
"""

import math
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import types
import unittest

import torch

import attnkit

TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
try:
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention
except ImportError:  # PyTorch 1.13
    torch_flex_attention = torch_create_block_mask = None

HAS_FLEX = torch_flex_attention is not None and TORCH >= (2, 5)


# FlexAttention's score functions (test_flex_attention.py's list), written once for both
# PyTorch's vmapped scalars and attnkit's broadcast index tensors.
def identity(score, b, h, q, kv):
    return score


def times_two(score, b, h, q, kv):
    return score * 2


def squared(score, b, h, q, kv):
    return score * score


def causal_score(score, b, h, q, kv):
    return torch.where(q >= kv, score, -float("inf"))


def rel_bias(score, b, h, q, kv):
    return score + (q - kv)


def rel_causal(score, b, h, q, kv):
    return torch.where(q >= kv, score + (q - kv), -float("inf"))


def alibi(score, b, h, q, kv):
    return score + (kv - q) * torch.exp2(-((h + 1) * 8.0 / 4))


def trig(score, b, h, q, kv):
    return torch.sin(torch.cos(score)) + torch.tan(b)


HEAD_OFFSET = torch.randn(4, dtype=torch.float64)


def head_offset(score, b, h, q, kv):
    return score + HEAD_OFFSET[h]


ENTRY_BIAS = torch.randn(4, 256, 256, generator=torch.Generator().manual_seed(3),
                         dtype=torch.float64) * 0.5


def entry_bias(score, b, h, q, kv):
    """A learnable (H, L, L) bias, each score reading its own entry: in a batch of one, the
    fused tile kernel writes its gradient in place."""
    return score + ENTRY_BIAS[h, q, kv]


# Score functions that read a captured tensor whose gradient is checked: the tensor, and the
# function over a copy of it.
CAPTURED = {head_offset: (HEAD_OFFSET, lambda t: lambda score, b, h, q, kv: score + t[h]),
            entry_bias: (ENTRY_BIAS, lambda t: lambda score, b, h, q, kv: score + t[h, q, kv])}


SCORE_MODS = [identity, times_two, squared, causal_score, rel_bias, rel_causal, alibi, trig,
              head_offset]


def causal(b, h, q, kv):
    return q >= kv


def sliding_window(b, h, q, kv):
    return (q >= kv) & (q - kv < 48)


def prefix_lm(b, h, q, kv):
    return (kv <= q) | (kv < 40)


DOCUMENT_IDS = torch.repeat_interleave(torch.arange(4), torch.tensor([37, 60, 90, 69]))


def documents(b, h, q, kv):
    return DOCUMENT_IDS[q] == DOCUMENT_IDS[kv]


MASK_MODS = [causal, sliding_window, prefix_lm, documents]


def dense_reference(q, k, v, score_mod=None, mask_mod=None, scale=None):
    """Attention with every score materialised: (out, lse), -inf lse and zeros for a query
    that sees no key."""
    B, H, L, E = q.shape
    groups = H // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(E))
    b = torch.arange(B).view(-1, 1, 1, 1)
    h = torch.arange(H).view(1, -1, 1, 1)
    qi = torch.arange(L).view(1, 1, -1, 1)
    ki = torch.arange(k.shape[2]).view(1, 1, 1, -1)
    if score_mod is not None:
        scores = score_mod(scores, b, h, qi, ki).to(q.dtype)
    if mask_mod is not None:
        scores = scores.masked_fill(~mask_mod(b, h, qi, ki), -math.inf)
    lse = scores.logsumexp(-1)
    weights = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return weights @ v, lse


def reference(q, k, v, score_mod, mask_mod, gqa):
    """(out, lse) with gradients: the dense reference, which is FlexAttention's math (PyTorch
    2.15's eager flex_attention refuses a backward on the CPU)."""
    return dense_reference(q, k, v, score_mod, mask_mod)


def flex_forward(q, k, v, score_mod, mask_mod, gqa):
    """(out, lse) as FlexAttention gives them: eager flex_attention where PyTorch has it
    (forward only), else the dense reference."""
    if not HAS_FLEX:
        return dense_reference(q, k, v, score_mod, mask_mod)
    bm = None if mask_mod is None else torch_create_block_mask(
        mask_mod, None, None, q.shape[2], k.shape[2], device="cpu")
    q, k, v = q.detach(), k.detach(), v.detach()
    with torch.no_grad():
        return torch_flex_attention(q, k, v, score_mod=score_mod, block_mask=bm,
                                    enable_gqa=gqa, return_lse=True)


def make_block_mask(mask_mod, L, S):
    if mask_mod is None:
        return None
    if HAS_FLEX:
        return torch_create_block_mask(mask_mod, None, None, L, S, device="cpu")
    return attnkit.create_block_mask(mask_mod, None, None, L, S)


def max_error(a, b):
    return (a.double() - b.double()).abs().max().item()


class FlexCases(unittest.TestCase):
    B, H, L, E = 2, 4, 256, 16

    def inputs(self, dtype, kv_heads=None, B=None, H=None):
        g = torch.Generator().manual_seed(0)
        B, H = B or self.B, H or self.H
        shape_q = (B, H, self.L, self.E)
        shape_kv = (B, kv_heads or H, self.L, self.E)
        return [torch.randn(s, generator=g, dtype=torch.float64) for s in
                (shape_q, shape_kv, shape_kv)]

    def check_case(self, score_mod, mask_mod, dtype, kv_heads=None, B=None, H=None):
        gqa = kv_heads is not None
        q64, k64, v64 = [t.requires_grad_() for t in self.inputs(dtype, kv_heads, B, H)]

        def with_buffer(buffer):
            # head_offset and entry_bias read a captured buffer: each run gets its own, in its
            # dtype.
            if score_mod not in CAPTURED:
                return score_mod, []
            return CAPTURED[score_mod][1](buffer), [buffer]

        def low(tensors):
            return [t.detach().to(dtype).requires_grad_() for t in tensors]

        buffer64 = (CAPTURED[score_mod][0] if score_mod in CAPTURED
                    else HEAD_OFFSET).clone().requires_grad_()
        mod64, extra64 = with_buffer(buffer64)
        ref_out, ref_lse = flex_forward(q64, k64, v64, mod64, mask_mod, gqa)
        dense_out, _ = reference(q64, k64, v64, mod64, mask_mod, gqa)
        self.assertLess(max_error(dense_out, ref_out), 1e-12, "the dense reference is not flex's")
        grad = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(1),
                           dtype=torch.float64)
        ref_grads = torch.autograd.grad(dense_out, [q64, k64, v64, *extra64], grad)
        # Eager's error in the low dtype: PyTorch's flex_attention for the forward, the dense
        # reference for the gradients.
        q, k, v, *extra = low([q64, k64, v64, *extra64])
        eager_mod, _ = with_buffer(extra[0] if extra else None)
        eager_out, eager_lse = flex_forward(q, k, v, eager_mod, mask_mod, gqa)
        dense_low, _ = reference(q, k, v, eager_mod, mask_mod, gqa)
        eager_grads = torch.autograd.grad(dense_low, [q, k, v, *extra], grad.to(dtype))
        q, k, v, *extra = low([q64, k64, v64, *extra64])
        mine_mod, _ = with_buffer(extra[0] if extra else None)
        bm = make_block_mask(mask_mod, self.L, self.L)
        out, aux = attnkit.flex_attention(q, k, v, score_mod=mine_mod, block_mask=bm,
                                          enable_gqa=gqa, return_aux=attnkit.AuxRequest(lse=True))
        lse = aux.lse
        grads = torch.autograd.grad(out, [q, k, v, *extra], grad.to(dtype))
        fudge = 10.0 if dtype == torch.float32 else 1.1
        names = ["out", "dq", "dk", "dv", "d_buffer"]
        for name, mine, eager, ref in zip(names, [out, *grads], [eager_out, *eager_grads],
                                          [ref_out, *ref_grads]):
            mine_error, eager_error = max_error(mine, ref), max_error(eager, ref)
            self.assertLessEqual(mine_error, max(fudge * eager_error, 1e-6),
                                 f"{name}: attnkit's error {mine_error:.3g}, eager's "
                                 f"{eager_error:.3g}")
        finite = torch.isfinite(ref_lse)
        self.assertTrue(torch.equal(finite, torch.isfinite(lse)), "lse: -inf rows differ")
        mine_error = max_error(lse[finite], ref_lse[finite])
        eager_error = max_error(eager_lse[finite], ref_lse[finite])
        self.assertLessEqual(mine_error, max(fudge * eager_error, 1e-5),
                             f"lse: attnkit's error {mine_error:.3g}, eager's {eager_error:.3g}")

    def test_score_mods(self):
        for dtype in (torch.float32, torch.bfloat16):
            for score_mod in SCORE_MODS:
                with self.subTest(score_mod=score_mod.__name__, dtype=dtype):
                    self.check_case(score_mod, None, dtype)

    def test_masks(self):
        for dtype in (torch.float32, torch.bfloat16):
            for mask_mod in MASK_MODS:
                with self.subTest(mask_mod=mask_mod.__name__, dtype=dtype):
                    self.check_case(rel_bias, mask_mod, dtype)

    def test_a_score_mod_that_takes_its_indices_as_star_args(self):
        # flex_attention calls score_mod(score, b, h, q_idx, kv_idx); `lambda s, *rest:` was
        # refused ("got 2 argument(s)").
        def distance(score, *indices):
            b, h, q_idx, kv_idx = indices
            return score + (q_idx - kv_idx) * 0.125
        self.check_case(distance, causal, torch.float32)
        self.check_case(lambda s, *rest: s * 1.0, documents, torch.float32)

    def test_gqa_and_broadcast(self):
        with self.subTest("gqa"):
            self.check_case(head_offset, causal, torch.float32, kv_heads=2)
        with self.subTest("B=1"):
            self.check_case(times_two, documents, torch.float32, B=1)
        with self.subTest("H=1"):
            self.check_case(alibi, sliding_window, torch.float32, H=1)
        # A bias at each score's own entry: in place in a batch of one, summed over a batch.
        for dtype in (torch.float32, torch.bfloat16):
            for B in (1, 2):
                with self.subTest("entry bias", dtype=dtype, B=B):
                    self.check_case(entry_bias, causal, dtype, B=B)


class CausalLists(unittest.TestCase):
    """Block lists that say causal run on a kernel that takes causal masks whole (LibTorch's
    CPU flash kernel, 2.5 on); lists one bit or one tile away from causal must not."""

    def check(self, mask_mod, L, S, BLOCK_SIZE=128):
        g = torch.Generator().manual_seed(7)
        q = torch.randn(1, 2, L, 16, generator=g, dtype=torch.float64, requires_grad=True)
        k, v = [torch.randn(1, 2, S, 16, generator=g, dtype=torch.float64, requires_grad=True)
                for _ in range(2)]
        makers = [attnkit.create_block_mask] + ([torch_create_block_mask] if HAS_FLEX else [])
        for make in makers:
            if make is torch_create_block_mask and not isinstance(BLOCK_SIZE, int):
                continue
            with self.subTest(maker=make.__module__):
                bm = make(mask_mod, None, None, L, S, device="cpu", BLOCK_SIZE=BLOCK_SIZE)
                out, lse = attnkit.flex_attention(q, k, v, block_mask=bm, return_lse=True)
                ref, ref_lse = dense_reference(q, k, v, mask_mod=mask_mod)
                self.assertLess(max_error(out, ref), 1e-12)
                self.assertLess(max_error(lse, ref_lse), 1e-12)
                grads = torch.autograd.grad(out.square().sum(), (q, k, v))
                ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
                for mine, theirs in zip(grads, ref_grads):
                    self.assertLess(max_error(mine, theirs), 1e-10)

    def test_causal_in_any_shape(self):
        for L, S in ((256, 256), (100, 256), (256, 100), (200, 200)):
            with self.subTest(L=L, S=S):
                self.check(causal, L, S)
        self.check(causal, 256, 256, BLOCK_SIZE=(64, 128))

    def test_one_bit_off_causal_is_not_causal(self):
        def bit_off(b, h, q, kv):  # causal's lists, one bit of the diagonal tile (1, 1) off
            return (kv <= q) & ~((q == 200) & (kv == 150))

        def tile_off(b, h, q, kv):  # tile (1, 0) partial, where causal's is full
            return (kv <= q) & ~((q == 200) & (kv == 50))

        def above(b, h, q, kv):  # one key past the diagonal in a partial tile
            return (kv <= q) | ((q == 10) & (kv == 11))
        for mask_mod in (bit_off, tile_off, above):
            with self.subTest(mask_mod=mask_mod.__name__):
                self.check(mask_mod, 256, 256)


class Gradcheck(unittest.TestCase):
    def test_families(self):
        g = torch.Generator().manual_seed(2)
        bias = torch.randn(2, 9, generator=g, dtype=torch.float64, requires_grad=True)
        slopes = torch.rand(2, generator=g, dtype=torch.float64)

        def learnable(score, b, h, q, kv):
            return score + bias[h, torch.clamp(kv - q, -4, 4) + 4]

        def softcap(score, b, h, q, kv):
            return 5.0 * torch.tanh(score / 5.0)

        def alibi_slopes(score, b, h, q, kv):
            return score + slopes[h] * (kv - q)

        ids = torch.tensor([0] * 5 + [1] * 9 + [2] * 6)

        def short_documents(b, h, q, kv):
            return ids[q] == ids[kv]

        cases = [(None, None), (softcap, causal), (alibi_slopes, sliding_window),
                 (learnable, short_documents), (learnable, prefix_lm)]
        for score_mod, mask_mod in cases:
            L = 20
            shape = (1, 2, L, 4)
            q, k, v = [torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
                       for _ in range(3)]
            bm = None if mask_mod is None else attnkit.create_block_mask(
                mask_mod, None, None, L, L, BLOCK_SIZE=8)

            def run(q, k, v, bias):
                return attnkit.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
            name = f"{getattr(score_mod, '__name__', None)} {getattr(mask_mod, '__name__', None)}"
            with self.subTest(name):
                self.assertTrue(torch.autograd.gradcheck(run, (q, k, v, bias), eps=1e-6,
                                                         atol=1e-6, fast_mode=True))


@unittest.skipUnless(hasattr(torch, "library") and hasattr(torch.library, "opcheck"),
                     "torch.library.opcheck: PyTorch 2.4 on")
class Opcheck(unittest.TestCase):
    def test_flex_attention(self):
        g = torch.Generator().manual_seed(3)
        q = torch.randn(2, 4, 40, 8, generator=g, requires_grad=True)
        k = torch.randn(2, 2, 40, 8, generator=g, requires_grad=True)
        v = torch.randn(2, 2, 40, 8, generator=g, requires_grad=True)
        buffer = torch.randn(4, generator=g, requires_grad=True)
        bm = attnkit.create_block_mask(causal, None, None, 40, 40, BLOCK_SIZE=16)
        q_block, kv_block, lists = attnkit._block_mask.partial_tiles(bm, q, k)
        graph, _ = attnkit._score_graph.trace(head_offset)
        for args in [
            (q, k, v, None, None, None, None, None, "", [], 128, 128, "", [], 0.35, 0.0, -1),
            (q, k, v, *lists, "", [], q_block, kv_block, graph, [buffer], 0.35, 0.0, -1),
            # a mask in its value form, with its tensors (attnkit.attention's)
            (q, k, v, None, None, None, None, None, "causal(3, window=9) & key_padding(#0)",
             [torch.tensor([40, 17])], 16, 16, graph, [buffer], 0.35, 0.0, -1),
            # with each row's largest score (max_scores), which takes no gradient
            (q, k, v, *lists, "", [], q_block, kv_block, graph, [buffer], 0.35, 0.0, -1, True),
        ]:
            torch.library.opcheck(torch.ops.attnkit.flex_attention.default, args)


@unittest.skipUnless(TORCH >= (2, 4), "torch.compile of custom operators: PyTorch 2.4 on")
class Compile(unittest.TestCase):
    def test_fullgraph_training_matches_eager(self):
        """A small model calling attnkit.flex_attention (block mask, score_mod with a learnable
        captured tensor) compiled with fullgraph=True: the same losses as eager, step by step.
        Dynamo and AOTAutograd (backend aot_eager: the operators' fake and autograd kernels),
        and on pip's newest PyTorch Inductor's code generation around them too."""
        backends = ["aot_eager"]
        if TORCH >= (2, 10):
            # Inductor builds C++ kernels: pip's PyTorch brings what it needs (the Debian 13
            # root's 2.6 has no compiler for it).
            sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                            "scripts"))
            from inductor_link import link_inductor_against_this_torch
            link_inductor_against_this_torch()
            backends.append("inductor")
        for backend in backends:
            with self.subTest(backend=backend):
                self.check_training(backend)

    def check_training(self, backend):
        n, dim, heads = 64, 32, 4
        bm = attnkit.create_block_mask(causal, None, None, n, n, BLOCK_SIZE=16)

        # One learnable tensor that the score function captures, reset in place for each
        # mode: under torch.compile a score_mod is traced by attnkit before the compiled
        # region (here by the eager run), not inside it (docs/python.md).
        bias = torch.nn.Parameter(torch.zeros(heads))

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + bias[h] * (q_idx - kv_idx)

        def make():
            torch.manual_seed(5)
            with torch.no_grad():
                bias.zero_()
            return torch.nn.ModuleDict({"qkv": torch.nn.Linear(dim, 3 * dim),
                                        "out": torch.nn.Linear(dim, dim)})

        def loss_of(model, x):
            q, k, v = model["qkv"](x).view(1, n, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)
            y = attnkit.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
            return model["out"](y.transpose(1, 2).reshape(1, n, dim)).square().mean()

        x = torch.randn(1, n, dim, generator=torch.Generator().manual_seed(6))
        losses = {}
        for mode in ("eager", "compiled"):
            model = make()
            step_loss = loss_of if mode == "eager" else torch.compile(loss_of, fullgraph=True,
                                                                      backend=backend)
            optimizer = torch.optim.SGD([*model.parameters(), bias], lr=0.5)
            losses[mode] = []
            for _ in range(3):
                loss = step_loss(model, x)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses[mode].append(loss.item())
        for eager, compiled in zip(losses["eager"], losses["compiled"]):
            self.assertAlmostEqual(eager, compiled, delta=1e-5 * abs(eager) + 1e-7,
                                   msg=f"{losses}")
        self.assertNotEqual(losses["eager"][0], losses["eager"][-1])


    @unittest.skipUnless(TORCH >= (2, 5), "torch.compile with block masks (2.5 on)")
    def test_a_block_mask_made_inside_the_compiled_function(self):
        """A new mask per length, made inside the compiled function (attnkit's or PyTorch's
        create_block_mask), with fullgraph=True: right on the first call of each length, the
        backward too, and no more graphs than PyTorch's flex_attention compiles for the same
        function (Dynamo's frame count; scripts/count_recompiles.py does it with Inductor)."""
        from torch._dynamo.testing import CompileCounterWithBackend

        def window(b, h, q, kv):  # partial tiles whose bits the kernels read
            return (q >= kv) & (q - kv < 24)

        def graphs_of(flex, maker, dynamic, backward):
            def windowed_flex(q):
                n = q.shape[2]
                bm = maker(window, None, None, n, n, device="cpu", BLOCK_SIZE=16)
                return flex(q, q, q, block_mask=bm)
            torch._dynamo.reset()
            counter = CompileCounterWithBackend("aot_eager")
            compiled = torch.compile(windowed_flex, backend=counter, dynamic=dynamic,
                                     fullgraph=True)
            for n in (40, 64, 72, 100, 128):
                with self.subTest(flex=flex.__module__, maker=maker.__module__,
                                  dynamic=dynamic, n=n):
                    q = torch.randn(1, 2, n, 16, requires_grad=backward)
                    out = compiled(q)
                    q_ref = q.detach().clone().requires_grad_(backward)
                    ref = dense_reference(q_ref, q_ref, q_ref, None, window)[0]
                    self.assertLess(max_error(out, ref), 1e-5)
                    if backward:
                        (grad,) = torch.autograd.grad(out.sum(), q)
                        (ref_grad,) = torch.autograd.grad(ref.sum(), q_ref)
                        self.assertLess(max_error(grad, ref_grad), 1e-4)
            return counter.frame_count

        makers = [attnkit.create_block_mask] + ([torch_create_block_mask] if HAS_FLEX else [])
        for dynamic in (None, True):
            # PyTorch's own count where it has flex_attention (forward: no CPU backward)
            theirs = graphs_of(torch_flex_attention, torch_create_block_mask, dynamic,
                               False) if HAS_FLEX else None
            for maker in makers:
                ours = graphs_of(attnkit.flex_attention, maker, dynamic, True)
                if theirs is not None:
                    self.assertLessEqual(ours, theirs,
                                         msg=f"dynamic={dynamic}, {maker.__module__}")


class BadInput(unittest.TestCase):
    def setUp(self):
        self.q = torch.randn(1, 2, 32, 8)
        self.k = torch.randn(1, 2, 32, 8)
        self.v = torch.randn(1, 2, 32, 8)

    def refused(self, error, words, **kwargs):
        args = {"query": self.q, "key": self.k, "value": self.v}
        args.update(kwargs)
        with self.assertRaises(error) as caught:
            attnkit.flex_attention(**args)
        for word in words:
            self.assertIn(word, str(caught.exception))

    def test_each(self):
        self.refused(ValueError, ["block_mask", "made for", "length 32"],
                     block_mask=attnkit.create_block_mask(causal, None, None, 64, 64))
        other = attnkit.create_block_mask(causal, None, None, 32, 32, device="meta") \
            if TORCH >= (2, 0) else None
        if other is not None:
            self.refused(ValueError, ["block_mask", "meta"], block_mask=other)

        def wrong_shape(score, b, h, q, kv):
            return score[0]
        self.refused(RuntimeError, ["score_mod", "shape"], score_mod=wrong_shape)

        def control_flow(score, b, h, q, kv):
            return score if (q > 3).any() else -score
        self.refused(attnkit.ScoreModError, ["score_mod", "traced"], score_mod=control_flow)

        self.refused(attnkit.ScoreModError, ["score_mod", "five positional", "argument"],
                     score_mod=lambda score, b: score)

        def unknown_operation(score, b, h, q, kv):
            return score.cumsum(-1)
        self.refused(attnkit.ScoreModError, ["score_mod", "cumsum"], score_mod=unknown_operation)
        self.refused(ValueError, ["query", "contiguous"], query=self.q.transpose(-1, -2))
        self.refused(ValueError, ["key", "4-D"], key=self.k.unsqueeze(0))
        self.refused(ValueError, ["enable_gqa"], key=self.k[:, :1], value=self.v[:, :1])
        if not attnkit._cpu_multiplies_float16():
            self.refused(TypeError, ["float16"], query=self.q.half(), key=self.k.half(),
                         value=self.v.half())

    def test_a_captured_tensor_off_the_querys_device_or_complex(self):
        # A meta tensor gave garbage (the fake kernel's uninitialised outputs).
        table = torch.empty(2, device="meta")

        def on_meta(score, b, h, q, kv):
            return score + table[h]
        self.refused(RuntimeError, ["score_tensors[0]", "captured tensor 0", "Float [2]",
                                    "is on meta, the query on cpu"], score_mod=on_meta)
        waves = torch.ones(2, dtype=torch.complex64)

        def complex_table(score, b, h, q, kv):
            return score + waves[h]
        self.refused(RuntimeError, ["score_tensors[0]", "ComplexFloat",
                                    "expected a real, integer or bool tensor"],
                     score_mod=complex_table)


@unittest.skipUnless(HAS_FLEX, "PyTorch's flex_attention (2.5 on)")
class NaNAsFlexAttention(unittest.TestCase):
    """A NaN in a key or a modified score reaches every output that attends to it, and a
    masked key's NaN is skipped, as in PyTorch's flex_attention (docs/masks.md). Some routes
    dropped it: the output was finite, as if the key were not there."""

    def check(self, out, expected):
        self.assertTrue(torch.equal(out.isnan(), expected.isnan()),
                        f"{int(out.isnan().sum())} NaN against flex_attention's "
                        f"{int(expected.isnan().sum())}")
        self.assertTrue(bool(expected.isnan().any()) and not bool(expected.isnan().all()))
        finite = ~expected.isnan()
        self.assertLess(max_error(out[finite], expected[finite]), 1e-5)

    def test_a_nan_key_or_score(self):
        torch.manual_seed(83)
        L = int(DOCUMENT_IDS.numel())
        q, k, v = (torch.randn(1, 2, L, 16) for _ in range(3))
        k[:, :, 100] = float("nan")
        for mask_mod in MASK_MODS:
            for score_mod in (None, times_two, alibi, causal_score):
                with self.subTest(mask_mod=mask_mod.__name__,
                                  score_mod=getattr(score_mod, "__name__", None)):
                    bm = attnkit.create_block_mask(mask_mod, None, None, L, L)
                    out = attnkit.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
                    self.check(out, flex_forward(q, k, v, score_mod, mask_mod, False)[0])
        # attnkit.attention's own masks, and one head's ALiBi slope NaN.
        def window(b, h, qi, kv):
            return (kv <= qi) & (kv > qi - 8)
        self.check(attnkit.attention(q, k, v, causal=True, window=8),
                   flex_forward(q, k, v, None, window, False)[0])
        lengths = torch.tensor([150])
        self.check(attnkit.attention(q, k, v, causal=True, key_lengths=lengths),
                   flex_forward(q, k, v, None,
                                lambda b, h, qi, kv: (kv <= qi) & (kv < lengths[b]), False)[0])
        # Documents without a gradient run by document on PyTorch's SDPA, which drops a NaN
        # query's row in a document of 12 tokens: such a call stays with attnkit's kernels.
        ids = torch.arange(96) // 12
        q12, v12 = torch.randn(1, 2, 96, 16), torch.randn(1, 2, 96, 16)
        q_nan = q12.clone()
        q_nan[:, :, 11] = float("nan")
        with torch.no_grad():
            self.check(attnkit.attention(q_nan, q12, v12, document_ids=ids),
                       flex_forward(q_nan, q12, v12, None,
                                    lambda b, h, qi, kv: ids[qi] == ids[kv], False)[0])
        # A score_mod that gives NaN for one query: its row and its lse are NaN.
        def nan_row(score, b, h, qi, kv):
            return torch.where(qi == 7, score * float("nan"), score)
        out, lse = attnkit.flex_attention(q, q, v, score_mod=nan_row, return_lse=True)
        expected, expected_lse = flex_forward(q, q, v, nan_row, None, False)
        self.check(out, expected)
        self.assertTrue(torch.equal(lse.isnan(), expected_lse.isnan()))
        slopes = torch.tensor([float("nan"), 0.5])
        q, k = torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
        v = torch.randn(1, 2, 64, 16)
        self.check(attnkit.attention(q, k, v, causal=True, alibi_slopes=slopes),
                   flex_forward(q, k, v, lambda s, b, h, qi, kv: s + slopes[h] * (kv - qi),
                                causal, False)[0])

    def test_the_rows_that_see_a_nan_get_nan_gradients(self):
        torch.manual_seed(89)
        L = int(DOCUMENT_IDS.numel())
        q, k, v = (torch.randn(1, 2, L, 16, requires_grad=True) for _ in range(3))
        k_nan = k.detach().clone()
        k_nan[:, :, 100] = float("nan")
        k_nan.requires_grad_()
        bm = attnkit.create_block_mask(documents, None, None, L, L, BLOCK_SIZE=16)
        out = attnkit.flex_attention(q, k_nan, v, score_mod=times_two, block_mask=bm)
        out.sum().backward()
        nan_rows = out.isnan().all(-1)
        self.assertEqual(int(nan_rows.sum()), 2 * 90)  # the third document, both heads
        self.assertTrue(bool(q.grad.isnan().all(-1)[nan_rows].all()))
        # Rows 0-31 (the first document's) share no tile of 16 with the NaN key: finite.
        self.assertTrue(bool(q.grad[:, :, :32].isfinite().all()))


class PaddedBlockLists(unittest.TestCase):
    def test_zero_padded_kv_indices_as_from_kv_blocks_makes_them(self):
        # Rows list fewer blocks than kv_indices holds; the rest is zeros. Row 0 lists block 0
        # alone, and its padding 0 overwrote it ("partial_tiles must be bool ...").
        g = torch.Generator().manual_seed(13)
        q, k, v = [torch.randn(1, 2, 64, 8, generator=g, dtype=torch.float64,
                               requires_grad=True) for _ in range(3)]
        kv_num_blocks = torch.tensor([[[1, 2]]], dtype=torch.int32)
        kv_indices = torch.tensor([[[[0, 0], [0, 1]]]], dtype=torch.int32)
        masks = {"lists": types.SimpleNamespace(kv_num_blocks=kv_num_blocks,
                                                kv_indices=kv_indices, BLOCK_SIZE=(32, 32),
                                                mask_mod=causal)}
        if HAS_FLEX:
            from torch.nn.attention.flex_attention import BlockMask
            masks["BlockMask.from_kv_blocks"] = BlockMask.from_kv_blocks(
                kv_num_blocks, kv_indices, BLOCK_SIZE=32, mask_mod=causal)
        want, _ = dense_reference(q, k, v, None, causal)
        want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
        for name, block_mask in masks.items():
            with self.subTest(name):
                out = attnkit.flex_attention(q, k, v, block_mask=block_mask)
                self.assertLess(max_error(out, want), 1e-12)
                grads = torch.autograd.grad(out.square().sum(), (q, k, v))
                for mine, theirs in zip(grads, want_grads):
                    self.assertLess(max_error(mine, theirs), 1e-10)


class ValueHeadSize(unittest.TestCase):
    def test_values_of_another_head_size_with_no_mask_or_causal(self):
        # Routed to LibTorch's CPU flash kernel (2.5 on), which refused Ev != E.
        g = torch.Generator().manual_seed(14)
        q, k = [torch.randn(1, 2, 40, 8, generator=g, requires_grad=True) for _ in range(2)]
        v = torch.randn(1, 2, 40, 12, generator=g, requires_grad=True)
        for mask_mod in (None, causal):
            with self.subTest(mask_mod=getattr(mask_mod, "__name__", None)):
                block_mask = make_block_mask(mask_mod, 40, 40)
                out = attnkit.flex_attention(q, k, v, block_mask=block_mask)
                want, _ = dense_reference(q, k, v, None, mask_mod)
                self.assertEqual(tuple(out.shape), (1, 2, 40, 12))
                self.assertLess(max_error(out, want), 1e-5)
                grads = torch.autograd.grad(out.square().sum(), (q, k, v))
                want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
                for mine, theirs in zip(grads, want_grads):
                    self.assertLess(max_error(mine, theirs), 1e-4)


class CapturedValuesAtCallTime(unittest.TestCase):
    """What a score_mod captures is read at each call, as PyTorch's flex_attention reads it
    (forward compared with it where PyTorch has it, else with the dense reference)."""

    def setUp(self):
        g = torch.Generator().manual_seed(11)
        self.q, self.k, self.v = [torch.randn(1, 2, 48, 8, generator=g, dtype=torch.float64)
                                  for _ in range(3)]

    def check(self, score_mod, reference=flex_forward):
        mine = attnkit.flex_attention(self.q, self.k, self.v, score_mod=score_mod)
        theirs, _ = reference(self.q, self.k, self.v, score_mod, None, False)
        self.assertLess(max_error(mine, theirs), 1e-10)
        return mine

    def test_a_changed_number_global_or_bool(self):
        settings = {"temperature": 1.0, "bias": torch.zeros(2, dtype=torch.float64),
                    "relative": False}

        def score_mod(score, b, h, q, kv):
            score = score / settings["temperature"] + settings["bias"][h]
            return score + (q - kv) if settings["relative"] else score
        # PyTorch 2.15's eager flex_attention compiles its score_mod and refuses a captured
        # Python float ("can only be of Tensor, int, SymInt"): the dense reference, which is
        # its math, serves for the number.
        first = self.check(score_mod, reference)
        settings["temperature"] = 0.25
        second = self.check(score_mod, reference)
        self.assertGreater(max_error(first, second), 1e-3)
        settings["temperature"] = 1.0
        settings["bias"] = torch.tensor([3.0, -3.0], dtype=torch.float64)  # bound anew
        self.check(score_mod)
        settings["relative"] = True  # the function's operations change
        self.check(score_mod)

    def test_a_parameter_assigned_anew_gets_its_gradient(self):
        module = torch.nn.Module()
        module.slopes = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))

        def score_mod(score, b, h, q, kv):
            return score + module.slopes[h] * (kv - q)
        attnkit.flex_attention(self.q, self.k, self.v, score_mod=score_mod).sum().backward()
        old = module.slopes
        module.slopes = torch.nn.Parameter(torch.full((2,), 0.5, dtype=torch.float64))
        out = attnkit.flex_attention(self.q, self.k, self.v, score_mod=score_mod)
        out.sum().backward()
        self.assertIsNotNone(module.slopes.grad)
        self.assertGreater(module.slopes.grad.abs().sum().item(), 0.0)
        theirs, _ = flex_forward(self.q, self.k, self.v, score_mod, None, False)
        self.assertLess(max_error(out, theirs), 1e-10)
        self.assertEqual(old.grad.shape, (2,))

    def test_one_function_whose_captured_tensor_is_replaced_each_step(self):
        state = {"bias": None}
        weight = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))

        def score_mod(score, b, h, q, kv):
            return score + state["bias"][h] * q
        for step in range(3):
            state["bias"] = weight * (step + 1)
            out = attnkit.flex_attention(self.q, self.k, self.v, score_mod=score_mod)
            out.sum().backward()  # step 2 failed: "backward through the graph a second time"
            theirs, _ = flex_forward(self.q, self.k, self.v, score_mod, None, False)
            self.assertLess(max_error(out, theirs), 1e-10)


class Inference(unittest.TestCase):
    def test_inference_mode_with_a_score_mod_or_a_mask(self):
        # The kernels' worker threads lacked inference mode: an in-place update of an inference
        # tensor there was refused ("Inplace update to inference tensor outside InferenceMode").
        g = torch.Generator().manual_seed(15)
        q, k, v = [torch.randn(2, 4, 96, 8, generator=g) for _ in range(3)]
        ids = torch.arange(96) // 24

        def same_document(b, h, qi, kv):
            return ids[qi] == ids[kv]
        calls = {
            "score_mod": (lambda: attnkit.flex_attention(q, k, v, score_mod=rel_bias),
                          rel_bias, None),
            "block mask": (lambda: attnkit.flex_attention(
                q, k, v, block_mask=attnkit.create_block_mask(same_document, None, None, 96, 96,
                                                              BLOCK_SIZE=32)),
                           None, same_document),
            "attention": (lambda: attnkit.attention(q, k, v, document_ids=ids, softcap=20.0),
                          lambda s, b, h, qi, kv: 20.0 * torch.tanh(s / 20.0), same_document),
        }
        for name, (run, score_mod, mask_mod) in calls.items():
            with self.subTest(name):
                with torch.inference_mode():
                    out = run()
                want, _ = dense_reference(q, k, v, score_mod, mask_mod)
                self.assertLess(max_error(out, want), 1e-5)


class SecondOrder(unittest.TestCase):
    def test_create_graph_is_refused_with_or_without_a_mask_or_score_mod(self):
        # It gave second-order gradients of zero with a mask or a score_mod.
        g = torch.Generator().manual_seed(12)
        q, k, v = [torch.randn(1, 2, 40, 8, generator=g, dtype=torch.float64,
                               requires_grad=True) for _ in range(3)]
        calls = {
            "plain": {},
            "block mask": {"block_mask": attnkit.create_block_mask(causal, None, None, 40, 40,
                                                                   BLOCK_SIZE=16)},
            "score_mod": {"score_mod": times_two},
        }
        for name, kwargs in calls.items():
            with self.subTest(name):
                out = attnkit.flex_attention(q, k, v, **kwargs)
                with self.assertRaisesRegex(RuntimeError, "second-order gradients are not "
                                                          "supported.*create_graph=True"):
                    torch.autograd.grad(out.square().sum(), q, create_graph=True)
                # Once, as usual.
                out = attnkit.flex_attention(q, k, v, **kwargs)
                grad, = torch.autograd.grad(out.square().sum(), q)
                self.assertGreater(grad.abs().sum().item(), 0.0)


class EmptyInputs(unittest.TestCase):
    def test_an_empty_batch_gives_empty_outputs_and_gradients(self):
        # B = 0 divided the workers by the batch in the chunked kernel (SIGFPE); L = 0 beside it.
        for batch, queries in ((0, 40), (2, 0)):
            q = torch.randn(batch, 2, queries, 8, requires_grad=True)
            k = torch.randn(batch, 2, 40, 8, requires_grad=True)
            v = torch.randn(batch, 2, 40, 8, requires_grad=True)
            runs = {
                "flex_attention": lambda: attnkit.flex_attention(q, k, v, return_lse=True),
                "attention": lambda: (attnkit.attention(q, k, v, causal=True, softcap=5.0),
                                      torch.zeros(batch, 2, queries)),
            }
            if queries > 0:  # a block mask needs Q_LEN >= 1, as PyTorch's does
                runs["flex_attention with a block mask and a score_mod"] = \
                    lambda: attnkit.flex_attention(
                        q, k, v, score_mod=times_two, return_lse=True,
                        block_mask=attnkit.create_block_mask(causal, None, None, queries, 40,
                                                             BLOCK_SIZE=16))
            for name, run in runs.items():
                with self.subTest(batch=batch, queries=queries, call=name):
                    out, lse = run()
                    self.assertEqual(tuple(out.shape), (batch, 2, queries, 8))
                    self.assertEqual(tuple(lse.shape), (batch, 2, queries))
                    grads = torch.autograd.grad(out.sum(), (q, k, v), allow_unused=True)
                    for grad, tensor in zip(grads, (q, k, v)):
                        if grad is not None:
                            self.assertEqual(grad.shape, tensor.shape)
                            self.assertEqual(grad.abs().sum().item(), 0.0)


class Autocast(unittest.TestCase):
    def test_cpu_autocast_runs_in_its_dtype_as_the_cpp_api(self):
        """Under CPU autocast to bfloat16, float32 inputs run as their bfloat16 copies would
        (computed in float32, rounded once): the output is bfloat16 and equals that run;
        float64 keeps its own dtype, as PyTorch's autocast leaves it."""
        g = torch.Generator().manual_seed(7)
        q, k, v = [torch.randn(1, 2, 40, 8, generator=g, requires_grad=True) for _ in range(3)]
        bm = attnkit.create_block_mask(causal, None, None, 40, 40, BLOCK_SIZE=16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = attnkit.flex_attention(q, k, v, block_mask=bm)
            out64 = attnkit.flex_attention(q.double(), k.double(), v.double(), block_mask=bm)
        expected = attnkit.flex_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(),
                                          block_mask=bm)
        self.assertEqual(out.dtype, torch.bfloat16)
        self.assertEqual(out64.dtype, torch.float64)
        self.assertTrue(torch.equal(out, expected))
        out.float().sum().backward()
        self.assertEqual(q.grad.dtype, torch.float32)


class OwnMasks(unittest.TestCase):
    def test_attention_equals_the_dense_math(self):
        g = torch.Generator().manual_seed(4)
        q, k, v = [torch.randn(2, 4, 50, 8, generator=g, dtype=torch.float64,
                               requires_grad=True) for _ in range(3)]
        lengths = torch.tensor([50, 31])
        slopes = torch.rand(4, generator=g, dtype=torch.float64)
        bias = torch.randn(4, 7, generator=g, dtype=torch.float64, requires_grad=True)
        out = attnkit.attention(q, k, v, causal=True, window=20, key_lengths=lengths,
                                softcap=8.0, alibi_slopes=slopes, bias=bias, block_size=16)

        def score_mod(s, b, h, qi, kv):
            s = 8.0 * torch.tanh(s / 8.0) + slopes[h] * (kv - qi)
            return s + bias[h, torch.clamp(kv - qi, -3, 3) + 3]

        def mask_mod(b, h, qi, kv):
            return (kv <= qi) & (kv > qi - 20) & (kv < lengths[b])
        ref, _ = dense_reference(q, k, v, score_mod, mask_mod)
        self.assertLess(max_error(out, ref), 1e-12)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v, bias))
        ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v, bias))
        for mine, theirs in zip(grads, ref_grads):
            self.assertLess(max_error(mine, theirs), 1e-10)

    def test_own_masks_pass_as_they_are_and_equal_the_dense_math(self):
        # attnkit.attention passes its masks to the operator in Mask's value form; the kernels
        # judge the tiles from their structure. Every combination, in shapes that cut the
        # blocks anywhere, against the dense math of the same mask_mod.
        g = torch.Generator().manual_seed(6)
        for L, S, block in [(100, 100, 16), (128, 128, 32), (300, 300, 128), (40, 300, 32),
                            (300, 40, 16)]:
            lengths = torch.randint(0, S + 1, (3,), generator=g)
            ids = torch.sort(torch.randint(0, 7, (3, S), generator=g), dim=-1).values
            q = torch.randn(3, 2, L, 8, generator=g, dtype=torch.float64)
            k, v = [torch.randn(3, 2, S, 8, generator=g, dtype=torch.float64) for _ in range(2)]
            offsets = [0, 5] + ([S - L] if S > L else [])
            for causal, offset, window, with_lengths, with_ids in [
                    (True, o, w, kl, False) for o in offsets for w in (None, 1, 20)
                    for kl in (False, True)] + [
                    (c, 0, w, kl, True) for c in (False, True) for w in ((None, 7) if c else
                                                                          (None,))
                    for kl in (False, True)]:
                if with_ids and L != S:
                    continue

                def mask_mod(b, h, qi, kv):
                    allowed = torch.ones_like(qi + kv, dtype=torch.bool)
                    if causal:
                        allowed = allowed & (kv <= qi + offset)
                        if window is not None:
                            allowed = allowed & (kv > qi + offset - window)
                    if with_lengths:
                        allowed = allowed & (kv < lengths[b])
                    if with_ids:
                        allowed = allowed & (ids[b, qi] == ids[b, kv])
                    return allowed
                with self.subTest(L=L, S=S, block=block, causal=causal, offset=offset,
                                  window=window, lengths=with_lengths, ids=with_ids):
                    out = attnkit.attention(q, k, v, causal=causal, query_offset=offset,
                                            window=window,
                                            key_lengths=lengths if with_lengths else None,
                                            document_ids=ids if with_ids else None,
                                            block_size=block, softcap=30.0)
                    ref, _ = dense_reference(q, k, v, lambda s, *_: 30.0 * torch.tanh(s / 30.0),
                                             mask_mod)
                    self.assertLess(max_error(out, ref), 1e-12)

    def test_a_pickled_block_mask_loads_and_runs(self):
        # The mask's value form changed the operator's schema, not BlockMask: a block mask
        # pickled before (its lists, BLOCK_SIZE, mask_mod, and the partial tiles' bits that
        # attnkit keeps on it) loads and gives the same answer, with the bits or without.
        import pickle
        g = torch.Generator().manual_seed(8)
        q, k, v = [torch.randn(1, 2, 70, 8, generator=g, dtype=torch.float64) for _ in range(3)]
        bm = attnkit.create_block_mask(causal, None, None, 70, 70, BLOCK_SIZE=32)
        want = attnkit.flex_attention(q, k, v, block_mask=bm)
        loaded = pickle.loads(pickle.dumps(bm))
        self.assertTrue(torch.equal(attnkit.flex_attention(q, k, v, block_mask=loaded), want))
        if hasattr(loaded, "_attnkit_partial_tiles"):
            del loaded._attnkit_partial_tiles
        self.assertTrue(torch.equal(attnkit.flex_attention(q, k, v, block_mask=loaded), want))

    def test_the_operator_refuses_a_mask_form_it_cannot_read(self):
        q = torch.randn(2, 1, 8, 4)
        lengths = torch.tensor([8, 5])
        none = (None,) * 5

        def run(form, tensors):
            return torch.ops.attnkit.flex_attention(q, q, q, *none, form, tensors, 8, 8, "", [],
                                                    0.5, 0.0, -1)
        for form, tensors, message in [
                ("causal(0) & sliding(3)", [], "cannot read 'sliding(3)'"),
                ("causal(-1)", [], "the query offset must be an integer >= 0, got '-1'"),
                ("causal(0, win=3)", [], "expected window=W with an integer W >= 1, got 'win=3'"),
                ("causal(0, window=0)", [], "window_size must be >= 1"),
                ("key_padding(0)", [lengths], "expected a tensor as #I, got '0'"),
                ("key_padding(#1)", [lengths], "reads mask_tensors[1], but mask_tensors holds 1"),
                ("causal(0)", [lengths], "mask_tensors[0] is not read by the mask 'causal(0)'"),
                ("documents(#0)", [torch.tensor([0, 0, 1])],
                 "[attnkit::flex_attention] mask: document_ids must have shape (8) or (2, 8), "
                 "got [3]"),
                ("causal(99999999999999999999)", [], "got '99999999999999999999'")]:
            with self.subTest(form=form):
                with self.assertRaises(RuntimeError) as caught:
                    run(form, tensors)
                self.assertIn(message, str(caught.exception))
        # The form it reads: the same as the block lists of the same mask.
        bm = attnkit.create_block_mask(lambda b, h, qi, kv: (kv <= qi) & (kv < lengths[b]), 2,
                                       None, 8, 8, BLOCK_SIZE=4)
        self.assertLess(max_error(run("causal(0) & key_padding(#0)", [lengths])[0],
                                  attnkit.flex_attention(q, q, q, block_mask=bm, scale=0.5)),
                        1e-6)

    def test_documents_without_a_gradient_run_by_document_on_sdpa(self):
        # attnkit.attention's route for document_ids: one SDPA call per document, no block
        # mask. It is taken only where it was measured faster; elsewhere the block mask's.
        g = torch.Generator().manual_seed(5)
        q, k, v = [torch.randn(2, 3, 160, 8, generator=g, dtype=torch.float64)
                   for _ in range(3)]
        row_ids = torch.tensor([[0] * 40 + [1] * 100 + [2] * 20,
                                [5] * 90 + [7] * 70])  # (B, L): each row its own documents
        split = torch.tensor([0] * 60 + [1] * 60 + [0] * 40)  # document 0 in two runs
        sdpa = getattr(torch.nn.functional, "scaled_dot_product_attention", None)
        calls = []

        def counted(*args, **kwargs):
            calls.append(args[0].shape[2])
            return sdpa(*args, **kwargs)
        cases = [  # ids, causal, scale, gradient, how many SDPA calls where PyTorch has SDPA
            (row_ids, False, None, False, 5),
            (row_ids, True, 0.3, False, 5),
            (row_ids, True, None, True, 0),   # a gradient to keep: the block mask's route
            (split, False, None, False, 0),   # a document in two runs
            (torch.arange(160) // 2, True, None, False, 0),  # 80 documents of 2 tokens
        ]
        long_q, long_k, long_v = [torch.randn(2, 1, 600, 4, generator=g, dtype=torch.float64)
                                  for _ in range(3)]
        long_documents = torch.arange(600) // 300  # causal, longer than 256, rows sharing ids
        long_cases = [(long_documents, True, 0), (long_documents, False, 4)]
        if sdpa is not None:
            torch.nn.functional.scaled_dot_product_attention = counted
        try:
            for ids, causal, scale, gradient, want_calls in cases:
                with self.subTest(causal=causal, scale=scale, gradient=gradient,
                                  documents=int(ids.max()) + 1):
                    calls.clear()
                    inputs = [t.clone().requires_grad_(gradient) for t in (q, k, v)]
                    out = attnkit.attention(*inputs, causal=causal, document_ids=ids,
                                            scale=scale, block_size=32)
                    rows = ids if ids.dim() == 2 else ids.unsqueeze(0)

                    def mask_mod(b, h, qi, kv):
                        same = rows[b if rows.shape[0] > 1 else 0, qi] == \
                            rows[b if rows.shape[0] > 1 else 0, kv]
                        return same & (kv <= qi) if causal else same
                    ref, _ = dense_reference(*inputs, None, mask_mod, scale)
                    self.assertLess(max_error(out, ref), 1e-12)
                    routed = len(calls)
                    self.assertEqual(routed, want_calls if sdpa is not None else 0)
                    self.assertEqual(sum(calls), 320 if routed else 0)  # every token, once
                    if gradient:
                        grads = torch.autograd.grad(out.square().sum(), inputs)
                        ref_grads = torch.autograd.grad(ref.square().sum(), inputs)
                        for mine, theirs in zip(grads, ref_grads):
                            self.assertLess(max_error(mine, theirs), 1e-10)
            for ids, causal, want_calls in long_cases:
                with self.subTest(long_documents=True, causal=causal):
                    calls.clear()
                    out = attnkit.attention(long_q, long_k, long_v, causal=causal,
                                            document_ids=ids)

                    def long_mask(b, h, qi, kv):
                        same = ids[qi] == ids[kv]
                        return same & (kv <= qi) if causal else same
                    ref, _ = dense_reference(long_q, long_k, long_v, None, long_mask)
                    self.assertLess(max_error(out, ref), 1e-12)
                    self.assertEqual(len(calls), want_calls if sdpa is not None else 0)
        finally:
            if sdpa is not None:
                torch.nn.functional.scaled_dot_product_attention = sdpa

    def test_refusals_name_the_argument(self):
        q = torch.randn(2, 2, 16, 8)
        cases = [
            (dict(window=4), "window needs causal=True"),
            (dict(causal=True, window=0), "window must be >= 1, got 0"),
            (dict(causal=True, query_offset=-1), "query_offset must be >= 0"),
            (dict(causal=True, query_offset=2 ** 63 - 1), "query_offset must be at most "
                                                          "2**63 - 1 - 16 (the last query's key "
                                                          "position must fit in int64), got "
                                                          "9223372036854775807"),
            (dict(key_lengths=torch.tensor([3])), "key_lengths must be (2,), got (1,)"),
            (dict(key_lengths=torch.tensor([17, 3])), "key_lengths must be in [0, 16] (the "
                                                      "number of keys), got [17, 3]"),
            (dict(key_lengths=torch.tensor([4, -1])), "key_lengths must be in [0, 16]"),
            (dict(document_ids=torch.zeros(15, dtype=torch.long)), "document_ids needs"),
            (dict(document_ids=torch.zeros(3, 16, dtype=torch.long)),
             "document_ids must be (16,) or (2, 16), got (3, 16)"),
            (dict(softcap=-1.0), "softcap must be > 0, got -1.0"),
            (dict(bias=torch.zeros(2)), "bias must be (heads, 2 D + 1), got (2,)"),
            (dict(alibi_slopes=torch.ones(3)), "alibi_slopes must be (2,), one slope per query "
                                               "head, got (3,)"),
            (dict(causal=True, block_size=0), "block_size must be >= 1, got 0"),
        ]
        for kwargs, words in cases:
            with self.subTest(str(kwargs)), self.assertRaises(ValueError) as caught:
                attnkit.attention(q, q, q, **kwargs)
            self.assertIn(words, str(caught.exception))
        # Ids or lengths that are not integers (0.5 and 0.7 would be one document as int64).
        for name, given in (("key_lengths", torch.tensor([4.0, 3.0])),
                            ("document_ids", torch.arange(16) / 2.0),
                            ("document_ids", torch.ones(16, dtype=torch.bool))):
            with self.subTest(name, dtype=given.dtype), self.assertRaises(TypeError) as caught:
                attnkit.attention(q, q, q, **{name: given})
            self.assertIn(f"{name} must be an integer tensor, got {given.dtype}",
                          str(caught.exception))
        # A key/value batch of 1 broadcasts (DropIn); any other than the query's is refused.
        with self.assertRaises(ValueError) as caught:
            attnkit.flex_attention(q, q.repeat(3, 1, 1, 1), q.repeat(3, 1, 1, 1))
        self.assertIn("the query's batch size or 1", str(caught.exception))
        with self.assertRaises(ValueError) as caught:
            attnkit.flex_attention(q, q[..., :4], q)
        self.assertIn("one head dimension", str(caught.exception))
        for size in (64.5, (8, 8.0), (8, 8, 8)):
            with self.subTest(BLOCK_SIZE=size), self.assertRaises(TypeError) as caught:
                attnkit.create_block_mask(causal, None, None, 16, 16, BLOCK_SIZE=size)
            self.assertIn("BLOCK_SIZE must be an int or a pair of ints (query block, key block), "
                          f"got {size!r}", str(caught.exception))
        for size in (1.5, True):
            with self.subTest(window=size), self.assertRaises(TypeError) as caught:
                attnkit.attention(q, q, q, causal=True, window=size)
            self.assertIn(f"window must be an int, got {size!r}", str(caught.exception))
        with self.assertRaises(TypeError) as caught:
            attnkit.create_block_mask(lambda b, h, qi, kv: (kv <= qi).float(), None, None, 16, 16)
        self.assertIn("mask_mod must return a bool tensor, got torch.float32",
                      str(caught.exception))
        # BLOCK_SIZE far above the lengths: the lists of one block, at the lengths' cost (16,384
        # on 64 tokens took 2.2 GB).
        big = attnkit.create_block_mask(causal, None, None, 64, 48, BLOCK_SIZE=16384)
        self.assertEqual(big.kv_num_blocks.tolist(), [[[1]]])
        self.assertEqual(big.full_kv_num_blocks.tolist(), [[[0]]])
        x = torch.randn(1, 2, 64, 8)
        self.assertLess(max_error(attnkit.flex_attention(x, x[:, :, :48], x[:, :, :48], block_mask=big),
                                  attnkit.flex_attention(x, x[:, :, :48], x[:, :, :48],
                                                         block_mask=attnkit.create_block_mask(
                                                             causal, None, None, 64, 48,
                                                             BLOCK_SIZE=16))), 1e-6)
        for size in (2.5, True):
            with self.subTest(block_size=size), self.assertRaises(TypeError) as caught:
                attnkit.attention(q, q, q, causal=True, block_size=size)
            self.assertIn(f"block_size must be an int, got {size!r}", str(caught.exception))
        # A window past int64 is no window (2**63 wrapped into another mask).
        for size in (2 ** 63, 2 ** 64 + 3):
            self.assertLess(max_error(attnkit.attention(q, q, q, causal=True, window=size),
                                      attnkit.attention(q, q, q, causal=True)), 1e-6)
        # The largest offset that fits: every key seen.
        self.assertLess(max_error(attnkit.attention(q, q, q, causal=True,
                                                    query_offset=2 ** 63 - 1 - 16),
                                  attnkit.attention(q, q, q)), 1e-6)
        # A block longer than the sequence is clamped to it (2**30 on 32 tokens grew to 24 GB).
        x = torch.randn(1, 2, 32, 8)
        self.assertLess(max_error(
            attnkit.attention(x, x, x, causal=True, window=5, block_size=2**30),
            attnkit.attention(x, x, x, causal=True, window=5, block_size=8)), 1e-6)
        learned = torch.tensor(0.3, requires_grad=True)
        with self.assertRaises(TypeError) as caught:
            attnkit.flex_attention(q, q, q, scale=learned)
        self.assertIn("scale is a tensor that requires grad", str(caught.exception))
        self.assertLess(max_error(attnkit.flex_attention(q, q, q, scale=torch.tensor(0.3)),
                                  attnkit.flex_attention(q, q, q, scale=0.3)), 1e-6)
        # The operator's own checks, for callers of torch.ops.attnkit directly.
        bm = attnkit.create_block_mask(causal, None, None, 16, 16, BLOCK_SIZE=8)
        lists = [bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices]
        with self.assertRaises(RuntimeError) as caught:
            torch.ops.attnkit.flex_attention(q, q, q, *lists, torch.ones(5, 8, 8, dtype=torch.bool),
                                             "", [], 8, 8, "", [], 0.3, 0.0, -1)
        self.assertIn("partial_tiles must be bool (2, 8, 8)", str(caught.exception))
        self.assertIn("or (1, 1, 2, 2, 8, 8) (one per slot of kv_indices)", str(caught.exception))
        # The layout with a tile per slot (what torch.compile sends): the same answer.
        from attnkit._block_mask import _partial_bits, _slot_bits
        packed, per_slot = _partial_bits(bm, 16, 16), _slot_bits(bm, 16, 16)
        self.assertEqual(tuple(per_slot.shape), (1, 1, 2, 2, 8, 8))
        self.assertTrue(torch.equal(
            torch.ops.attnkit.flex_attention(q, q, q, *lists, per_slot, "", [], 8, 8, "", [], 0.3, 0.0,
                                             -1)[0],
            torch.ops.attnkit.flex_attention(q, q, q, *lists, packed, "", [], 8, 8, "", [], 0.3, 0.0,
                                             -1)[0]))
        with self.assertRaises(RuntimeError) as caught:
            torch.ops.attnkit.flex_attention(q, q, q, None, None, None, None, None, "", [], 8, 8,
                                             "", [], 0.3, 0.5, -1)
        self.assertIn("dropout_p > 0 needs a dropout_seed", str(caught.exception))


class Package(unittest.TestCase):
    """Where the package comes from, and the torch its library was built for."""

    def test_the_package_is_the_one_this_leg_installed_or_built(self):
        package = os.path.realpath(os.path.dirname(attnkit.__file__))
        if os.environ.get("ATTNKIT_PYTHON_INSTALLED"):  # pip install . (scripts/test.sh --pip)
            site = os.path.realpath(sysconfig.get_paths()["purelib"])
            self.assertEqual(os.path.dirname(package), site)
        else:  # the build tree's package, through PYTHONPATH
            self.assertIn("PYTHONPATH", os.environ)
            self.assertEqual(os.path.dirname(package),
                             os.path.realpath(os.environ["PYTHONPATH"].split(os.pathsep)[0]))

    def test_a_library_built_for_another_torch_is_refused_before_it_loads(self):
        with tempfile.TemporaryDirectory() as folder:
            copy = os.path.join(folder, "attnkit")
            shutil.copytree(os.path.dirname(attnkit.__file__), copy,
                            ignore=shutil.ignore_patterns("lib", "__pycache__"))
            with open(os.path.join(copy, "_built_for.py"), "w") as out:
                out.write('TORCH_VERSION = "0.9.0"\n')
            environment = dict(os.environ, PYTHONPATH=folder)
            environment.pop("ATTNKIT_OPS_LIBRARY", None)
            run = subprocess.run([sys.executable, "-c", "import attnkit"], env=environment,
                                 capture_output=True, text=True, cwd=folder)
        self.assertNotEqual(run.returncode, 0)
        self.assertIn("ImportError: attnkit:", run.stderr)
        self.assertIn(f"does not load into this PyTorch {torch.__version__} (it was built "
                      "against PyTorch 0.9.0); the library must be built against the LibTorch "
                      "of the same PyTorch", run.stderr)


if __name__ == "__main__":
    print(f"torch {torch.__version__}, eager flex_attention: {HAS_FLEX}", file=sys.stderr)
    unittest.main()
