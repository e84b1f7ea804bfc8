"""`dtk train` starts its ranks before the launcher imports torch (dtk.prestart). A rank whose imports fail there
fails the run the way a rank started later would: the traceback in its log, and its last lines on the terminal."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import RECIPES, ROOT, TINY, dtk_env

pytestmark = [pytest.mark.e2e]


@pytest.mark.timeout(120)
def test_a_deepspeed_that_fails_to_import_in_a_prestarted_rank_is_shown_from_its_log(tmp_path):
    env = dtk_env()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests" / "fixtures" / "broken_deepspeed"),
                                         env.get("PYTHONPATH", "")])
    run_dir = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "dtk.cli", "train", str(RECIPES / "quickstart.yaml"), *TINY,
                        "strategy.name=zero1", f"output.dir={run_dir}", "--no-progress"],
                       capture_output=True, text=True, timeout=100, env=env, cwd=ROOT)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "failed (exit code 1)" in p.stderr and "ImportError: this deepspeed is broken on purpose" in p.stderr
    # the rank named is the first seen to fail; the launcher then stops the other
    [rank] = re.findall(r"error: rank (\d) failed", p.stderr)
    log = (run_dir / "logs" / f"rank{rank}.log").read_text()
    assert "Traceback" in log and "this deepspeed is broken on purpose" in log, log
