"""The embedded default model: a tiny Llama built and warm-started locally, no downloads.

``ensure_tiny_model(cache_dir)`` returns a directory in Hugging Face format (config.json,
model.safetensors, tokenizer.json, the chat template) plus the task's prompt files
(``train.jsonl``, ``heldout.jsonl``), building it on first use:

1. a byte-level BPE tokenizer trained with ``tokenizers`` on the task's own text;
2. a ``LlamaForCausalLM`` of about a million parameters (Llama rather than Qwen2 because
   ``AutoTokenizer`` keeps our token ids for ``model_type: llama``);
3. a short supervised warm start on the noisy demonstrations of the task: ``ops.toy.tinytask``
   (single-turn, the default) or ``ops.toy.tinytool`` (multi-turn tool use); ``TASK_RECIPES``
   maps the configuration's ``task`` to its recipe.

``with_context(dir, positions)`` is the same model with a longer (or shorter) context, for
prompts such as a game's first observation (a few hundred tokens). The build is
deterministic for a seed and cached under a key that hashes the recipe, so a
changed recipe never reuses a stale model. The directory is written to a temporary name and
renamed into place, so a half-built model is never taken for a whole one.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from rlhfless.ops.toy import tinytask, tinytool
from rlhfless.ops.toy.tinytask import TallyTask
from rlhfless.ops.toy.tinytool import TallyToolTask

SPECIAL_TOKENS = ["<pad>", "<unk>", "<bos>", "<eos>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass(frozen=True)
class TinyRecipe:
    """Everything that determines the built model; its hash names the cache entry."""

    task: TallyTask | TallyToolTask = field(default_factory=TallyTask)
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    max_positions: int = 256
    sft_steps: int = 900  # about two minutes on two CPU cores
    sft_batch: int = 32
    sft_lr: float = 3e-3
    seed: int = 0

    def key(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


TASK_RECIPES = {  # config key ``task``: the recipe of the embedded model that learns it
    "tally": TinyRecipe(),
    "tally-tool": TinyRecipe(task=TallyToolTask()),
    "tally-long": TinyRecipe(),  # the default model answers the long-tail setting as it is
}


def _task_module(task: TallyTask | TallyToolTask):
    """The module that makes the task's prompts, demonstrations and tokenizer corpus."""
    return tinytool if isinstance(task, TallyToolTask) else tinytask


def default_cache_dir() -> Path:
    return Path(os.environ.get("RLHFLESS_CACHE", Path.home() / ".cache" / "rlhfless"))


def ensure_tiny_model(cache_dir: str | Path | None = None, recipe: TinyRecipe | None = None,
                      log=print) -> Path:
    """Return the directory of the built model, building it if it is not cached yet."""
    recipe = recipe or TinyRecipe()
    root = Path(cache_dir) if cache_dir else default_cache_dir()

    def build(tmp: Path) -> dict:
        started = time.perf_counter()
        build_tiny_model(tmp, recipe, log=log)
        return {"seconds": time.perf_counter() - started}

    return cached_build(root / f"tiny-{recipe.key()}", build)


def with_context(model_dir: str | Path, positions: int) -> Path:
    """The tiny model of ``model_dir`` with a context of ``positions`` tokens: its files as
    they are, ``max_position_embeddings`` changed (Llama's rotary positions are computed, not
    learned: the same weights run at any length, untrained past the built context), cached
    beside it as ``<model_dir>-ctx<positions>``."""
    model_dir = Path(model_dir)

    def build(tmp: Path) -> dict:
        shutil.copytree(model_dir, tmp, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("COMPLETE"))
        config = json.loads((tmp / "config.json").read_text())
        config["max_position_embeddings"] = positions
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        return {"from": model_dir.name, "max_position_embeddings": positions}

    return cached_build(model_dir.parent / f"{model_dir.name}-ctx{positions}", build)


