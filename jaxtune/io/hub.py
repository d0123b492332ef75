"""Models named by their Hugging Face Hub id (`Qwen/Qwen3-8B`, `owner/repo/file.gguf`, `owner/repo@revision`).

Only the files the loader reads are fetched (safetensors shards and their index, the config, the tokenizer files,
or the one GGUF named), through `huggingface_hub`: its cache, its progress bars, the token from the environment
(HF_TOKEN) and HF_HUB_OFFLINE. Every failure is one line that names the problem and the fix.
"""

from __future__ import annotations

import os
import re

from jaxtune.errors import CheckpointError

# what from_pretrained / convert read from an HF model directory (never pickle weights)
MODEL_FILES = ["*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
               "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
               "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json", "jaxtune.json"]
# the loader reads the repo's top level only; subfolders hold other formats of the same weights (gpt-oss's `original/`
# and `metal/`: as large again)
IGNORED_FILES = ["*/*"]
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?P<file>/[\w./-]+\.gguf)?(?:@(?P<revision>[\w./-]+))?")


def parse_hub_id(name: str) -> tuple[str, str | None, str | None] | None:
    """(repo id, GGUF file in it or None, revision or None) of a hub id, or None if `name` is not one."""
    m = _HUB_ID.fullmatch(name)
    if m is None or ".." in name or name.startswith("."):
        return None
    file = m.group("file")
    return m.group("repo"), file[1:] if file else None, m.group("revision")


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def download(name: str, revision: str | None = None) -> str:
    """Local path of hub id `name` (a directory of the model's files, or the GGUF file), from the cache or fetched."""
    parsed = parse_hub_id(name)
    if parsed is None:
        raise CheckpointError(f"{name!r} is not a hub id; pass owner/repo, owner/repo/FILE.gguf or owner/repo@revision")
    repo, gguf_file, at = parsed
    revision = revision or at
    import huggingface_hub
    from huggingface_hub import errors

    where = repo + (f"@{revision}" if revision else "")
    try:
        if gguf_file:
            return huggingface_hub.hf_hub_download(repo, gguf_file, revision=revision)
        path = huggingface_hub.snapshot_download(repo, revision=revision, allow_patterns=MODEL_FILES,
                                                     ignore_patterns=IGNORED_FILES)
    except errors.IncompleteSnapshotError:
        raise CheckpointError(f"the cached copy of {where} is incomplete and the Hub cannot complete it; check the "
                              "network (or unset HF_HUB_OFFLINE) and run again") from None
    except errors.GatedRepoError:
        raise CheckpointError(f"{where} is a gated repo: accept its terms on its Hub page, then set HF_TOKEN to a token "
                              "of that account (or run `hf auth login`)") from None
    except errors.RepositoryNotFoundError:
        raise CheckpointError(f"model {name!r} is not a local path, and the Hub has no repo {repo!r} (or it is private: "
                              "set HF_TOKEN); check the name or the path") from None
    except errors.RevisionNotFoundError:
        raise CheckpointError(f"the Hub repo {repo} has no revision {revision!r}; pass a branch, tag or commit of "
                              "it") from None
    except errors.EntryNotFoundError as e:
        if isinstance(e, errors.LocalEntryNotFoundError):
            raise _unreachable(name, where) from None
        raise CheckpointError(f"the Hub repo {where} has no file {gguf_file!r}; name one of its .gguf files") from None
    except (errors.OfflineModeIsEnabled, OSError) as e:  # no network (connection refused, DNS, timeout)
        raise _unreachable(name, where, e) from None
    except errors.HfHubHTTPError as e:
        raise CheckpointError(f"downloading {where} failed: {str(e).splitlines()[0]}; retry, or set "
                              "HF_HUB_OFFLINE=1 to use the local cache only") from None
    if not any(f.endswith(".safetensors") for f in os.listdir(path)):
        raise CheckpointError(f"the Hub repo {where} has no safetensors weights (jaxtune never reads pickle .bin files); "
                              "for a GGUF repo name the file: owner/repo/FILE.gguf")
    return path


def _unreachable(name: str, where: str, error: BaseException | None = None) -> CheckpointError:
    if offline():
        return CheckpointError(f"model {name!r} is neither a local path nor in the huggingface_hub cache, and "
                               "HF_HUB_OFFLINE=1 forbids downloading it; unset HF_HUB_OFFLINE to download it, or "
                               "pass a local directory")
    reason = f" ({type(error).__name__})" if error is not None else ""
    return CheckpointError(f"cannot reach the Hub to download {where}{reason} and it is not in the local cache; check "
                           "the network (HF_ENDPOINT, proxy), or pass a local directory")
