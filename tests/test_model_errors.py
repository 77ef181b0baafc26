"""A model path that is wrong, or a checkpoint that is damaged, is named in one clear message:
by ModelConfig / the loader, and through Engine(...) as a StartupError of phase "config" or
"weights" whose message includes it."""

from __future__ import annotations

import gc
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pyengine import Engine, StartupError
from pyengine.models.config import ModelConfig
from pyengine.models.loader import checkpoint_files, load_tensors


@pytest.fixture(scope="module")
def single_dir(checkpoint_factory) -> Path:
    return checkpoint_factory("errors_single", model_type="llama", num_layers=1)


@pytest.fixture(scope="module")
def sharded_dir(checkpoint_factory) -> Path:
    return checkpoint_factory("errors_sharded", model_type="llama", num_layers=1, sharded=True)


def _startup_error(model, phase: str) -> str:
    with pytest.raises(StartupError) as info:
        Engine(model)
    assert info.value.phase == phase, str(info.value)
    return str(info.value)


def test_missing_path_says_it_does_not_exist(tmp_path):
    missing = tmp_path / "no" / "such" / "model"
    with pytest.raises(FileNotFoundError) as info:
        ModelConfig.from_model_dir(missing)
    message = str(info.value)
    assert f"model directory {str(missing)!r} does not exist" in message
    assert "local directory" in message
    assert "config.json" not in message.split("(")[0]  # not "no config.json in ...": the directory itself is missing
    assert "Hugging Face Hub" not in message  # an absolute path is not a Hub id
    startup = _startup_error(missing, "config")
    assert message in startup and "FileNotFoundError" in startup


@pytest.mark.parametrize("hub_id", ["meta-llama/Llama-3.2-1B", "Qwen/Qwen3-0.6B"])
def test_hub_id_says_local_directories_only(hub_id, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the id must not resolve to a local directory by chance
    with pytest.raises(FileNotFoundError) as info:
        ModelConfig.from_model_dir(hub_id)
    message = str(info.value)
    assert f"model directory {hub_id!r} does not exist" in message
    assert "pyengine loads models from local directories only" in message
    assert "does not download from the Hugging Face Hub" in message
    assert f"hf download {hub_id} --local-dir DIR" in message
    assert message in _startup_error(hub_id, "config")


def test_hub_like_name_that_is_a_local_directory_loads(single_dir, tmp_path, monkeypatch):
    (tmp_path / "org").mkdir()
    shutil.copytree(single_dir, tmp_path / "org" / "model")
    monkeypatch.chdir(tmp_path)
    assert ModelConfig.from_model_dir("org/model").model_type == "llama"


def test_file_instead_of_directory(single_dir, tmp_path):
    config_file = single_dir / "config.json"
    with pytest.raises(NotADirectoryError) as info:
        ModelConfig.from_model_dir(config_file)
    message = str(info.value)
    assert f"model path {str(config_file)!r} is a file, not a directory" in message
    assert f"the directory that holds it is {str(single_dir)!r}" in message
    assert message in _startup_error(config_file, "config")

    other = tmp_path / "notes.txt"
    other.write_text("not a model")
    with pytest.raises(NotADirectoryError) as info:
        ModelConfig.from_model_dir(other)
    assert f"model path {str(other)!r} is a file, not a directory" in str(info.value)
    assert "the directory that holds it" not in str(info.value)  # no guess for an unrelated file


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json in model directory"):
        ModelConfig.from_model_dir(tmp_path)
    assert "no config.json in model directory" in _startup_error(tmp_path, "config")


@pytest.mark.parametrize("size", ["half", "header"])
def test_truncated_single_file_is_named(single_dir, tmp_path, size):
    bad = tmp_path / "model"
    shutil.copytree(single_dir, bad)
    weights = bad / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2 if size == "half" else 4)
    for call in (lambda: checkpoint_files(bad), lambda: load_tensors(bad, ["lm_head.weight"], torch.float32)):
        with pytest.raises(ValueError) as info:
            call()
        message = str(info.value)
        assert message.startswith(f"cannot read {str(weights)!r}: ")
        assert "Error while deserializing header" in message
        assert "may be truncated or corrupt" in message
    startup = _startup_error(bad, "weights")
    assert f"cannot read {str(weights)!r}" in startup and "may be truncated or corrupt" in startup


