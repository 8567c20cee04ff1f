"""A tiny randomly initialised Llama (GQA: 4 heads, 2 KV heads) with a byte-level BPE tokenizer, built in
process with no network, saved as an ordinary Hugging Face folder so tests go through the real loading path."""

from __future__ import annotations

from pathlib import Path

CORPUS = [
    "The KV cache holds keys and values for every position so decode does not recompute them.",
    "Prefill reads the whole prompt in one forward pass; decode adds one token per forward pass.",
    "Temperature, top-k and top-p change which token is chosen from the probabilities.",
    "日本語のテキストと絵文字 😀 🎉 also appear, so multi-byte characters are exercised.",
    "hello world " * 5,
] * 20

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant: {% endif %}")


def build_tokenizer():
    """A byte-level BPE trained on ``CORPUS`` (no network), with a chat template and left padding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=1000, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>", padding_side="left")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny_model(folder: Path, *, layers: int = 2, max_positions: int = 256, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer()
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
