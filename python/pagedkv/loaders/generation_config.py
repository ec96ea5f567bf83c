"""A checkpoint's sampling defaults: ``generation_config.json`` (Hugging Face) turned into the
:class:`SamplingParams` an engine uses for a request submitted without any.

Precedence: parameters the caller passes replace these whole (they are a complete
:class:`SamplingParams`); these replace the dataclass's own defaults, key by key, for the keys the
file has. Keys mapped: ``max_new_tokens`` → ``max_tokens``, ``do_sample: false`` → greedy
(``temperature`` 0), and every key named as a :class:`SamplingParams` field (``temperature``,
``top_p``, ``top_k``, ``repetition_penalty``… as the dataclass has them); others (``eos_token_id``:
the model config's) are ignored. Values go through :class:`SamplingParams`' own validation: a
value it refuses raises :class:`CheckpointError` naming the file.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pagedkv.errors import CheckpointError, InvalidArgumentError
from pagedkv.loaders.files import CheckpointFile, is_present
from pagedkv.sampling import SamplingParams

__all__ = ["GENERATION_CONFIG_FILE", "default_sampling_params"]

GENERATION_CONFIG_FILE = "generation_config.json"


def default_sampling_params(checkpoint_dir: Path) -> SamplingParams | None:
    """The defaults of ``checkpoint_dir/generation_config.json``; None without that file."""
    if not is_present(checkpoint_dir, GENERATION_CONFIG_FILE):
        return None
    file = CheckpointFile.locate(checkpoint_dir, GENERATION_CONFIG_FILE)
    config = file.read_json()
    if not isinstance(config, dict):
        raise CheckpointError(file.path, "not a JSON object")
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    values = {key: value for key, value in config.items() if key in fields}
    if "max_new_tokens" in config:
        values["max_tokens"] = config["max_new_tokens"]
    if config.get("do_sample") is False:
        values["temperature"] = 0.0
    try:
        return SamplingParams(**values)
    except (InvalidArgumentError, TypeError) as error:
        raise CheckpointError(file.path, f"bad sampling default: {error}") from None
