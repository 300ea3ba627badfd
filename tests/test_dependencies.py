"""What the runtime imports is what a runtime install brings.

`bash scripts/demo.sh` installs radixrt without its `dev` extra, so every third-party module that radixrt,
frontend_lang or the demo's examples import at module level must come from a runtime dependency in
pyproject.toml (directly or through one of their own requirements). A module imported only inside a
function (an optional backend such as `openai`, `flashinfer`) is not required.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO_EXAMPLES = ["demo.py", "common.py", "react_agent.py", "classify.py"]
FIRST_PARTY = {"radixrt", "frontend_lang", "common", "classify", "react_agent", "demo"}
# Modules of optional extras, imported only by modules that are themselves loaded on demand (the attention
# backend registry imports `radixrt.kernels.flashinfer_backend` only when that backend is asked for).
OPTIONAL = {"flashinfer": "the gpu extra"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(req: str) -> str:
    return _norm(re.split(r"[\s<>=!~;\[(]", req.strip(), maxsplit=1)[0])


def module_level_imports(source: str) -> set[str]:
    """Top-level module names imported by statements that run at import time: module-level statements
    and those nested in module-level `if` / `try` blocks, except `if TYPE_CHECKING:` bodies."""
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
            elif isinstance(node, ast.If):
                if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)

    visit(ast.parse(source).body)
    return found


def runtime_closure() -> set[str]:
    """The normalized distribution names a runtime install brings: pyproject's dependencies and theirs."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    todo = [_requirement_name(d) for d in deps]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        todo.extend(_requirement_name(r) for r in requires if "extra ==" not in r)
    return seen


def test_import_scanner_sees_runtime_imports_only() -> None:
    src = (
        "import a.b\nfrom c import d\nif TYPE_CHECKING:\n    import e\ntry:\n    import f\nexcept ImportError:\n"
        "    pass\ndef g():\n    import h\nfrom . import i\n"
    )
    assert module_level_imports(src) == {"a", "c", "f"}


def test_runtime_imports_come_from_runtime_dependencies() -> None:
    files = [*ROOT.glob("radixrt/**/*.py"), *ROOT.glob("frontend_lang/**/*.py")]
    files += [ROOT / "examples" / name for name in DEMO_EXAMPLES]
    providers = md.packages_distributions()
    closure = runtime_closure()
    missing: dict[str, set[str]] = {}
    for path in files:
        for module in module_level_imports(path.read_text()):
            if module in sys.stdlib_module_names or module in FIRST_PARTY or module in OPTIONAL:
                continue
            dists = {_norm(d) for d in providers.get(module, [])}
            assert dists, (
                f"{path.relative_to(ROOT)} imports {module}, which no installed distribution provides"
            )
            if not dists & closure:
                missing.setdefault(module, set()).add(str(path.relative_to(ROOT)))
    assert missing == {}, f"imported at module level but not a runtime dependency: {missing}"
