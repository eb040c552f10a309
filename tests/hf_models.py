"""Tiny random Hugging Face models, saved by the tests themselves with save_pretrained: nothing is downloaded.
transformers is imported only here, and only by the tests that need it (pip install -r requirements-hf.txt)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="pip install -r requirements-hf.txt")


def tiny_gpt2(folder: Path, vocab: int = 100, positions: int = 64, seed: int = 0, **config: object) -> Path:
    """A GPT2LMHeadModel of 2 layers, 2 heads, width 32: config.json and model.safetensors in `folder`;
    `config`: other GPT2Config settings (tie_word_embeddings=False, layer_norm_epsilon=1e-3, ...)."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=vocab, n_positions=positions,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=vocab - 1,
                                     eos_token_id=vocab - 1, **config)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


def logits_of(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    """What transformers computes for `tokens` (B, T) with the model of `folder`, in fp32."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def tiny_llama(folder: Path, vocab: int = 128, positions: int = 64, tie: bool = False, seed: int = 0,
               tokenizer: bool = True, max_shard_size: str | None = None) -> Path:
    """A LlamaForCausalLM of 2 layers, 4 heads (2 key/value heads: grouped-query attention), width 32, MLP 64: its
    weights drawn around transformers' init (the norms away from 1, so that a norm left at its init shows), and,
    with `tokenizer`, a tokenizer.json of at most `vocab` tokens (tiny_tokenizer) beside it, as a real folder has."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=64, vocab_size=vocab, max_position_embeddings=positions,
                                      tie_word_embeddings=tie, bos_token_id=0, eos_token_id=1, pad_token_id=None)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    if tokenizer:
        tiny_tokenizer(folder, vocab)
    return folder


def tiny_other(folder: Path, model_type: str, vocab: int = 128, positions: int = 64, seed: int = 0) -> Path:
    """A model of 2 layers, width 32 of another architecture: gpt_neox (Pythia: transformers renames its embed_out
    to lm_head as it loads it), gpt_neo (no sdpa attention in transformers) or opt (its mask builder is not handed
    its position ids: packed conversations would see each other)."""
    torch.manual_seed(seed)
    if model_type == "opt":
        config = transformers.OPTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                                        vocab_size=vocab, max_position_embeddings=positions, word_embed_proj_dim=32)
        model = transformers.OPTForCausalLM(config)
    elif model_type == "gpt_neox":
        config = transformers.GPTNeoXConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                            intermediate_size=64, vocab_size=vocab, max_position_embeddings=positions)
        model = transformers.GPTNeoXForCausalLM(config)
    else:
        config = transformers.GPTNeoConfig(hidden_size=32, num_layers=2, num_heads=4, vocab_size=vocab,
                                           max_position_embeddings=positions, window_size=16, bos_token_id=0,
                                           eos_token_id=1, attention_types=[[["global", "local"], 1]])
        model = transformers.GPTNeoForCausalLM(config)
    model.save_pretrained(folder)
    return folder


TEXT = ("the quick brown fox jumps over the lazy dog. a stitch in time saves nine. all that glitters is not gold. "
        "the early bird catches the worm; the second mouse gets the cheese. ")


def tiny_tokenizer(folder: Path, vocab: int = 128) -> Path:
    """A byte-level BPE tokenizer (tokenizers', as GPT-2's and Llama 3's are) trained on a few sentences up to `vocab`
    tokens, <|begin_of_text|> (0) and <|end_of_text|> (1) first: tokenizer.json in `folder`, and the
    tokenizer_config.json that transformers' AutoTokenizer reads."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    # a byte-level alphabet is 256 tokens: a vocabulary under that keeps the bytes the text has
    alphabet = pre_tokenizers.ByteLevel.alphabet() if vocab > 256 + len(specials) else []
    tok.train_from_iterator([TEXT] * 10, trainer=trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                                                     initial_alphabet=alphabet))
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", 0)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": specials[0], "eos_token": specials[1]}))
    return folder


def fp8(folder: Path, scales: bool = True) -> Path:
    """The model of `folder` as FP8 checkpoints store it: its 2-D weights in float8_e4m3fn, each with the
    weight_scale_inv it is to be multiplied by, and (with `scales`) the quantization_config that says so."""
    import json

    from safetensors.torch import load_file, save_file

    tensors = {}
    for key, t in load_file(folder / "model.safetensors").items():
        if t.dim() == 2:
            scale = t.abs().max() / 448.0
            tensors[key] = (t / scale).to(torch.float8_e4m3fn)
            tensors[key + "_scale_inv"] = scale.reshape(1)
        else:
            tensors[key] = t
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    if scales:
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": None}
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def without_prefix(folder: Path, prefix: str = "transformer.") -> Path:
    """The model of `folder` stored as the Hub stores GPT-2 (openai-community/gpt2): the base model's keys without
    its prefix (wte.weight, h.0.attn.c_attn.weight, ...), the tied lm_head.weight left out."""
    from safetensors.torch import load_file, save_file

    tensors = {k.removeprefix(prefix): t for k, t in load_file(folder / "model.safetensors").items()
               if k != "lm_head.weight"}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def word_tokenizer(folder: Path, vocab: int, specials: list[str], bos: str | None, eos: str | None,
                   chat_template: str = "") -> Path:
    """A word-level tokenizer of exactly `vocab` tokens (specials first, then words w0, w1, ... split at spaces and
    punctuation, decoded joined by spaces), a Llama-style <bos> $A post-processor where `bos` is set: tokenizer.json and
    the tokenizer_config.json (bos/eos tokens, the chat template) that transformers' AutoTokenizer reads."""
    import json

    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors

    words = {t: i for i, t in enumerate(specials)} | {f"w{i}": len(specials) + i for i in range(vocab - len(specials))}
    tok = Tokenizer(models.WordLevel(words, unk_token=specials[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    if bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, words[bos])])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos}
    if chat_template:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert tok.get_vocab_size(with_added_tokens=True) == vocab
    return folder


ROLES = ["system", "user", "assistant"]
# Llama 3's chat template, its date and tools left out: <|begin_of_text|>, then each turn as a header and <|eot_id|>.
LLAMA3_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                   "{{ m['content'] | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# ChatML (Qwen's, SmolLM2's): no BOS, each turn <|im_start|>role\n ... <|im_end|>\n.
CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def chat_tokenizer(folder: Path, style: str, words: int = 200) -> Path:
    """A word-level tokenizer with a chat template: Llama 3's (`llama3`) or ChatML (`chatml`), its special tokens,
    the roles and `words` words w0, w1, ..."""
    if style == "llama3":
        return word_tokenizer(folder, len(LLAMA3_SPECIALS) + 3 + words, LLAMA3_SPECIALS + ROLES, None,
                              "<|eot_id|>", LLAMA3_TEMPLATE) and _bos(folder, "<|begin_of_text|>")
    return word_tokenizer(folder, len(CHATML_SPECIALS) + 3 + words, CHATML_SPECIALS + ROLES, None, "<|im_end|>",
                          CHATML_TEMPLATE)


def _bos(folder: Path, bos: str) -> Path:
    """tokenizer_config.json's bos_token (the template writes it; the post-processor adds none, as Llama 3's chat
    models' apply_chat_template encodes without special tokens)."""
    import json

    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"bos_token": bos}))
    return folder
