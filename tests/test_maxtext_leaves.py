"""Logit examples checked against MaxText's own conversion instead of transformers' logits (``Example.reference ==
"maxtext"``): every leaf ckptconv writes equals, bit for bit, the leaf MaxText 0.2.5's ``to_maxtext`` wrote for the
same synthetic checkpoint.

MaxText's leaves are recorded once by the bench driver (``bench/compare_deepseek_v4.py``, MaxText's venv) as
``tests/data/maxtext_leaves/<example>.json``: each leaf's shape, dtype and the SHA-256 of its bytes, with the one
difference ckptconv makes on purpose already applied (``moved``: MaxText's ``MoEBiasVar`` router bias, which ckptconv
writes under ``params/params``; docs/families.md). The synthetic checkpoint is rewritten here from the same seed, so a change to
the family, the synthetic writer or the transforms fails this test.
"""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from ckptconv.commands import synth
from ckptconv.families import FAMILIES
from tests.conftest import run_cli
from tests.test_convert import restore

DATA = Path(__file__).resolve().parent / "data" / "maxtext_leaves"
EXAMPLES = {example.name: (family, example) for family in FAMILIES for example in family.synthetic.logits
            if example.reference == "maxtext"}


def digest(value: np.ndarray) -> dict:
    return {"shape": list(value.shape), "dtype": str(value.dtype),
            "sha256": hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()}


@pytest.mark.parametrize("name", EXAMPLES)
def test_leaves_equal_maxtexts_conversion(tmp_path, synth_dir, name):
    family, example = EXAMPLES[name]
    recorded = json.loads((DATA / f"{name}.json").read_text())
    model = synth.for_family(family, example.model)
    assert model.config() == recorded["config"], "the synthetic checkpoint changed since MaxText converted it"
    src, dst = synth_dir(model), tmp_path / "dst"
    layout = ["--devices", str(example.devices), "--scan-layers" if example.scan else "--no-scan-layers"]
    result = run_cli("convert", str(src), str(dst), "--progress", "none", "--dtype", "bfloat16", *layout)
    assert result.returncode == 0, result.stderr
    ours = {leaf: digest(value) for leaf, value in restore(dst).items() if leaf != "step"}
    theirs = recorded["leaves"]
    assert sorted(ours) == sorted(theirs)
    assert [leaf for leaf in sorted(ours) if ours[leaf] != theirs[leaf]] == []
