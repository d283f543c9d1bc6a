"""Shared helpers for engine tests: run token chunks through a model over a scattered paged KV pool."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

from hicache.engine import load_model
from hicache.engine.model import ForwardBatch, LlamaModel

REPO_ROOT = Path(__file__).resolve().parents[2]
INTERPRETER_TIMEOUT_S = 600.0


class InterpretedRun:
    """interpreted_checks.py SECTION... started now in a subprocess under Triton's interpreter (TRITON_INTERPRET=1
    must be set before Triton is imported); `results(section)` waits for that section and loads what it saved."""

    def __init__(self, out_dir: Path, sections: list[str]) -> None:
        self.out_dir, self.sections = out_dir, list(sections)
        self.log_path = out_dir / "interpreter.log"
        self._log = open(self.log_path, "wb")
        inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        # this checkout's hicache first, as in the tests that started it (not the one a venv may have installed)
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *inherited])}
        script = Path(__file__).resolve().parent / "interpreted_checks.py"
        self.proc = subprocess.Popen([sys.executable, str(script), str(out_dir), *self.sections],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.deadline = time.monotonic() + INTERPRETER_TIMEOUT_S

    def results(self, section: str) -> dict:
        assert section in self.sections, f"{section!r} was not asked of this run"
        done, failed = self.out_dir / f"{section}.pt", self.out_dir / f"{section}.error"
        while not (done.exists() or failed.exists()) and self.proc.poll() is None:
            if time.monotonic() > self.deadline:
                self.kill()
                raise AssertionError(f"interpreter checks not done after {INTERPRETER_TIMEOUT_S} s")
            time.sleep(0.05)
        if done.exists():
            return torch.load(done)
        why = failed.read_text() if failed.exists() else f"exit {self.proc.returncode}:\n{self.log_path.read_text()}"
        raise AssertionError(f"interpreter check {section!r} failed:\n{why[-4000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def slot(page_table: Tensor, position: int, page_size: int) -> int:
    """Flat KV slot of `position` in a sequence with `page_table`."""
    return int(page_table[position // page_size]) * page_size + position % page_size


def make_batch(
    sequences: list[tuple[list[int], int, Tensor]], page_size: int, device: torch.device | str = "cpu"
) -> ForwardBatch:
    """ForwardBatch from (new tokens, number already cached, page table) per sequence."""
    ids, positions, slots, seq_lens, new_lens, tables = [], [], [], [], [], []
    for new_tokens, cached, page_table in sequences:
        seq_len = cached + len(new_tokens)
        ids += new_tokens
        positions += list(range(cached, seq_len))
        slots += [slot(page_table, p, page_size) for p in range(cached, seq_len)]
        seq_lens.append(seq_len)
        new_lens.append(len(new_tokens))
        tables.append(page_table[: -(-seq_len // page_size)].to(device))
    return ForwardBatch(
        input_ids=torch.tensor(ids, device=device),
        positions=torch.tensor(positions, device=device),
        out_slots=torch.tensor(slots, device=device),
        seq_lens=seq_lens,
        new_lens=new_lens,
        page_tables=tables,
    )


def run_in_chunks(
    model: LlamaModel, kv: Tensor, page_table: Tensor, tokens: list[int], chunks: list[int], page_size: int
) -> Tensor:
    """Feed `tokens` as consecutive chunks of the given sizes; return all new-token logits [len, vocab]."""
    if sum(chunks) != len(tokens):
        raise ValueError("chunks must cover the tokens")
    logits, cached = [], 0
    for size in chunks:
        batch = make_batch([(tokens[cached : cached + size], cached, page_table)], page_size, model.device)
        logits.append(model(batch, kv, page_size, all_logits=True))
        cached += size
    return torch.cat(logits)


SMALL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def hf_and_ours(tmp_path: Path, kind: str, device: str = "cpu"):
    """A small random HF model of `kind` (llama, llama3, qwen2, tied) and ours loaded from its saved dir."""
    import transformers

    torch.manual_seed(0)
    if kind == "qwen2":
        config = transformers.Qwen2Config(**SMALL, rope_theta=1e6)
        hf = transformers.Qwen2ForCausalLM(config)
    else:
        extra = {}
        if kind == "llama3":
            extra["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        tied = kind == "tied"
        config = transformers.LlamaConfig(**SMALL, rope_theta=500000.0, tie_word_embeddings=tied, **extra)
        hf = transformers.LlamaForCausalLM(config)
    if kind == "qwen2":  # HF initialises biases to zero; make them matter
        with torch.no_grad():
            for name, param in hf.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0, 0.5)
    hf.eval()
    hf.save_pretrained(tmp_path / kind, max_shard_size="100KB" if kind == "qwen2" else "1GB")
    if kind == "qwen2":
        assert len(list((tmp_path / kind).glob("*.safetensors"))) > 1  # sharded checkpoint path
    ours, _ = load_model(str(tmp_path / kind), torch.float32, torch.device(device))
    return hf.to(device), ours


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    """All-position float32 logits of one sequence from a transformers model."""
    with torch.no_grad():
        return hf(torch.tensor([tokens], device=hf.device)).logits[0].float()