def cached_build(final: Path, build: Callable[[Path], dict]) -> Path:
    """``final``, made by ``build(tmp)`` in a fresh temporary directory beside it (its
    return value goes into the ``COMPLETE`` marker, written last) and renamed into place,
    unless a complete one is cached already; a half-built directory is never ``final``."""
    if (final / "COMPLETE").exists():
        return final
    tmp = final.parent / f".{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "COMPLETE").write_text(json.dumps(build(tmp)))
    try:
        tmp.rename(final)
    except OSError:  # another process finished the same build first
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def build_tokenizer(recipe: TinyRecipe) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    module = _task_module(recipe.task)
    corpus = module.corpus_lines(recipe.task, recipe.seed)
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<bos>",
        eos_token="<eos>",
        padding_side="left",
        chat_template=getattr(module, "CHAT_TEMPLATE", CHAT_TEMPLATE),  # a task's own, if any
    )


def build_model(recipe: TinyRecipe, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        max_position_embeddings=recipe.max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(recipe.seed)
    return LlamaForCausalLM(config)


def _demo_tokens(row: dict, tokenizer) -> tuple[list[int], list[int]]:
    """(ids, labels) of a demonstration: the prompt, then its ``response`` or its
    multi-turn ``segments`` ([text, trained], each part tokenized on its own, as the rollout
    loop does; EOS after every trained part); untrained tokens get label -100."""
    eos = tokenizer.eos_token_id
    parts = [(row["prompt"], False)] + ([tuple(s) for s in row["segments"]]
                                        if "segments" in row else [(row["response"], True)])
    ids: list[int] = []
    labels: list[int] = []
    for text, trained in parts:
        part = tokenizer(text, add_special_tokens=False)["input_ids"] + ([eos] if trained else [])
        ids += part
        labels += part if trained else [-100] * len(part)
    return ids, labels


def _sft_batches(rows: list[dict], tokenizer, recipe: TinyRecipe):
    """Endless shuffled batches: (input_ids [B, T], labels [B, T]) with the prompt masked."""
    encoded = [_demo_tokens(row, tokenizer) for row in rows]
    rng = random.Random(recipe.seed)
    window = recipe.sft_batch * 16
    while True:
        rng.shuffle(encoded)
        chunks = []
        for w in range(0, len(encoded), window):  # similar lengths per batch: less padding
            part = sorted(encoded[w : w + window], key=lambda demo: len(demo[0]))
            size = recipe.sft_batch
            chunks += [part[i : i + size] for i in range(0, len(part) - size + 1, size)]
        rng.shuffle(chunks)
        for chunk in chunks:
            width = max(len(seq) for seq, _ in chunk)
            ids = torch.full((len(chunk), width), tokenizer.pad_token_id, dtype=torch.long)
            labels = torch.full((len(chunk), width), -100, dtype=torch.long)
            for i, (seq, lab) in enumerate(chunk):
                ids[i, : len(seq)] = torch.tensor(seq)
                labels[i, : len(seq)] = torch.tensor(lab)
            yield ids, labels


def warm_start(model: LlamaForCausalLM, tokenizer, rows: list[dict], recipe: TinyRecipe,
               log=print) -> list[float]:
    """Supervised fine-tuning on the demonstrations; returns the loss curve."""
    torch.manual_seed(recipe.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.sft_lr, weight_decay=0.01)
    warmup = max(1, recipe.sft_steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (recipe.sft_steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    losses = []
    batches = _sft_batches(rows, tokenizer, recipe)
    for step in range(recipe.sft_steps):
        ids, labels = next(batches)
        mask = (ids != tokenizer.pad_token_id).long()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 100 == 0 or step == recipe.sft_steps - 1:
            log(f"warm start step {step}/{recipe.sft_steps} loss {loss.item():.3f}")
    model.eval()
    return losses


def _write_jsonl(rows: list[dict], path: Path) -> None:
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def build_tiny_model(out: Path, recipe: TinyRecipe, log=print) -> None:
    """Build tokenizer, model and prompt files into ``out`` (an empty directory)."""
    splits = _task_module(recipe.task).make_splits(recipe.task, recipe.seed)
    tokenizer = build_tokenizer(recipe)
    model = build_model(recipe, tokenizer)
    log(f"built tiny model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params")
    losses = warm_start(model, tokenizer, splits["sft"], recipe, log=log)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for name in ("train", "heldout"):
        _write_jsonl(splits[name], out / f"{name}.jsonl")
    (out / "recipe.json").write_text(json.dumps(asdict(recipe), indent=1))
    (out / "warm_start.json").write_text(json.dumps({"losses": losses}))
