"""Registration: ``from colossalai import cmap`` in a clean interpreter, for editable and wheel installs."""

import glob
import os
import subprocess
import sys
import sysconfig
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(code, *flags, env=None):
    return subprocess.run(
        [sys.executable, *flags, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd="/"
    )


def test_from_colossalai_import_cmap_in_a_clean_interpreter():
    code = (
        "import sys\n"
        "assert 'torch' not in sys.modules, 'the start-up hook imported torch'\n"
        "assert 'colossalai' not in sys.modules\n"
        "from colossalai import cmap\n"
        "import colossalai, colossalai_cmap, torch\n"
        "assert colossalai.cmap is colossalai_cmap.cmap is cmap\n"
        "x = torch.arange(6.0).view(3, 2)\n"
        "assert torch.equal(cmap(torch.sum)(x), torch.vmap(torch.sum)(x))\n"
        "print('ok')\n"
    )
    result = _python(code)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_start_up_hook_is_cheap():
    """What the .pth line runs at every interpreter start imports the package's three small modules and nothing else
    (no torch, no colossalai, no typing). That list, not a timing, is the check: a time limit would measure the
    machine and its load as much as the hook."""
    code = (
        "import sys\n"
        f"sys.path.insert(0, {ROOT!r})\n"
        "before = set(sys.modules)\n"
        "import colossalai_cmap.integration.register\n"
        "print(sorted(set(sys.modules) - before))\n"
    )
    result = _python(code, "-I", "-S")
    assert result.returncode == 0, result.stderr
    # importlib.machinery (and what it pulls in) is already loaded in a normal start-up; -S starts without it
    allowed = {
        "colossalai_cmap",
        "colossalai_cmap.integration",
        "colossalai_cmap.integration.register",
        "importlib",
        "importlib._bootstrap",
        "importlib._bootstrap_external",
        "importlib.machinery",
        "warnings",
    }
    assert set(eval(result.stdout)) <= allowed, result.stdout


def test_wheel_installs_the_hook(tmp_path):
    """``pip install .`` (a wheel) ships colossalai_cmap.pth at the top of site-packages and it registers cmap."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            ROOT,
        ],
        check=True,
        timeout=300,
        capture_output=True,
    )
    wheel = glob.glob(str(tmp_path / "dist" / "*.whl"))[0]
    with zipfile.ZipFile(wheel) as zf:
        assert "colossalai_cmap.pth" in zf.namelist()
        zf.extractall(tmp_path / "site")
    # -S: skip this venv's own site processing (and its editable hook); add its packages as a plain path, then
    # process only the wheel's directory as a site dir, as pip's install would.
    site_packages = sysconfig.get_paths()["purelib"]
    code = (
        "import sys, site\n"
        f"sys.path.append({site_packages!r})\n"
        f"site.addsitedir({str(tmp_path / 'site')!r})\n"
        "import colossalai_cmap\n"
        f"assert colossalai_cmap.__file__.startswith({str(tmp_path / 'site')!r}), colossalai_cmap.__file__\n"
        "from colossalai import cmap\n"
        "assert cmap is colossalai_cmap.cmap\n"
        "print('ok')\n"
    )
    result = _python(code, "-S", env={**os.environ, "PYTHONPATH": ""})
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
