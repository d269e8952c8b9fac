"""Test fixtures for real-text training, made on the fly (no downloads): a generated English-like
corpus, a byte-level BPE tokenizer trained on it with the tokenizers library, and a small HF
Llama directory with weights and that tokenizer.

    text_corpus(dir, n_docs)        -> path of corpus.txt (documents separated by blank lines)
    train_tokenizer(dir, texts)     -> tokenizer directory (PreTrainedTokenizerFast, EOS </s>)
    llama_dir(dir, tokenizer_dir)   -> model directory (config.json, model.safetensors, tokenizer)
"""
from __future__ import annotations

import os

import numpy as np

SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the teacher", "a small bird",
            "the farmer", "our neighbour", "the captain", "a young girl"]
VERBS = ["sees", "likes", "finds", "carries", "paints", "follows", "feeds", "remembers"]
OBJECTS = ["the red ball", "a green apple", "the wooden boat", "a long letter", "the blue door",
           "an empty box", "the quiet river", "a bright lamp"]
PLACES = ["in the garden", "near the station", "by the sea", "under the bridge",
          "at the market", "on the hill"]
TIMES = ["every morning", "at night", "on sunday", "after dinner", "before the rain"]


def sentence(rng) -> str:
    s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
    if rng.random() < 0.6:
        s += f" {rng.choice(PLACES)}"
    if rng.random() < 0.4:
        s += f" {rng.choice(TIMES)}"
    return s[0].upper() + s[1:] + "."


def documents(n_docs: int, seed: int = 0) -> list[str]:
    """n_docs short documents of 2..6 sentences, a pure function of (n_docs, seed)."""
    rng = np.random.default_rng([seed, 0xDA7A])
    return [" ".join(sentence(rng) for _ in range(int(rng.integers(2, 7))))
            for _ in range(n_docs)]


def text_corpus(directory: str, n_docs: int = 200, seed: int = 0,
                name: str = "corpus.txt") -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        f.write("\n\n".join(documents(n_docs, seed)) + "\n")
    return path


def train_tokenizer(directory: str, texts: list[str], vocab_size: int = 320) -> str:
    """A byte-level BPE tokenizer (any text encodes) with <unk>, <s> and </s> (EOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.save_pretrained(directory)
    return directory


def llama_dir(directory: str, tokenizer_dir: str | None = None, vocab_size: int | None = None,
              hidden: int = 64, layers: int = 4, heads: int = 4, kv_heads: int = 2,
              intermediate: int = 128, tied: bool = False, seed: int = 0,
              dtype: str = "float32") -> str:
    """A small Llama checkpoint with random weights (seeded), saved with save_pretrained
    (safetensors), with the tokenizer's files beside it when one is given."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    tok = AutoTokenizer.from_pretrained(tokenizer_dir) if tokenizer_dir else None
    V = vocab_size or (len(tok) if tok is not None else 256)
    cfg = LlamaConfig(vocab_size=V, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=1024,
                      tie_word_embeddings=tied, rms_norm_eps=1e-6,
                      bos_token_id=tok.bos_token_id if tok is not None else None,
                      eos_token_id=tok.eos_token_id if tok is not None else None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    model.save_pretrained(directory)
    if tok is not None:
        tok.save_pretrained(directory)
    return directory
