"""A score_mod traced with torch.fx into attnkit's ScoreGraph text (include/attnkit/score_graph.h).

One line per operation; operands %0..%4 are (score, b, h, q_idx, kv_idx), %5 on the lines'
results, $i the i-th captured tensor, f:/i:/b: constants and _ a whole dimension.
"""

import inspect
import operator

import torch
import torch.fx

# Python operators and torch functions or methods whose graph name differs from their own.
_OPERATORS = {
    operator.add: "add",
    operator.sub: "sub",
    operator.mul: "mul",
    operator.truediv: "div",
    operator.floordiv: "floor_divide",
    operator.mod: "remainder",
    operator.pow: "pow",
    operator.neg: "neg",
    operator.abs: "abs",
    operator.eq: "eq",
    operator.ne: "ne",
    operator.lt: "lt",
    operator.le: "le",
    operator.gt: "gt",
    operator.ge: "ge",
    operator.and_: "bitwise_and",
    operator.or_: "bitwise_or",
    operator.xor: "bitwise_xor",
    operator.invert: "bitwise_not",
    operator.getitem: "index",
}
_ALIASES = {
    "multiply": "mul",
    "subtract": "sub",
    "true_divide": "div",
    "divide": "div",
    "clip": "clamp",
    "greater": "gt",
    "greater_equal": "ge",
    "less": "lt",
    "less_equal": "le",
    "not_equal": "ne",
    "negative": "neg",
    "absolute": "abs",
    "__getitem__": "index",
}


class _Tracer(torch.fx.Tracer):
    """Records every tensor the function reads (a buffer, a parameter) as a captured tensor."""

    def __init__(self):
        super().__init__()
        self.captured = []

    def create_arg(self, a):
        if isinstance(a, torch.Tensor):
            for i, known in enumerate(self.captured):
                if known is a:
                    break
            else:
                self.captured.append(a)
                i = len(self.captured) - 1
            return self.create_node("get_attr", f"captured_{i}", (), {})
        return super().create_arg(a)


class ScoreModError(ValueError):
    """A score_mod that attnkit cannot trace or express."""


def _operand(value, numbers, captured_index):
    if isinstance(value, torch.fx.Node):
        if value.op == "get_attr":
            return f"${captured_index[value.name]}"
        return f"%{numbers[value.name]}"
    if isinstance(value, bool):
        return f"b:{int(value)}"
    if isinstance(value, int):
        return f"i:{value}"
    if isinstance(value, float):
        return f"f:{value!r}"
    if isinstance(value, slice) and value == slice(None):
        return "_"
    if value is None:
        return "_"
    raise ScoreModError(f"score_mod: an operand {value!r} ({type(value).__name__}) is none of a "
                        "tensor, a number, a bool or a whole slice ':'")


def _name_of(node):
    if node.op == "call_function":
        if node.target in _OPERATORS:
            return _OPERATORS[node.target]
        name = getattr(node.target, "__name__", str(node.target))
    else:  # call_method
        name = node.target
    return _ALIASES.get(name, name)


def trace(score_mod):
    """(graph text, captured tensors) of score_mod; ScoreModError names what failed."""
    try:
        inspect.signature(score_mod).bind(*range(5))
    except TypeError as error:
        raise ScoreModError("score_mod must take (score, b, h, q_idx, kv_idx) as five positional "
                            f"arguments, as flex_attention calls it: {error}") from error
    except ValueError:
        pass  # no signature to read (a builtin): the trace below tells

    # fx makes one placeholder per named parameter (and one for *args), so trace a function of
    # exactly five that calls score_mod as flex_attention does: `lambda s, *rest: ...` works.
    def score_mod_of_five(score, b, h, q_idx, kv_idx):
        return score_mod(score, b, h, q_idx, kv_idx)

    tracer = _Tracer()
    try:
        graph = tracer.trace(score_mod_of_five)
    except Exception as error:  # fx raises TraceError, TypeError, ... for untraceable code
        raise ScoreModError(
            f"score_mod cannot be traced with torch.fx ({type(error).__name__}: {error}); a "
            "score_mod is pointwise tensor operations, indexing of captured tensors by b, h, "
            "q_idx or kv_idx, comparisons and torch.where, without Python control flow on "
            "tensor values") from error
    graph.eliminate_dead_code()
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    numbers = {n.name: i for i, n in enumerate(placeholders)}
    captured_index = {}
    lines = []
    result = None
    for node in graph.nodes:
        if node.op == "get_attr":
            captured_index[node.name] = int(node.target.split("_")[1])
        elif node.op in ("call_function", "call_method"):
            name = _name_of(node)
            args = list(node.args)
            if name == "index":
                index = args[1] if isinstance(args[1], tuple) else (args[1],)
                args = [args[0], *index]
            if name == "clamp":
                args = [args[0], node.kwargs.get("min", args[1] if len(args) > 1 else None),
                        node.kwargs.get("max", args[2] if len(args) > 2 else None)]
            elif node.kwargs:
                raise ScoreModError(f"score_mod: {name} with keyword arguments "
                                    f"{sorted(node.kwargs)} is not supported")
            operands = [_operand(a, numbers, captured_index) for a in args]
            numbers[node.name] = 5 + len(lines)
            lines.append(" ".join([name, *operands]))
        elif node.op == "output":
            result = node.args[0]
        elif node.op != "placeholder":
            raise ScoreModError(f"score_mod: a {node.op} node ({node.target}) is not supported")
    if not isinstance(result, torch.fx.Node) or result.op == "get_attr":
        raise ScoreModError("score_mod must return a tensor computed from its arguments")
    if numbers[result.name] == 0 and not lines:
        return "", []  # the identity
    if numbers[result.name] != 4 + len(lines):
        lines.append(f"add %{numbers[result.name]} i:0")  # the result is not the last line
    return "\n".join(lines), tracer.captured


def compiling():
    """Whether torch.compile (Dynamo) is tracing this call."""
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and hasattr(compiler, "is_compiling"):
        return compiler.is_compiling()
    dynamo = getattr(torch, "_dynamo", None)  # 2.0 to 2.2; none on 1.13
    return dynamo is not None and hasattr(dynamo, "is_compiling") and dynamo.is_compiling()


def traced(score_mod):
    """trace(score_mod), anew at every eager call: a score_mod reads its captured values when
    it is called, as PyTorch's flex_attention calls it, so a changed number (a temperature), a
    global bound anew, a parameter assigned anew, a tensor recomputed each step or a Python bool
    that steers its operations all count at the next call. Tracing costs about a millisecond.
    The latest trace is kept on the function object (an attribute, which Dynamo reads where it
    would not inline a WeakKeyDictionary): inside torch.compile, where attnkit does not trace,
    the compiled region reads the trace of the last eager call (docs/python.md)."""
    if compiling():
        result = getattr(score_mod, "_attnkit_score_graph", None)
        if result is not None:
            return result
    result = trace(score_mod)
    try:
        score_mod._attnkit_score_graph = result
    except AttributeError:
        pass
    return result
