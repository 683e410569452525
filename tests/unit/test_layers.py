"""The shared runtime (kubekit) depends on no component and not on the local federation's
harness: the image and the manifests carry the runtime and the components only."""

import ast
import importlib
from pathlib import Path

import pytest

from kubekit import cli

ROOT = Path(__file__).resolve().parents[2]
ABOVE_KUBEKIT = {"virtual_node", "webhook", "multischeduler", "descheduler", "harness"}


def imported_packages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value.split(".")[0])
    return found


KUBEKIT = sorted((ROOT / "kubekit").rglob("*.py"))


@pytest.mark.parametrize("path", KUBEKIT, ids=lambda p: str(p.relative_to(ROOT)))
def test_kubekit_imports_no_component_and_no_harness(path: Path) -> None:
    allowed = {"harness"} if path == ROOT / "kubekit" / "cli.py" else set()
    assert not (imported_packages(path) & ABOVE_KUBEKIT) - allowed, path


def test_without_the_harness_the_command_runs_components_and_says_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.import_module

    def image_import(name: str, package: str | None = None) -> object:
        if name.split(".")[0] == "harness":
            raise ModuleNotFoundError(name)
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", image_import)
    assert cli.main(["up"]) == 2
    assert "the local federation's commands are not installed here" in capsys.readouterr().err
    with pytest.raises(SystemExit) as parsed:
        cli.main(["webhook", "--help"])
    assert parsed.value.code == 0
