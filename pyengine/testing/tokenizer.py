"""The tiny checkpoints' tokenizer: a byte-level BPE trained offline with ``tokenizers`` on a
small built-in corpus, saved in the Hugging Face layout (tokenizer.json and its config files)."""

from __future__ import annotations

from pathlib import Path

UNK_TOKEN = "<unk>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
#: Special tokens in id order: <unk>=0, <s>=1, </s>=2, <pad>=3 (the Llama layout plus a pad).
SPECIAL_TOKENS = (UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)


CORPUS = """\
The lighthouse keeper wrote in his log every evening, even when nothing had happened.
Wind from the north-west, moderate. Two fishing boats returned before dark. The lamp was
cleaned and the wick trimmed. He believed that a record of quiet days was worth as much as
a record of storms, because only the quiet days showed what ordinary looked like.

A small inference engine does one thing over and over: it takes the requests that are
waiting, decides which of them may run, reserves memory for their keys and values, runs
the model once, picks the next token for each sequence, and hands the new tokens back to
the application. Then it frees what finished requests held and starts again. The work is
simple to describe and easy to get subtly wrong, which is why every step should be tested.

When the bakery opened at six, the first customers were always the same: a nurse coming
off the night shift, two students who had not slept, and an old man who bought one roll
and read the newspaper standing at the counter. The baker knew their orders by heart and
started wrapping bread as soon as the door bell rang.

Rivers do not flow in straight lines. Water follows the easiest path, and small
differences in the ground grow into wide bends over hundreds of years. Engineers who
straighten a river often find that it floods more, not less, because the water now
arrives downstream all at once instead of slowly.

She planted tomatoes, beans, and a row of sunflowers along the fence. By August the
sunflowers were taller than the shed, and the birds came every morning for the seeds.
The beans climbed the strings she had tied, and the tomatoes split open after a heavy rain.

def schedule(requests, max_tokens):
    batch, used = [], 0
    for request in requests:
        if used + request.num_tokens > max_tokens:
            break
        batch.append(request)
        used += request.num_tokens
    return batch

Numbers and units: 3.14159, 2.71828, 1,024 blocks of 16 tokens, 42 requests per second,
100 km/h, 25 degrees, 0x7fff, 2024-06-01 12:30:45, $19.99, 50% off, version 1.2.3.

Questions and answers. What is a block table? A list of block ids, in order, that hold a
sequence's cached keys and values. Why sixteen tokens per block? Small enough to waste
little memory, large enough to keep the tables short. Who frees the blocks? The cache
manager, when the request finishes or is paused.

今天天气很好，我们去公园散步吧。机器学习模型需要大量的数据和计算资源。
这个推理引擎在中央处理器上运行，也可以在图形处理器上运行。你好，世界！谢谢你的帮助。
Café, naïve, résumé, façade, jalapeño, Zürich, smörgåsbord, Ελληνικά, Привет, мир!
Emoji: 😀 😃 🚀 🌍 🎉 👍 ❤️ 🔥 ✨ 🤖 — the robot 🤖 launched a rocket 🚀 around the world 🌍 🎉.
"""


def _train_tokenizer_object(vocab_size: int):
    """Train the byte-level BPE ``tokenizers.Tokenizer`` (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeat the corpus so counts, not order, decide the merges; train from a list so
    # no file I/O is involved.
    lines = [line for line in CORPUS.splitlines() if line.strip()]
    tok.train_from_iterator(lines * 2, trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    # Like Llama: a BOS is prepended on encode (add_special_tokens=True), no EOS.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tok


def build_tokenizer(path: Path | str | None = None, vocab_size: int = 512):
    """Train a byte-level BPE tokenizer on ``CORPUS`` and return it as a
    ``transformers.PreTrainedTokenizerFast``; if ``path`` is given, ``save_pretrained``
    it there.

    Ids: ``<unk>``=0, ``<s>``=1 (BOS, prepended on encode), ``</s>``=2 (EOS), ``<pad>``=3.
    Byte-level, so every string round-trips through encode/decode (the unknown token is
    never produced). The vocabulary has at most ``vocab_size`` entries (fewer if the
    corpus has too few distinct pairs). Deterministic: the same ``vocab_size`` always
    gives the same tokenizer.
    """
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size={vocab_size} is too small for a byte-level tokenizer "
            f"(needs at least {256 + len(SPECIAL_TOKENS)})"
        )
    tok = _train_tokenizer_object(vocab_size)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        pad_token=PAD_TOKEN,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )
    if path is not None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        fast.save_pretrained(str(path))
    return fast


# --------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------
