"""torshmon as a user installs it: the built wheel, run from outside the source tree.

The wheel is built from this checkout and installed with ``--target`` into a folder
that comes first on ``PYTHONPATH``, so the commands below import the wheel's files,
not the repository's (the test checks which). Its dependencies are the test venv's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pg import pg_database

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Iterator[Path]:
    """A folder holding torshmon installed from the wheel built from this checkout."""
    work = tmp_path_factory.mktemp("wheel-site")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    names = zipfile.ZipFile(wheel).namelist()
    assert "torshmon/history/migrations/versions/0001_initial.py" in names
    target = work / "site"
    subprocess.run(
        [*pip, "install", "--no-deps", "--target", target, wheel],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    yield target


def torshmon(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("TORSHMON_DB_URL", None)
    return subprocess.run(
        [sys.executable, "-c", "from torshmon.cli import main; raise SystemExit(main())", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_the_wheel_is_what_runs(installed: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import torshmon; print(torshmon.__file__)"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(installed)},
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert Path(done.stdout.strip()).is_relative_to(installed)


def test_db_upgrade_and_query_on_sqlite_from_the_wheel(installed: Path, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'history.db'}"
    upgraded = torshmon(installed, tmp_path, "db", "upgrade", "--db", url)
    assert upgraded.returncode == 0, upgraded.stderr
    assert "history database at head" in upgraded.stdout
    query = torshmon(installed, tmp_path, "query", "--db", url, "SELECT count(*) AS n FROM jobs")
    assert query.returncode == 0, query.stderr
    assert query.stdout.split()[-3:] == ["0", "(1", "row)"]
    write = torshmon(installed, tmp_path, "query", "--db", url, "DELETE FROM jobs")
    assert write.returncode == 2
    assert write.stderr.startswith("torshmon query: refused") and "Traceback" not in write.stderr


def test_db_upgrade_makes_the_reader_role_from_the_wheel(installed: Path, tmp_path: Path) -> None:
    with pg_database() as url:
        upgraded = torshmon(installed, tmp_path, "db", "upgrade", "--db", url)
        assert upgraded.returncode == 0, upgraded.stderr
        # The superuser's URL is not used for queries: they connect as the reader.
        attack = torshmon(
            installed, tmp_path, "query", "--db", url, "SELECT pg_read_file('/etc/passwd')"
        )
        assert attack.returncode == 2
        assert "permission denied for function pg_read_file" in attack.stderr
        assert "root:" not in attack.stdout
        as_superuser = torshmon(
            installed, tmp_path, "query", "--db", url, "--query-db", url, "SELECT 1"
        )
        assert as_superuser.returncode == 2
        assert "refused: queries would run as superuser postgres" in as_superuser.stderr


def test_a_bad_rule_file_is_one_line_from_the_wheel(installed: Path, tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - name: !!python/name:os.system x\n")
    checked = torshmon(installed, tmp_path, "rules", "check", str(rules))
    assert checked.returncode != 0
    assert checked.stderr.strip() == f"{rules}:2: unsupported YAML tag !!python/name:os.system"


def test_the_sdist_carries_what_a_user_builds_and_tests_with(tmp_path: Path) -> None:
    """The source distribution: license, migrations, tests and their data, dashboards."""
    code = (
        "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    sdist = tmp_path / done.stdout.split()[-1]
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
        pkg_info = tar.extractfile(f"{sdist.name.removesuffix('.tar.gz')}/PKG-INFO")
        assert pkg_info is not None
        metadata = pkg_info.read().decode()
    for path in (
        "LICENSE",
        "torshmon/history/migrations/env.py",
        "torshmon/history/migrations/versions/0001_initial.py",
        "torshmon/aggregator/core/default_rules.yaml",
        "tests/conftest.py",
        "dashboards/build.py",
        "docs/security.md",
        "scripts/setup",
    ):
        assert path in names, path
    assert any(name.startswith("tests/data/") for name in names)
    assert not any("__pycache__" in name for name in names)
    assert "License-Expression: Apache-2.0" in metadata
    assert (REPO_ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
