import pytest

from engine.facts.textstream import TextStream, pieces

TEXTS = ["日本語のテキスト 😀 🎉 ok", "plain words here", "mixed 😀日本 and é"]


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_join_to_decode_and_never_hold_broken_characters(tiny, text):
    tok = tiny.tokenizer
    ids = tok(text)["input_ids"]
    assert len(ids) > len(text.split())                # multi-byte characters span several tokens
    parts = pieces(tok, ids)
    assert "".join(parts) == tok.decode(ids)
    assert all("\ufffd" not in p for p in parts)


def test_skip_special_tokens_matches_decode(tiny):
    tok = tiny.tokenizer
    ids = [tok.bos_token_id] + tok("hello 😀")["input_ids"] + [tok.eos_token_id]
    stream = TextStream(tok, skip_special_tokens=True)
    assert "".join(stream.step(i) for i in ids) == tok.decode(ids, skip_special_tokens=True)


def test_fallback_without_fast_backend_gives_the_same_pieces(tiny):
    tok = tiny.tokenizer
    ids = tok(TEXTS[0])["input_ids"]
    slow = TextStream(tok)
    slow._stream = None                                  # the path for tokenizers with no fast backend
    assert "".join(slow.step(i) for i in ids) == tok.decode(ids)
