#!/usr/bin/env python
"""Train the tiny Llama that `python -m pyengine demo` runs (pyengine/demo_model/).

The text is CPython's own bundled documentation: the reference topics that `help()` shows
(the `topics` dict of the standard library module `pydoc_data.topics`), plus the longer
docstrings of the pure-Python standard library modules (read with `ast` from the source
files, nothing is imported). Both ship with every CPython and are under the PSF licence.
A few topics (HELD_OUT_TOPICS) are left out of training so that a test can measure the
model on documentation it has not seen.

The script trains, in this order:
  1. a byte-level BPE tokenizer (`tokenizers`, VOCAB_SIZE entries) with <s>/</s>/<pad> and
     chat special tokens <|system|>, <|user|>, <|assistant|>, <|end|>, saved as a
     `PreTrainedTokenizerFast` with a Jinja chat template (the model is NOT chat-trained:
     the template only makes `apply_chat_template` work);
  2. a `transformers.LlamaForCausalLM` (a few million parameters) on packed sequences of
     SEQ_LEN tokens, AdamW with linear warm-up and a cosine schedule, float32 on the CPU;
then saves it with `save_pretrained` (config.json, generation_config.json, model.safetensors
in bfloat16) with the tokenizer files, a model card (README.md) and training.json (the
settings, the corpus figures, the held-out topics, the losses, the time).

Reproducible: seeded (torch.manual_seed, a seeded document order per epoch), so the same
machine with the same Python, torch and tokenizers versions gives the same weights;
bit-identical weights across machines (other CPU kernels, thread counts) are not promised.
The corpus depends on the Python version's documentation (the shipped model was trained with
the Python that training.json names).

    python scripts/train_demo_model.py            # about 9.5 minutes on 2 idle CPU cores
    python scripts/train_demo_model.py --out /tmp/demo --steps 50   # a quick try
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import platform
import random
import re
import sys
import sysconfig
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "pyengine" / "demo_model"

SEED = 1234
VOCAB_SIZE = 4096
SEQ_LEN = 256
BATCH_SIZE = 8
STEPS = 1000
WARMUP = 40
LR = 3e-3
MIN_LR_RATIO = 0.1
WEIGHT_DECAY = 0.1
MODEL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             intermediate_size=640, max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-5,
             tie_word_embeddings=True)

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
CHAT_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# <|system|>\n...<|end|>\n<|user|>\n...<|end|>\n<|assistant|>\n...<|end|>\n
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] | trim + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# Topics kept out of training (measured on in tests/test_cli.py via training.json).
HELD_OUT_TOPICS = ["while", "pass", "del"]
TOPIC_REPEATS = 3
MIN_DOCSTRING_CHARS = 200
# Standard-library directories that are tests, demos or GUI code rather than documentation.
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "idlelib", "lib2to3", "tkinter", "turtledemo",
             "ensurepip", "venv", "__phello__", "pydoc_data"}


# ---- the corpus --------------------------------------------------------------------------


_RULE = re.compile(r"^([*=\-~^])\1{2,}$")  # a heading's underline
_WORD = re.compile(r"[A-Za-z]+")
_CODE = re.compile(r">>>|::=|(^|\s)#\s|\s=\s|^\.\.\.")


def prose(text: str) -> str:
    """The running text of a document: headings (the line above an underline) and paragraphs of
    sentences, each paragraph's hard-wrapped lines joined into one; code examples, grammar rules,
    tables and lists of names are left out. Paragraphs are separated by a blank line."""
    out: list[str] = []
    for para in re.split(r"\n[ \t]*\n", text.replace("\r\n", "\n")):
        lines = [line for line in para.split("\n") if line.strip()]
        if not lines:
            continue
        if len(lines) >= 2 and _RULE.match(lines[-1].strip()):
            title = " ".join(line.strip() for line in lines[:-1])
            if not _RULE.match(title):
                out.append(title)
            continue
        joined = " ".join(line.strip() for line in lines)
        indented = any(line[:1].isspace() for line in lines)
        if _CODE.search(joined) or any(_CODE.search(line.strip()) for line in lines):
            continue
        if indented and (not joined.endswith(".") or joined.count("(") > 2):
            continue
        words = _WORD.findall(joined)
        if len(words) < 6 or sum(map(len, words)) < 0.6 * len(joined):
            continue
        if not re.search(r"[.:;)]$|[a-z]$", joined):
            continue
        out.append(re.sub(r"[ \t]+", " ", joined))
    return "\n\n".join(out)


def pydoc_topics() -> dict[str, str]:
    """The help() topics' running text (see prose), by topic name."""
    from pydoc_data.topics import topics
    return {name: prose(text) for name, text in sorted(topics.items())}


def stdlib_docstrings() -> list[str]:
    """The running text (see prose) of the docstrings (modules, classes, functions) in the
    standard library's .py files, where it has at least MIN_DOCSTRING_CHARS characters, in sorted
    path order, without duplicates."""
    root = Path(sysconfig.get_paths()["stdlib"])
    seen: set[str] = set()
    docs: list[str] = []
    for path in sorted(root.rglob("*.py")):
        if SKIP_DIRS.intersection(path.relative_to(root).parts[:-1]):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= MIN_DOCSTRING_CHARS:
                    doc = prose(doc)
                    if len(doc) >= MIN_DOCSTRING_CHARS and doc not in seen:
                        seen.add(doc)
                        docs.append(doc)
    return docs


