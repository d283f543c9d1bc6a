"""Convert a llama-architecture GGUF file into an HF-style directory (safetensors + config + tokenizer).

Quantized tensors are dequantized to float32 once; the result is cached so later loads only read
safetensors. llama.cpp stores Q and K projections with rows permuted for its interleaved rotary layout;
`unpermute_rotary` undoes that so the weights match the half-split RoPE in model.py.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from hicache.engine.tokenizer import Tokenizer
from hicache.modelinfo import LlamaConfig

FORMAT_VERSION = 1
# GGUF tensor name (after "blk.N.") -> our parameter name (after "layers.N.")
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_TENSORS = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's `reshape(n_head, 2, d // n_head // 2, ...).swapaxes(1, 2)` on Q/K rows."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_model_config(reader: Any, name: str, revision: str) -> LlamaConfig:
    """LlamaConfig from a GGUF file's `llama.*` metadata."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported; only 'llama'")
    hidden = _field(reader, "llama.embedding_length")
    num_heads = _field(reader, "llama.attention.head_count")
    tensor_names = {t.name for t in reader.tensors}
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    rope_scaling = None
    if _field(reader, "llama.rope.scaling.type") not in (None, "none"):
        raise ValueError("GGUF rope scaling is not supported")
    return LlamaConfig(
        vocab_size=int(_field(reader, "llama.vocab_size", embedding.shape[-1])),
        hidden_size=hidden,
        intermediate_size=_field(reader, "llama.feed_forward_length"),
        num_layers=_field(reader, "llama.block_count"),
        num_heads=num_heads,
        num_kv_heads=_field(reader, "llama.attention.head_count_kv", num_heads),
        head_dim=_field(reader, "llama.rope.dimension_count", hidden // num_heads),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=_field(reader, "llama.context_length", 4096),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (eos,),
        name=name,
        revision=revision,
    )


def gguf_state_dict(reader: Any, config: LlamaConfig) -> dict[str, torch.Tensor]:
    """All tensors dequantized to float32 under our names, Q/K rows un-permuted (tqdm progress)."""
    from gguf.quants import dequantize

    state: dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc="dequantizing GGUF", unit="tensor"):
        base, suffix = tensor.name.rsplit(".", 1)  # "blk.0.attn_q", "weight"
        if base.startswith("blk."):
            _, layer, kind = base.split(".", 2)
            if kind not in LAYER_TENSORS:
                raise ValueError(f"unexpected GGUF tensor {tensor.name}")
            name = f"layers.{layer}.{LAYER_TENSORS[kind]}.{suffix}"
        elif base in GLOBAL_TENSORS:
            kind, name = base, f"{GLOBAL_TENSORS[base]}.{suffix}"
        else:
            raise ValueError(f"unexpected GGUF tensor {tensor.name}")
        # GGUF shapes are listed innermost first; numpy data is already [rows, cols] = [out, in]
        shape = tuple(int(d) for d in reversed(tensor.shape))
        values = dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float32)
        if kind == "attn_q":
            values = unpermute_rotary(values, config.num_heads)
        elif kind == "attn_k":
            values = unpermute_rotary(values, config.num_kv_heads)
        state[name] = torch.from_numpy(np.ascontiguousarray(values))
    return state


def gguf_tokenizer(reader: Any) -> Tokenizer:
    """Byte-level BPE tokenizer and chat template from `tokenizer.ggml.*` metadata."""
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported; only 'gpt2' (byte-level BPE)")
    return Tokenizer.from_gguf_vocab(
        tokens=_field(reader, "tokenizer.ggml.tokens"),
        merges=_field(reader, "tokenizer.ggml.merges"),
        token_types=_field(reader, "tokenizer.ggml.token_type"),
        bos_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        chat_template=_field(reader, "tokenizer.chat_template"),
    )


def convert_gguf(gguf_path: Path, out_dir: Path, name: str, revision: str) -> None:
    """Write model.safetensors, config.json, tokenizer files and hicache.json for `gguf_path` to `out_dir`.

    Writes into a temporary sibling directory and renames it into place, so a crash leaves no partial cache. An
    `out_dir` that exists meanwhile (another process converted the same file) is kept and the copy dropped: the
    directory a reader may be using is never removed.
    """
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    config = gguf_model_config(reader, name, revision)
    state = gguf_state_dict(reader, config)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config.to_hf_config(), indent=2))
        gguf_tokenizer(reader).save(tmp)
        meta = {
            "format_version": FORMAT_VERSION,
            "source": str(gguf_path),
            "name": name,
            "revision": revision,
        }
        (tmp / "hicache.json").write_text(json.dumps(meta, indent=2))
        try:
            os.rename(tmp, out_dir)
        except OSError:  # out_dir appeared: another conversion of the same content won
            if not (out_dir / "hicache.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
