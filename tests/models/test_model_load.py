"""Streaming loads (``load_model``, ``LlamaModel.from_tensors``), and the load peak of a real
model: ``Engine.from_pretrained("smollm2-135m")`` streams the GGUF file tensor by tensor into
packed ``Linear`` weights, so its peak resident memory, above what the interpreter held before
the load, stays within 1.2× the bytes the loaded model holds (``LlamaModel.nbytes``). The whole
float32 model in numpy, then packed, peaked at 1.76× (1148 MB over the 651 MB of the float32
model) before the load streamed.

Each load runs in a subprocess of its own, so its ``VmHWM`` (peak resident set) measures that load
alone; the RSS before the load (imports done) is subtracted from it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from pagedkv.errors import InvalidArgumentError
from pagedkv.loaders import load_model, load_pretrained
from pagedkv.models import DEFAULT_WEIGHT_DTYPE, LlamaModel
from support.prefill import prefill_logits

LIMIT = 1.2

SCRIPT = """
import json, sys

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

import numpy, gguf, tokenizers, pagedkv
from pagedkv.engine import Engine
before = status("VmRSS")
engine = Engine.from_pretrained("smollm2-135m", weight_dtype=sys.argv[1])
peak = status("VmHWM")
nbytes = engine.core.runner.model.nbytes
engine.shutdown()
print(json.dumps({"before": before, "peak": peak, "nbytes": nbytes}))
"""


def test_loading_smollm2_peaks_within_1_2x_of_the_model_bytes() -> None:
    # The default dtype only: a load takes seconds. float32 measured 1.12×, float16 1.16×.
    weight_dtype = DEFAULT_WEIGHT_DTYPE
    result = subprocess.run([sys.executable, "-c", SCRIPT, weight_dtype], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    ratio = (figures["peak"] - figures["before"]) / figures["nbytes"]
    assert ratio <= LIMIT, f"{weight_dtype}: load peak {ratio:.2f}× the model's {figures['nbytes'] / 2**20:.0f} MiB"


@pytest.mark.parametrize("weight_dtype", ["float32", "bfloat16"])
def test_a_streamed_model_equals_one_packed_from_all_weights(weight_dtype: str) -> None:
    streamed, _ = load_model("tiny", weight_dtype=weight_dtype)
    weights, _ = load_pretrained("tiny")
    whole = LlamaModel(weights, weight_dtype=weight_dtype)
    assert streamed.weight_dtype == whole.weight_dtype == weight_dtype
    assert streamed.nbytes == whole.nbytes
    tokens = [5, 9, 200, 3, 77, 41, 8]
    np.testing.assert_array_equal(prefill_logits(streamed, tokens), prefill_logits(whole, tokens))


def test_from_tensors_refuses_missing_or_unknown_tensors_and_bad_dtypes() -> None:
    weights, _ = load_pretrained("tiny")
    tensors = list(weights.named_tensors())
    with pytest.raises(InvalidArgumentError, match="model.layers.1"):
        LlamaModel.from_tensors(weights.config, [t for t in tensors if not t[0].startswith("model.layers.1.")])
    with pytest.raises(InvalidArgumentError, match="not part of this model"):
        LlamaModel.from_tensors(weights.config, [*tensors, ("model.layers.0.rotary.inv_freq", np.ones(4, np.float32))])

    def never_read():
        raise AssertionError("a bad weight_dtype must be refused before any tensor is read")
        yield

    with pytest.raises(InvalidArgumentError):
        LlamaModel.from_tensors(weights.config, never_read(), weight_dtype="int3")
    with pytest.raises(InvalidArgumentError):
        load_model("tiny", weight_dtype="int3")


def test_a_weight_beyond_float16s_range_is_refused_in_float16_only() -> None:
    weights, _ = load_pretrained("tiny")
    weights.layers[1].down_proj[3, 5] = -7e4  # float16 would store -inf
    with pytest.raises(InvalidArgumentError, match=r"model\.layers\.1\.down_proj.*float16"):
        LlamaModel(weights, weight_dtype="float16")
    assert LlamaModel(weights, weight_dtype="bfloat16").weight_dtype == "bfloat16"