def corpus() -> tuple[list[str], dict]:
    topics = pydoc_topics()
    train_topics = [text for name, text in topics.items() if name not in HELD_OUT_TOPICS]
    docstrings = stdlib_docstrings()
    # The reference topics TOPIC_REPEATS times an epoch: they are the demo's subject (and about a
    # third of the docstrings' size); the docstrings add variety.
    docs = train_topics * TOPIC_REPEATS + docstrings
    info = {"pydoc_topics": len(train_topics), "pydoc_topic_chars": sum(map(len, train_topics)),
            "held_out_topics": HELD_OUT_TOPICS, "stdlib_docstrings": len(docstrings),
            "stdlib_docstring_chars": sum(map(len, docstrings)), "topic_repeats": TOPIC_REPEATS}
    return docs, info


# ---- the tokenizer -----------------------------------------------------------------------


def train_tokenizer(docs: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=[BOS, EOS, PAD, *CHAT_TOKENS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer=trainer)
    # Like Llama: encode prepends <s> (add_special_tokens=True); no </s>.
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, tok.token_to_id(BOS))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   additional_special_tokens=CHAT_TOKENS, chat_template=CHAT_TEMPLATE,
                                   clean_up_tokenization_spaces=False, model_max_length=1 << 30)


def save_tokenizer(tokenizer, out: Path) -> None:
    """tokenizer.json and tokenizer_config.json, with the chat template inside the latter, in the
    layout that transformers 4 reads as well as 5 (class PreTrainedTokenizerFast, the chat tokens
    as additional_special_tokens)."""
    tokenizer.save_pretrained(str(out), save_jinja_files=False)
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("backend", "extra_special_tokens", "is_local", "local_files_only"):
        config.pop(key, None)
    config["additional_special_tokens"] = CHAT_TOKENS
    config["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for extra in ("chat_template.jinja", "special_tokens_map.json"):
        if (out / extra).exists():
            (out / extra).unlink()


def encode(tokenizer, docs: list[str]) -> list[list[int]]:
    """<s> doc </s> per document."""
    eos = tokenizer.eos_token_id
    return [ids + [eos] for ids in tokenizer(docs)["input_ids"]]


def epoch_batches(encoded: list[list[int]], epoch: int) -> torch.Tensor:
    """The documents in a seeded order, packed end to end and cut into rows of SEQ_LEN + 1."""
    order = list(range(len(encoded)))
    random.Random(SEED * 1000 + epoch).shuffle(order)
    stream = [t for i in order for t in encoded[i]]
    rows = len(stream) // (SEQ_LEN + 1)
    return torch.tensor(stream[: rows * (SEQ_LEN + 1)], dtype=torch.long).view(rows, SEQ_LEN + 1)


# ---- training ------------------------------------------------------------------------------


def lr_at(step: int, steps: int) -> float:
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    progress = (step - WARMUP) / max(1, steps - WARMUP)
    return LR * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


def build_model(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         hidden_act="silu", initializer_range=0.02, attention_bias=False, mlp_bias=False, **MODEL)
    return LlamaForCausalLM(config)


def held_out_loss(model, tokenizer) -> float:
    """Mean per-token loss (nats) on the held-out topics."""
    topics = pydoc_topics()
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for name in HELD_OUT_TOPICS:
            ids = tokenizer(topics[name])["input_ids"]
            for start in range(0, len(ids), SEQ_LEN):
                chunk = torch.tensor([ids[start: start + SEQ_LEN]])
                if chunk.shape[1] < 2:
                    continue
                # the model shifts the labels: n - 1 predictions for n tokens
                total += model(input_ids=chunk, labels=chunk).loss.item() * (chunk.shape[1] - 1)
                count += chunk.shape[1] - 1
    model.train()
    return total / max(1, count)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"optimizer steps (default {STEPS})")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args(argv)

    from transformers import GenerationConfig

    start = time.perf_counter()
    torch.manual_seed(SEED)
    torch.set_num_threads(args.threads)

    docs, info = corpus()
    print(f"corpus: {info['pydoc_topics']} pydoc topics ({info['pydoc_topic_chars']:,} chars, x{TOPIC_REPEATS}) + "
          f"{info['stdlib_docstrings']} stdlib docstrings ({info['stdlib_docstring_chars']:,} chars); "
          f"held out: {', '.join(HELD_OUT_TOPICS)}", flush=True)
    tokenizer = train_tokenizer(docs)
    encoded = encode(tokenizer, docs)
    num_tokens = sum(map(len, encoded))
    info["tokens_per_epoch"] = num_tokens
    print(f"tokenizer: {len(tokenizer)} tokens; {num_tokens:,} training tokens an epoch "
          f"({time.perf_counter() - start:.1f} s)", flush=True)

    torch.manual_seed(SEED)
    model = build_model(tokenizer)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model: {num_params:,} parameters, {MODEL['num_hidden_layers']} layers, hidden {MODEL['hidden_size']}; "
          f"{args.steps} steps x {BATCH_SIZE} x {SEQ_LEN} tokens = {args.steps * BATCH_SIZE * SEQ_LEN / num_tokens:.1f} "
          "epochs", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.95), eps=1e-8)

    model.train()
    epoch, rows, row = 0, epoch_batches(encoded, 0), 0
    losses: list[float] = []
    train_start = time.perf_counter()
    for step in range(args.steps):
        if row + BATCH_SIZE > rows.shape[0]:
            epoch, row = epoch + 1, 0
            rows = epoch_batches(encoded, epoch)
        batch = rows[row: row + BATCH_SIZE]
        row += BATCH_SIZE
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % args.log_every == 0 or step == 0 or step + 1 == args.steps:
            elapsed = time.perf_counter() - train_start
            recent = losses[-args.log_every:]
            print(f"step {step + 1:4d}/{args.steps}  loss {sum(recent) / len(recent):.3f}  "
                  f"lr {lr_at(step, args.steps):.2e}  epoch {epoch}  {elapsed:6.1f} s "
                  f"({elapsed / (step + 1):.2f} s/step)", flush=True)
    train_seconds = time.perf_counter() - train_start
    final = losses[-min(20, len(losses)):]
    final_loss = sum(final) / len(final)
    eval_loss = held_out_loss(model, tokenizer)
    print(f"final training loss {final_loss:.3f} (mean of the last {len(final)} steps); held-out topics "
          f"{eval_loss:.3f} (log(vocab) = {math.log(len(tokenizer)):.2f})", flush=True)

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*"):  # a clean directory: no stale shard or tokenizer file from an earlier run
        if old.is_file():
            old.unlink()
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id, do_sample=True, temperature=0.7,
                                               top_k=40, top_p=0.9, repetition_penalty=1.3, max_new_tokens=128)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.model_max_length = MODEL["max_position_embeddings"]  # set last: whole documents were encoded
    save_tokenizer(tokenizer, out)
    total_seconds = time.perf_counter() - start
    record = {
        "script": "scripts/train_demo_model.py", "seed": SEED, "steps": args.steps, "batch_size": BATCH_SIZE,
        "seq_len": SEQ_LEN, "lr": LR, "warmup": WARMUP, "min_lr_ratio": MIN_LR_RATIO, "weight_decay": WEIGHT_DECAY,
        "model": MODEL, "num_parameters": num_params, "vocab_size": len(tokenizer), "corpus": info,
        "epochs": round(args.steps * BATCH_SIZE * SEQ_LEN / num_tokens, 2),
        "final_train_loss": round(final_loss, 4), "held_out_loss": round(eval_loss, 4),
        "train_seconds": round(train_seconds, 1), "total_seconds": round(total_seconds, 1), "threads": args.threads,
        "python": platform.python_version(), "torch": torch.__version__,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
    }
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / "README.md").write_text(model_card(record))
    for f in out.iterdir():  # safetensors writes its file owner-only (0600); a wheel would install it so
        if f.is_file():
            f.chmod(0o644)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"wrote {out} ({size / 2**20:.1f} MiB) in {total_seconds:.0f} s", flush=True)
    return 0


