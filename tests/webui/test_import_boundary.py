"""The UI process never imports the heavy ML stack: importing and building the app must leave torch,
transformers, peft, trl, accelerate and datasets out of sys.modules."""
import subprocess
import sys

HEAVY = ("torch", "transformers", "peft", "trl", "accelerate", "datasets")


def test_app_import_and_build_stay_light():
    code = ("import sys\nfrom webui.app import create_app\ncreate_app()\n"
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1:] in ([""], []), f"heavy modules imported: {out.stdout}"
