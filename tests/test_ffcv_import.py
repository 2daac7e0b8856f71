"""pipeline/formats/ffcv_import.py: FFCV imported through it compiles none of numba's typed-dict code,
its IMAGE_MODES holds FFCV's values, and numba's own Dict is given back afterwards."""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT

PROBE = """
import json
import pipeline.formats.ffcv_import
import numba.typed
import ffcv.fields.rgb_image as rgb_image
from numba.typed import typeddict
print(json.dumps({"modes": dict(rgb_image.IMAGE_MODES), "plain": type(rgb_image.IMAGE_MODES) is dict,
                  "compiled": len(typeddict._setitem.signatures), "given_back": numba.typed.Dict is typeddict.Dict}))
"""


def test_ffcv_imported_through_it_compiles_no_typed_dict():
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen == {"modes": {"jpg": 0, "raw": 1}, "plain": True, "compiled": 0, "given_back": True}
