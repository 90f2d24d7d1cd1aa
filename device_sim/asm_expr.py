"""Integer expressions of CTPU assembly operands and `.equ` constants, evaluated without `eval`.

Grammar (precedence as in Python, lowest first):

    expr    := xor ('|' xor)*
    xor     := and ('^' and)*
    and     := shift ('&' shift)*
    shift   := sum (('<<' | '>>') sum)*
    sum     := product (('+' | '-') product)*
    product := unary (('*' | '//' | '%') unary)*
    unary   := ('-' | '+' | '~') unary | atom
    atom    := number | name | name '(' expr ')' | '(' expr ')'

Numbers are decimal, 0x hex or 0b binary integers, or decimal floats (`1.5`, `2e-3`). Floats exist only to
be turned into bit patterns by f32() / bf16(); an operand whose value is still a float is an error.
Functions: f32(x) and bf16(x) give the IEEE bit pattern (unsigned), hi(x) = (x >> 16) & 0xffff,
lo(x) = x & 0xffff. Names are looked up through a callback, so the assembler decides what labels and
constants mean (and can resolve them lazily, before their definition).
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Callable

Number = int | float

_TOKEN = re.compile(r"""
    \s*(?:
      (?P<num>0[xX][0-9a-fA-F_]+|0[bB][01_]+|(?:\d+\.\d*|\.\d+)(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+|\d+)
    | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
    | (?P<op>//|<<|>>|[-+*%&|^~(),])
    )""", re.VERBOSE)

# Shifting by more than this is certainly a mistake, and 1 << 10**9 would hang the assembler.
MAX_SHIFT = 256


class ExprError(ValueError):
    """An expression that cannot be evaluated; the message says why, without file or line."""


def f32_bits(x: Number) -> int:
    """Bit pattern of x rounded to float32 (nearest even), as an unsigned int."""
    try:
        return struct.unpack("<I", struct.pack("<f", x))[0]
    except OverflowError:
        raise ExprError(f"f32({x}) overflows float32") from None


def bf16_bits(x: Number) -> int:
    """Bit pattern of x rounded once, to nearest even, straight to bf16 (no double rounding via fp32)."""
    x = float(x)
    if math.isnan(x):
        return 0x7FC0
    if x == 0 or math.isinf(x):
        return f32_bits(x) >> 16
    _, exp = math.frexp(x)  # |x| = m * 2**exp with 0.5 <= m < 1
    # bf16 keeps 8 significant bits; below the normal range its quantum stays 2**-133.
    quantum = 2.0 ** max(exp - 8, -133)
    rounded = round(x / quantum) * quantum  # x / quantum is exact; round() is half-to-even
    if abs(rounded) >= 2.0 ** 128:
        raise ExprError(f"bf16({x}) overflows bf16")
    return f32_bits(rounded) >> 16


def _need_int(fn: str, x: Number) -> int:
    if not isinstance(x, int):
        raise ExprError(f"{fn}() needs an integer, got {x}")
    return x


FUNCTIONS: dict[str, Callable[[Number], int]] = {
    "f32": f32_bits,
    "bf16": bf16_bits,
    "hi": lambda x: (_need_int("hi", x) >> 16) & 0xFFFF,
    "lo": lambda x: _need_int("lo", x) & 0xFFFF,
}


def _tokenize(text: str) -> list[tuple[str, str]]:
    tokens = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            char = text[pos:].lstrip()[:1]
            raise ExprError(f"unexpected character {char!r} in expression {text.strip()!r}")
        kind = m.lastgroup
        assert kind is not None
        tokens.append((kind, m.group(kind)))
        pos = m.end()
    return tokens


def _parse_number(tok: str) -> Number:
    t = tok.replace("_", "")
    if t[:2] in ("0x", "0X"):
        return int(t, 16)
    if t[:2] in ("0b", "0B"):
        return int(t, 2)
    if any(c in t for c in ".eE"):
        return float(t)
    return int(t, 10)


def _binary(op: str, a: Number, b: Number) -> Number:
    if op in "+-*":
        return a + b if op == "+" else a - b if op == "-" else a * b
    if not (isinstance(a, int) and isinstance(b, int)):
        raise ExprError(f"operator {op!r} needs integers, got {a} and {b}")
    if op in ("//", "%"):
        if b == 0:
            raise ExprError("division by zero")
        return a // b if op == "//" else a % b
    if op in ("<<", ">>"):
        if not 0 <= b <= MAX_SHIFT:
            raise ExprError(f"shift count {b} out of range 0..{MAX_SHIFT}")
        return a << b if op == "<<" else a >> b
    return a & b if op == "&" else a | b if op == "|" else a ^ b


# Binary operators by precedence level, lowest first.
_LEVELS: tuple[tuple[str, ...], ...] = (("|",), ("^",), ("&",), ("<<", ">>"), ("+", "-"), ("*", "//", "%"))


class _Parser:
    def __init__(self, text: str, lookup: Callable[[str], int]) -> None:
        self.text = text.strip()
        self.tokens = _tokenize(text)
        self.pos = 0
        self.lookup = lookup

    def peek(self) -> str | None:
        return self.tokens[self.pos][1] if self.pos < len(self.tokens) else None

    def take(self) -> tuple[str, str]:
        if self.pos >= len(self.tokens):
            raise ExprError(f"expression {self.text!r} ends too early")
        tok = self.tokens[self.pos]
        self.pos += 1
        return tok

    def expect(self, op: str) -> None:
        kind, tok = self.take()
        if kind != "op" or tok != op:
            raise ExprError(f"expected {op!r} but found {tok!r} in expression {self.text!r}")

    def parse(self) -> Number:
        if not self.tokens:
            raise ExprError("empty expression")
        value = self.level(0)
        if self.pos != len(self.tokens):
            raise ExprError(f"unexpected {self.tokens[self.pos][1]!r} in expression {self.text!r}")
        return value

    def level(self, n: int) -> Number:
        if n == len(_LEVELS):
            return self.unary()
        value = self.level(n + 1)
        while self.peek() in _LEVELS[n] and self.tokens[self.pos][0] == "op":
            _, op = self.take()
            value = _binary(op, value, self.level(n + 1))
        return value

    def unary(self) -> Number:
        if self.peek() in ("-", "+", "~") and self.tokens[self.pos][0] == "op":
            _, op = self.take()
            value = self.unary()
            if op == "-":
                return -value
            if op == "~":
                return ~_need_int("~", value)
            return value
        return self.atom()

    def atom(self) -> Number:
        kind, tok = self.take()
        if kind == "num":
            return _parse_number(tok)
        if kind == "name":
            if self.peek() == "(":
                fn = FUNCTIONS.get(tok)
                if fn is None:
                    raise ExprError(f"unknown function {tok!r} (known: {', '.join(FUNCTIONS)})")
                self.expect("(")
                arg = self.level(0)
                self.expect(")")
                return fn(arg)
            if tok in FUNCTIONS:
                raise ExprError(f"{tok} is a function: write {tok}(x)")
            return self.lookup(tok)
        if tok == "(":
            value = self.level(0)
            self.expect(")")
            return value
        raise ExprError(f"unexpected {tok!r} in expression {self.text!r}")


def evaluate(text: str, lookup: Callable[[str], int]) -> Number:
    """Value of `text`; `lookup(name)` gives a symbol's value or raises ExprError."""
    return _Parser(text, lookup).parse()


def evaluate_int(text: str, lookup: Callable[[str], int]) -> int:
    """Like evaluate, but the result must be an integer (an operand or a constant)."""
    value = evaluate(text, lookup)
    if not isinstance(value, int):
        raise ExprError(f"{text.strip()!r} is the float {value}; use f32(...) or bf16(...) for its bits")
    return value
