"""scripts/: setup_env.sh skips a finished install and redoes only what changed; train.sh asks for no
test tools and test.sh for them. The set-up runs in a copy of the repository whose .venv python refuses
pip, so that nothing is installed: a run that would install shows it by its progress line and failure."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"

FAKE_PYTHON = f"""#!/bin/sh
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then echo "pip refused by the test" >&2; exit 3; fi
exec {sys.executable} "$@"
"""


@pytest.fixture
def repo(tmp_path) -> Path:
    """A copy of setup.py and scripts/setup_env.sh with a .venv whose python runs everything but pip."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPTS / "setup_env.sh", tmp_path / "scripts")
    shutil.copy(ROOT / "setup.py", tmp_path)
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text(FAKE_PYTHON)
    (bin_dir / "python").chmod(0o755)
    (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    return tmp_path


def setup_env(repo: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(repo / "scripts" / "setup_env.sh"), *extra], capture_output=True, text=True,
                          timeout=120)


def stamp(repo: Path, name: str) -> None:
    """The stamp setup_env.sh leaves after installing `name` ('base' or an extra) for this setup.py."""
    digest = subprocess.run(["sha256sum", str(repo / "setup.py")], capture_output=True, text=True,
                            check=True).stdout[:16]
    (repo / ".venv" / ".hf_slideformer-setup").mkdir(exist_ok=True)
    (repo / ".venv" / ".hf_slideformer-setup" / f"{name}-{digest}").touch()


def test_a_stamped_install_is_skipped_silently(repo):
    stamp(repo, "base")
    proc = setup_env(repo)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")


def test_the_test_extra_covers_the_base_install_but_not_the_reverse(repo):
    stamp(repo, "test")
    assert setup_env(repo).returncode == 0
    shutil.rmtree(repo / ".venv" / ".hf_slideformer-setup")
    stamp(repo, "base")
    proc = setup_env(repo, "test")
    assert proc.returncode != 0 and "[setup] installing hf_slideformer[test]" in proc.stdout
    assert "pip refused by the test" in proc.stderr                 # the failing step's output is shown


def test_a_changed_setup_py_reinstalls(repo):
    stamp(repo, "base")
    with open(repo / "setup.py", "a") as f:
        f.write("# changed\n")
    proc = setup_env(repo)
    assert proc.returncode != 0 and proc.stdout.startswith("[setup] preparing .venv")
    assert "[setup] installing hf_slideformer and its dependencies" in proc.stdout


def test_train_installs_no_test_tools_and_test_does():
    def setup_line(script: str) -> str:
        return next(line for line in (SCRIPTS / script).read_text().splitlines() if "setup_env.sh" in line
                    and not line.startswith("#"))
    assert setup_line("train.sh").split() == ["bash", "scripts/setup_env.sh"]
    assert setup_line("test.sh").split() == ["bash", "scripts/setup_env.sh", "test"]
