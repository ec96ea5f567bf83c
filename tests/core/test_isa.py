"""Issue 19: one instruction-set dispatch for every kernel family. ``PAGEDKV_ISA`` caps what
attention, linear and sampling run on by default (read once, so each setting runs in its own
process), each family taking the best set it has kernels for; every set this CPU runs gives the
same model within rounding, and a name that is not a set (or one the CPU lacks) leaves the best."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from pagedkv._core import Linear, available_isas, available_kernels, available_linear_kernels

SETS = available_isas()
QUANTIZED_SETS = Linear.quantized(32, [("q8_0", np.zeros((1, 34), np.uint8))]).kernels
SAMPLING_SETS = available_linear_kernels()  # the sampler is compiled for the dense linear's sets

CHILD = """
import json, sys
import numpy as np
from pagedkv._core import default_isas
from pagedkv.models import LlamaConfig, LlamaModel, LlamaWeights
from pagedkv.sampling import SamplingParams, sample_with_logprobs
from support.prefill import prefill_logits

model = LlamaModel(LlamaWeights.random(LlamaConfig.tiny(), seed=3))
logits = prefill_logits(model, list(range(1, 40)))
params = [SamplingParams(temperature=0.8, seed=1, logprobs=True)] * len(logits)
samples = sample_with_logprobs(logits, params, [p.make_generator(0) for p in params], [None] * len(logits))
np.save(sys.argv[1], np.concatenate([logits.ravel(), samples.logprobs.astype(np.float32)]))
print(json.dumps(dict(default_isas())))
"""


def run_under(isa: str, tmp_path) -> tuple[dict[str, str], np.ndarray]:
    out = tmp_path / f"{isa}.npy"
    env = {**os.environ, "PAGEDKV_ISA": isa, "PYTHONPATH": os.pathsep.join(["tests", os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run([sys.executable, "-c", CHILD, str(out)], env=env, capture_output=True, text=True, check=True)
    return json.loads(child.stdout), np.load(out)


def expected_default(family_sets: list[str], ceiling: str) -> str:
    return next(s for s in family_sets if SETS.index(s) >= SETS.index(ceiling))


@pytest.mark.parametrize("isa", SETS)
def test_each_set_caps_every_family_and_computes_the_same_model(isa: str, tmp_path) -> None:
    defaults, result = run_under(isa, tmp_path)
    assert defaults == {
        "ceiling": isa,
        "attention": expected_default(available_kernels(), isa),
        "linear": expected_default(available_linear_kernels(), isa),
        "quantized": expected_default(QUANTIZED_SETS, isa),
        "sampling": expected_default(SAMPLING_SETS, isa),
    }
    _, best = run_under(SETS[0], tmp_path)
    np.testing.assert_allclose(result, best, rtol=0, atol=2e-4)


def test_an_unknown_set_leaves_the_best(tmp_path) -> None:
    defaults, _ = run_under("sse9", tmp_path)
    assert defaults == {"ceiling": SETS[0], "attention": available_kernels()[0],
                        "linear": available_linear_kernels()[0], "quantized": QUANTIZED_SETS[0],
                        "sampling": SAMPLING_SETS[0]}
