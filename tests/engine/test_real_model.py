"""The real embedded SmolLM2-135M-Instruct: conversion fidelity, parity with generate(), text streaming."""

import pytest
import torch

from engine.facts import kvformula
from engine.facts.events import RunFinished, TokenStep
from engine.facts.params import GenerationParams
from engine.model import embedded, gguf
from engine.run.session import Session

pytestmark = pytest.mark.real
PROMPT = "hey, what is continuous batching?"


def test_converted_copy_gives_the_same_logits_as_the_gguf(smol):
    from transformers import AutoModelForCausalLM

    path = embedded.embedded_gguf()
    assert gguf.is_converted(path)
    direct = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ids = torch.tensor([smol.tokenizer("The capital of France is")["input_ids"]])
    with torch.inference_mode():
        assert torch.equal(direct(input_ids=ids).logits, smol.model(input_ids=ids).logits)


def test_facts_match_smollm2(smol):
    f = smol.facts
    assert (f.num_layers, f.num_heads, kvformula.kv_heads(f), f.head_dim, f.max_context) == (30, 9, 3, 64, 8192)
    assert kvformula.bytes_per_token(f) == 46_080


@pytest.mark.parametrize("kv_cache", [True, False])
def test_greedy_tokens_equal_generate_for_32_tokens(smol, kv_cache):
    session = Session(smol)
    events = []
    result = session.run(PROMPT, GenerationParams(max_new_tokens=32, kv_cache=kv_cache), events.append)
    ids = events[0].prompt_ids
    with torch.inference_mode():
        out = smol.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  do_sample=False, max_new_tokens=32)
    expected = out[0, len(ids):].tolist()
    assert len(expected) == 32 and result.summary.generated_tokens == 32
    assert result.summary.token_ids == expected


def test_kv_bytes_equal_the_formula_on_the_real_model(smol):
    events = []
    Session(smol).run(PROMPT, GenerationParams(max_new_tokens=8), events.append)
    n = len(events[0].prompt_ids)
    assert sum(map(sum, events[1].kv_bytes_per_layer)) == 46_080 * n
    for s in (e for e in events if isinstance(e, TokenStep)):
        assert sum(map(sum, s.kv_bytes_per_layer)) == 46_080 * (n + s.step)


def test_streamed_text_equals_decode_with_emoji_and_cjk(smol):
    session = Session(smol)
    events = []
    result = session.run("Reply with only these characters: 日本語 😀 🎉 café", GenerationParams(
        max_new_tokens=40, temperature=0.7, seed=1), events.append)
    assert isinstance(result, RunFinished)
    ids = result.summary.token_ids
    steps = [e for e in events if isinstance(e, TokenStep)]
    tok = smol.tokenizer
    complete = 0
    for k in range(1, len(ids) + 1):
        streamed, decoded = "".join(s.text for s in steps[:k]), tok.decode(ids[:k])
        assert decoded.startswith(streamed) and "\ufffd" not in streamed
        if not decoded.endswith("\ufffd"):   # no character left half-done: the stream has caught up exactly
            assert streamed == decoded
            complete += 1
    assert complete >= len(ids) // 2
    assert result.summary.text == tok.decode(ids, skip_special_tokens=True)
    assert any(ord(ch) > 0x2E80 for ch in result.summary.text), result.summary.text  # CJK or emoji produced
    prompt_pieces = events[0].prompt_pieces
    assert "".join(prompt_pieces) == smol.tokenizer.decode(events[0].prompt_ids)
    assert "日本語" in "".join(prompt_pieces) and all("\ufffd" not in p for p in prompt_pieces)


def test_the_seed_examples_note_gives_this_models_computed_crossover(smol, capsys):
    """The worked example's note names where SmolLM2's n^2 attention term overtakes its linear weight FLOPs; the
    number it prints must be what the cost model computes for the real model."""
    from engine import cli
    from engine.facts.costmodel import ModelCost, quadratic_from

    assert cli.main(["costmodel", "--seed-example"]) == 0
    note = capsys.readouterr().out.split("Why a real model's prefill time grows slower than this:")[1]
    crossover = quadratic_from(ModelCost(smol.facts))
    assert f"at about {round(crossover, -2):,.0f} tokens, computed" in note
