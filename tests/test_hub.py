"""Models by their hub id: read from a cache laid out as huggingface_hub lays it out (HF_HUB_OFFLINE=1, nothing
downloaded), and the error paths against a fake Hub endpoint on localhost."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import socket
import threading

import numpy as np
import pytest
from transformers import LlamaConfig

import jaxtune
from conftest import build_hf_model
from jaxtune.cli import main as cli_main
from jaxtune.io.hub import parse_hub_id

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1)
COMMIT, COMMIT_V1 = "a" * 40, "b" * 40


def _cache_repo(cache, repo: str, files: dict[str, str], commit: str, ref: str = "main"):
    """Lays `files` (name -> source path) into `cache` as huggingface_hub does: blobs, a snapshot of symlinks, a ref."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / ref).write_text(commit)
    for name, src in files.items():
        blob = root / "blobs" / f"{abs(hash((commit, name))):x}"
        blob.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, blob)
        link = root / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return root / "snapshots" / commit


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def _tiny_dir(path, tiny_tokenizer, seed=0):
    build_hf_model(LlamaConfig(**{**TINY, "vocab_size": len(tiny_tokenizer)}), path, seed=seed)
    tiny_tokenizer.save_pretrained(path)
    (path / "pytorch_model.bin").write_bytes(b"never read: pickle")  # a file the loader must not fetch
    return path


def test_hub_ids_parse_and_local_paths_do_not():
    assert parse_hub_id("Qwen/Qwen3-8B") == ("Qwen/Qwen3-8B", None, None)
    assert parse_hub_id("unsloth/Llama-3.2-1B-Instruct-bnb-4bit@main") == (
        "unsloth/Llama-3.2-1B-Instruct-bnb-4bit", None, "main")
    assert parse_hub_id("owner/repo/sub/model.Q4_K_M.gguf@v1") == ("owner/repo", "sub/model.Q4_K_M.gguf", "v1")
    for name in ("smollm2", "../x/y", "/abs/path", "a/b/c", ".hidden/x", "a/b/model.bin"):
        assert parse_hub_id(name) is None, name
    with pytest.raises(jaxtune.CheckpointError, match=r"model path './a/b' does not exist; pass an HF model directory"):
        jaxtune.from_pretrained("./a/b")  # a relative path is never taken for a hub id


def test_a_cached_hub_id_loads_as_its_directory_with_only_the_files_loading_reads(hub_cache, tmp_path, tiny_tokenizer):
    src = _tiny_dir(tmp_path / "src", tiny_tokenizer)
    files = {f: src / f for f in os.listdir(src)}
    snapshot = _cache_repo(hub_cache, "owner/tiny", files, COMMIT)
    want, _ = jaxtune.from_pretrained(src, dtype="float32")
    got, tok = jaxtune.from_pretrained("owner/tiny", dtype="float32")
    ids = np.arange(12, dtype=np.int32)[None] % TINY["vocab_size"]
    np.testing.assert_array_equal(np.asarray(got(ids)), np.asarray(want(ids)))
    assert tok is not None and got.name_or_path == "owner/tiny"
    assert os.path.isfile(snapshot / "pytorch_model.bin")  # cached, but never a pattern the loader asks for
    from huggingface_hub.utils import filter_repo_objects

    from jaxtune.io.hub import IGNORED_FILES, MODEL_FILES
    listed = ["pytorch_model.bin", "model.safetensors", "config.json", "original/model.safetensors", "metal/model.bin"]
    assert list(filter_repo_objects(listed, allow_patterns=MODEL_FILES, ignore_patterns=IGNORED_FILES)) == [
        "model.safetensors", "config.json"]  # huggingface_hub's own filter, as snapshot_download applies it

    # a revision: the id's @ suffix or the keyword
    _cache_repo(hub_cache, "owner/tiny", {f: _tiny_dir(tmp_path / "v1", tiny_tokenizer, seed=1) / f
                                          for f in os.listdir(src)}, COMMIT_V1, ref="v1")
    v1, _ = jaxtune.from_pretrained("owner/tiny@v1", dtype="float32")
    v1_kw, _ = jaxtune.from_pretrained("owner/tiny", dtype="float32", revision="v1")
    assert not np.allclose(np.asarray(v1(ids)), np.asarray(want(ids)))
    np.testing.assert_array_equal(np.asarray(v1(ids)), np.asarray(v1_kw(ids)))
    assert v1_kw.name_or_path == "owner/tiny@v1"

    # the command line takes it as it takes a path: convert, then train from the converted copy
    assert cli_main(["convert", "owner/tiny", str(tmp_path / "nf4"), "--quantize", "none"]) == 0
    converted, _ = jaxtune.from_pretrained(tmp_path / "nf4", dtype="float32")
    assert converted.config == want.config


def test_a_named_gguf_of_a_hub_repo_loads(hub_cache, smollm2_path):
    _cache_repo(hub_cache, "owner/smol-GGUF", {"SmolLM2.Q4_1.gguf": smollm2_path}, COMMIT)
    model, tokenizer = jaxtune.from_pretrained("owner/smol-GGUF/SmolLM2.Q4_1.gguf", dtype="float32")
    assert model.config.num_layers == 30 and tokenizer is not None


def test_offline_and_not_cached_is_one_line_naming_hf_hub_offline(hub_cache, capsys, tmp_path):
    with pytest.raises(jaxtune.CheckpointError, match=r"HF_HUB_OFFLINE=1 forbids downloading it") as e:
        jaxtune.from_pretrained("owner/never-cached")
    assert "\n" not in str(e.value)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "x"}) + "\n")
    # the CLI: train and generate accept the id before anything loads; the load then fails in one line
    assert cli_main(["generate", "owner/never-cached", "--prompt", "hi"]) == 1
    assert cli_main(["train", "--model", "owner/never-cached", "--data", str(data), "--format", "text",
                     "--out", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("jaxtune: error: model 'owner/never-cached'") for line in err), err
    assert not (tmp_path / "run").exists()


class _FakeHub(http.server.BaseHTTPRequestHandler):
    """Answers the Hub API as the Hub does for a missing and a gated repo (status and X-Error-Code)."""

    def _answer(self):
        if "/gated" in self.path:
            status, code, message = 403, "GatedRepo", "Access to model owner/gated is restricted."
        elif "/revision/nope" in self.path:
            status, code, message = 404, "RevisionNotFound", "Invalid rev id: nope"
        else:
            status, code, message = 404, "RepoNotFound", "Repository not found"
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_hub(hub_cache, monkeypatch):
    from huggingface_hub import constants

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    yield
    server.shutdown()


@pytest.mark.parametrize("name, message", [
    ("owner/missing", r"the Hub has no repo 'owner/missing' \(or it is private: set HF_TOKEN\)"),
    ("owner/gated", r"owner/gated is a gated repo: accept its terms .* set HF_TOKEN"),
    ("owner/repo@nope", r"the Hub repo owner/repo has no revision 'nope'"),
])
def test_hub_errors_are_one_line_with_the_fix(fake_hub, name, message):
    with pytest.raises(jaxtune.CheckpointError, match=message) as e:
        jaxtune.from_pretrained(name)
    assert "\n" not in str(e.value)


def test_no_network_names_the_network_and_the_offline_switch(hub_cache, monkeypatch):
    from huggingface_hub import constants

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(jaxtune.CheckpointError, match=r"cannot reach the Hub to download owner/tiny") as e:
        jaxtune.from_pretrained("owner/tiny")
    assert "\n" not in str(e.value)
