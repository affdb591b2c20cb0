"""The allocator's shape, checked: short functions, no reads of another class's private
attributes, no import circles, one module per checkpoint policy and per group kind, and a new
policy that needs nothing but its own class."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from hybridkv import models
from hybridkv.alloc import HybridAllocator
from hybridkv.alloc.groups import MANAGER_CLASSES, GroupManager
from hybridkv.alloc.policies import POLICY_CLASSES, LastPolicy
from hybridkv.alloc.policies import registry as policy_registry
from hybridkv.layouts import make_plan

ALLOC = Path(__file__).resolve().parents[1] / "hybridkv" / "alloc"
#: the consistency checker lists every invariant in one place: it may be long
LONG_ALLOWED = {("check.py", "check_consistency")}
MAX_LINES = 60


def _modules() -> list[Path]:
    return sorted(ALLOC.rglob("*.py"))


def _body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of a function, its docstring aside."""
    body = fn.body
    first = body[0]
    is_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    start = body[1].lineno if is_doc and len(body) > 1 else first.lineno
    return fn.end_lineno - start + 1  # type: ignore[operator]


def test_no_function_over_sixty_lines():
    long = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = _body_lines(node)
                if n > MAX_LINES and (path.name, node.name) not in LONG_ALLOWED:
                    long.append(f"{path.relative_to(ALLOC)}:{node.lineno} {node.name} ({n})")
    assert not long, f"functions over {MAX_LINES} lines: {long}"


def _is_own(value: ast.expr) -> bool:
    """``self._x``, ``cls._x`` or ``super()._x``: an object's own private attribute."""
    if isinstance(value, ast.Name):
        return value.id in ("self", "cls")
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Name)
        and value.func.id == "super"
    )


def test_no_reads_of_other_objects_private_attributes():
    found = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and not _is_own(node.value)
            ):
                found.append(f"{path.relative_to(ALLOC)}:{node.lineno} .{node.attr}")
    assert not found, f"private attributes of other objects: {found}"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ALLOC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Modules of ``hybridkv.alloc`` that ``path`` imports at module level (type-checking
    imports included: a circle there is still a circle for a reader)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    tree = ast.parse(path.read_text())
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If):  # if TYPE_CHECKING:
            stack.extend(node.body)
        elif isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")
            base = base[: len(base) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
            out.add(target)
    return {m for m in out if m.startswith("alloc")}


def test_no_import_circle():
    graph = {_module_name(p): _imports(p) for p in _modules()}
    # a package's __init__ imports its modules; a module importing its package back is the
    # circle that matters, so the edges from a package to its own modules are left out
    for pkg in graph:
        graph[pkg] = {m for m in graph[pkg] if not m.startswith(pkg + ".")}
    seen: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m: str, path: list[str]) -> None:
        seen[m] = 1
        for nxt in sorted(graph.get(m, ())):
            if seen.get(nxt) == 1:
                raise AssertionError(f"import circle: {' -> '.join([*path, m, nxt])}")
            if nxt not in seen:
                visit(nxt, [*path, m])
        seen[m] = 2

    for m in sorted(graph):
        if m not in seen:
            visit(m, [])


def test_one_module_per_policy_and_per_group_kind():
    modules = [cls.__module__ for cls in POLICY_CLASSES.values()]
    assert len(set(modules)) == len(modules), modules
    assert all(name == cls.name for name, cls in POLICY_CLASSES.items())
    modules = [cls.__module__ for cls in MANAGER_CLASSES]
    assert len(set(modules)) == len(modules), modules
    kinds = [k for cls in MANAGER_CLASSES for k in cls.kinds]
    assert len(set(kinds)) == len(kinds) and issubclass(MANAGER_CLASSES[0], GroupManager)


class EveryOtherUnit(LastPolicy):
    """A policy a user might add: ``last``, plus a state at every second hash unit a step
    ends on inside the prompt (a test of the protocol, not a proposal)."""

    name = "every_other_unit"

    def step_end(self, r, P, known, act):
        if known == P and 0 < P < r.nprompt and P % (2 * self.h) == 0:
            act.keep(r, P)
        super().step_end(r, P, known, act)

    def chunk_stops(self, r):
        return [*super().chunk_stops(r), (r.num_alloc // (2 * self.h) + 1) * 2 * self.h]


def test_a_new_policy_is_one_class(monkeypatch):
    monkeypatch.setitem(POLICY_CLASSES, EveryOtherUnit.name, EveryOtherUnit)
    assert policy_registry.policy_class("every_other_unit") is EveryOtherUnit
    plan = make_plan(models.load("qwen3.5-0.8b"), "per_group", memory="2GiB", max_num_seqs=4)
    a = HybridAllocator(plan, checkpoint_policy="every_other_unit", hash_block_size=16)
    prompt = list(range(1, 101))
    a.add_request("a", prompt)
    ends = []
    while a.num_tokens("a") < len(prompt):
        n = a.prefill_chunk("a", len(prompt) - a.num_tokens("a"))
        assert n > 0 and a.allocate_slots("a", n)
        a.take_state_copies()
        ends.append(a.num_tokens("a"))
    assert ends == [32, 64, 96, 100]  # chunks end where the policy keeps states
    a.free("a")
    # a prompt sharing 70 tokens hits the state at 64 the new policy kept
    assert a.find_longest_cache_hit([*range(1, 71), 999, 998]) == 64


def test_an_unknown_policy_says_which_exist():
    with pytest.raises(ValueError, match="checkpoint_policy must be one of align, last"):
        HybridAllocator(
            make_plan(models.load("qwen3.5-0.8b"), "per_group", memory="2GiB", max_num_seqs=4),
            checkpoint_policy="nope",
        )
