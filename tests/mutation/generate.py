"""Generated mutants: single-line edits of a module, found by walking its syntax tree (stdlib ``ast``).

Kinds (each a realistic one-token bug):

- ``cmp``: a comparison flipped at its boundary or negated (``<`` ``<=``, ``>`` ``>=``, ``==`` ``!=``,
  ``is`` ``is not``, ``in`` ``not in``);
- ``arith``: ``+`` and ``-`` swapped (also ``+=`` / ``-=``);
- ``const``: an integer constant off by one (``n`` -> ``n + 1``);
- ``cond``: the test of an ``if`` / ``while`` / conditional expression replaced by ``True`` or ``False``;
- ``drop``: a statement with an effect (a call, an augmented or attribute / item assignment, a
  ``raise``, an early ``return`` inside an ``if``) replaced by ``pass``;
- ``swap``: two neighbouring positional arguments of the same kind swapped (two names, two
  attributes, two constants of one type), except in calls symmetric in them (``SYMMETRIC``);
- ``detach``: ``x.detach()`` / ``x.clone()`` replaced by ``x``.

Nothing inside an ``assert`` (internal invariants) or in the exception a ``raise`` builds (its
message) is mutated, nor a line marked ``# pragma: no mutate``. A mutant whose text does not
compile, or parses to the same tree, is left out. Ids are ``module:line:kind:n`` (``n`` counts the
mutants of that kind on that line, left to right); the order is by line, then column, then kind.
The ``fingerprint`` (the original and mutated line, hashed) names a mutant across line moves: the
allow-list of equivalent mutants (``equivalent.txt``) uses it.
"""

from __future__ import annotations

import ast
import copy
import hashlib
from dataclasses import dataclass
from pathlib import Path

KINDS = ("cmp", "arith", "const", "cond", "drop", "swap", "detach")
_FLIP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
         ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
_ARITH = {ast.Add: ast.Sub, ast.Sub: ast.Add}
SKIP_MARK = "pragma: no mutate"


@dataclass(frozen=True)
class Generated:
    module: str          # path relative to the repository root
    line: int            # 1-based
    col: int             # where the mutated node starts (orders mutants of one line)
    kind: str
    n: int
    old: str             # the original line (without its newline)
    new: str             # the mutated line

    @property
    def id(self) -> str:
        return f"{self.module}:{self.line}:{self.kind}:{self.n}"

    @property
    def fingerprint(self) -> str:
        text = f"{self.kind}\0{self.old.strip()}\0{self.new.strip()}"
        return hashlib.sha1(text.encode()).hexdigest()[:10]

    def apply(self, source: str) -> str:
        """``source`` (the module's text) with this mutant's line in place of the original."""
        lines = source.splitlines(keepends=True)
        original = lines[self.line - 1]
        assert original.rstrip("\r\n") == self.old, f"{self.id}: the module changed since the mutants were made"
        lines[self.line - 1] = self.new + original[len(original.rstrip("\r\n")):]
        return "".join(lines)


def _splice(line: str, start: int, end: int, text: str) -> str:
    """``line`` with its UTF-8 byte range ``[start, end)`` (``ast`` column offsets) replaced by ``text``."""
    raw = line.encode()
    return (raw[:start] + text.encode() + raw[end:]).decode()


def _segment(line: str, node: ast.AST) -> str:
    return line.encode()[node.col_offset:node.end_col_offset].decode()


def _one_line(node: ast.AST) -> bool:
    return getattr(node, "lineno", None) is not None and node.lineno == node.end_lineno


def _protected(tree: ast.AST) -> set[int]:
    """ids of the nodes never mutated: inside ``assert``, the exception of ``raise``, docstrings."""
    out: set[int] = set()
    for node in ast.walk(tree):
        roots = []
        if isinstance(node, ast.Assert):
            roots = [node]
        elif isinstance(node, ast.Raise) and node.exc is not None:
            roots = [node.exc] + ([node.cause] if node.cause is not None else [])
        elif isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                roots = [first]
        for root in roots:
            out.update(id(n) for n in ast.walk(root))
    return out


