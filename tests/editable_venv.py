"""A venv as `make install` leaves one, for tests that run commands as a user
of the clone would: fastpin in it editable (a .pth naming the clone, whose
extension is built in place), and this interpreter's packages (torch, numpy,
matplotlib) by another .pth, so that the commands find fastpin through the venv
alone, whatever put it on this interpreter's path (PYTHONPATH, an editable
install, the current directory)."""
from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def installed_venv(where: Path) -> Path:
    """The venv, made in `where`/venv; its bin/ has python and python3."""
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    site = subprocess.run([str(venv / "bin" / "python"), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    packages = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    (Path(site) / "fastpin-editable.pth").write_text(f"{ROOT}\n")
    (Path(site) / "zz-test-packages.pth").write_text("\n".join(sorted(packages)) + "\n")
    return venv
