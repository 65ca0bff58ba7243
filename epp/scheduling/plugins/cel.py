"""A small evaluator for the subset of CEL (Common Expression Language) that GIE's
``request-attribute-reporter`` expressions use.

Supported: literals (integers, decimal or ``0x`` hex; doubles; ``'…'`` / ``"…"`` strings;
``true``, ``false``, ``null``), the declared variables, field selection ``a.b``, indexing
``a["k"]`` / ``a[0]``, ``has(a.b)``, ``int()``, ``double()``, ``string()``, ``size()``,
unary ``!`` and ``-``, ``* / %``, ``+ -``, ``< <= > >= == !=``, ``in``, ``&&``, ``||``,
``? :`` and parentheses. Typing follows CEL at run time: arithmetic needs operands of one
type (a ``google.protobuf.Struct`` number, as every ``usage`` field is, is a double, so
``usage.prompt_tokens + 1`` is an error while ``usage.prompt_tokens + 1.0`` is not);
numbers of different types compare and test equal by value; ``&&`` and ``||`` absorb an
error on one side when the other side decides. An undeclared variable, an unknown
function or a syntax error fails :func:`compile_expression` (GIE compiles at startup).
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any


class CelError(Exception):
    """A compile error (bad syntax, unknown name) or an evaluation error."""


_TOKEN = re.compile(r"""
    \s*(?:
      (?P<double>(?:\d+\.\d*|\.\d+)(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+)
    | (?P<hex>0[xX][0-9a-fA-F]+)
    | (?P<int>\d+)
    | (?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')
    | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
    | (?P<op>&&|\|\||==|!=|<=|>=|[-+*/%!<>?:.,()\[\]])
    )""", re.VERBOSE)

_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"', "0": "\0"}
_FUNCTIONS = {"has", "int", "double", "string", "size"}

Node = tuple[Any, ...]


def _tokens(text: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            raise CelError(f"syntax error at column {pos + 1}: unexpected "
                           f"{text[pos:pos + 10].strip()!r}")
        pos = m.end()
        kind = m.lastgroup
        value = m.group(kind) if kind else ""
        if kind == "double":
            out.append(("lit", float(value)))
        elif kind == "hex":
            out.append(("lit", int(value, 16)))
        elif kind == "int":
            out.append(("lit", int(value)))
        elif kind == "string":
            out.append(("lit", re.sub(r"\\(.)", lambda e: _ESCAPES.get(e.group(1), e.group(1)),
                                      value[1:-1])))
        elif kind == "ident":
            if value in ("true", "false"):
                out.append(("lit", value == "true"))
            elif value == "null":
                out.append(("lit", None))
            elif value == "in":
                out.append(("op", "in"))
            else:
                out.append(("ident", value))
        else:
            out.append(("op", value))
    out.append(("end", None))
    return out


_BINARY = {"||": 1, "&&": 2, "==": 3, "!=": 3, "<": 3, "<=": 3, ">": 3, ">=": 3, "in": 3,
           "+": 4, "-": 4, "*": 5, "/": 5, "%": 5}


class _Parser:
    def __init__(self, text: str, variables: Collection[str]) -> None:
        self.toks = _tokens(text)
        self.i = 0
        self.variables = variables

    def peek(self) -> tuple[str, Any]:
        return self.toks[self.i]

    def take(self, op: str | None = None) -> tuple[str, Any]:
        tok = self.toks[self.i]
        if op is not None and tok != ("op", op):
            raise CelError(f"syntax error: expected {op!r}, got {tok[1]!r}")
        self.i += 1
        return tok

    def parse(self) -> Node:
        node = self.expr()
        if self.peek()[0] != "end":
            raise CelError(f"syntax error: unexpected {self.peek()[1]!r}")
        return node

    def expr(self) -> Node:
        cond = self.binary(1)
        if self.peek() == ("op", "?"):
            self.take()
            a = self.expr()
            self.take(":")
            b = self.expr()
            return ("cond", cond, a, b)
        return cond

    def binary(self, level: int) -> Node:
        left = self.unary()
        while True:
            kind, op = self.peek()
            prec = _BINARY.get(op) if kind == "op" else None
            if prec is None or prec < level:
                return left
            self.take()
            right = self.binary(prec + 1)
            left = ("bin", op, left, right)

    def unary(self) -> Node:
        if self.peek() in (("op", "!"), ("op", "-")):
            op = self.take()[1]
            return ("un", op, self.unary())
        return self.postfix(self.primary())

    def postfix(self, node: Node) -> Node:
        while True:
            tok = self.peek()
            if tok == ("op", "."):
                self.take()
                kind, name = self.take()
                if kind != "ident":
                    raise CelError(f"syntax error: expected a field name after '.', got {name!r}")
                node = ("sel", node, name)
            elif tok == ("op", "["):
                self.take()
                index = self.expr()
                self.take("]")
                node = ("idx", node, index)
            else:
                return node

    def primary(self) -> Node:
        kind, value = self.take()
        if kind == "lit":
            return ("lit", value)
        if kind == "op" and value == "(":
            node = self.expr()
            self.take(")")
            return node
        if kind == "ident":
            if self.peek() == ("op", "("):
                if value not in _FUNCTIONS:
                    raise CelError(f"undeclared reference to function {value!r}")
                self.take()
                args: list[Node] = []
                if self.peek() != ("op", ")"):
                    args.append(self.expr())
                    while self.peek() == ("op", ","):
                        self.take()
                        args.append(self.expr())
                self.take(")")
                if len(args) != 1:
                    raise CelError(f"{value}() takes one argument, got {len(args)}")
                if value == "has" and args[0][0] != "sel":
                    raise CelError("has() takes a field selection, e.g. has(usage.total_tokens)")
                return ("call", value, args[0])
            if value not in self.variables:
                raise CelError(f"undeclared reference to {value!r}")
            return ("var", value)
        raise CelError(f"syntax error: unexpected {value!r}")


def _type(v: Any) -> str:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "double"
    if isinstance(v, str):
        return "string"
    if v is None:
        return "null"
    if isinstance(v, Mapping):
        return "map"
    if isinstance(v, list):
        return "list"
    return type(v).__name__


def _num(v: Any) -> bool:
    return _type(v) in ("int", "double")


def _int64(v: int) -> int:
    if not -(1 << 63) <= v < (1 << 63):
        raise CelError("int overflow")
    return v


def _arith(op: str, a: Any, b: Any) -> Any:
    ta, tb = _type(a), _type(b)
    if ta != tb:
        raise CelError(f"no such overload: {ta} {op} {tb}")
    if op == "+" and ta in ("string", "list"):
        return a + b
    if ta == "int":
        if op in ("/", "%") and b == 0:
            raise CelError("division by zero" if op == "/" else "modulus by zero")
        if op == "/":
            return _int64(int(a / b) if (a < 0) != (b < 0) else a // b)
        if op == "%":
            return _int64(int(math.fmod(a, b)))
        return _int64({"+": a + b, "-": a - b, "*": a * b}[op])
    if ta == "double":
        if op == "%":
            raise CelError("no such overload: double % double")
        if op == "/":
            return a / b if b != 0 else (math.copysign(math.inf, a) if a else math.nan)
        return {"+": a + b, "-": a - b, "*": a * b}[op]
    raise CelError(f"no such overload: {ta} {op} {tb}")


def _equal(a: Any, b: Any) -> bool:
    if _num(a) and _num(b):
        return bool(a == b)
    if _type(a) != _type(b):
        return False
    return bool(a == b)


def _compare(op: str, a: Any, b: Any) -> bool:
    if not ((_num(a) and _num(b)) or (_type(a) == _type(b) and _type(a) in ("string", "bool"))):
        raise CelError(f"no such overload: {_type(a)} {op} {_type(b)}")
    return bool({"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[op])


class _Eval:
    def __init__(self, env: Mapping[str, Any]) -> None:
        self.env = env

    def run(self, n: Node) -> Any:
        kind = n[0]
        if kind == "lit":
            return n[1]
        if kind == "var":
            return self.env[n[1]]
        if kind == "sel":
            obj = self.run(n[1])
            if not isinstance(obj, Mapping):
                raise CelError(f"no such field {n[2]!r} on {_type(obj)}")
            if n[2] not in obj:
                raise CelError(f"no such key: {n[2]!r}")
            return obj[n[2]]
        if kind == "idx":
            obj, key = self.run(n[1]), self.run(n[2])
            if isinstance(obj, Mapping):
                if key not in obj:
                    raise CelError(f"no such key: {key!r}")
                return obj[key]
            if isinstance(obj, list) and _type(key) == "int":
                if not 0 <= key < len(obj):
                    raise CelError(f"index out of range: {key}")
                return obj[key]
            raise CelError(f"no such overload: {_type(obj)}[{_type(key)}]")
        if kind == "call":
            return self.call(n[1], n[2])
        if kind == "un":
            v = self.run(n[2])
            if n[1] == "!":
                if not isinstance(v, bool):
                    raise CelError(f"no such overload: !{_type(v)}")
                return not v
            if _type(v) == "int":
                return _int64(-v)
            if _type(v) == "double":
                return -v
            raise CelError(f"no such overload: -{_type(v)}")
        if kind == "cond":
            c = self.run(n[1])
            if not isinstance(c, bool):
                raise CelError(f"no such overload: {_type(c)} ? _ : _")
            return self.run(n[2] if c else n[3])
        op = n[1]
        if op in ("&&", "||"):
            return self.logic(op, n[2], n[3])
        a, b = self.run(n[2]), self.run(n[3])
        if op in ("==", "!="):
            return _equal(a, b) == (op == "==")
        if op in ("<", "<=", ">", ">="):
            return _compare(op, a, b)
        if op == "in":
            if isinstance(b, (Mapping, list)):
                return any(_equal(a, x) for x in b)
            raise CelError(f"no such overload: {_type(a)} in {_type(b)}")
        return _arith(op, a, b)

    def logic(self, op: str, left: Node, right: Node) -> bool:
        decisive = op == "||"  # the value that decides alone
        err: CelError | None = None
        for side in (left, right):
            try:
                v = self.run(side)
            except CelError as e:
                err = err or e
                continue
            if not isinstance(v, bool):
                err = err or CelError(f"no such overload: {_type(v)} {op} _")
                continue
            if v is decisive:
                return decisive
        if err is not None:
            raise err
        return not decisive

    def call(self, fn: str, arg: Node) -> Any:
        if fn == "has":
            obj = self.run(arg[1])
            if not isinstance(obj, Mapping):
                raise CelError(f"has(): no such field {arg[2]!r} on {_type(obj)}")
            return arg[2] in obj
        v = self.run(arg)
        if fn == "size":
            if isinstance(v, (str, list, Mapping)):
                return len(v)
            raise CelError(f"no such overload: size({_type(v)})")
        if fn == "int":
            if _type(v) in ("int", "double"):
                if isinstance(v, float) and not math.isfinite(v):
                    raise CelError("int() of a non-finite double")
                return _int64(int(v))
            if _type(v) == "string":
                try:
                    return _int64(int(v))
                except ValueError:
                    raise CelError(f"int(): cannot parse {v!r}") from None
            raise CelError(f"no such overload: int({_type(v)})")
        if fn == "double":
            if _type(v) in ("int", "double"):
                return float(v)
            if _type(v) == "string":
                try:
                    return float(v)
                except ValueError:
                    raise CelError(f"double(): cannot parse {v!r}") from None
            raise CelError(f"no such overload: double({_type(v)})")
        if fn == "string":
            if isinstance(v, bool):
                return "true" if v else "false"
            if _type(v) in ("int", "double", "string"):
                return str(v)
            raise CelError(f"no such overload: string({_type(v)})")
        raise CelError(f"undeclared reference to function {fn!r}")  # pragma: no cover


@dataclass(frozen=True)
class Program:
    """A compiled expression; :meth:`eval` raises :class:`CelError` on a run-time error."""

    text: str
    tree: Node

    def eval(self, env: Mapping[str, Any]) -> Any:
        return _Eval(env).run(self.tree)


def compile_expression(text: str, variables: Collection[str]) -> Program:
    """Parse ``text`` with ``variables`` declared; raises :class:`CelError`."""
    if not text.strip():
        raise CelError("empty expression")
    return Program(text, _Parser(text, variables).parse())


def struct_value(v: Any) -> Any:
    """A JSON value as a ``google.protobuf.Struct`` holds it (every number a double)."""
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, Mapping):
        return {str(k): struct_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [struct_value(x) for x in v]
    return str(v)


