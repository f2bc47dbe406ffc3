"""Hypothesis strategies that write random valid GEIR programs as text.

The generator keeps its own record of every value's type (an independent formulation of the shape
rules for the ops it uses), spells names, numbers and whitespace in many legal ways, and adds
comments, graph attributes and pass attributes, so that a printer or parser that is not faithful to
the grammar shows up as a failed round trip.
"""

from __future__ import annotations

import json
import math

from hypothesis import strategies as st

FLOATS = ("f16", "bf16", "f32")
INTS = ("i8", "i32", "i64")
DTYPES = FLOATS + INTS + ("i1",)
NAME_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_$.-"
SYMBOL_START = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_"
PUNCT = {",", "=", ":", "{", "}", "[", "]", "(", ")", "->", ">", "dense<", "dense_resource<"}
# `dense<` may not touch a preceding word (`ge.constdense<` lexes as one op name)
PUNCT_BEFORE = PUNCT - {"dense<", "dense_resource<"}
SEPARATORS = [" ", " ", " ", "  ", "\t", "\n    ", " // a comment\n  ", "\r\n ", "\n\n"]


def type_text(shape, dtype, fmt="ND"):
    dims = "".join(("?" if d is None else str(d)) + "x" for d in shape)
    return f"tensor<{dims}{dtype}" + (f", {fmt}" if fmt != "ND" else "") + ">"


def broadcast(a, b):
    """numpy broadcasting with None for `?`; None when the shapes clash."""
    n = max(len(a), len(b))
    pa, pb = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
    out = []
    for x, y in zip(pa, pb):
        if x == 1:
            out.append(y)
        elif y == 1:
            out.append(x)
        elif x is None:
            out.append(y)
        elif y is None or x == y:
            out.append(x)
        else:
            return None
    return tuple(out)


