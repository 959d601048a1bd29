"""The digest that decides whether scripts/image.py builds an image again: it must change with
anything the build copies, and only then (the image tests would otherwise run a stale image)."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.image import context_digest

IGNORE = "# comment\n*\n!pyproject.toml\n!outbox\n!scripts/jvm/spark\n**/__pycache__\n"


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    files = {
        "helm/Dockerfile": "FROM python:3.11-slim\n",
        "helm/Dockerfile.dockerignore": IGNORE,
        "pyproject.toml": "[project]\n",
        "outbox/__init__.py": "x = 1\n",
        "outbox/sub/deep.py": "y = 2\n",
        "scripts/jvm/spark/pom.xml": "<project/>\n",
        "scripts/services.py": "# not in the context\n",
        "tests/test_x.py": "# not in the context\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    "changed",
    [
        "helm/Dockerfile",
        "helm/Dockerfile.dockerignore",
        "pyproject.toml",
        "outbox/__init__.py",
        "outbox/sub/deep.py",
        "scripts/jvm/spark/pom.xml",
    ],
)
def test_a_change_to_what_the_build_copies_changes_the_digest(tree: Path, changed: str) -> None:
    before = context_digest("sidecar", tree)
    (tree / changed).write_text((tree / changed).read_text() + "# edited\n")
    assert context_digest("sidecar", tree) != before


def test_a_file_added_to_a_copied_folder_changes_the_digest(tree: Path) -> None:
    before = context_digest("sidecar", tree)
    (tree / "outbox" / "new.py").write_text("")
    assert context_digest("sidecar", tree) != before


def test_a_file_moved_between_copied_folders_changes_the_digest(tree: Path) -> None:
    before = context_digest("sidecar", tree)
    (tree / "outbox/sub/deep.py").rename(tree / "outbox/deep.py")
    assert context_digest("sidecar", tree) != before


def test_files_outside_the_context_and_bytecode_leave_it_alone(tree: Path) -> None:
    before = context_digest("sidecar", tree)
    (tree / "scripts/services.py").write_text("# edited\n")
    (tree / "tests/test_x.py").write_text("# edited\n")
    (tree / "outbox/__pycache__").mkdir()
    (tree / "outbox/__pycache__/x.cpython-311.pyc").write_bytes(b"\0")
    assert context_digest("sidecar", tree) == before


def test_each_target_has_its_own_digest(tree: Path) -> None:
    assert context_digest("sidecar", tree) != context_digest("reconcile", tree)


def test_an_ignore_file_that_is_not_an_allow_list_means_always_build(tree: Path) -> None:
    (tree / "helm/Dockerfile.dockerignore").write_text(".local\n.venv\n")
    assert context_digest("sidecar", tree) is None


def test_the_projects_own_ignore_file_is_read_as_an_allow_list() -> None:
    assert context_digest("sidecar") is not None


def test_podman_is_installed_before_it_is_asked_for_the_built_image(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On a new machine (no Docker engine, no podman yet) the build asked podman whether the
    image was built already, before it installed podman: both image builds failed."""
    import subprocess

    from scripts import image

    installed: list[str] = []
    digest = image.context_digest("sidecar")

    def run(command: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        if command[0] == "podman" and not installed:
            raise FileNotFoundError(2, "No such file or directory", "podman")
        assert "build" not in command, "built again: the image was there"
        return subprocess.CompletedProcess(command, 0, stdout=f"{digest}\n", stderr="")

    monkeypatch.setattr(image, "engine", image.podman)
    monkeypatch.setattr(image, "STORE", tmp_path)
    monkeypatch.setattr(image.shutil, "which", lambda tool: None)  # a new machine
    monkeypatch.setattr(image, "install_tools", lambda: installed.append("podman"))
    monkeypatch.setattr(image.subprocess, "run", run)
    assert image._build("sidecar") == f"localhost/{image.TARGETS['sidecar']}:test"
    assert installed == ["podman"]
