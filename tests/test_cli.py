import subprocess
import sys

from m3lm.cli import main


def test_list_prints_the_family(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:2] == ["MODEL_TYPE", "ARCHITECTURE"]
    assert "minimax_m3" in out[1] and "mxfp8" in out[1]


def test_python_dash_m_works():
    r = subprocess.run([sys.executable, "-m", "m3lm", "list"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "MiniMaxM3" in r.stdout
