"""Registration: ``from colossalai import cmap`` in a clean interpreter, for editable and wheel installs (issue 2)."""

import glob
import os
import re
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
    """The .pth hook costs well under 10 ms and imports neither torch nor colossalai."""
    costs = []
    for _ in range(3):
        result = _python("pass", "-X", "importtime")
        own = [
            int(m.group(1))
            for m in re.finditer(r"import time:\s+\d+ \|\s+(\d+) \|\s+colossalai_cmap\s*$", result.stderr, re.M)
        ]
        assert own, result.stderr[-2000:]
        assert not re.search(r"\|\s+(torch|colossalai)\s*$", result.stderr, re.M)
        costs.append(own[0])
    assert min(costs) < 10_000, f"hook cost {costs} us"


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
