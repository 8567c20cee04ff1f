"""Every figure true on every cache shape: what the model's cache really holds per layer (not what its config
suggests), measured bytes equal to the formula past the sliding window, the full-context figure equal to what
the cache holds at ``max_context - 1`` positions, greedy tokens equal to ``generate()``, and chat reuse and
continuous batching either working or declined with a reason."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch

from engine import cli
from engine.facts import config_facts, kvformula
from engine.facts.errors import ModelSourceError, ParameterError
from engine.facts.events import AttentionStep, PrefillDone, TokenStep
from engine.facts.params import GenerationParams
from engine.model import kvcache
from engine.model.models import load
from engine.run.session import Session
from tests.architectures import CONTEXT, EXPECTED, WINDOW, build, build_encoder_decoder

PROMPT = "The KV cache holds keys and values for every position"
NEW_TOKENS = 40             # with the prompt, well past the sliding window and short of the context


@pytest.fixture(scope="module", params=list(EXPECTED))
def arch(request, tmp_path_factory):
    folder = build(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, str(folder), load(str(folder), device="cpu", dtype="float32")


def run_events(loaded, params: GenerationParams, prompt: str = PROMPT) -> tuple[list, object]:
    events: list = []
    result = Session(loaded).run(prompt, params, events.append)
    return events, result


def test_facts_come_from_the_cache_the_model_builds(arch):
    name, _folder, loaded = arch
    layers = loaded.facts.kv_layers
    assert [(a.kind, a.kv_heads, a.k_dim, a.capacity) for a in layers] == EXPECTED[name]
    assert loaded.facts.num_layers == len(EXPECTED[name])


def test_measured_bytes_equal_the_formula_after_every_step_past_the_window(arch):
    _name, _folder, loaded = arch
    facts = loaded.facts
    events, result = run_events(loaded, GenerationParams(max_new_tokens=NEW_TOKENS, chat_template=False))
    steps = [e for e in events if isinstance(e, TokenStep)]
    assert steps[-1].position > WINDOW + 8, "the run must go well past the sliding window"
    prefill = next(e for e in events if isinstance(e, PrefillDone))
    assert [k + v for k, v in prefill.kv_bytes_per_layer] == kvformula.predicted_kv_bytes_per_layer(
        facts, prefill.n_tokens)
    for step in steps:
        measured = [k + v for k, v in step.kv_bytes_per_layer]
        assert measured == kvformula.predicted_kv_bytes_per_layer(facts, step.position), step.step
        assert step.kv_positions_per_layer == [kvformula.held_positions(layer, step.position)
                                               for layer in facts.kv_layers]
    assert result.summary.kv_bytes == kvformula.predicted_kv_bytes(facts, result.summary.kv_tokens)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _tally(layer) -> tuple[int, int]:
    """(cache bytes, state bytes) of every tensor a cache layer holds, each counted once however many names
    point at it, read straight from the object (bookkeeping aside: private fields, and 0-d tensors, which count
    positions and hold none, as a state layer's ``cumulative_length_linear``): a count independent of KVScope's
    own reading."""
    cache: dict = {}
    state: dict = {}
    for name, value in vars(layer).items():
        if name.startswith("_"):
            continue
        into = state if name.rstrip("s").endswith("state") else cache
        for tensor in _tensors(value):
            if tensor.dim():
                into[(tensor.data_ptr(), tuple(tensor.shape))] = tensor.nbytes
    return sum(cache.values()), sum(state.values())


@pytest.mark.parametrize("positions", [5, 40])
def test_every_tensor_the_cache_holds_is_counted_once(arch, positions):
    _name, _folder, loaded = arch
    cache = kvcache.new_cache(loaded.model)
    with torch.inference_mode():
        kvcache.forward(loaded.model, torch.arange(3, 3 + positions).unsqueeze(0), cache)
    tallies = [_tally(layer) for layer in cache.layers]
    assert [held for held, _ in tallies] == kvformula.predicted_kv_bytes_per_layer(loaded.facts, positions)
    assert [state for _, state in tallies] == [layer.state_bytes for layer in loaded.facts.kv_layers]


def test_full_context_figure_is_what_the_cache_holds_at_max_context_minus_one(arch):
    _name, _folder, loaded = arch
    facts = loaded.facts
    assert facts.max_context == CONTEXT
    ids = torch.arange(kvformula.full_context_positions(facts)).remainder(facts.vocab_size - 4).add(4).view(1, -1)
    session = Session(loaded)
    with torch.inference_mode():
        _logits, cache = session.prefill(ids, use_cache=True)
    held = sum(k + v for k, v in kvcache.held_per_layer(cache, facts.num_layers)[0])
    assert held == kvformula.full_context_kv_bytes(facts)


def test_greedy_tokens_equal_generate(arch):
    _name, _folder, loaded = arch
    events, result = run_events(loaded, GenerationParams(max_new_tokens=NEW_TOKENS, chat_template=False))
    ids = torch.tensor([events[0].prompt_ids])
    with torch.inference_mode():
        out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=NEW_TOKENS, pad_token_id=loaded.tokenizer.pad_token_id)
    assert result.summary.token_ids == out[0, ids.shape[1]:].tolist()


def test_cli_json_measured_formula_and_full_context_agree(arch, capsys):
    _name, folder, loaded = arch
    code = cli.main(["--model", folder, "--device", "cpu", "--dtype", "float32", "--raw", "--json",
                     "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS)])
    payload = json.loads(capsys.readouterr().out)
    assert code == 0
    assert payload["kv_bytes"] == payload["kv_bytes_formula"] > 0
    assert payload["kv_bytes_full_context"] == kvformula.full_context_kv_bytes(loaded.facts)
    assert payload["kv_positions_full_context"] == CONTEXT - 1


def test_recorded_attention_equals_eager_output_attentions_or_is_refused(arch):
    """What the attention view draws is what the model computed: each step's recorded weights equal the row of
    the query's position in an eager forward over the whole sequence with ``output_attentions=True``
    (sliding layers: the positions outside the window carry no weight), and recording changes no token.
    DeepSeek-V3.2's and V4's indexers pick the positions each query reads: refused before any compute."""
    from transformers import AutoModelForCausalLM

    name, folder, loaded = arch
    params = GenerationParams(max_new_tokens=NEW_TOKENS, chat_template=False)
    refused = {"deepseek-v32-indexer": "DeepseekV32ForCausalLM: its indexer",
               "deepseek-v4-compressed": "DeepseekV4ForCausalLM: its indexer"}
    if name in refused:
        events: list = []
        with pytest.raises(ParameterError, match=f"attention cannot be recorded for {refused[name]}"):
            Session(loaded).run(PROMPT, params.with_(capture_attention=True), events.append)
        assert events == []
        return
    events, recorded = run_events(loaded, params.with_(capture_attention=True))
    _plain_events, plain = run_events(loaded, params)
    assert recorded.summary.token_ids == plain.summary.token_ids
    steps = [e for e in events if isinstance(e, AttentionStep)]
    prompt_ids = events[0].prompt_ids
    assert [s.step for s in steps] == list(range(recorded.summary.generated_tokens))
    eager = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    sequence = torch.tensor([prompt_ids + recorded.summary.token_ids[:-1]])
    with torch.inference_mode():
        maps = eager(sequence, output_attentions=True).attentions
    by_layer = dict(enumerate(maps)) if len(maps) == loaded.facts.num_layers else dict(zip(steps[0].layers, maps))
    attention_layers = [i for i, kv in enumerate(loaded.facts.kv_layers) if kv.kind != kvformula.STATE]
    for step in steps:
        assert step.layers == attention_layers and step.position == len(prompt_ids) - 1 + step.step
        for layer, first, weights in zip(step.layers, step.first_positions, step.weights):
            expected = by_layer[layer][0, :, step.position, : step.position + 1]
            assert torch.allclose(torch.tensor(weights), expected[:, first:], atol=2e-4), (layer, step.step)
            assert float(expected[:, :first].sum()) < 1e-4


def test_chat_reuse_works_or_says_why_not(arch):
    _name, _folder, loaded = arch
    replies: dict[bool, list] = {}
    notes: list[str] = []
    reused: list[int] = []
    seen: list[int] = []
    for reuse in (True, False):
        session = Session(loaded)
        messages: list[dict] = []
        replies[reuse] = []
        for turn in ("hello world", "and the cache?"):
            events: list = []
            messages.append({"role": "user", "content": turn})
            result = session.chat(messages, GenerationParams(max_new_tokens=8), events.append, reuse=reuse)
            prefill = next(e for e in events if isinstance(e, PrefillDone))
            if reuse:
                notes.append(prefill.cache_note)
                reused.append(prefill.reused_tokens)
                seen.append(result.summary.kv_tokens)
            replies[reuse].append(result.summary.token_ids)
            messages.append({"role": "assistant", "content": result.summary.text})
    assert replies[True] == replies[False]
    assert reused[0] == 0 and "first turn" in notes[0]
    facts = loaded.facts
    if reused[1] == seen[0]:
        return                                  # the new turn extends the whole kept cache: no rollback needed
    if kvformula.state_layers(facts):         # a running state cannot be rolled back to where the turns differ
        assert reused[1] == 0 and "state-space" in notes[1]
    elif any(layer.compressed for layer in facts.kv_layers):       # nor can entries condensed from the context
        assert reused[1] == 0 and "compressed entries" in notes[1]
    elif any(layer.kind == kvformula.SLIDING and layer.capacity < seen[0] for layer in facts.kv_layers):
        assert reused[1] == 0 and "sliding-window" in notes[1]     # the window dropped what a rollback needs
    else:
        assert 0 < reused[1] < seen[0] and "differed" in notes[1]


def test_continuous_batching_gives_solo_tokens_or_declines(arch):
    from engine.run.batch_generate import generate_batch
    from engine.run.scheduler import ScheduledRequest, serve

    _name, _folder, loaded = arch
    facts = loaded.facts
    model = copy.deepcopy(loaded.model).to(torch.float64)     # exact, so padding and masks must be right
    if getattr(model.config, "_experts_implementation", None) not in (None, "eager"):
        model.set_experts_implementation("eager")             # grouped matmuls of experts take no float64
    session = Session(loaded)
    prompts = [session.encode(t, chat_template=False) for t in
               ("hello world", "The KV cache holds keys and values for every position so decode does not",
                "Prefill reads the whole prompt")]
    requests = [ScheduledRequest(i, ids, 20, i * 3) for i, ids in enumerate(prompts)]
    if kvformula.batching_refusal(facts) is not None:
        with pytest.raises(ParameterError, match="Continuous batching is not available"):
            serve(SimpleNamespace(model=model, device=torch.device("cpu"), facts=facts), requests, "continuous")
        return
    assert serve(SimpleNamespace(model=model, device=torch.device("cpu"), facts=facts), requests, "continuous")
    pad = loaded.tokenizer.pad_token_id
    solo = [generate_batch(model, [r.ids], 20, pad, torch.device("cpu")).tokens[0] for r in requests]
    assert [r.tokens for r in requests] == solo


def test_a_model_without_attention_cache_is_refused_with_one_line(tmp_path):
    from tests.architectures import build as build_shape

    folder = build_shape("mamba", tmp_path / "mamba")
    with pytest.raises(ModelSourceError, match="keeps no attention KV cache") as err:
        load(str(folder), device="cpu", dtype="float32")
    assert "\n" not in str(err.value)


def test_a_model_with_a_cache_class_of_its_own_is_refused_naming_it(tmp_path):
    from tests.architectures import build as build_shape

    folder = build_shape("minimax", tmp_path / "minimax")
    with pytest.raises(ModelSourceError, match="keeps its cache in a class of its own \\(MiniMaxCache") as err:
        load(str(folder), device="cpu", dtype="float32")
    assert "\n" not in str(err.value)


def test_config_only_facts_equal_the_loaded_models(arch):
    """One reading of a config for both paths: what ``costmodel --model`` computes from config.json alone is what
    the loaded model's cache holds, layer by layer, and the context it declares."""
    _name, folder, loaded = arch
    from_config = config_facts.model_facts(folder, config_facts.read(folder), "float32")

    def shape(facts):
        return [(a.kind, a.kv_heads, a.k_dim, a.v_dim, a.capacity, a.compressed, a.state_bytes, a.extra_bytes)
                for a in facts.kv_layers]
    assert shape(from_config) == shape(loaded.facts)
    assert (from_config.max_context, from_config.context_declared) == (loaded.facts.max_context,
                                                                       loaded.facts.context_declared)


def test_an_encoder_decoder_model_is_refused_with_one_line(tmp_path):
    folder = build_encoder_decoder(tmp_path / "t5")
    with pytest.raises(ModelSourceError, match="encoder-decoder") as err:
        load(str(folder), device="cpu", dtype="float32")
    assert "\n" not in str(err.value)


def test_attention_on_a_kernel_kvscope_does_not_record_is_refused_before_any_compute(tmp_path):
    """Flex attention computes no weights KVScope could read without changing what the model computes: the run
    is refused in words, with nothing emitted."""
    loaded = load(str(build("llama-gqa", tmp_path / "llama")), device="cpu", dtype="float32")
    loaded.model.set_attn_implementation("flex_attention")
    events: list = []
    params = GenerationParams(max_new_tokens=4, chat_template=False, capture_attention=True)
    with pytest.raises(ParameterError, match="it runs flex_attention attention, which KVScope records only as "
                                             "eager or sdpa"):
        Session(loaded).run(PROMPT, params, events.append)
    assert events == []
