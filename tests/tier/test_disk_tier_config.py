"""Configuring the disk tier: the model identity it records, the engine's and the CLI's options,
and their typed refusals (nothing is built when one is refused)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
import pytest

from pagedkv import AllBlocksCleared, InvalidArgumentError, KvSpec, Scheduler
from pagedkv.__main__ import main
from pagedkv.cli import add_engine_arguments, byte_size, engine_kwargs
from pagedkv.engine import DEFAULT_KV_DISK_BYTES, Engine, EngineConfig
from pagedkv.errors import KvTierError
from pagedkv.loaders import load_model, load_tokenizer
from pagedkv.loaders.identity import WeightsDigest, kv_identity
from pagedkv.models import LlamaConfig, LlamaModel, LlamaWeights


def digest_of(seed: int) -> str:
    digest = WeightsDigest()
    load_model("tiny", seed=seed, digest=digest)
    return digest.hexdigest()


def test_the_weights_digest_is_the_tensors_as_loaded() -> None:
    assert digest_of(0) == digest_of(0)
    assert digest_of(0) != digest_of(1)
    a, b = WeightsDigest(), WeightsDigest()
    a.update("w", np.zeros((2, 3), np.float32))
    b.update("w", np.zeros((3, 2), np.float32))  # same bytes, another shape
    assert a.hexdigest() != b.hexdigest()
    c = WeightsDigest()
    c.update("w", np.zeros((3, 2), np.float32).T)  # a transposed view hashes as its C-order copy
    assert c.hexdigest() == a.hexdigest()


def test_the_identity_changes_with_everything_that_changes_the_kv_bytes() -> None:
    config = LlamaConfig.tiny()
    base = kv_identity(config, "d", "float32", "float32", 16)
    assert base == kv_identity(config, "d", "float32", "float32", 16)
    variants = [
        kv_identity(LlamaConfig(**{**config.__dict__, "rope_theta": 500.0}), "d", "float32", "float32", 16),
        kv_identity(config, "e", "float32", "float32", 16),
        kv_identity(config, "d", "bfloat16", "float32", 16),
        kv_identity(config, "d", "float32", "float16", 16),
        kv_identity(config, "d", "float32", "float32", 32),
    ]
    assert len({base, *variants}) == 6


@pytest.mark.parametrize(("text", "value"), [("1", 1), ("4096", 4096), ("4K", 4096), ("2m", 2 << 20), ("1G", 1 << 30),
                                              ("3GiB", 3 << 30), ("1TB", 1 << 40)])
def test_byte_sizes(text: str, value: int) -> None:
    assert byte_size(text) == value


@pytest.mark.parametrize("text", ["0", "-1", "", "G", "1.5G", "1X", "one"])
def test_bad_byte_sizes_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        byte_size(text)


def test_the_cli_flags_reach_the_engine_config(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    kwargs = engine_kwargs(parser.parse_args(["--kv-disk-path", str(tmp_path), "--kv-disk-bytes", "64M"]))
    assert kwargs["kv_disk_path"] == tmp_path and kwargs["kv_disk_bytes"] == 64 << 20
    assert engine_kwargs(parser.parse_args([]))["kv_disk_path"] is None
    config = EngineConfig(kv_disk_path=tmp_path)
    assert config.disk_tier() == (tmp_path, DEFAULT_KV_DISK_BYTES)
    assert EngineConfig().disk_tier() is None


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--kv-disk-bytes", "0"], "--kv-disk-bytes"),
        (["--kv-disk-bytes", "lots"], "--kv-disk-bytes"),
        (["--kv-disk-bytes", "1G"], "kv_disk_bytes needs kv_disk_path"),
    ],
)
def test_bad_tier_flags_are_usage_errors(argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["demo", "--model", "tiny", "--requests", "1", *argv])
    assert exit.value.code == 2
    assert expected in capsys.readouterr().err


def test_a_tier_path_that_is_a_file_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(SystemExit) as exit:
        main(["demo", "--model", "tiny", "--requests", "1", "--kv-disk-path", str(file)])
    assert exit.value.code == 2 and "--kv-disk-path" in capsys.readouterr().err


def test_a_tier_directory_that_cannot_be_made_is_a_tier_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(SystemExit) as exit:  # under a file: only opening the tier finds out
        main(["demo", "--model", "tiny", "--requests", "1", "--kv-disk-path", str(file / "tier")])
    assert exit.value.code == 1 and "KvTierError" in capsys.readouterr().err
    with pytest.raises(KvTierError):
        Engine.from_pretrained("tiny", kv_disk_path=file / "tier")


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (dict(kv_disk_bytes=1 << 20), "kv_disk_bytes needs kv_disk_path"),
        (dict(kv_disk_path=3), "kv_disk_path must be a str or Path"),
        (dict(kv_disk_path="DIR", kv_disk_bytes=0), "hold no slot"),  # the core's check
        (dict(kv_disk_path="DIR", kv_disk_bytes=1000), "hold no slot"),  # less than one block
        (dict(kv_disk_path="DIR", kv_disk_bytes=-1), "capacity_bytes"),  # the binding's conversion
        (dict(kv_disk_path="DIR", kv_disk_bytes=True), "capacity_bytes"),
        (dict(kv_disk_path="DIR", kv_disk_bytes=1.5), "capacity_bytes"),
    ],
)
def test_bad_tier_options_are_typed_and_make_nothing(config: dict, match: str, tmp_path: Path) -> None:
    if config.get("kv_disk_path") == "DIR":
        config["kv_disk_path"] = tmp_path / "tier"
    with pytest.raises(InvalidArgumentError, match=match):
        Engine.from_pretrained("tiny", **config)
    assert not (tmp_path / "tier").exists()


def test_an_engine_built_from_a_model_needs_its_digest_for_a_tier(tmp_path: Path) -> None:
    model = LlamaModel(LlamaWeights.random(LlamaConfig.tiny(), seed=0))
    with pytest.raises(InvalidArgumentError, match="weights_digest"):
        Engine(model, load_tokenizer(None, 512), EngineConfig(kv_disk_path=tmp_path / "tier"))
    assert not (tmp_path / "tier").exists()


def scheduler(kv: bool = True, **options: object) -> Scheduler:
    """A scheduler of 16 blocks of 16 tokens, owning K/V of a small spec unless ``kv`` is False."""
    spec = KvSpec.uniform(2, 2, 8) if kv else None
    return Scheduler(num_blocks=16, block_size=16, kv_spec=spec, **options)  # type: ignore[arg-type]


# A tier attaches over the scheduler's own K/V, shaped from its pool: a cache of another pool or
# block size (refused here before the scheduler owned its K/V) can no longer be given at all.
@pytest.mark.parametrize(
    ("kv", "args", "match"),
    [
        (False, lambda d: (d, 1 << 20, b"id"), "needs a runtime that keeps K/V"),
        (True, lambda d: (str(d).encode(), 1 << 20, b"id"), "path must be a str or os.PathLike"),
        (True, lambda d: (d, -5, b"id"), "capacity_bytes"),
        (True, lambda d: (d, 1 << 20, "id"), "identity must be bytes"),
    ],
)
def test_scheduler_attach_refusals_are_typed_and_attach_nothing(kv: bool, args, match: str, tmp_path: Path) -> None:
    s = scheduler(kv)
    with pytest.raises(InvalidArgumentError, match=match):
        s.attach_disk_tier(*args(tmp_path / "tier"))
    assert "disk_blocks" not in s.stats() and s.detach_disk_tier() == []
    if kv:
        assert s.attach_disk_tier(tmp_path / "ok", 1 << 20, b"id") == {"recovered": 0, "cleared": False}


def test_a_tier_attaches_once_and_only_to_a_fresh_scheduler(tmp_path: Path) -> None:
    s = scheduler()
    s.attach_disk_tier(tmp_path / "a", 1 << 20, b"id")
    with pytest.raises(InvalidArgumentError, match="attached already"):
        s.attach_disk_tier(tmp_path / "b", 1 << 20, b"id")
    used = scheduler()
    used.add_request("r", list(range(40)), max_tokens=1)
    step = used.schedule()
    used.update(step, [5])
    with pytest.raises(InvalidArgumentError, match="before any sequence or cached block"):
        used.attach_disk_tier(tmp_path / "c", 1 << 20, b"id")
    assert "disk_blocks" not in used.stats()
    assert s.detach_disk_tier() == [] and "disk_blocks" in s.stats()  # no events asked; the figures stay
    assert s.take_kv_events() == [] and s.kv_blocks() == []


def test_an_identity_change_clears_the_tier_and_says_so(tmp_path: Path) -> None:
    s = scheduler(emit_kv_events=True)
    assert s.attach_disk_tier(tmp_path, 1 << 20, b"model A") == {"recovered": 0, "cleared": False}
    assert s.detach_disk_tier() == [AllBlocksCleared("disk")]
    s = scheduler(emit_kv_events=True)
    assert s.attach_disk_tier(tmp_path, 1 << 20, b"model B")["cleared"] is True
    assert s.take_kv_events() == [AllBlocksCleared("disk")]


def test_a_disk_tier_larger_than_its_file_system_is_refused(tmp_path: Path) -> None:
    """Issue 23 item 5: 2**62 bytes (``--kv-disk-bytes 1000T``) aborted the process (SIGABRT) on
    allocating the tier's slot table; now a typed error, nothing created, the process alive."""
    for size in (2**62, 2**63 - 1):
        with pytest.raises(InvalidArgumentError, match="file system"):
            Engine.from_pretrained("tiny", kv_disk_path=tmp_path / "tier", kv_disk_bytes=size)
        with pytest.raises(InvalidArgumentError, match="file system"):
            scheduler().attach_disk_tier(tmp_path / "tier", size, b"id")
    assert not (tmp_path / "tier").exists()
    assert scheduler().attach_disk_tier(tmp_path / "tier", 1 << 20, b"id")["recovered"] == 0


def test_an_empty_tier_path_is_refused_not_taken_for_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 23 item 19: ``kv_disk_path=""`` (an unset variable) put the tier in the current
    directory."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidArgumentError, match="empty path"):
        Engine.from_pretrained("tiny", kv_disk_path="")
    with pytest.raises(InvalidArgumentError, match="empty path"):
        scheduler().attach_disk_tier("", 1 << 20, b"id")
    with pytest.raises(SystemExit) as exit:
        main(["demo", "--model", "tiny", "--requests", "1", "--kv-disk-path", ""])
    assert exit.value.code == 2 and "--kv-disk-path" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []
