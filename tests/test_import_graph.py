"""No import circle anywhere in ``jrl/``: the module graph of every ``import`` statement (module level and inside
functions, where a circle used to hide) read from the source, must have no strongly connected component; and each
room imports only the rooms below it (the layout table of docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
    out = {}
    for path in (ROOT / "jrl").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the jrl modules it imports (``from a.b import c`` names ``a.b.c`` when that is a module)."""
    modules = _modules()

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                found = known(target) if target.startswith("jrl") else None
                if found and found != name:
                    graph[name].add(found)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


#: Rooms each room may import (besides the shared helpers :data:`HELPERS`).
BELOW = {
    "kernels": set(), "sharding": set(), "data": set(), "losses": {"kernels"}, "models": {"kernels", "sharding"},
    "rollout": {"models", "data", "sharding"}, "rewards": {"sharding"}, "sources": {"rollout", "data", "losses"},
    "explore": {"models", "sharding"}, "envs": {"rollout"},
    "train": {"kernels", "sharding", "data", "losses", "models", "rollout", "rewards", "sources", "explore", "envs"},
    "cli": {"kernels", "sharding", "data", "losses", "models", "rollout", "rewards", "sources", "explore", "envs",
            "train"},
}
HELPERS = {"_lazy", "validation", "registry", "errors"}


def test_rooms_import_only_the_rooms_below_them():
    wrong = sorted((a, b) for a, targets in import_graph().items() for b in targets
                   if (ra := a.split(".")[1]) != (rb := b.split(".")[1]) and ra in BELOW
                   and rb not in BELOW[ra] | HELPERS)
    assert wrong == []


def test_no_import_circle_in_jrl():
    assert circles(import_graph()) == []


def test_the_check_finds_a_circle():
    graph = import_graph()
    assert "jrl.train.learner" in graph["jrl.train.algorithms.grpo_update"]  # the graph is read from the source
    graph["jrl.train.learner"].add("jrl.train.algorithms.grpo_update")
    assert ["jrl.train.algorithms.grpo_update", "jrl.train.learner"] in circles(graph)


def _module_level_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The jrl modules ``name`` imports at module level (imports inside functions run at validation time only)."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("jrl")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jrl"):
            out |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                    for a in node.names}
    return out


#: Modules a config section may import although they are not config modules: the registries and name lists its
#: validation reads (a name must be one that is registered). Anything else a config module imports is an error.
CONFIG_READS = {
    "jrl.data.config": {"jrl.data.tasks", "jrl.data.tasks.arithmetic"},
    "jrl.losses.config": {"jrl.losses.advantages", "jrl.losses.importance", "jrl.losses.policy", "jrl.losses.registry"},
    "jrl.models.config": {"jrl.kernels.attention", "jrl.models.remat", "jrl.models.errors", "jrl.models.family",
                          "jrl.models.families"},
    "jrl.rollout.config": {"jrl.rollout.base", "jrl.rollout.weight_sync", "jrl.sharding.mesh"},
    "jrl.train.ebft_config": {"jrl.losses"},
    "jrl.train.config": {"jrl.kernels.attention", "jrl.models.remat", "jrl.sharding.mesh"},
}


def test_config_sections_import_config_sections_and_the_registries_they_validate_against():
    modules = _modules()
    configs = {n for n in modules if n.rpartition(".")[2] == "config" or n.endswith("_config")}
    helpers = {f"jrl.{h}" for h in HELPERS}
    extra = {name: sorted(_module_level_imports(name, modules[name], modules) - configs - helpers
                          - CONFIG_READS.get(name, set())) for name in sorted(configs)}
    assert {k: v for k, v in extra.items() if v} == {}
    assert {"jrl.train.config", "jrl.data.config", "jrl.models.lora_config", "jrl.rewards.config"} <= configs