class _Graph:
    def __init__(self, draw, name: str, taken_names: set):
        self.draw = draw
        self.name = name
        self.values: list[tuple[str, tuple, str]] = []  # (name, shape, dtype)
        self.names = taken_names
        self.lines: list[list[str]] = []

    # --- spelling ----------------------------------------------------------------------------
    def fresh(self) -> str:
        base = self.draw(st.text(NAME_CHARS, min_size=1, max_size=5))
        name = base
        i = 0
        while name in self.names:
            i += 1
            name = f"{base}_{i}"
        self.names.add(name)
        return name

    def int_text(self, v: int) -> str:
        return self.draw(st.sampled_from([str(v), str(v) if v < 0 else "+" + str(v)]))

    def float_text(self, v: float) -> str:
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        options = [repr(v), f"{v:e}", f"{v:E}"]
        if float(v).is_integer() and abs(v) < 1e15:
            options.append(f"{int(v)}.")
        return self.draw(st.sampled_from(options))

    def number(self, dtype: str, special: bool = True):
        if dtype == "i1":
            return self.draw(st.sampled_from(["true", "false"]))
        if dtype in INTS:
            lo, hi = {"i8": (-128, 127), "i32": (-(2**31), 2**31 - 1), "i64": (-(2**63), 2**63 - 1)}[dtype]
            return self.int_text(self.draw(st.integers(lo, hi) | st.integers(-5, 5)))
        if self.draw(st.booleans()):
            return self.int_text(self.draw(st.integers(-100, 100)))  # integers initialise floats too
        # finite values stay within what the element type holds (a literal beyond it is an error, not an inf)
        top = {"f16": 65504.0, "bf16": 3.3800000765064914e+38}.get(dtype)  # exactly representable in f32
        finite = st.floats(-top, top, width=32) if top else st.floats(allow_nan=False, allow_infinity=False, width=32)
        v = self.draw(finite | st.sampled_from([0.5, -0.0, 1e-5] + ([float("nan"), float("inf"), -float("inf")]
                                                                      if special else [])))
        return self.float_text(v)

    def attr_value(self, depth: int = 0) -> str:
        kinds = ["int", "float", "bool", "str", "dtype"] + (["list", "dict"] if depth < 3 else [])
        kind = self.draw(st.sampled_from(kinds))
        if kind == "int":
            return self.int_text(self.draw(st.integers(-(2**63), 2**63 - 1)))  # integer attributes are 64-bit
        if kind == "float":
            return self.float_text(self.draw(st.floats()))
        if kind == "bool":
            return self.draw(st.sampled_from(["true", "false"]))
        if kind == "str":
            return json.dumps(self.draw(st.text(max_size=8)), ensure_ascii=self.draw(st.booleans()))
        if kind == "dtype":
            return self.draw(st.sampled_from(DTYPES))
        if kind == "list":
            n = self.draw(st.integers(0, 3))
            return "[" + ", ".join(self.attr_value(depth + 1) for _ in range(n)) + "]"
        return self.attr_dict(depth + 1)

    def attr_key(self) -> str:
        if self.draw(st.integers(0, 4)) == 0:
            return json.dumps(self.draw(st.text(min_size=1, max_size=6)))
        return self.draw(st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True))

    def attr_dict(self, depth: int = 1) -> str:
        keys = self.draw(st.lists(st.builds(self.attr_key), max_size=3, unique_by=lambda k: json.loads(k) if k.startswith('"') else k))
        return "{" + ", ".join(f"{k} = {self.attr_value(depth)}" for k in keys) + "}"

    # --- values ------------------------------------------------------------------------------
    def pick(self, pred=lambda v: True):
        cands = [v for v in self.values if pred(v)]
        return self.draw(st.sampled_from(cands)) if cands else None

    def emit(self, op: str, operands: list[str], attrs: dict[str, str], results: list[tuple], dense: str | None = None):
        names = [self.fresh() for _ in results]
        toks: list[str] = []
        for i, n in enumerate(names):
            if i:
                toks.append(",")
            toks.append("%" + n)
        toks += ["=", op]
        for i, o in enumerate(operands):
            if i:
                toks.append(",")
            toks.append("%" + o)
        if dense is not None:
            toks += dense_tokens(dense)
        if self.draw(st.integers(0, 9)) == 0:  # passes' attributes are allowed on any op
            attrs = dict(attrs, tiling=self.attr_dict())
        if attrs:
            items = list(attrs.items())
            items = self.draw(st.permutations(items))
            toks.append("{")
            for i, (k, v) in enumerate(items):
                if i:
                    toks.append(",")
                toks += [k, "=", v]
            toks.append("}")
        if dense is not None or self.draw(st.booleans()):
            toks.append(":")
            for i, (shape, dtype) in enumerate(results):
                if i:
                    toks.append(",")
                toks.append(type_text(shape, dtype))
        self.lines.append(toks)
        for n, (shape, dtype) in zip(names, results):
            self.values.append((n, shape, dtype))

    def const(self, shape, dtype):
        if self.draw(st.booleans()) or not shape:
            body = self.number(dtype)
        else:
            body = self.nested(shape, dtype)
        self.emit("ge.const", [], {}, [(shape, dtype)], dense=body)

    def nested(self, shape, dtype) -> str:
        if not shape:
            return self.number(dtype, special=False)
        return "[" + ", ".join(self.nested(shape[1:], dtype) for _ in range(shape[0])) + "]"

    # --- ops ---------------------------------------------------------------------------------
    def step(self):
        kind = self.draw(st.sampled_from([
            "unary", "unary", "binary", "binary", "compare", "cast", "reduce", "softmax", "matmul", "transpose",
            "reshape", "concat", "split", "slice", "norm", "trans_data", "const", "attention", "gelu",
        ]))
        getattr(self, "op_" + kind)()

    def float_value(self):
        return self.pick(lambda v: v[2] in FLOATS)

    def op_unary(self):
        v = self.pick()
        if v is None:
            return
        if v[2] in FLOATS:
            op = self.draw(st.sampled_from(["exp", "log", "sqrt", "rsqrt", "neg", "abs", "tanh", "sigmoid", "relu",
                                            "silu", "erf"]))
        elif v[2] == "i1":
            return
        else:
            op = self.draw(st.sampled_from(["neg", "abs", "relu"]))
        self.emit("ge." + op, [v[0]], {}, [(v[1], v[2])])

    def op_gelu(self):
        v = self.float_value()
        if v is None:
            return
        attrs = {}
        if self.draw(st.booleans()):
            attrs["approximate"] = json.dumps(self.draw(st.sampled_from(["none", "tanh"])))
        self.emit("ge.gelu", [v[0]], attrs, [(v[1], v[2])])

    def partner(self, v):
        """Another value that broadcasts with v (same dtype), or a new constant that does."""
        cands = [w for w in self.values if w[2] == v[2] and broadcast(v[1], w[1]) is not None]
        if cands and self.draw(st.booleans()):
            return self.draw(st.sampled_from(cands))
        # a suffix of v's shape with some dims set to 1 (always 1 where v has `?`)
        k = self.draw(st.integers(0, len(v[1])))
        shape = tuple(1 if d is None or self.draw(st.booleans()) else d for d in v[1][len(v[1]) - k:])
        self.const(shape, v[2])
        return self.values[-1]

    def op_binary(self):
        v = self.pick(lambda v: v[2] != "i1")
        if v is None:
            return
        w = self.partner(v)
        op = self.draw(st.sampled_from(["add", "sub", "mul", "div", "max", "min", "pow"]))
        a, b = (v, w) if self.draw(st.booleans()) else (w, v)
        self.emit("ge." + op, [a[0], b[0]], {}, [(broadcast(a[1], b[1]), v[2])])

    def op_compare(self):
        v = self.pick(lambda v: v[2] != "i1")
        if v is None:
            return
        w = self.partner(v)
        op = self.draw(st.sampled_from(["greater", "less", "equal"]))
        shape = broadcast(v[1], w[1])
        self.emit("ge." + op, [v[0], w[0]], {}, [(shape, "i1")])
        c = self.values[-1]
        if self.draw(st.booleans()):
            shape2 = broadcast(shape, broadcast(v[1], w[1]))
            self.emit("ge.select", [c[0], v[0], w[0]], {}, [(shape2, v[2])])

    def op_cast(self):
        v = self.pick()
        if v is None:
            return
        to = self.draw(st.sampled_from(DTYPES))
        self.emit("ge.cast", [v[0]], {"to": to}, [(v[1], to)])

    def axes_text(self, axes):
        return "[" + ", ".join(str(a) for a in axes) + "]"

    def op_reduce(self):
        v = self.pick(lambda v: v[2] in FLOATS)
        if v is None:
            return
        r = len(v[1])
        axes = self.draw(st.lists(st.integers(0, max(r - 1, 0)), unique=True, max_size=r)) if r else []
        spelled = [a - r if self.draw(st.booleans()) else a for a in axes]
        keep = self.draw(st.booleans())
        shape = tuple(1 if i in axes else d for i, d in enumerate(v[1])) if keep else tuple(
            d for i, d in enumerate(v[1]) if i not in axes)
        attrs = {"axes": self.axes_text(spelled)}
        if keep or self.draw(st.booleans()):
            attrs["keepdims"] = "true" if keep else "false"
        op = self.draw(st.sampled_from(["reduce_sum", "reduce_max", "reduce_mean"]))
        self.emit("ge." + op, [v[0]], attrs, [(shape, v[2])])

    def op_softmax(self):
        v = self.pick(lambda v: v[2] in FLOATS and len(v[1]) > 0)
        if v is None:
            return
        r = len(v[1])
        attrs = {}
        if self.draw(st.booleans()):
            attrs["axis"] = str(self.draw(st.integers(-r, r - 1)))
        self.emit("ge.softmax", [v[0]], attrs, [(v[1], v[2])])

    def op_matmul(self):
        v = self.pick(lambda v: len(v[1]) >= 2 and v[2] != "i1")
        if v is None:
            return
        # v @ v^T always fits: [..., M, K] x [..., K, M]
        ta = self.draw(st.booleans())
        m = v[1][-1] if ta else v[1][-2]
        attrs = {"transpose_b": "true"} if not ta else {"transpose_a": "true"}
        if ta:
            attrs["transpose_b"] = "false"
            # with transpose_a the left is [.., K, M]: use v as both, so contraction is v[-2] and result [M, M]
            out = v[1][:-2] + (m, v[1][-1])
        else:
            out = v[1][:-2] + (m, m)
        self.emit("ge.matmul", [v[0], v[0]], attrs, [(out, v[2])])

    def op_transpose(self):
        v = self.pick()
        if v is None:
            return
        perm = self.draw(st.permutations(list(range(len(v[1])))))
        self.emit("ge.transpose", [v[0]], {"perm": self.axes_text(perm)}, [(tuple(v[1][p] for p in perm), v[2])])

    def op_reshape(self):
        v = self.pick()
        if v is None:
            return
        shape = v[1]
        static = None not in shape
        total = math.prod(d for d in shape if d is not None)
        choice = self.draw(st.integers(0, 2))
        if choice == 0:
            target, out = [-1], (total if static else None,)
        elif choice == 1 and static:
            target, out = [total, 1], (total, 1)
        else:
            target, out = [1, -1], (1, total if static else None)
        self.emit("ge.reshape", [v[0]], {"shape": self.axes_text(target)}, [(out, v[2])])

    def op_concat(self):
        v = self.pick(lambda v: len(v[1]) > 0)
        if v is None:
            return
        r = len(v[1])
        axis = self.draw(st.integers(-r, r - 1))
        n = self.draw(st.integers(1, 3))
        shape = list(v[1])
        d = shape[axis]
        shape[axis] = None if d is None else d * n
        self.emit("ge.concat", [v[0]] * n, {"axis": str(axis)}, [(tuple(shape), v[2])])

    def op_split(self):
        v = self.pick(lambda v: any(d is not None and d >= 1 for d in v[1]))
        if v is None:
            return
        axes = [i for i, d in enumerate(v[1]) if d is not None and d >= 1]
        axis = self.draw(st.sampled_from(axes))
        d = v[1][axis]
        cut = self.draw(st.integers(0, d))
        sizes = [cut, d - cut]
        results = []
        for s in sizes:
            shape = list(v[1])
            shape[axis] = s
            results.append((tuple(shape), v[2]))
        self.emit("ge.split", [v[0]], {"axis": str(axis), "sizes": self.axes_text(sizes)}, results)

    def op_slice(self):
        v = self.pick(lambda v: len(v[1]) > 0)
        if v is None:
            return
        r = len(v[1])
        axis = self.draw(st.integers(0, r - 1))
        d = v[1][axis]
        bound = 6 if d is None else d + 2
        s, e = self.draw(st.integers(-bound, bound)), self.draw(st.integers(-bound, bound))
        shape = list(v[1])
        shape[axis] = None if d is None else len(range(d)[s:e])
        self.emit("ge.slice", [v[0]], {"axes": f"[{axis}]", "starts": f"[{s}]", "ends": f"[{e}]"}, [(tuple(shape), v[2])])

    def op_norm(self):
        v = self.pick(lambda v: v[2] in FLOATS and len(v[1]) > 0 and v[1][-1] is not None)
        if v is None:
            return
        last = v[1][-1:]
        self.const(last, v[2])
        g = self.values[-1]
        attrs = {}
        if self.draw(st.booleans()):
            attrs["epsilon"] = self.float_text(self.draw(st.floats(1e-9, 1.0)))
        if self.draw(st.booleans()):
            self.const(last, v[2])
            b = self.values[-1]
            if self.draw(st.booleans()):
                attrs["axis"] = "-1"
            self.emit("ge.layer_norm", [v[0], g[0], b[0]], attrs, [(v[1], v[2])])
        else:
            self.emit("ge.rms_norm", [v[0], g[0]], attrs, [(v[1], v[2])])

    def op_trans_data(self):
        v = self.pick()
        if v is None:
            return
        fmt = self.draw(st.sampled_from(["ND", "NZ"]))
        self.emit("ge.trans_data", [v[0]], {"dst_format": json.dumps(fmt)}, [(v[1], v[2])])
        # the result's storage format is the one asked for
        toks = self.lines[-1]
        if ":" in toks:
            toks[toks.index(":") + 1] = type_text(v[1], v[2], fmt)

    def op_const(self):
        dtype = self.draw(st.sampled_from(DTYPES))
        shape = tuple(self.draw(st.lists(st.integers(0, 3), max_size=3)))
        self.const(shape, dtype)

    def op_attention(self):
        v = self.pick(lambda v: len(v[1]) == 4 and v[2] in FLOATS and 0 not in v[1])
        if v is None:
            return
        attrs = {}
        if self.draw(st.booleans()):
            attrs["causal"] = self.draw(st.sampled_from(["true", "false"]))
        if self.draw(st.booleans()):
            attrs["scale"] = self.float_text(self.draw(st.floats(0.01, 2.0)))
        layout = self.draw(st.sampled_from([None, "BNSD", "BSND"]))
        if layout:
            attrs["layout"] = json.dumps(layout)
        self.emit("ge.flash_attention", [v[0], v[0], v[0]], attrs, [(v[1], v[2])])