def test_truncated_shard_is_named(sharded_dir, tmp_path):
    bad = tmp_path / "model"
    shutil.copytree(sharded_dir, bad)
    shards = sorted(bad.glob("model-*.safetensors"))
    assert len(shards) > 1
    shard = shards[1]
    os.truncate(shard, shard.stat().st_size - 1)
    startup = _startup_error(bad, "weights")
    assert f"cannot read {str(shard)!r}: " in startup
    assert "Error while deserializing header" in startup and "may be truncated or corrupt" in startup
    assert str(shards[0]) not in startup


def test_missing_shard_is_named(sharded_dir, tmp_path):
    bad = tmp_path / "model"
    shutil.copytree(sharded_dir, bad)
    shard = sorted(bad.glob("model-*.safetensors"))[-1]
    shard.unlink()
    assert f"names shard {shard.name!r}, which does not exist" in _startup_error(bad, "weights")


# ---- damaged checkpoints: each a StartupError naming the file and the problem, nothing kept ----

def _live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


def _rewrite(d: Path, change) -> None:
    tensors = load_file(d / "model.safetensors")
    change(tensors)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})


def _corrupt_header(d: Path) -> None:  # same size, garbage where the JSON header is
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:40] = b"#" * 32
    f.write_bytes(bytes(data))


def _garbage_in_data(d: Path) -> None:  # bytes of the last tensor overwritten: 0xff.. decodes to NaN
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-64:] = b"\xff" * 64
    f.write_bytes(bytes(data))


def _drop_field(field: str):
    def change(d: Path) -> None:
        config = json.loads((d / "config.json").read_text())
        del config[field]
        (d / "config.json").write_text(json.dumps(config))
    return change


Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
DAMAGE = {
    "corrupt header": (_corrupt_header, "weights", "cannot read '{weights}': Error while deserializing header"),
    "garbage in the data": (_garbage_in_data, "weights", "in '{weights}' holds a non-finite value (nan at flat index"),
    "integer weight": (lambda d: _rewrite(d, lambda t: t.update({Q_PROJ: t[Q_PROJ].to(torch.int32)})), "weights",
                       f"tensor '{Q_PROJ}' in '{{weights}}' has dtype int32, expected a floating-point type"),
    "wrong shape": (lambda d: _rewrite(d, lambda t: t.update({Q_PROJ: t[Q_PROJ][:-1].contiguous()})), "weights",
                    f"tensor '{Q_PROJ}' has shape"),
    "missing tensor": (lambda d: _rewrite(d, lambda t: t.pop(Q_PROJ)), "weights",
                       f"checkpoint '{{dir}}' is missing tensor '{Q_PROJ}'"),
    "config without hidden_size": (_drop_field("hidden_size"), "config",
                                   "config.json lacks the required field 'hidden_size'"),
    "config without num_hidden_layers": (_drop_field("num_hidden_layers"), "config",
                                         "config.json lacks the required field 'num_hidden_layers'"),
    "broken tokenizer": (lambda d: (d / "tokenizer.json").write_text("{not json"), "config",
                         "cannot load the tokenizer in '{dir}': JSONDecodeError"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_is_named_and_leaves_nothing(single_dir, tmp_path, damage):
    bad = tmp_path / "model"
    shutil.copytree(single_dir, bad)
    change, phase, expected = DAMAGE[damage]
    change(bad)
    before = _live_tensors()
    with pytest.raises(StartupError) as info:
        Engine(bad)
    assert info.value.phase == phase
    assert expected.format(weights=bad / "model.safetensors", dir=bad) in str(info.value)
    # the tensors loaded before the failure are gone, even while the error is held
    assert _live_tensors() == before


def test_a_tokenizer_directory_must_exist_and_hold_one(single_dir, tmp_path):
    missing = tmp_path / "no-such-tokenizer"
    assert f"tokenizer directory {str(missing)!r} does not exist" in _startup_error_with(single_dir, missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (f"no tokenizer.json or tokenizer_config.json in tokenizer directory {str(empty)!r}"
            in _startup_error_with(single_dir, empty))
    # a model without a tokenizer, given one: text prompts work
    bare = tmp_path / "bare"
    shutil.copytree(single_dir, bare)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (bare / f).unlink()
    with Engine(bare) as engine:
        with pytest.raises(ValueError, match=r"a text prompt needs a tokenizer.*Engine\(\.\.\., tokenizer=DIR\)"):
            engine.add_request("hello")
    with Engine(bare, tokenizer=single_dir) as engine:
        engine.add_request("hello")
        assert engine.tokenizer is not None


def _startup_error_with(model, tokenizer) -> str:
    with pytest.raises(StartupError) as info:
        Engine(model, tokenizer=tokenizer)
    assert info.value.phase == "config"
    return str(info.value)
