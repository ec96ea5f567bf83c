"""The tiny model behind a disk tier, as the tier tests and their crash child build it: an
:class:`EngineCore` stepped synchronously, and a fixed prompt set whose greedy outputs every
restart must reproduce."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

from pagedkv.engine import EngineConfig, EngineCore, PagedModelRunner
from pagedkv.loaders.identity import WeightsDigest, kv_identity
from pagedkv.models import LlamaConfig, LlamaModel, LlamaWeights
from pagedkv.sampling import SamplingParams

BLOCK_SIZE = 16
# Bytes of one tiny-model block (4 layers x 2 KV heads x 32 dims x K and V x 16 tokens x float32).
BLOCK_BYTES = 4 * 2 * 32 * 2 * BLOCK_SIZE * 4
GREEDY = dict(temperature=0.0, ignore_eos=True)

_rng = random.Random(1234)
# Four system prompts of 3 to 5 blocks; the fixed prompts are each followed by a short question.
SYSTEMS = [[_rng.randrange(3, 512) for _ in range(BLOCK_SIZE * n + 5)] for n in (3, 4, 5, 4)]
FIXED = [system + [_rng.randrange(3, 512) for _ in range(7)] for system in SYSTEMS]


def tiny_model(seed: int = 0) -> tuple[LlamaModel, bytes]:
    """The tiny model (float32 weights, seeded) and the identity a tier records for it."""
    weights = LlamaWeights.random(LlamaConfig.tiny(), seed=seed)
    digest = WeightsDigest()
    for name, array in weights.named_tensors():
        digest.update(name, array)
    model = LlamaModel(weights)
    return model, kv_identity(model.config, digest.hexdigest(), model.weight_dtype, "float32", BLOCK_SIZE)


def tiny_core(
    model: LlamaModel, identity: bytes, directory: Path | None, num_blocks: int, capacity_blocks: int = 256, **config: object
) -> EngineCore:
    """A core over ``model`` with ``num_blocks`` RAM blocks and, given a ``directory``, a disk tier
    of ``capacity_blocks`` blocks there."""
    disk = {} if directory is None else dict(kv_disk_path=directory, kv_disk_bytes=capacity_blocks * BLOCK_BYTES)
    # The whole pool kept clean ahead of need (every cached block offloaded once released): small
    # pools evict many blocks in one step, and an allocation finding none clean drops a cached
    # block unsaved, which orphans the blocks after it on disk when it is a prefix's head.
    settings = dict(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_seqs=4, max_num_batched_tokens=256,
                    offload_watermark_blocks=num_blocks) | disk | config
    engine_config = EngineConfig(**settings)  # type: ignore[arg-type]
    runner = PagedModelRunner(model)
    return EngineCore(runner, engine_config, eos_token_ids=model.config.eos_token_ids, model_identity=identity)


def greedy(core: EngineCore, prompts: Sequence[Sequence[int]], max_tokens: int = 4, prefix: str = "fixed",
           check: bool = False, max_tokens_each: Sequence[int] | None = None) -> list[list[int]]:
    """Serves ``prompts`` together, greedily, ``max_tokens`` each (or ``max_tokens_each[i]``);
    their tokens in order (invariants checked after every step when ``check``)."""
    limits = max_tokens_each or [max_tokens] * len(prompts)
    outputs = [core.add_request(f"{prefix}{i}", list(p), SamplingParams(max_tokens=n, **GREEDY))
               for i, (p, n) in enumerate(zip(prompts, limits, strict=True))]
    while core.has_unfinished():
        core.step()
        if check:
            core.scheduler.check_invariants()
    return [o.token_ids for o in outputs]


def random_prompt(rng: random.Random) -> list[int]:
    """A system prompt (or none) and a random question: the crash child's and the property test's traffic."""
    head = rng.choice([*SYSTEMS, []])
    return head + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 3 * BLOCK_SIZE))]