def model_card(r: dict) -> str:
    c = r["corpus"]
    m = r["model"]
    return f"""# pyengine demo model

A {r['num_parameters'] / 1e6:.1f} M-parameter Llama (`LlamaForCausalLM`: {m['num_hidden_layers']} layers, hidden
{m['hidden_size']}, {m['num_attention_heads']} heads / {m['num_key_value_heads']} KV heads, tied embeddings, a
{r['vocab_size']}-token byte-level BPE vocabulary), trained from scratch by `scripts/train_demo_model.py` for
`python -m pyengine demo`. Weights in bfloat16.

Training text: CPython {r['python']}'s bundled documentation: the reference topics that `help()` shows
(`pydoc_data.topics`, {c['pydoc_topics']} topics, {c['pydoc_topic_chars']:,} characters, each seen
{c['topic_repeats']} times an epoch) and the docstrings of at least 200 characters of the pure-Python standard library
({c['stdlib_docstrings']} docstrings, {c['stdlib_docstring_chars']:,} characters), both under the PSF licence.
The topics {', '.join(repr(t) for t in c['held_out_topics'])} were held out.

{r['steps']} steps of {r['batch_size']} x {r['seq_len']} tokens ({r['epochs']} epochs), AdamW, cosine schedule, seed
{r['seed']}, {r['train_seconds']:.0f} s on {r['threads']} CPU threads (torch {r['torch']}). Final training loss
{r['final_train_loss']:.2f}, loss on the held-out topics {r['held_out_loss']:.2f} nats a token.

It continues text in the style of the Python documentation; it is not chat-trained (the chat
template in tokenizer_config.json is there so that `apply_chat_template` works) and it knows
nothing reliably: a demonstration of the engine, not an assistant.
"""


if __name__ == "__main__":
    sys.exit(main())
