"""The install the docs give beside an engine works: a wheel built from a clone, installed into a fresh venv.

moe-place is not on PyPI, so the docs (docs/vllm.md, docs/sglang.md, docs/dropin.md, docs/trtllm.md) say:
in a clone, `python -m pip wheel --no-deps -w dist .`; in the engine's environment,
`pip install dist/moe_place-*.whl`. This test does the same, offline and in seconds:

1. Copy the files git tracks or would add (those it does not ignore) into a scratch folder (the wheel is
   built from what a clone holds, and the build writes its `build/` folder there, not in the checkout),
   and build the wheel with this interpreter's pip and setuptools: `--no-build-isolation --no-index`, so
   no registry is asked.
2. Read the wheel: the packages mapped into `moe_place` (`traces/`, `solvers/`, `kernels/` as
   `moe_place.traces`, `moe_place.solvers`, `moe_place.kernels`), `moe_place_sglang.pth` at the top (the
   SGLang start-up hook; setup.py puts it there), the console script and the vLLM plugin entry point, and
   base dependencies that leave an engine's own packages alone: no torch, triton or OR-Tools, numpy not
   capped (vLLM and SGLang require an unpinned numpy).
3. Make a fresh venv (`python -m venv --without-pip`, no system site-packages) and install the wheel into
   it with this interpreter's pip (`pip --python VENV/bin/python install --no-deps --no-index`). The
   dependencies (numpy, networkx, matplotlib) are not downloaded: a `.pth` file in the fresh venv appends
   this environment's site-packages to its path. Only directories are appended: `.pth` files there are not
   run, so the checkout's editable install (a `.pth` hook) stays invisible and `moe_place` resolves to the
   wheel's copy, which the test checks (it runs from a scratch folder, not the checkout).
4. In that venv: import the entry points an engine loads (`moe_place.eplb`, the vLLM plugin
   `moe_place.engines.vllm:register_plugin`, the SGLang hook `moe_place.engines.sglang_startup`), run the
   `moe-place` script the wheel installed (`--version`), and check the `.pth` hook: nothing of moe-place is
   imported at start without `MOE_PLACE_SGLANG`, the hook is registered with `MOE_PLACE_SGLANG=1`.
"""

import configparser
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

from moe_place import __version__

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                                reason="needs the git checkout (the wheel is built from the files git tracks)")


def _run(argv, cwd, env=None, check=True) -> subprocess.CompletedProcess:
    result = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, argv))} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    scratch = tmp_path_factory.mktemp("clone")
    tracked = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], ROOT).stdout.split("\0")
    for name in filter(None, tracked):
        source = ROOT / name
        if source.is_file():  # a tracked file deleted in the working tree is not in a clone either
            (scratch / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, scratch / name)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", "dist", "."], scratch)
    (built,) = (scratch / "dist").glob("moe_place-*.whl")
    return built


def test_the_wheel_holds_the_mapped_packages_the_pth_hook_and_the_entry_points(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in ("moe_place", "moe_place.traces", "moe_place.solvers", "moe_place.solvers.comm",
                    "moe_place.kernels", "moe_place.engines", "moe_place.cli"):
        assert f"{package.replace('.', '/')}/__init__.py" in names, package
    assert not {n.split("/")[0] for n in names} & {"traces", "solvers", "kernels"}  # one import root
    assert "moe_place_sglang.pth" in names  # at the top: site-packages runs it at every start
    info = f"moe_place-{__version__}.dist-info"
    entry_points = configparser.ConfigParser()
    entry_points.read_string(zipfile.ZipFile(wheel).read(f"{info}/entry_points.txt").decode())
    assert entry_points["console_scripts"]["moe-place"] == "moe_place.cli.main:main"
    assert entry_points["vllm.general_plugins"]["moe_place"] == "moe_place.engines.vllm:register_plugin"


def test_the_base_dependencies_leave_the_engines_packages_alone(wheel):
    metadata = Parser().parsestr(zipfile.ZipFile(wheel).read(f"moe_place-{__version__}.dist-info/METADATA").decode())
    base = [r for r in metadata.get_all("Requires-Dist") if "extra ==" not in r]
    names = {r.split(">")[0].split("<")[0].split("=")[0].split(";")[0].strip().lower() for r in base}
    assert names == {"numpy", "networkx", "matplotlib"}, base
    assert not any("<" in r for r in base), base  # no cap that could move the engine's numpy


def test_a_fresh_venv_with_the_wheel_runs_every_entry_point(wheel, tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp_path)
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel], tmp_path)
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp_path).stdout.strip())
    assert (site / "moe_place_sglang.pth").is_file()
    # numpy, networkx, matplotlib from this environment, appended after the wheel's own site-packages
    (site / "zz_test_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    script = ("import moe_place, moe_place.eplb, moe_place.engines.sglang_startup, moe_place.traces, "
              "moe_place.solvers, moe_place.kernels\n"
              "from moe_place.engines.vllm import register_plugin\n"
              "register_plugin()  # what vLLM calls in every process: a no-op without MOE_PLACE_VLLM_POLICY\n"
              "print(moe_place.__file__)")
    imported = _run([python, "-c", script], tmp_path).stdout.strip()
    assert Path(imported).is_relative_to(site), imported  # the wheel's copy, not the checkout's
    version = _run([venv / "bin" / "moe-place", "--version"], tmp_path).stdout.strip()
    assert version == f"moe-place {__version__}"
    probe = "import sys; print('moe_place.engines.sglang_startup' in sys.modules)"
    assert _run([python, "-c", probe], tmp_path, env={"PATH": "/usr/bin:/bin"}).stdout.strip() == "False"
    hooked = _run([python, "-c", probe], tmp_path, env={"PATH": "/usr/bin:/bin", "MOE_PLACE_SGLANG": "1"})
    assert hooked.stdout.strip() == "True", hooked.stderr