def dense_tokens(body: str) -> list[str]:
    return ["dense<", body, ">"]


@st.composite
def shapes(draw, dynamic: bool = True):
    rank = draw(st.integers(0, 4))
    return tuple(None if dynamic and draw(st.integers(0, 5)) == 0 else draw(st.integers(1, 4)) for _ in range(rank))


def join(draw, tokens: list[str]) -> str:
    out = [tokens[0]]
    for prev, tok in zip(tokens, tokens[1:]):
        seps = SEPARATORS + ([""] if prev in PUNCT or tok in PUNCT_BEFORE else [])
        out.append(draw(st.sampled_from(seps)))
        out.append(tok)
    return "".join(out)


@st.composite
def programs(draw, max_ops: int = 10, max_graphs: int = 2) -> str:
    """Text of a random valid module."""
    names_of_graphs: list[str] = []
    texts: list[str] = []
    for _ in range(draw(st.integers(1, max_graphs))):
        gname = draw(st.from_regex(r"[A-Za-z_][A-Za-z0-9_$.\-]{0,6}", fullmatch=True).filter(
            lambda n: n not in names_of_graphs))
        names_of_graphs.append(gname)
        g = _Graph(draw, gname, set())
        args = []
        for _ in range(draw(st.integers(0, 3))):
            n = g.fresh()
            shape = draw(shapes())
            dtype = draw(st.sampled_from(FLOATS + FLOATS + INTS + ("i1",)))
            fmt = "NZ" if draw(st.integers(0, 7)) == 0 else "ND"
            args.append((n, shape, dtype, fmt))
            g.values.append((n, shape, dtype))
        if draw(st.booleans()):
            n = g.fresh()
            shape = tuple(draw(st.integers(1, 3)) for _ in range(4))
            args.append((n, shape, "f32", "ND"))
            g.values.append((n, shape, "f32"))
        for _ in range(draw(st.integers(0, max_ops))):
            g.step()
        if not g.values:
            g.op_const()
        k = draw(st.integers(0, min(3, len(g.values))))
        rets = [g.values[-1]] + [draw(st.sampled_from(g.values)) for _ in range(k - 1)] if k else []
        # trans_data results carry their format in the value's type only when annotated; keep returns plain
        head = ["ge.graph", "@" + gname, "("]
        for i, (n, shape, dtype, fmt) in enumerate(args):
            if i:
                head.append(",")
            head += ["%" + n, ":", type_text(shape, dtype, fmt)]
        head += [")", "->"]
        arg_fmt = {n: fmt for n, _, _, fmt in args}
        ret_types = [type_text(s, d, arg_fmt.get(n, "ND")) for n, s, d in rets]
        if len(rets) == 1 and draw(st.booleans()):
            head.append(ret_types[0])
        else:
            head.append("(")
            for i, t in enumerate(ret_types):
                if i:
                    head.append(",")
                head.append(t)
            head.append(")")
        if draw(st.integers(0, 3)) == 0:
            head += ["attributes", g.attr_dict()]
        head.append("{")
        lines = [join(draw, head)]
        for toks in g.lines:
            lines.append(join(draw, toks))
        ret = ["ge.return"]
        for i, (n, _, _) in enumerate(rets):
            if i:
                ret.append(",")
            ret.append("%" + n)
        lines.append(join(draw, ret))
        lines.append("}")
        sep = draw(st.sampled_from(["\n", "\n  ", "\n// between ops\n", " \n\t"]))
        texts.append(sep.join(lines))
    lead = draw(st.sampled_from(["", "// leading comment\n", "\n\n"]))
    return lead + "\n".join(texts) + draw(st.sampled_from(["", "\n", "\n// trailing"]))
