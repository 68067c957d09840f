"""A multi grader's `calculate_output`: arithmetic over its graders' scores, read with
Python's parser and evaluated by walking the tree, never by `eval`. Numbers, the graders'
names, `+ - * / ^` (`^` is a power, as in OpenAI's guide, read as Python's `**` so that it
binds tighter than `*` and from the right; `**` too), unary minus and
`min max abs floor ceil exp sqrt log`: anything else is refused where the grader is
checked, naming what it found."""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable, Mapping

_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
FUNCTIONS: dict[str, Callable[..., float]] = {
    "min": min,
    "max": max,
    "abs": abs,
    "floor": math.floor,
    "ceil": math.ceil,
    "exp": math.exp,
    "sqrt": math.sqrt,
    "log": math.log,
}
_ONE_ARGUMENT = {"abs", "floor", "ceil", "exp", "sqrt", "log"}
# A formula is a line of arithmetic; a longer or deeper one is a mistake or an attack on the
# parser (and evaluation recurses once per level).
MAX_LENGTH = 4096
MAX_DEPTH = 64


class FormulaError(ValueError):
    """The formula does not parse, or uses what a formula may not."""


class UnknownVariable(FormulaError):
    """The formula names something that is neither a grader nor a function."""


def _check(node: ast.AST, names: frozenset[str], depth: int = 0) -> None:
    if depth > MAX_DEPTH:
        raise FormulaError(f"nested deeper than {MAX_DEPTH} levels")
    depth += 1
    match node:
        case ast.Expression(body=body):
            _check(body, names, depth)
        case ast.Constant(value=value) if type(value) in (int, float):
            pass
        case ast.Name(id=name):
            if name not in names:
                raise UnknownVariable(
                    f"`{name}` is not one of the graders ({', '.join(sorted(names))})"
                )
        case ast.BinOp(left=left, op=op, right=right) if type(op) in _BINARY:
            _check(left, names, depth)
            _check(right, names, depth)
        case ast.UnaryOp(op=op, operand=operand) if type(op) in _UNARY:
            _check(operand, names, depth)
        case ast.Call(func=ast.Name(id=function), args=args, keywords=[]) if function in (
            FUNCTIONS
        ):
            if not args or (function in _ONE_ARGUMENT and len(args) != 1):
                raise FormulaError(f"{function}() takes {_arity(function)}")
            for arg in args:
                _check(arg, names, depth)
        case _:
            raise FormulaError(
                f"`{ast.unparse(node)}` is not allowed: a formula has numbers, the graders' "
                f"names, + - * / ^ and {', '.join(FUNCTIONS)}"
            )


def _arity(function: str) -> str:
    return "one argument" if function in _ONE_ARGUMENT else "one or more arguments"


def parse(formula: str, names: frozenset[str]) -> ast.Expression:
    """The formula's tree, checked against the graders' `names`."""
    if len(formula) > MAX_LENGTH:
        raise FormulaError(f"longer than {MAX_LENGTH} characters")
    try:
        # Python's `^` is an exclusive or, below `+` in precedence: never what a formula means.
        tree = ast.parse(formula.strip().replace("^", "**"), mode="eval")
    except SyntaxError as error:
        raise FormulaError(f"does not parse: {error.msg}") from None
    except RecursionError:
        raise FormulaError(f"nested deeper than {MAX_DEPTH} levels") from None
    except (ValueError, MemoryError) as error:
        raise FormulaError(f"does not parse: {type(error).__name__}") from None
    clash = names & FUNCTIONS.keys()
    if clash:
        raise FormulaError(f"a grader may not be named after a function: {sorted(clash)}")
    try:
        _check(tree, names)
    except RecursionError:
        raise FormulaError(f"nested deeper than {MAX_DEPTH} levels") from None
    return tree


def _value(node: ast.AST, scores: Mapping[str, float]) -> float:
    match node:
        case ast.Expression(body=body):
            return _value(body, scores)
        case ast.Constant(value=int() | float() as value):
            return float(value)
        case ast.Name(id=name):
            return float(scores[name])
        case ast.BinOp(left=left, op=op, right=right):
            value = _BINARY[type(op)](_value(left, scores), _value(right, scores))
            if isinstance(value, complex):  # a negative number to a fractional power
                raise ValueError("the result is not a real number")
            return float(value)
        case ast.UnaryOp(op=op, operand=operand):
            return float(_UNARY[type(op)](_value(operand, scores)))
        case ast.Call(func=ast.Name(id=function), args=args):
            return float(FUNCTIONS[function](*(_value(a, scores) for a in args)))
    raise FormulaError(f"`{ast.unparse(node)}` is not allowed")  # parse() let it through


def evaluate(tree: ast.Expression, scores: Mapping[str, float]) -> float:
    """The formula's value for these scores. Arithmetic that has no value (a division by
    zero, the log of a negative, an overflow) raises ArithmeticError or ValueError."""
    return _value(tree, scores)