def _parents(tree: ast.AST) -> dict[int, ast.AST]:
    return {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _same_kind(a: ast.expr, b: ast.expr) -> bool:
    if isinstance(a, ast.Constant) and isinstance(b, ast.Constant):
        return type(a.value) is type(b.value) and a.value != b.value
    return type(a) is type(b) and isinstance(a, (ast.Name, ast.Attribute))


def _edits(node: ast.AST, line: str, parents: dict[int, ast.AST]):
    """``(kind, replacement line)`` for each mutant of ``node`` (a single-line node of ``line``)."""
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            if type(op) in _FLIP:
                new = copy.deepcopy(node)
                new.ops[i] = _FLIP[type(op)]()
                yield "cmp", _splice(line, node.col_offset, node.end_col_offset, ast.unparse(new))
    elif isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
        if not any(isinstance(side, (ast.JoinedStr, ast.Constant)) and isinstance(getattr(side, "value", 0), str)
                   for side in (node.left, node.right)):
            new = copy.deepcopy(node)
            new.op = _ARITH[type(node.op)]()
            yield "arith", _splice(line, node.col_offset, node.end_col_offset, ast.unparse(new))
    elif isinstance(node, ast.AugAssign) and type(node.op) in _ARITH:
        new = copy.deepcopy(node)
        new.op = _ARITH[type(node.op)]()
        yield "arith", _splice(line, node.col_offset, node.end_col_offset, ast.unparse(new))
    elif isinstance(node, ast.Constant) and type(node.value) is int:
        if not isinstance(parents.get(id(node)), ast.JoinedStr):
            yield "const", _splice(line, node.col_offset, node.end_col_offset, repr(node.value + 1))
    elif isinstance(node, ast.Call):
        yield from _call_edits(node, line)
    if isinstance(node, (ast.If, ast.While, ast.IfExp)) and _one_line(node.test) \
            and node.test.lineno == node.lineno and not isinstance(node.test, ast.Constant):
        for value in ("True", "False"):
            yield "cond", _splice(line, node.test.col_offset, node.test.end_col_offset, value)
    if _droppable(node, parents):
        yield "drop", _splice(line, node.col_offset, node.end_col_offset, "pass")


# Calls whose result does not depend on the order of their positional arguments: a swap there is
# the same program (``x.transpose(1, 2)``, ``torch.equal(a, b)``, ``max(a, b)``; ``records_grad``
# is an ``any()`` over its arguments).
SYMMETRIC = frozenset({"transpose", "swapaxes", "swapdims", "equal", "maximum", "minimum", "max", "min",
                       "records_grad"})


def _call_edits(node: ast.Call, line: str):
    args = node.args
    name = getattr(node.func, "attr", getattr(node.func, "id", None))
    for a, b in zip(args, args[1:]) if name not in SYMMETRIC else ():
        if _one_line(a) and _one_line(b) and _same_kind(a, b) and not isinstance(a, ast.Starred):
            left, right = _segment(line, a), _segment(line, b)
            if left != right:
                swapped = _splice(line, b.col_offset, b.end_col_offset, left)
                yield "swap", _splice(swapped, a.col_offset, a.end_col_offset, right)
    func = node.func
    if isinstance(func, ast.Attribute) and func.attr in ("detach", "clone") and not node.args and not node.keywords:
        yield "detach", _splice(line, node.col_offset, node.end_col_offset, _segment(line, func.value))


def _droppable(node: ast.AST, parents: dict[int, ast.AST]) -> bool:
    if isinstance(node, ast.Expr):
        return isinstance(node.value, (ast.Call, ast.Await))
    if isinstance(node, (ast.AugAssign, ast.Raise)):
        return True
    if isinstance(node, ast.Assign):
        return all(isinstance(t, (ast.Attribute, ast.Subscript)) for t in node.targets)
    if isinstance(node, ast.Return):
        return isinstance(parents.get(id(node)), ast.If)
    return False


def mutants_of_source(module: str, source: str) -> list[Generated]:
    """Every mutant of ``source`` (the text of ``module``), in id order."""
    tree = ast.parse(source)
    lines = source.splitlines()
    protected, parents = _protected(tree), _parents(tree)
    reference = ast.dump(tree)
    found: dict[tuple[int, int, str, str], None] = {}
    for node in ast.walk(tree):
        block = isinstance(node, (ast.If, ast.While))       # only its test is mutated: one line is enough
        if id(node) in protected or not (_one_line(node) or block and node.test.lineno == node.lineno):
            continue
        line = lines[node.lineno - 1]
        if SKIP_MARK in line:
            continue
        for kind, new in _edits(node, line, parents):
            found.setdefault((node.lineno, node.col_offset, kind, new), None)
    out, counts = [], {}
    for lineno, col, kind, new in sorted(found, key=lambda k: (k[0], k[1], KINDS.index(k[2]), k[3])):
        old = lines[lineno - 1]
        text = "\n".join(lines[:lineno - 1] + [new] + lines[lineno:])
        try:
            if ast.dump(ast.parse(text)) == reference:
                continue
        except SyntaxError:
            continue
        n = counts.get((lineno, kind), 0)
        counts[(lineno, kind)] = n + 1
        out.append(Generated(module, lineno, col, kind, n, old, new))
    return out


def mutants_of(root: Path, module: str) -> list[Generated]:
    """The mutants of the file ``root / module``."""
    return mutants_of_source(module, (Path(root) / module).read_text())


def product_modules(root: Path, packages=("ssm_pack", "mixers")) -> list[str]:
    """Every ``.py`` file of the product packages, relative to ``root``, sorted."""
    root = Path(root)
    return sorted(str(p.relative_to(root)) for pkg in packages for p in (root / pkg).rglob("*.py")
                  if "__pycache__" not in p.parts)
